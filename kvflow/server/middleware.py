"""ASGI middleware (plain ASGI, so streaming responses and disconnect detection pass through untouched):
an API key check and a request body size limit."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvflow.server.errors import APIError, error_response

OPEN_PATHS = {"/health"}  # answered without the key, so load balancers can probe

OnError = Callable[[APIError], None]


async def _reject(scope: Scope, receive: Receive, send: Send, error: APIError, on_error: OnError) -> None:
    on_error(error)
    await error_response(Request(scope, receive), error)(scope, receive, send)


class APIKeyMiddleware:
    """401 unless `Authorization: Bearer KEY` (or Ollama-style `Authorization: KEY`) matches."""

    def __init__(self, app: ASGIApp, api_key: str, on_error: OnError) -> None:
        self.app, self.api_key, self.on_error = app, api_key, on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"").decode("latin-1").strip()
        if given.lower().startswith("bearer "):
            given = given[7:].strip()
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            error = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.", None,
                             "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            return await _reject(scope, receive, send, error, self.on_error)
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for a body over max_bytes: at once when Content-Length says so, else once the bytes read pass
    the limit. The body is read here and replayed, then later receive() calls go to the server (they
    report the client's disconnect)."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_error: OnError) -> None:
        self.app, self.max_bytes, self.on_error = app, max_bytes, on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        too_large = APIError(413, f"the request body is larger than the limit of {self.max_bytes} bytes",
                             None, "request_too_large")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await _reject(scope, receive, send, too_large, self.on_error)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await _reject(scope, receive, send, too_large, self.on_error)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)


def _replay(body: bytes, receive: Receive) -> Callable[[], Awaitable[Message]]:
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
