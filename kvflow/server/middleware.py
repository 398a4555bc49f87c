"""The API key check, as plain ASGI middleware (so streaming responses and disconnect detection pass
through untouched). The body size limit is enforced where routes read bodies (serving.read_body)."""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from kvflow.server.errors import APIError, error_response, route_path

# Answered without the key: /health, so load balancers can probe; the page and its files, which ask for
# the key and send it with every request they make.
OPEN_PATHS = {"/health", "/"}
OPEN_PREFIXES = ("/ui/",)

OnError = Callable[[APIError], None]


def _is_open(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


async def _reject(scope: Scope, receive: Receive, send: Send, error: APIError, on_error: OnError) -> None:
    on_error(error)
    await error_response(Request(scope, receive), error)(scope, receive, send)


class RootPathMiddleware:
    """--root-path: every route is also served under the prefix (as when a proxy forwards /prefix/... to
    the server without stripping it); the prefix becomes the ASGI root_path, so /docs links include it."""

    def __init__(self, app: ASGIApp, prefix: str) -> None:
        self.app, self.prefix = app, "/" + prefix.strip("/")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] in ("http", "websocket") and (path == self.prefix or path.startswith(self.prefix + "/")):
            scope = {**scope, "root_path": scope.get("root_path", "") + self.prefix,
                     "path": path[len(self.prefix):] or "/"}
        await self.app(scope, receive, send)


class RequestIdMiddleware:
    """An X-Request-Id the client sends comes back on the response (the routes also use it as the
    request's id); vLLM's clients and proxies rely on both."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        given = dict(scope.get("headers", [])).get(b"x-request-id") if scope["type"] == "http" else None
        if not given:
            return await self.app(scope, receive, send)

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", given)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class APIKeyMiddleware:
    """401 unless `Authorization: Bearer KEY` (or Ollama-style `Authorization: KEY`, or Anthropic-style
    `x-api-key: KEY`) matches."""

    def __init__(self, app: ASGIApp, api_key: str, on_error: OnError) -> None:
        self.app, self.api_key, self.on_error = app, api_key, on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _is_open(route_path(scope)):
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
