"""Every error as an OpenAI error body ``{"error": {"message", "type", "param", "code"}}``:
400 for any invalid input (FastAPI's 422s become one readable 400 naming the field), 401
for a missing / wrong API key, 404 for an unknown model or route, 413 for a body over the
limit, 503 with Retry-After when the service is full, 500 for anything unexpected."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.http.schemas import FIELD_HELP, FIELD_NAMES
from specdec.errors import CapacityError, ContextLengthError, RequestError, UnknownModelError

logger = logging.getLogger("specdec.http")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable_error",
}
_CODES = {UnknownModelError: "model_not_found", ContextLengthError: "context_length_exceeded"}


def error_body(status: int, message: str, type_: str | None = None, param=None, code=None) -> dict:
    return {
        "error": {
            "message": message or "error",
            "type": type_ or _TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


class ErrorJSON(JSONResponse):
    """ASCII-escaped, so that client text quoted in a message (even a lone surrogate) can
    never make the error response itself fail."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":"), default=str).encode("ascii")


def error_response(status: int, message: str, headers: dict | None = None, **kw) -> JSONResponse:
    return ErrorJSON(error_body(status, message, **kw), status_code=status, headers=headers)


def error_content(exc: Exception) -> tuple[int, dict, dict | None]:
    """(status, body, headers) of an exception raised while serving a request."""
    if isinstance(exc, CapacityError):
        retry = str(max(1, int(getattr(exc, "retry_after", 1) or 1)))
        return 503, error_body(503, str(exc), code="capacity"), {"Retry-After": retry}
    if isinstance(exc, RequestError):
        status, message = getattr(exc, "status_code", 400), exc.message
        if exc.param and exc.param.split("[")[0] not in message:
            message = f"'{exc.param}': {message}"
        return status, error_body(status, message, param=exc.param, code=_CODES.get(type(exc))), None
    if isinstance(exc, ValidationError):
        err = exc.errors(include_url=False)[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        return 400, error_body(400, err["msg"].removeprefix("Value error, "), param=param), None
    return 500, error_body(500, "internal error; see the server log"), None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    @app.exception_handler(CapacityError)
    @app.exception_handler(ValidationError)
    async def _domain_error(request: Request, exc: Exception) -> JSONResponse:
        status, body, headers = error_content(exc)
        return ErrorJSON(body, status_code=status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail, default=str)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}; see /docs"
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(500, "internal error; see the server log")

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        help_ = FIELD_HELP["chat" if request.url.path.endswith("/chat/completions") else "completions"]
        param, message = describe_validation(exc.errors(), help_)
        return error_response(400, message, param=param)


def describe_validation(errors: Iterable[dict], help_: dict[str, str]) -> tuple[str | None, str]:
    """FastAPI's 422 -> one readable 400: the first invalid field, what it got, what it allows."""
    errors = list(errors)
    if not errors:
        return None, "invalid request"
    err = errors[0]
    loc = [p for p in err.get("loc", ()) if p != "body"]
    if not loc or err.get("type") == "json_invalid":
        return None, _body_message(err)
    path = _field_path(loc)
    if err.get("type") == "extra_forbidden":
        return path, f"unknown or unsupported field '{path}'; see /docs for the accepted fields"
    if err.get("type") == "missing":
        return path, f"'{path}' is required"
    # A union type gives one error per alternative (some deeper): quote none of them.
    paths = [_field_path([p for p in e["loc"] if p != "body"]) for e in errors]
    union = sum(1 for p in paths if p == path or p.startswith((path + ".", path + "["))) > 1
    message = f"invalid '{path}'" + ("" if union else f": {err['msg']}")
    message += f" (got {_short(err.get('input'))})"
    if allowed := help_.get(path.split("[")[0].split(".")[0]):
        message += f"; allowed: {allowed}"
    return path, message


def _body_message(err: dict) -> str:
    kind = err.get("type")
    if kind == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        return f"the request body is not valid JSON: {detail}".rstrip(": ")
    if kind == "missing":
        return "the request body is missing: send a JSON object"
    if kind in ("model_attributes_type", "dict_type"):
        return "the request body must be a JSON object sent with 'Content-Type: application/json'"
    return f"invalid request body: {err.get('msg', 'unreadable')}"


def _field_path(loc: list) -> str:
    """Keep field names and list indices; drop pydantic's union-member tags like 'list[int]'."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in FIELD_NAMES:
            path += f".{part}" if path else part
    return path or ".".join(str(p) for p in loc)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
