"""The API key check, as plain ASGI middleware (so streaming responses and disconnect detection pass
through untouched). The body size limit is enforced where routes read bodies (serving.read_body)."""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from kvflow.server.errors import APIError, error_response

OPEN_PATHS = {"/health"}  # answered without the key, so load balancers can probe

OnError = Callable[[APIError], None]


async def _reject(scope: Scope, receive: Receive, send: Send, error: APIError, on_error: OnError) -> None:
    on_error(error)
    await error_response(Request(scope, receive), error)(scope, receive, send)


class APIKeyMiddleware:
    """401 unless `Authorization: Bearer KEY` (or Ollama-style `Authorization: KEY`, or Anthropic-style
    `x-api-key: KEY`) matches."""

    def __init__(self, app: ASGIApp, api_key: str, on_error: OnError) -> None:
        self.app, self.api_key, self.on_error = app, api_key, on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"").decode("latin-1").strip()
        if given.lower().startswith("bearer "):
            given = given[7:].strip()
        if not given:  # Anthropic's clients send the key as x-api-key
            given = headers.get(b"x-api-key", b"").decode("latin-1").strip()
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            error = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.", None,
                             "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            return await _reject(scope, receive, send, error, self.on_error)
        await self.app(scope, receive, send)
