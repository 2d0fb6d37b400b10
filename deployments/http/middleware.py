"""ASGI middleware that runs before any body parsing: the API key (401) and the body size
limit (413). Both read the environment per request, so a replica's runtime_env decides."""

from __future__ import annotations

import hmac
import logging
import os

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deployments.http.errors import error_response

logger = logging.getLogger("specdec.http")

DEFAULT_MAX_BODY_BYTES = 1 << 20


def _max_body_bytes() -> int:
    raw = os.environ.get("SPECDEC_MAX_BODY_BYTES")
    try:
        return int(raw) if raw else DEFAULT_MAX_BODY_BYTES
    except ValueError:
        logger.warning("SPECDEC_MAX_BODY_BYTES=%r is not an integer; using %d", raw, DEFAULT_MAX_BODY_BYTES)
        return DEFAULT_MAX_BODY_BYTES


class GuardMiddleware:
    """Bearer-token check on /v1 when SPECDEC_API_KEY is set (read per request, so a
    replica's runtime_env decides), then a request body limit (413)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if not self._authorized(scope):
            response = error_response(
                401,
                "missing or wrong API key: send 'Authorization: Bearer <key>'",
                headers={"WWW-Authenticate": "Bearer"},
                code="invalid_api_key",
            )
            return await response(scope, receive, send)
        limit = _max_body_bytes()
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await self._too_large(scope, receive, send, limit)
        body = await _read_body(receive, limit)
        if body is None:
            return await self._too_large(scope, receive, send, limit)
        await self.app(scope, _replay(body, receive), send)

    @staticmethod
    def _authorized(scope: Scope) -> bool:
        key = os.environ.get("SPECDEC_API_KEY")
        if not key or not scope["path"].startswith("/v1"):
            return True
        given = _header(scope, b"authorization") or ""
        scheme, _, token = given.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())

    @staticmethod
    async def _too_large(scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        response = error_response(
            413, f"the request body is larger than {limit} bytes", code="request_too_large"
        )
        await response(scope, receive, send)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole body, or None once it passes `limit` (the rest is not read)."""
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break  # disconnect: let the app see an empty body and the disconnect
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(parts)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # later calls wait for the disconnect, as usual

    return replay

