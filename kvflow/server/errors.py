"""API errors and how they are written: OpenAI's shape on /v1 and elsewhere, Ollama's on /api.

OpenAI: {"error": {"message", "type", "param", "code"}}. Ollama: {"error": "message"} (what the Ollama
server sends and its Python client parses).
"""

from __future__ import annotations

import re

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.types import Scope

# HTTP status -> (OpenAI error type, metrics kind)
_KINDS = {
    400: ("invalid_request_error", "invalid_request"),
    401: ("invalid_request_error", "unauthorized"),
    404: ("invalid_request_error", "not_found"),
    413: ("invalid_request_error", "too_large"),
    415: ("invalid_request_error", "unsupported_media_type"),
    422: ("invalid_request_error", "invalid_request"),
    500: ("server_error", "engine"),
    503: ("server_error", "overloaded"),
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return _KINDS.get(self.status, ("invalid_request_error", ""))[0]

    @property
    def kind(self) -> str:
        return _KINDS.get(self.status, ("", "other"))[1]

    def openai_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        kind = {401: "authentication_error", 404: "not_found_error", 413: "request_too_large",
                503: "overloaded_error"}.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        message = f"{self.param}: {self.message}" if self.param and self.param not in self.message else self.message
        return {"type": "error", "error": {"type": kind, "message": message}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


_PARAM_IN_MESSAGE = re.compile(r"^SamplingParams\.(\w+):")


def from_value_error(exc: ValueError, param_names: dict[str, str] | None = None) -> APIError:
    """A ValueError from SamplingParams or the engine as a 400; SamplingParams names the field at fault,
    which param_names maps back to the request's own field name."""
    message = str(exc)
    m = _PARAM_IN_MESSAGE.match(message)
    param = None
    if m is not None:
        param = (param_names or {}).get(m.group(1), m.group(1))
    elif "prompt" in message:
        param = "prompt" if "max_tokens" not in message else "max_tokens"
    return APIError(400, message, param)


def route_path(scope: Scope) -> str:
    """The path without the --root-path prefix the server may be mounted at."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root):
        return path[len(root):] or "/"
    return path


def error_response(request: Request, error: APIError) -> JSONResponse:
    """The error in the shape of the API the path belongs to: Ollama's, Anthropic's, or OpenAI's."""
    path = route_path(request.scope)
    if path.startswith("/api/"):
        body = {"error": error.message}
    elif path.startswith("/v1/messages"):
        body = error.anthropic_body()
    else:
        body = error.openai_body()
    return JSONResponse(body, status_code=error.status, headers=error.headers)
