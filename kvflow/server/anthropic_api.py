"""Anthropic's Messages API (POST /v1/messages), so that clients written for it (the `anthropic` SDK,
Claude Code pointed at a local server) can use kvflow: content blocks of text and tool_use, stop_reason,
usage, and when streamed, its events (message_start, content_block_start/delta/stop, message_delta,
message_stop). An adapter of the chat pipeline (chat_pipeline.py): the request becomes the internal chat
request (anthropic_protocol.py), and the pipeline's events become content blocks and their events. POST
/v1/messages/count_tokens counts the prompt the same request would run."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvflow.engine.async_engine import EngineDeadError
from kvflow.outputs import RequestOutput
from kvflow.server import openapi
from kvflow.server.answer_parser import Reasoning
from kvflow.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from kvflow.server.chat_pipeline import ChatRun, prepare_chat, start_chat
from kvflow.server.metrics import request_timings, timing_headers
from kvflow.server.openai_api import SSE_HEADERS
from kvflow.server.serving import get_state, parse_body
from kvflow.server.tool_calls import ToolCall

router = APIRouter()


def _stop_reason(out: RequestOutput, called: bool) -> str:
    c = out.outputs[0]
    if c.finish_reason == "length":
        return "max_tokens"
    if called:
        return "tool_use"
    return "stop_sequence" if isinstance(c.stop_reason, str) else "end_turn"


def _tool_use(call: ToolCall) -> dict:
    try:
        arguments = json.loads(call.arguments)
    except json.JSONDecodeError:
        arguments = {}
    return {"type": "tool_use", "id": call.id.replace("call_", "toolu_", 1), "name": call.name, "input": arguments}


def _usage(out: RequestOutput) -> dict:
    timings = request_timings([out])
    return {"input_tokens": len(out.prompt_token_ids) - timings["cached_tokens"],
            "cache_read_input_tokens": timings["cached_tokens"], "cache_creation_input_tokens": 0,
            "output_tokens": len(out.outputs[0].token_ids), "kvflow_timings": timings}


@router.post("/v1/messages/count_tokens", openapi_extra=openapi.body(CountTokensRequest))
async def count_tokens(request: Request) -> dict:
    state = get_state(request)
    body = await parse_body(request, CountTokensRequest)
    state.check_model(body.model)
    chat = body.as_chat()
    chat.validate_request()
    _, ids = await state.engine.prompt_ids(prepare_chat(state.tokenizer, chat).prompt)
    return {"input_tokens": len(ids)}


@router.post("/v1/messages", openapi_extra=openapi.body(MessagesRequest))
async def create_message(request: Request):
    state = get_state(request)
    body = await parse_body(request, MessagesRequest)
    state.check_model(body.model)
    message_id = f"msg_{uuid.uuid4().hex}"
    run = await start_chat(state, body.as_chat(), message_id)
    head = {"id": message_id, "type": "message", "role": "assistant", "model": state.model_name}
    if body.stream:
        return StreamingResponse(_events(request, run, head), media_type="text/event-stream", headers=SSE_HEADERS)
    final, (answer,) = await run.answers(request)
    content = [{"type": "thinking", "thinking": answer.reasoning, "signature": ""}] if answer.reasoning else []
    if answer.content.strip() or not answer.calls:
        content.append({"type": "text", "text": answer.content})
    content += [_tool_use(call) for call in answer.calls]
    stop = final.outputs[0].stop_reason
    doc = {**head, "content": content, "stop_reason": _stop_reason(final, bool(answer.calls)),
           "stop_sequence": stop if isinstance(stop, str) else None, "usage": _usage(final)}
    return JSONResponse(doc, headers=timing_headers(doc["usage"]["kvflow_timings"]))


_TEXT_BLOCKS = {"thinking": {"type": "thinking", "thinking": "", "signature": ""}, "text": {"type": "text", "text": ""}}


def _event(kind: str, **fields) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"


async def _events(request: Request, run: ChatRun, head: dict) -> AsyncIterator[str]:
    # The whole prompt's count: what of it the prefix cache holds is known once it runs (message_delta).
    usage = {"input_tokens": len(run.prompt_ids), "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0,
             "output_tokens": 0}
    yield _event("message_start", message={**head, "content": [], "stop_reason": None, "stop_sequence": None,
                                           "usage": usage})
    index, called = 0, False
    open_kind: str | None = None  # the kind of the text block being streamed: "thinking" or "text"
    try:
        async for piece in run.pieces(request):
            kind = "thinking" if isinstance(piece, Reasoning) else "text" if isinstance(piece, str) else None
            if open_kind is not None and open_kind != kind:
                yield _event("content_block_stop", index=index)
                index, open_kind = index + 1, None
            if kind is not None:
                if open_kind is None:
                    yield _event("content_block_start", index=index, content_block=_TEXT_BLOCKS[kind])
                    open_kind = kind
                yield _event("content_block_delta", index=index, delta={"type": f"{kind}_delta", kind: str(piece)})
                continue
            if isinstance(piece, ToolCall):
                block = _tool_use(piece)
                yield _event("content_block_start", index=index, content_block={**block, "input": {}})
                yield _event("content_block_delta", index=index,
                             delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])})
                yield _event("content_block_stop", index=index)
                index, called = index + 1, True
            else:
                stop = piece.outputs[0].stop_reason
                usage = _usage(piece)
                yield _event("message_delta", delta={"stop_reason": _stop_reason(piece, called),
                                                     "stop_sequence": stop if isinstance(stop, str) else None},
                             usage=usage)
                yield _event("message_stop")
    except EngineDeadError as exc:
        yield _event("error", error={"type": "api_error", "message": str(exc)})
