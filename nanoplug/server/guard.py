"""The checks every HTTP request passes before its body is read: the API key, then the body's size.

Pure ASGI (streaming untouched), outermost but for the status counter: a client without the key is
a 401 before a byte of its body is read or parsed, and a body over the limit is a 413 as soon as its
Content-Length (or, sent chunked, its running size) passes the limit, never buffered whole.
"""
from __future__ import annotations

import hmac
from typing import Any

from nanoplug.server.errors import APIError

OPEN_PATHS = ("/health", "/")  # what a load balancer or a browser opening the page reaches without the key


class _TooLarge(BaseException):
    """Raised from `receive` past the limit; a BaseException so that no handler of the app turns it into a 500."""


def _key_ok(headers: list[tuple[bytes, bytes]], key: bytes) -> bool:
    given = next((v for k, v in headers if k == b"authorization"), b"")
    scheme, _, token = given.partition(b" ")
    # compare_digest runs in time independent of where the strings differ (not of their lengths)
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key)


async def _send_error(send: Any, error: APIError) -> None:
    response = error.response()
    await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})


class Guard:
    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int, metrics_require_key: bool = False):
        self.app, self.max_body = app, max_body_bytes
        self.key = api_key.encode() if api_key else None
        self.open_paths = OPEN_PATHS if metrics_require_key else OPEN_PATHS + ("/metrics",)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = scope.get("headers", [])
        if self.key is not None and scope.get("path", "") not in self.open_paths and not _key_ok(headers, self.key):
            return await _send_error(send, APIError(
                401, "a valid API key is required: send the header 'Authorization: Bearer <key>' with the key "
                "the server was started with (--api-key)", code="invalid_api_key"))
        length = next((v for k, v in headers if k == b"content-length"), None)
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            return await _send_error(send, self._too_large())
        seen = 0
        started = False

        async def counted_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    raise _TooLarge
            return message

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracking_send)
        except _TooLarge:
            if not started:
                await _send_error(send, self._too_large())

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is over the server's limit of {self.max_body} bytes "
                        "(--max-body-bytes); send fewer or shorter prompts", code="request_too_large")
