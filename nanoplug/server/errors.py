"""Errors as OpenAI shapes them: `{"error": {"message", "type", "param", "code"}}` with the HTTP status.

Every refusal the server makes is an `APIError`; the handlers registered by `install_handlers` turn
it, a body that fails validation, malformed JSON, an unknown route and the engine's own RequestError
into that body, so an OpenAI client raises its usual exception with our message in it.
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanoplug.errors import RequestError

log = logging.getLogger("nanoplug.server")


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def validation_error(errors: list[dict]) -> APIError:
    """The first problem pydantic found, naming the field the way the client spelt it."""
    err = errors[0]
    if err.get("type") == "json_invalid":
        detail = err.get("ctx", {}).get("error", err.get("msg", ""))
        return bad_request(f"the request body is not valid JSON ({detail}); send a JSON object", code="invalid_json")
    loc = [str(part) for part in err.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    msg = err.get("msg", "invalid value")
    if err.get("type") == "missing" and not loc:
        return bad_request("the request body is empty; send a JSON object, e.g. {\"prompt\": \"Hello\"}",
                           code="invalid_json")
    if err.get("type") == "missing":
        return bad_request(f"the field {param!r} is required", param=param, code="missing_required_parameter")
    if not loc:
        return bad_request(f"the request body must be a JSON object ({msg})", code="invalid_json")
    return bad_request(f"{param}: {msg}" if param else msg, param=param, code="invalid_value")


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(RequestError)
    async def _engine_refused(request: Request, exc: RequestError):
        return bad_request(str(exc), param="prompt").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = (f"no route {request.method} {request.url.path}; see GET /v1/models, POST /v1/completions, "
                   "POST /v1/chat/completions") if exc.status_code in (404, 405) else str(exc.detail)
        return APIError(exc.status_code, message, type=kind).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("unhandled error serving %s %s", request.method, request.url.path)
        return APIError(500, f"internal server error ({type(exc).__name__}: {exc})", type="server_error").response()
