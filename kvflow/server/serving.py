"""Running requests for a route: parse the body, submit prompts, follow their streams, abort on disconnect."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from kvflow.engine.async_engine import EngineDeadError, RequestStream
from kvflow.outputs import RequestOutput
from kvflow.sampling_params import SamplingParams
from kvflow.server.errors import APIError, bad_request, from_value_error
from kvflow.server.state import ServerState

M = TypeVar("M", bound=BaseModel)

DISCONNECT_POLL_S = 0.1


async def parse_body(request: Request, model: type[M]) -> M:
    """The JSON body as `model`; malformed JSON, unknown fields and wrong types are 400s naming the field."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the body is not valid JSON: {exc}", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object", None, "invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from None


def _validation_error(exc: ValidationError) -> APIError:
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
    """Add every prompt (one engine request each); all or none: a refused prompt aborts the others."""
    state.check_capacity(len(prompts))
    streams: list[RequestStream] = []
    try:
        for i, prompt in enumerate(prompts):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            streams.append(await state.engine.add_request(prompt, params, rid))
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
