"""API errors and how they are written: OpenAI's shape on /v1 and elsewhere, Ollama's on /api.

OpenAI: {"error": {"message", "type", "param", "code"}}. Ollama: {"error": "message"} (what the Ollama
server sends and its Python client parses). A prompt that leaves no room to generate gets the error each
API's clients act on (ContextLengthExceeded): OpenAI's code "context_length_exceeded", and Anthropic's
"prompt is too long: N tokens > M maximum" (on which Claude Code compacts its history).
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


class ContextLengthExceeded(APIError):
    """A prompt of n_prompt tokens where at most `limit` fit with one token to generate: the context
    (max_model_len - 1) or, where the KV cache holds fewer tokens, the cache (the pool's tokens + 1: the
    last sampled token takes no slot)."""

    def __init__(self, n_prompt: int, max_model_len: int, pool_tokens: int | None = None) -> None:
        if pool_tokens is not None and pool_tokens < max_model_len - 1:
            message = (f"The KV cache holds {pool_tokens} tokens (set by --kv-cache-memory), fewer than this "
                       f"model's maximum context length of {max_model_len} tokens, and the prompt has {n_prompt} "
                       f"tokens. Please reduce the length of the messages.")
            self.limit = pool_tokens
        else:
            message = (f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
                       f"{n_prompt} tokens (at least one must be left to generate). Please reduce the length of "
                       f"the messages.")
            self.limit = max_model_len - 1
        super().__init__(400, message, None, "context_length_exceeded")
        self.n_prompt = n_prompt
        self.max_model_len = max_model_len

    def anthropic_body(self) -> dict:
        # Anthropic's own wording, which its clients parse: the maximum is the longest prompt that fits.
        message = f"prompt is too long: {self.n_prompt} tokens > {self.limit} maximum"
        return {"type": "error", "error": {"type": "invalid_request_error", "message": message}}


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
