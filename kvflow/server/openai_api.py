"""OpenAI's chat completions (POST /v1/chat/completions), the adapter of the chat pipeline that the other
wire APIs' adapters are modelled on: its body is the internal chat request itself (protocol.py), and the
pipeline's events come back as a chat.completion object or chat.completion.chunk SSE events, one choice
per index (n > 1), with logprobs, usage (also in every chunk: vLLM's continuous_usage_stats) and vLLM's
fields (vllm_fields.py). Also /v1/models, and the pieces /v1/completions shares: SSE framing, the usage block
(with kvflow_timings) and the prompt's logprobs."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Sequence

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvflow.engine.async_engine import EngineDeadError
from kvflow.outputs import RequestOutput
from kvflow.server import openapi
from kvflow.server.answer_parser import Reasoning
from kvflow.server.chat_pipeline import ChatRun, ChoiceDelta, Finished, start_chat
from kvflow.server.errors import APIError
from kvflow.server.metrics import request_timings, timing_headers
from kvflow.server.prompt_logprobs import chat_logprobs, echoed_prompt_logprobs, vllm_prompt_logprobs
from kvflow.server.protocol import ChatCompletionRequest, SamplingFields
from kvflow.server.serving import ServerState, get_state, parse_body, request_id
from kvflow.server.tool_calls import ToolCall
from kvflow.server.vllm_fields import opening_usage, running_usage_wanted, token_options

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


@router.post("/v1/chat/completions", openapi_extra=openapi.body(ChatCompletionRequest))
async def create_chat_completion(request: Request):
    state = get_state(request)
    body = await parse_body(request, ChatCompletionRequest)
    state.check_model(body.model)
    rid = request_id(request, "chatcmpl")
    run = await start_chat(state, body, rid, every_token=body.logprobs or bool(body.return_token_ids))
    head = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": state.model_name}
    if body.stream:
        head["object"] = "chat.completion.chunk"
        return StreamingResponse(_chat_events(request, body, run, head), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    final, answers = await run.answers(request)
    chat, k = run.chat, body.top_logprobs or 0
    # vLLM: thinking left out takes its logprobs and token ids with it
    hide = not body.include_reasoning and chat.reasoning is not None
    choices = []
    for answer in answers:
        c = answer.choice
        message: dict = {"role": body.answer_role, "content": answer.content, "refusal": None}
        finish = c.finish_reason
        if chat.reasoning is not None and body.include_reasoning:
            message["reasoning_content"] = answer.reasoning
        if answer.calls:
            message.update(content=answer.content if answer.content.strip() else None,
                           tool_calls=[call.openai(custom=call.name in chat.custom_names) for call in answer.calls])
            finish = "tool_calls" if finish == "stop" else finish
        if body.echoed():
            message["content"] = body.echoed() + (message["content"] or "")
        lp = _chat_logprobs(body, c.token_ids, c.logprobs or [], k) if body.logprobs and not hide else None
        ids = {"token_ids": None if hide else list(c.token_ids)} if body.return_token_ids else {}
        choices.append({"index": c.index, "message": message, "logprobs": lp, "finish_reason": finish, **ids})
    prompt_part = {"prompt_token_ids": final.prompt_token_ids} if body.return_token_ids else {}
    return json_with_timings({**head, "choices": choices, "usage": usage([final]), "system_fingerprint": None,
                              **vllm_part(prompt_fields(state, body, final)), **prompt_part})


async def _chat_events(request: Request, body: ChatCompletionRequest, run: ChatRun, head: dict) -> AsyncIterator[str]:
    running = body.stream_options is not None and running_usage_wanted(body.stream_options)
    tail = {"usage": None} if body.include_usage else {}
    opening = {"usage": opening_usage([run.prompt_ids])} if running else tail
    k = body.top_logprobs or 0
    # vLLM: thinking left out takes its logprobs and token ids with it
    hide = not body.include_reasoning and run.chat.reasoning is not None
    plain = run.chat.tool_format is None and run.chat.reasoning is None  # all content: one chunk per delta
    choices: dict[int, ChoiceChunks] = {}
    given = {"prompt_token_ids": run.prompt_ids} if body.return_token_ids else {}
    for j in range(body.n):  # the first chunk of every choice names the role
        choice = {"index": j, "delta": {"role": body.answer_role, "content": ""}, "logprobs": None,
                  "finish_reason": None}
        yield sse({**head, "choices": [choice], **opening, **given})
    for j in range(body.n if body.echoed() else 0):
        choice = {"index": j, "delta": {"content": body.echoed()}, "logprobs": None, "finish_reason": None}
        yield sse({**head, "choices": [choice], **opening})
    scored = body.prompt_logprobs is not None
    final: RequestOutput | None = None
    try:
        async for event in run.events(request):
            if isinstance(event, Finished):
                final = event.output
                continue
            if running:  # usage in every chunk (vLLM's continuous_usage_stats)
                tail = {"usage": usage([run.latest])}
            if scored:  # vLLM's prompt_logprobs, once, in a chunk of their own before the first token's
                scored = False
                yield sse({**head, "choices": [], **vllm_part(prompt_fields(get_state(request), body, run.latest)),
                           **tail})
            lp = _chat_logprobs(body, event.token_ids, event.logprobs, k) if body.logprobs and not hide else None
            token_ids = {"token_ids": event.token_ids} if body.return_token_ids and not hide else {}
            if plain:
                delta = {"content": event.text} if event.text else {}
                choice = {"index": event.index, "delta": delta, "logprobs": lp, "finish_reason": event.finish_reason,
                          **token_ids}
                yield sse({**head, "choices": [choice], **tail})
                continue
            chunks = choices.setdefault(event.index, ChoiceChunks(body.include_reasoning, run.chat.custom_names))
            deltas = chunks.deltas(event)
            for delta, finish in deltas or ([({}, None)] if token_ids else []):  # ids of text held back go out too
                choice = {"index": event.index, "delta": delta, "logprobs": lp, "finish_reason": finish, **token_ids}
                lp, token_ids = None, {}  # a token's logprobs and id go with the first chunk its text is in
                yield sse({**head, "choices": [choice], **tail})
    except EngineDeadError as exc:
        yield sse(APIError(500, str(exc), None, "engine_error").openai_body())
        yield sse("[DONE]")
        return
    if body.include_usage:
        yield sse({**head, "choices": [], "usage": usage([final] if final is not None else [])})
    yield sse("[DONE]")


class ChoiceChunks:
    """One streamed choice's pieces as OpenAI's deltas: thinking as reasoning_content (unless vLLM's
    include_reasoning is false), content, and each tool call as OpenAI streams it (a chunk with its index,
    id and name, then one with its arguments; a custom tool's call whole); the finish in a chunk of its
    own, "tool_calls" once the choice called."""

    def __init__(self, include_reasoning: bool = True, custom_names: frozenset[str] = frozenset()) -> None:
        self.include_reasoning = include_reasoning
        self.custom_names = custom_names
        self.sent_calls = 0

    def deltas(self, event: ChoiceDelta) -> list[tuple[dict, str | None]]:
        out: list[tuple[dict, str | None]] = []
        for piece in event.pieces:
            if isinstance(piece, ToolCall):
                out += self._call(piece)
            elif isinstance(piece, Reasoning):
                if self.include_reasoning:
                    out.append(({"reasoning_content": str(piece)}, None))
            else:
                out.append(({"content": piece}, None))
        if event.finish_reason is None:
            return out or ([({}, None)] if event.text == "" else [])
        finish = "tool_calls" if self.sent_calls and event.finish_reason == "stop" else event.finish_reason
        return [*out, ({}, finish)]

    def _call(self, call: ToolCall) -> list[tuple[dict, str | None]]:
        index, self.sent_calls = self.sent_calls, self.sent_calls + 1
        if call.name in self.custom_names:  # a custom tool's call comes whole
            return [({"tool_calls": [call.openai(index, custom=True)]}, None)]
        head = {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
        return [({"tool_calls": [head]}, None),
                ({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]}, None)]


# ---- response pieces (shared with /v1/completions) ---------------------------------------------------------
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


def json_with_timings(body: dict) -> JSONResponse:
    return JSONResponse(body, headers=timing_headers(body["usage"]["kvflow_timings"]))


def prompt_fields(state: ServerState, body: SamplingFields, out: RequestOutput) -> dict:
    """What a choice says about its prompt: with echo and logprobs on completions, the prompt's logprobs
    block ("logprobs"); with vLLM's prompt_logprobs, that list ("prompt_logprobs")."""
    if out.prompt_logprobs is None:
        return {}
    fields: dict = {}
    k = getattr(body, "logprobs", None)
    if getattr(body, "echo", False) and k is not None:
        fields["logprobs"] = echoed_prompt_logprobs(out.prompt_token_ids, out.prompt_logprobs, k,
                                                    state.tokenizer.decode, bool(body.return_tokens_as_token_ids))
    if body.prompt_logprobs is not None:
        fields["prompt_logprobs"] = vllm_prompt_logprobs(out.prompt_token_ids, out.prompt_logprobs,
                                                         body.prompt_logprobs)
    return fields


def vllm_part(prompt_part: dict) -> dict:
    return {"prompt_logprobs": prompt_part["prompt_logprobs"]} if "prompt_logprobs" in prompt_part else {}


def _chat_logprobs(body: ChatCompletionRequest, token_ids: list[int], entries: list, k: int) -> dict:
    return chat_logprobs(token_ids, entries, k, **token_options(body))
