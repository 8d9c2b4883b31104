"""A request's output constraint, from the OpenAI fields (`response_format`) or vLLM's extras
(`structured_outputs`, and the older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`), as the
engine's StructuredOutputsParams; or a 400 naming the field. At most one constraint per request: tools with
tool_choice "required" or a named function bring their own (server/tools.py).
"""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from nanoplug.config import StructuredOutputsParams
from nanoplug.server.errors import bad_request

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _params(values: dict[str, Any], param: str) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**values)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise bad_request(f"{param}: {err['msg']}", param=param, code="invalid_value") from None
    except TypeError as exc:
        raise bad_request(f"{param}: {exc}", param=param, code="invalid_value") from None


def from_response_format(fmt: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """OpenAI's response_format: text (none), json_object (any JSON object), json_schema (that schema; `strict`
    or not, it is always enforced: every token is drawn under it)."""
    if not fmt:
        return None
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise bad_request("response_format.json_schema must be {\"name\": ..., \"schema\": {...}, \"strict\": ...}",
                              param="response_format", code="invalid_value")
        return _params({"json": spec.get("schema", True)}, "response_format")
    raise bad_request(f"response_format type {kind!r} is unknown; use text, json_object or json_schema",
                      param="response_format", code="invalid_value")


def constraint_of(req: Any) -> StructuredOutputsParams | None:
    """The one constraint a request asks for (None: none), from whichever field it came in."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    fmt = from_response_format(getattr(req, "response_format", None))
    if fmt is not None:
        found.append(("response_format", fmt))
    extra = getattr(req, "structured_outputs", None)
    if extra:
        if not isinstance(extra, dict):
            raise bad_request("structured_outputs must be an object such as {\"json\": {...}} or {\"regex\": \"...\"}",
                              param="structured_outputs", code="invalid_value")
        found.append(("structured_outputs", _params(extra, "structured_outputs")))
    for param, key in GUIDED.items():
        value = getattr(req, param, None)
        if value is not None:
            found.append((param, _params({key: value}, param)))
    if len(found) > 1:
        names = ", ".join(p for p, _ in found)
        raise bad_request(f"the request gives {len(found)} output constraints ({names}); give at most one",
                          param=found[1][0], code="invalid_value")
    return found[0][1] if found else None
