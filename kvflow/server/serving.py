"""What every route needs to run requests: the server's state (engine, names, limits, metrics), the body
(read within the size limit and validated), the prompt (a chat template rendered), submitting prompts,
following their streams and aborting them when the client leaves, and where each response's time went.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from kvflow.engine.async_engine import AsyncEngine, EngineDeadError, RequestStream
from kvflow.outputs import RequestOutput
from kvflow.sampling_params import SamplingParams
from kvflow.server.context_fit import fit_context
from kvflow.server.errors import APIError, bad_request, from_value_error, route_path
from kvflow.server.metrics import ServerMetrics
from kvflow.server.unknown_fields import unknown_fields
from kvflow.structured.compiler import GrammarError

log = logging.getLogger("kvflow")

M = TypeVar("M", bound=BaseModel)

DISCONNECT_POLL_S = 0.1
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


def log_finished(out: RequestOutput) -> None:
    """One INFO line per finished request, under its id (the client's X-Request-Id when it sent one)."""
    if not log.isEnabledFor(logging.INFO):
        return
    m = out.metrics
    how = out.error or ",".join(sorted({c.finish_reason or "unfinished" for c in out.outputs}))
    log.info("request %s finished (%s): %d prompt tokens (%d cached), %d generated, queue %s, TTFT %s, TPOT %s",
             out.request_id, how, m.num_prompt_tokens, m.num_cached_tokens, m.num_generated_tokens,
             _ms(m.queue_time), _ms(m.ttft), _ms(m.tpot))


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"


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
    are ignored, logged once and counted (unknown_fields.py)."""
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


def render_chat(tokenizer, messages: list[dict], param: str = "messages", tools: list[dict] | None = None,
                template_kwargs: dict | None = None, continue_final: bool = False,
                add_generation_prompt: bool = True) -> str:
    """The prompt text for messages (and tools, as transformers passes them to the template; template_kwargs
    such as enable_thinking go to the template too), ending with the assistant's turn (unless
    add_generation_prompt is false); a 400 when the template refuses them."""
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template, so it cannot chat; use the completions API",
                          param, "no_chat_template")
    try:
        if continue_final:  # the prompt ends inside the last assistant message, which the answer goes on with
            return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=False,
                                                 continue_final_message=True, **(template_kwargs or {}))
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **(template_kwargs or {}))
    except Exception as exc:  # jinja2 raises TemplateError (or anything a template's raise_exception throws)
        raise bad_request(f"the chat template could not render these messages: {exc}", param) from None


def check_constraint(state: ServerState, params: SamplingParams, field: str | None) -> None:
    """A 400 naming `field` when the request's output constraint cannot be compiled (a bad schema, an
    unsupported keyword, a bad regex); compiled grammars are cached, so the engine's own compile is a hit."""
    if params.structured_output is None:
        return
    try:
        state.engine.engine.grammars.compile(params.structured_output)
    except GrammarError as exc:
        raise bad_request(str(exc), field, "invalid_schema") from None


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


async def submit(
    state: ServerState, prompts: Sequence[str | list[int]], params: SamplingParams, request_id: str
) -> list[RequestStream]:
    """Add every prompt (one engine request each); all or none: a refused prompt aborts the others. Each is
    tokenized here to fit it into the context (server/context_fit.py): max_tokens clamped to the room left."""
    check_request_size(state, len(prompts), params.n)
    state.check_capacity(len(prompts))
    engine, strict = state.engine.engine, state.settings.strict_max_tokens
    pool = getattr(engine, "longest_request_tokens", None)
    fitted = []
    for prompt in prompts:
        _, ids = await state.engine.prompt_ids(prompt)
        fitted.append((ids, fit_context(len(ids), params, engine.max_model_len, strict, pool)))
    streams: list[RequestStream] = []
    try:
        for i, (ids, prompt_params) in enumerate(fitted):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            streams.append(await state.engine.add_request(ids, prompt_params, rid))
    except ValueError as exc:
        _abort(streams)
        raise from_value_error(exc) from None
    except EngineDeadError as exc:
        _abort(streams)
        raise APIError(503, str(exc), None, "engine_unavailable") from None
    except BaseException:
        _abort(streams)
        raise
    return streams


def check_request_size(state: ServerState, num_prompts: int, n: int) -> None:
    """A 400 naming the field when one request asks for more sequences than a request may: n above --max-n,
    or more than MAX_PROMPTS prompts."""
    if n > state.settings.max_n:
        raise bad_request(f"n must be at most {state.settings.max_n} (--max-n), got {n}", "n")
    if num_prompts > MAX_PROMPTS:
        raise bad_request(f"a request may hold at most {MAX_PROMPTS} prompts, got {num_prompts}", "prompt")


def _abort(streams: Sequence[RequestStream]) -> None:
    for stream in streams:
        stream.abort()


@contextlib.asynccontextmanager
async def abort_on_disconnect(request: Request, streams: Sequence[RequestStream]) -> AsyncIterator[None]:
    """While inside, a client that goes away aborts the streams (their blocks are freed within a step);
    leaving early (an error, a closed generator) aborts whatever has not finished."""

    async def watch() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)
        _abort(streams)

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()
        _abort(streams)


async def iterate(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams as they come."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except BaseException as exc:  # noqa: BLE001 - handed to the reader
            queue.put_nowait((i, exc))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


async def collect(request: Request, streams: Sequence[RequestStream]) -> list[RequestOutput]:
    """Each stream's final output (for non-streaming responses)."""
    finals: list[RequestOutput | None] = [None] * len(streams)
    async with abort_on_disconnect(request, streams):
        try:
            async for i, out in iterate(streams):
                if out.finished:
                    finals[i] = out
        except EngineDeadError as exc:
            raise APIError(500, str(exc), None, "engine_error") from None
    return [f for f in finals if f is not None]


_PHASES = (("queue_ms", "queue_time"), ("ttft_ms", "ttft"), ("prefill_ms", "prefill_time"),
           ("decode_ms", "decode_time"))


def request_timings(outputs: Sequence[RequestOutput]) -> dict:
    """Where a response's time went: queue, TTFT, prefill, decode (ms), cached prompt tokens and speculated
    tokens. Reported
    as usage.kvflow_timings (OpenAI), kvflow_timings (Ollama) and x-kvflow-* headers; a request with
    several prompts reports the slowest prompt's times and the sum of their cached tokens."""
    timings: dict = {}
    for key, attr in _PHASES:
        values = [getattr(o.metrics, attr) for o in outputs]
        known = [v for v in values if v is not None]
        timings[key] = round(max(known) * 1000, 3) if known else None
    timings["cached_tokens"] = sum(o.metrics.num_cached_tokens for o in outputs)
    timings["disk_cached_tokens"] = sum(o.metrics.num_disk_cached_tokens for o in outputs)  # of those, from disk
    # Speculative decoding: guessed tokens verified, and those kept (their ratio is the acceptance rate).
    timings["spec_draft_tokens"] = sum(o.metrics.num_draft_tokens for o in outputs)
    timings["spec_accepted_tokens"] = sum(o.metrics.num_accepted_tokens for o in outputs)
    return timings


def timing_headers(timings: dict) -> dict[str, str]:
    headers = {}
    for key, value in timings.items():
        if value is None:
            continue
        name = "x-kvflow-" + key.replace("_ms", "-ms").replace("_", "-")
        headers[name] = str(value)
    return headers
