"""OpenAI's text completions (POST /v1/completions): prompts (text or token ids, several in a batch) run
as they are, with no chat template, so not through the chat pipeline: each prompt is its own engine request,
whose n choices come back as JSON or an SSE stream, with logprobs, echo and vLLM's fields (vllm_fields.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from kvflow.engine.async_engine import EngineDeadError, RequestStream
from kvflow.outputs import CompletionOutput, RequestOutput
from kvflow.server import openapi
from kvflow.server.chat_pipeline import (
    abort_on_disconnect,
    check_constraint,
    check_request_size,
    collect,
    submit,
)
from kvflow.server.errors import APIError
from kvflow.server.openai_api import SSE_HEADERS, json_with_timings, prompt_fields, sse, usage, vllm_part
from kvflow.server.prompt_logprobs import completion_logprobs, joined
from kvflow.server.protocol import CompletionRequest
from kvflow.server.serving import get_state, parse_body, request_id
from kvflow.server.vllm_fields import opening_usage, prompt_inputs, running_usage_wanted, token_options

router = APIRouter()


@router.post("/v1/completions", openapi_extra=openapi.body(CompletionRequest))
async def create_completion(request: Request):
    state = get_state(request)
    body = await parse_body(request, CompletionRequest)
    state.check_model(body.model)
    params = body.validate_request()
    check_constraint(state, params, body.structured_output()[1])
    given = body.prompts()
    check_request_size(state, len(given), body.n)  # before any prompt is read: a batch may be huge
    prompts, prompt_ids = prompt_inputs(state.engine.engine, body, given)
    shown = prompts if body.truncate_prompt_tokens is not None else given  # what echo repeats: what ran
    echo_texts = [p if isinstance(p, str) else state.tokenizer.decode(p) for p in shown] if body.echo else []
    rid = request_id(request, "cmpl")
    streams = await submit(state, prompts, params, rid)
    head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": state.model_name}
    if body.stream:
        events = _completion_events(request, body, streams, head, echo_texts, prompt_ids)
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
    finals = await collect(request, streams)
    n, k = body.n, body.logprobs
    choices = []
    for i, out in enumerate(finals):
        echo = echo_texts[i] if body.echo else ""
        prompt_part = prompt_fields(state, body, out)
        for c in out.outputs:
            lp = completion_logprobs(c.token_ids, c.logprobs or [], k, len(echo), **token_options(body)) \
                if k is not None else None
            if "logprobs" in prompt_part:
                lp = joined(prompt_part["logprobs"], lp)
            ids = {"prompt_token_ids": out.prompt_token_ids, "token_ids": list(c.token_ids)} \
                if body.return_token_ids else {}
            choices.append({"index": i * n + c.index, "text": echo + c.text, "logprobs": lp,
                            "finish_reason": c.finish_reason, **vllm_part(prompt_part), **ids})
    return json_with_timings({**head, "choices": choices, "usage": usage(finals), "system_fingerprint": None})


class _ChoiceCursor:
    """Per streamed choice: tokens sent so far (for logprob slices) and the next logprobs text_offset."""

    def __init__(self, text_offset: int = 0) -> None:
        self.tokens = 0
        self.text = text_offset
        self.done = False

    def advance(self, c: CompletionOutput) -> tuple[list[int], list]:
        start, count = self.tokens, len(c.delta_token_ids)
        ids, entries = c.token_ids[start:start + count], (c.logprobs or [])[start:start + count]
        self.tokens += count
        self.done = c.finish_reason is not None
        return ids, entries


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


async def _follow(
    request: Request, body: CompletionRequest, streams: Sequence[RequestStream], head: dict, n: int,
    cursors: dict[int, _ChoiceCursor], with_logprobs: bool, latest: list,
) -> AsyncIterator[tuple[int, CompletionOutput, list, list, _ChoiceCursor] | str]:
    """Yields (choice index, completion, new token ids, their logprob entries, cursor) for every choice
    with something to send, then the closing SSE events (the usage chunk when asked for, and [DONE]);
    an engine failure ends the stream with an error event. `latest` (one slot per stream) is kept at each
    stream's newest output, for usage in every chunk."""
    finals: list[RequestOutput | None] = [None] * len(streams)
    async with abort_on_disconnect(request, streams):
        try:
            async for i, out in iterate(streams):
                latest[i] = out
                if out.finished:
                    finals[i] = out
                for c in out.outputs:
                    if not (c.delta_text or c.delta_token_ids or c.finish_reason is not None):
                        continue
                    index = i * n + c.index
                    cursor = cursors.setdefault(index, _ChoiceCursor())
                    if cursor.done:
                        continue
                    ids, entries = cursor.advance(c)
                    if not c.delta_text and c.finish_reason is None and not with_logprobs:
                        continue  # tokens whose text is held back (a possible stop string, a partial character)
                    yield index, c, ids, entries, cursor
        except EngineDeadError as exc:
            yield sse(APIError(500, str(exc), None, "engine_error").openai_body())
            yield sse("[DONE]")
            return
    if body.include_usage:
        yield sse({**head, "choices": [], "usage": usage([f for f in finals if f is not None])})
    yield sse("[DONE]")


async def _completion_events(
    request: Request, body: CompletionRequest, streams: Sequence[RequestStream], head: dict, echo_texts: list[str],
    prompt_ids: list[list[int]] | None,
) -> AsyncIterator[str]:
    n, k = body.n, body.logprobs
    tail = {"usage": None} if body.include_usage else {}
    running = running_usage_wanted(body.stream_options)
    opening = {"usage": opening_usage(prompt_ids)} if prompt_ids and running else tail
    latest: list = [None] * len(streams)
    cursors: dict[int, _ChoiceCursor] = {}
    given_ids: set[int] = set()  # choices whose prompt_token_ids were sent (vLLM: in their first chunk)

    def token_ids(index: int, ids: list[int]) -> dict:
        if not body.return_token_ids or prompt_ids is None:
            return {}
        first = {} if index in given_ids else {"prompt_token_ids": prompt_ids[index // n]}
        given_ids.add(index)
        return {**first, "token_ids": ids}

    # A scored prompt's chunk waits for its logprobs, which come with the choice's first output.
    scored = body.prompt_logprobs_wanted is not None
    for i, text in enumerate(echo_texts):
        for j in range(n):
            cursors[i * n + j] = _ChoiceCursor(len(text))
            if not scored:
                yield sse({**head, "choices": [{"index": i * n + j, "text": text, "logprobs": None,
                                                "finish_reason": None, **token_ids(i * n + j, [])}], **opening})
    introduced: set[int] = set()
    with_ids = k is not None or bool(body.return_token_ids)  # every token goes out, its text held back or not
    async for item in _follow(request, body, streams, head, n, cursors, with_ids, latest):
        if isinstance(item, str):
            yield item
            continue
        if running:  # usage in every chunk (vLLM's continuous_usage_stats)
            tail = {"usage": usage([o for o in latest if o is not None])}
        index, c, ids, entries, cursor = item
        if scored and index not in introduced:
            introduced.add(index)
            prompt_part = prompt_fields(get_state(request), body, latest[index // n])
            choice = {"index": index, "text": echo_texts[index // n] if body.echo else "",
                      "logprobs": prompt_part.get("logprobs"), "finish_reason": None, **vllm_part(prompt_part)}
            yield sse({**head, "choices": [choice], **tail})
        lp = None
        if k is not None:
            lp = completion_logprobs(ids, entries, k, cursor.text, **token_options(body))
            # offsets count decoded tokens, as unstreamed
            cursor.text += sum(len(e[t].decoded_token or "") for t, e in zip(ids, entries))
        choice = {"index": index, "text": c.delta_text, "logprobs": lp, "finish_reason": c.finish_reason,
                  **token_ids(index, ids)}
        yield sse({**head, "choices": [choice], **tail})
