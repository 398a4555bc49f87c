"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions (JSON or SSE streams), and
the pieces of their responses: logprobs blocks, usage (with kvflow_timings) and SSE framing."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Sequence

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvflow.engine.async_engine import EngineDeadError, RequestStream
from kvflow.outputs import CompletionOutput, RequestOutput
from kvflow.server import openapi
from kvflow.server.answer_parser import AnswerParser
from kvflow.server.chat_prompt import ChatPrompt, prepare_chat
from kvflow.server.errors import APIError
from kvflow.server.prompt_logprobs import (
    chat_logprobs,
    completion_logprobs,
    echoed_prompt_logprobs,
    joined,
    vllm_prompt_logprobs,
)
from kvflow.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from kvflow.server.serving import (
    abort_on_disconnect,
    check_constraint,
    check_request_size,
    collect,
    get_state,
    iterate,
    parse_body,
    request_id,
    request_timings,
    submit,
    timing_headers,
)
from kvflow.server.vllm_fields import opening_usage, prompt_inputs, running_usage_wanted, token_options

router = APIRouter()

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    state = get_state(request)
    return {"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": int(state.started), "owned_by": "kvflow",
        "max_model_len": state.engine.engine.max_model_len,
    }]}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(request: Request, model_id: str) -> dict:
    state = get_state(request)
    state.check_model(model_id)
    return {"id": state.model_name, "object": "model", "created": int(state.started), "owned_by": "kvflow",
            "max_model_len": state.engine.engine.max_model_len}


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
        prompt_part = _prompt_fields(state, body, out)
        for c in out.outputs:
            lp = completion_logprobs(c.token_ids, c.logprobs or [], k, len(echo), **token_options(body)) \
                if k is not None else None
            if "logprobs" in prompt_part:
                lp = joined(prompt_part["logprobs"], lp)
            ids = {"prompt_token_ids": out.prompt_token_ids, "token_ids": list(c.token_ids)} \
                if body.return_token_ids else {}
            choices.append({"index": i * n + c.index, "text": echo + c.text, "logprobs": lp,
                            "finish_reason": c.finish_reason, **_vllm_part(prompt_part), **ids})
    return _json_with_timings({**head, "choices": choices, "usage": usage(finals), "system_fingerprint": None})


def _prompt_fields(state, body: SamplingFields, out: RequestOutput) -> dict:
    """What a choice says about its prompt: with echo and logprobs on completions, the prompt's logprobs
    block ("logprobs"); with vLLM's prompt_logprobs, that list ("prompt_logprobs")."""
    fields: dict = {}
    if out.prompt_logprobs is None:
        return fields
    k = getattr(body, "logprobs", None)
    if getattr(body, "echo", False) and k is not None:
        fields["logprobs"] = echoed_prompt_logprobs(out.prompt_token_ids, out.prompt_logprobs, k,
                                                    state.tokenizer.decode, bool(body.return_tokens_as_token_ids))
    if body.prompt_logprobs is not None:
        fields["prompt_logprobs"] = vllm_prompt_logprobs(out.prompt_token_ids, out.prompt_logprobs,
                                                         body.prompt_logprobs)
    return fields


def _vllm_part(prompt_part: dict) -> dict:
    return {"prompt_logprobs": prompt_part["prompt_logprobs"]} if "prompt_logprobs" in prompt_part else {}


@router.post("/v1/chat/completions", openapi_extra=openapi.body(ChatCompletionRequest))
async def create_chat_completion(request: Request):
    state = get_state(request)
    body = await parse_body(request, ChatCompletionRequest)
    state.check_model(body.model)
    params = body.validate_request()
    chat = prepare_chat(state.tokenizer, body)
    params = chat.sampling(params)
    check_constraint(state, params, chat.constraint_field)
    (prompt,), prompt_ids = prompt_inputs(state.engine.engine, body, [chat.prompt])
    rid = request_id(request, "chatcmpl")
    streams = await submit(state, [prompt], params, rid)
    head = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": state.model_name}
    k = body.top_logprobs or 0
    if body.stream:
        head["object"] = "chat.completion.chunk"
        events = _chat_events(request, body, streams, head, chat, prompt_ids[0] if prompt_ids else None)
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
    (final,) = await collect(request, streams)
    # vLLM: thinking left out takes its logprobs and token ids with it
    hide = not body.include_reasoning and chat.reasoning is not None
    choices = []
    for c in final.outputs:
        message: dict = {"role": body.answer_role, "content": c.text, "refusal": None}
        finish = c.finish_reason
        parser = chat.answer_parser()
        if parser is not None:
            answer = parser.whole(c.text)
            message["content"] = answer.content
            if chat.reasoning is not None and body.include_reasoning:
                message["reasoning_content"] = answer.reasoning
            if answer.calls:
                message.update(content=answer.content if answer.content.strip() else None,
                               tool_calls=[call.openai(custom=call.name in chat.custom_names)
                                           for call in answer.calls])
                finish = "tool_calls" if finish == "stop" else finish
        if body.echoed():
            message["content"] = body.echoed() + (message["content"] or "")
        lp = chat_logprobs(c.token_ids, c.logprobs or [], k, **token_options(body)) if body.logprobs else None
        ids = {"token_ids": None if hide else list(c.token_ids)} if body.return_token_ids else {}
        choices.append({"index": c.index, "message": message, "logprobs": None if hide else lp,
                        "finish_reason": finish, **ids})
    prompt_part = {"prompt_token_ids": final.prompt_token_ids} if body.return_token_ids else {}
    return _json_with_timings({**head, "choices": choices, "usage": usage([final]), "system_fingerprint": None,
                               **_vllm_part(_prompt_fields(state, body, final)), **prompt_part})


def _json_with_timings(body: dict) -> JSONResponse:
    return JSONResponse(body, headers=timing_headers(body["usage"]["kvflow_timings"]))


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


async def _follow(
    request: Request, body: SamplingFields, streams: Sequence[RequestStream], head: dict, n: int,
    cursors: dict[int, _ChoiceCursor], with_logprobs: bool, latest: list | None = None,
) -> AsyncIterator[tuple[int, CompletionOutput, list, list, _ChoiceCursor] | str]:
    """Yields (choice index, completion, new token ids, their logprob entries, cursor) for every choice
    with something to send, then the closing SSE events (the usage chunk when asked for, and [DONE]);
    an engine failure ends the stream with an error event. `latest` (one slot per stream) is kept at each
    stream's newest output, for usage in every chunk."""
    finals: list[RequestOutput | None] = [None] * len(streams)
    async with abort_on_disconnect(request, streams):
        try:
            async for i, out in iterate(streams):
                if latest is not None:
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
    opening = {"usage": opening_usage(prompt_ids)} if prompt_ids and running_usage_wanted(body.stream_options) else tail
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
        tail = _running_usage(body, latest, tail)
        index, c, ids, entries, cursor = item
        if scored and index not in introduced:
            introduced.add(index)
            prompt_part = _prompt_fields(get_state(request), body, latest[index // n])
            choice = {"index": index, "text": echo_texts[index // n] if body.echo else "",
                      "logprobs": prompt_part.get("logprobs"), "finish_reason": None, **_vllm_part(prompt_part)}
            yield sse({**head, "choices": [choice], **tail})
        lp = None
        if k is not None:
            lp = completion_logprobs(ids, entries, k, cursor.text, **token_options(body))
            # offsets count decoded tokens, as unstreamed
            cursor.text += sum(len(e[t].decoded_token or "") for t, e in zip(ids, entries))
        choice = {"index": index, "text": c.delta_text, "logprobs": lp, "finish_reason": c.finish_reason,
                  **token_ids(index, ids)}
        yield sse({**head, "choices": [choice], **tail})


async def _chat_events(
    request: Request, body: ChatCompletionRequest, streams: Sequence[RequestStream], head: dict,
    chat: ChatPrompt, prompt_ids: list[int] | None,
) -> AsyncIterator[str]:
    tail = {"usage": None} if body.include_usage else {}
    opening = {"usage": opening_usage([prompt_ids])} if prompt_ids and running_usage_wanted(body.stream_options) \
        else tail
    k = body.top_logprobs or 0
    # vLLM: thinking left out takes its logprobs and token ids with it
    hide = not body.include_reasoning and chat.reasoning is not None
    parsers: dict[int, _StreamedAnswer] = {}
    latest: list = [None] * len(streams)
    given = {"prompt_token_ids": prompt_ids} if body.return_token_ids and prompt_ids is not None else {}
    for j in range(body.n):  # the first chunk of every choice names the role
        choice = {"index": j, "delta": {"role": body.answer_role, "content": ""}, "logprobs": None,
                  "finish_reason": None}
        yield sse({**head, "choices": [choice], **opening, **given})
    for j in range(body.n if body.echoed() else 0):
        choice = {"index": j, "delta": {"content": body.echoed()}, "logprobs": None, "finish_reason": None}
        yield sse({**head, "choices": [choice], **opening})
    scored = body.prompt_logprobs is not None
    with_ids = bool(body.logprobs) or bool(body.return_token_ids)  # every token goes out, its text held back or not
    async for item in _follow(request, body, streams, head, body.n, {}, with_ids, latest):
        if isinstance(item, str):
            yield item
            continue
        tail = _running_usage(body, latest, tail)
        if scored:  # vLLM's prompt_logprobs, once, in a chunk of their own before the first token's
            scored = False
            yield sse({**head, "choices": [], **_vllm_part(_prompt_fields(get_state(request), body, latest[0])),
                       **tail})
        index, c, ids, entries, _ = item
        lp = chat_logprobs(ids, entries, k, **token_options(body)) if body.logprobs and not hide else None
        token_ids = {"token_ids": ids} if body.return_token_ids and not hide else {}
        if chat.tool_format is None and chat.reasoning is None:
            delta = {"content": c.delta_text} if c.delta_text else {}
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": c.finish_reason, **token_ids}
            yield sse({**head, "choices": [choice], **tail})
            continue
        answer = parsers.setdefault(index, _StreamedAnswer(chat.answer_parser(), body.include_reasoning,
                                                           chat.custom_names))
        deltas = answer.deltas(c.delta_text, c.finish_reason)
        for delta, finish in deltas or ([({}, None)] if token_ids else []):  # ids of text held back go out too
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish, **token_ids}
            lp, token_ids = None, {}  # a token's logprobs and id go with the first chunk its text is in
            yield sse({**head, "choices": [choice], **tail})


def _running_usage(body: SamplingFields, latest: list, tail: dict) -> dict:
    """With stream_options include_usage and continuous_usage_stats (vLLM's rule: both), every chunk carries
    the usage so far."""
    if not running_usage_wanted(body.stream_options):
        return tail
    return {"usage": usage([o for o in latest if o is not None])}


class _StreamedAnswer:
    """One streamed choice whose text is split: thinking as reasoning_content deltas, content deltas as the
    parsers let text through, and each tool call as OpenAI streams it (a chunk with its index, id and
    name, then one with its arguments)."""

    def __init__(self, parser: AnswerParser, include_reasoning: bool = True,
                 custom_names: frozenset[str] = frozenset()) -> None:
        self.parser = parser
        self.include_reasoning = include_reasoning  # vLLM's include_reasoning false: thinking is not sent
        self.custom_names = custom_names
        self.sent_calls = 0

    def deltas(self, text: str, finish_reason: str | None) -> list[tuple[dict, str | None]]:
        out = self._emit(self.parser.feed(text)) if text else []
        if finish_reason is None:
            return out or ([({}, None)] if text == "" else [])
        out += self._emit(self.parser.finish())
        finish = "tool_calls" if self.sent_calls and finish_reason == "stop" else finish_reason
        return [*out, ({}, finish)]

    def _emit(self, piece) -> list[tuple[dict, str | None]]:
        out: list[tuple[dict, str | None]] = []
        if piece.reasoning and self.include_reasoning:
            out.append(({"reasoning_content": piece.reasoning}, None))
        if piece.content:
            out.append(({"content": piece.content}, None))
        for call in piece.calls:
            index, self.sent_calls = self.sent_calls, self.sent_calls + 1
            if call.name in self.custom_names:  # a custom tool's call comes whole
                out.append(({"tool_calls": [call.openai(index, custom=True)]}, None))
                continue
            head = {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
            out.append(({"tool_calls": [head]}, None))
            out.append(({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]}, None))
        return out


# ---- response pieces -------------------------------------------------------------------------
def sse(obj: dict | str) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n"


def usage(outputs: Sequence[RequestOutput]) -> dict:
    """OpenAI's usage block (prompt tokens of every prompt, tokens of every choice) plus kvflow_timings."""
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    timings = request_timings(outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": timings["cached_tokens"]},
        "kvflow_timings": timings,
    }
