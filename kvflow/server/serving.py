"""What every route shares, around the chat pipeline: the server's state (engine, names, limits, metrics),
the request's id, its body read within the size limit and validated into the route's request model, and
the plain ASGI middleware every request passes (the API key, the X-Request-Id echo, --root-path), which
leaves streaming responses and disconnect detection untouched.

Fields a body carries that kvflow does not know are accepted and ignored, as vLLM, llama-server and Ollama
do, since the clients of each wire API send the newest (and beta) fields of that API, which a local server
cannot track release by release; a known field of the wrong type or value is still a 400 naming it. Every
request model is built with `extra="allow"`: pydantic keeps the unknown fields aside (model_extra), and
parse_body walks the validated body for them (unknown_fields): each is logged once per route at debug
level and counted in /metrics (`kvflow:request_ignored_fields_total{route, field}`), its path written with
`*` for list positions (`messages.*.refusal`), so the label stays one per kind of field however long the
conversation.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from kvflow.engine.async_engine import AsyncEngine
from kvflow.server.errors import APIError, bad_request, error_response, route_path
from kvflow.server.metrics import ServerMetrics, log_finished

log = logging.getLogger("kvflow")

M = TypeVar("M", bound=BaseModel)

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
# What one request may ask for, so that no single body queues unbounded work: n choices per prompt
# (--max-n; OpenAI allows up to 128, vLLM sets no bound) and prompts in a completions batch (OpenAI's 2048).
DEFAULT_MAX_N = 16
MAX_PROMPTS = 2048


@dataclass
class ServerSettings:
    served_model_name: str
    model_aliases: set[str] = field(default_factory=set)  # other names the model answers to
    api_key: str | None = None
    max_waiting: int | None = None  # refuse new requests (503) while this many wait; None: no limit
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    retry_after_s: int = 1
    root_path: str = ""  # --root-path: every route also served under this prefix
    ui: bool = True  # the page at GET / (--no-ui: a line of text there instead)
    metrics: bool = True  # /metrics and the page's live data (--no-metrics: both 404)
    strict_max_tokens: bool = False  # --strict-max-tokens: max_tokens past the context is a 400, not clamped
    max_n: int = DEFAULT_MAX_N  # --max-n: the most choices (n) one request may ask for per prompt


class ServerState:
    def __init__(self, engine: AsyncEngine, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = ServerMetrics(lambda: engine.stats, getattr(engine, "replica_stats", None))
        engine.finished_listeners.append(self.metrics.observe_finished)
        engine.finished_listeners.append(log_finished)
        self.started = time.time()
        self._machine = None

    @property
    def machine(self):
        """What this machine allows the model (server/machine.py), built when the page first asks."""
        if self._machine is None:
            from kvflow.server.machine import MachineLimits

            engine = self.engine.engine
            self._machine = MachineLimits(engine.model_summary, engine.runner.kv_element_bytes)
        return self._machine

    @property
    def model_name(self) -> str:
        return self.settings.served_model_name

    @property
    def tokenizer(self):
        return self.engine.engine.tokenizer

    def check_model(self, name: str | None) -> None:
        """404 unless name is empty, the served name or one of its aliases (Ollama's ':latest' tag allowed)."""
        if not name:
            return
        names = {self.model_name, *self.settings.model_aliases}
        if name in names or name.removesuffix(":latest") in names:
            return
        raise APIError(404, f"The model `{name}` does not exist. This server serves `{self.model_name}`.",
                       "model", "model_not_found")

    def check_capacity(self, num_new: int = 1) -> None:
        """503 with Retry-After while the waiting queue is full."""
        limit = self.settings.max_waiting
        waiting = self.engine.num_waiting
        if limit is not None and waiting + num_new > limit:
            raise APIError(503, f"the server is busy: {waiting} requests are waiting (limit {limit}); "
                           "retry later", None, "server_overloaded",
                           headers={"Retry-After": str(self.settings.retry_after_s)})


def get_state(request: Request) -> ServerState:
    return request.app.state.kvflow


def metrics_state(request: Request) -> ServerState:
    """The server's state, for a route that serves metrics: 404 when they are off (--no-metrics)."""
    state = get_state(request)
    if not state.settings.metrics:
        raise APIError(404, "metrics are off (--no-metrics)", None, "not_found")
    return state


def request_id(request: Request, prefix: str) -> str:
    """The client's X-Request-Id when it sent one, else a fresh id."""
    given = request.headers.get("x-request-id", "").strip()
    return given[:200] if given else f"{prefix}-{uuid.uuid4().hex}"


async def parse_body(request: Request, model: type[M]) -> M:
    """The JSON body as `model`: 413 past the size limit (at once when Content-Length says so, else as the
    bytes arrive); malformed JSON, missing fields and wrong types are 400s naming the field; unknown fields
    are ignored, logged once and counted (unknown_fields, below)."""
    check_json_content_type(request)
    raw = await read_body(request, get_state(request).settings.max_body_bytes)
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the body is not valid JSON: {exc}", None, "invalid_json") from None
    except RecursionError:  # arrays or objects nested past Python's recursion limit (a few kB of brackets)
        raise bad_request("the body's JSON is nested too deeply", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object", None, "invalid_json")
    try:
        parsed = model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None
    _note_unknown_fields(request, parsed)
    return parsed


def _note_unknown_fields(request: Request, body: BaseModel) -> None:
    names = unknown_fields(body)
    if not names:
        return
    state = get_state(request)
    route = route_path(request.scope)
    for name in names:
        if state.metrics.count_ignored_field(route, name):
            log.debug("ignoring the field %r on %s (kvflow does not know it)", name, route)


def check_json_content_type(request: Request) -> None:
    """415 unless the body is declared JSON (or not declared at all). A browser sends text/plain and form
    bodies across origins without asking first, so accepting them would let any web page a user opens
    make their local server generate."""
    declared = request.headers.get("content-type")
    if declared is None:
        return
    media = declared.split(";")[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise APIError(415, f"the body must be JSON sent as Content-Type: application/json, not {media!r} "
                       "(with curl: -H 'Content-Type: application/json')", None, "unsupported_media_type")


async def read_body(request: Request, max_bytes: int) -> bytes:
    too_large = f"the request body is larger than the limit of {max_bytes} bytes"
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise APIError(413, too_large, None, "request_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise APIError(413, too_large, None, "request_too_large")
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(400, "the client left before sending its whole body", None, "client_disconnected") from None
    return b"".join(chunks)


def validate_as(model: type[M], data: dict) -> M:
    """data as `model`, a 400 naming the field where it does not fit: for the chat request an adapter
    (Responses, Messages, Ollama) builds from what its client sent."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


def validation_error(exc: ValidationError) -> APIError:
    first = exc.errors()[0]
    loc = [str(part) for part in first["loc"]]
    # Unions report every branch; the field path is the part before the branch names.
    path = ".".join(p for p in loc if not _is_branch(p))
    if first["type"] == "extra_forbidden":
        return bad_request(f"unknown field: {path}", path, "unknown_parameter")
    if first["type"] == "missing":
        return bad_request(f"missing required field: {path}", path, "missing_parameter")
    return bad_request(f"invalid value for {path}: {first['msg']}", path, "invalid_value")


def _is_branch(part: str) -> bool:
    return any(ch in part for ch in "[]|") or part in ("str", "int", "float", "bool", "list", "dict")



def unknown_fields(model: BaseModel) -> list[str]:
    """The paths of the fields in model (and the models inside it) that its classes do not declare, each once."""
    return sorted(set(_walk(model, "")))


def _walk(value: object, prefix: str) -> Iterator[str]:
    if isinstance(value, BaseModel):
        for name in value.model_extra or {}:
            yield prefix + name
        for name in type(value).model_fields:
            yield from _walk(getattr(value, name), f"{prefix}{name}.")
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _walk(item, prefix + "*.")


# ---- ASGI middleware -------------------------------------------------------------------------------------
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
