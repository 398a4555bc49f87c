"""OpenAI's Responses API (POST /v1/responses), as Codex and the OpenAI Agents SDK speak it: one answer
per request, made of output items (a message with output_text, function calls), and when streamed, the
typed events (response.created, response.output_text.delta, response.function_call_arguments.delta,
response.completed...). An adapter of the chat pipeline (chat_pipeline.py): the request becomes the internal
chat request (responses_protocol.py), and the pipeline's events become output items and their events."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvflow.engine.async_engine import EngineDeadError
from kvflow.outputs import RequestOutput
from kvflow.server import openapi
from kvflow.server.answer_parser import Reasoning
from kvflow.server.chat_pipeline import ChatRun, start_chat
from kvflow.server.custom_tools import custom_input
from kvflow.server.errors import APIError
from kvflow.server.metrics import request_timings, timing_headers
from kvflow.server.openai_api import SSE_HEADERS
from kvflow.server.responses_protocol import ResponsesRequest
from kvflow.server.responses_tools import ToolBook
from kvflow.server.serving import get_state, parse_body
from kvflow.server.tool_calls import ToolCall

router = APIRouter()


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(text: str | None) -> dict:
    """A message item: complete with its text, or (None) just started, with no content yet."""
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "in_progress" if text is None else
            "completed", "role": "assistant", "content": [] if text is None else [_text_part(text)]}


def _reasoning_item(text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(call: ToolCall, book: ToolBook, status: str = "completed") -> dict:
    """A function_call item, or a custom tool's custom_tool_call, named as the client declared the tool
    (its name, and its namespace where it has one: responses_tools.py)."""
    tool = book.split(call.name)
    done = status == "completed"
    if tool.custom:
        item = {"type": "custom_tool_call", "id": f"ctc_{uuid.uuid4().hex}", "call_id": call.id, "name": tool.name,
                "input": custom_input(call.arguments) if done else "", "status": status}
    else:
        item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call.id, "name": tool.name,
                "arguments": call.arguments if done else "", "status": status}
    if tool.namespace is not None:
        item["namespace"] = tool.namespace
    return item


def _usage(out: RequestOutput | None) -> dict | None:
    if out is None:
        return None
    timings = request_timings([out])
    prompt, completion = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": timings["cached_tokens"]},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion, "kvflow_timings": timings}


class _Response:
    """The response object, as it stands."""

    def __init__(self, body: ResponsesRequest, model: str) -> None:
        self.doc: dict = {
            "id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "model": model, "output": [], "error": None, "incomplete_details": None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": {"effort": None, "summary": None}, "store": False,
            "temperature": body.temperature, "top_p": body.top_p,
            "text": body.text.model_dump(by_alias=True, exclude_none=True) if body.text else {"format": {"type": "text"}},
            "tool_choice": body.tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "truncation": body.truncation or "disabled", "usage": None, "metadata": body.metadata or {},
        }

    def finish(self, out: RequestOutput) -> dict:
        if out.outputs[0].finish_reason == "length":
            self.doc.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
        else:
            self.doc["status"] = "completed"
        self.doc["usage"] = _usage(out)
        return self.doc


@router.post("/v1/responses", openapi_extra=openapi.body(ResponsesRequest))
async def create_response(request: Request):
    state = get_state(request)
    body = await parse_body(request, ResponsesRequest)
    state.check_model(body.model)
    response = _Response(body, state.model_name)
    chat, book = body.as_chat()
    run = await start_chat(state, chat, response.doc["id"])
    if body.stream:
        return StreamingResponse(_events(request, run, response, book), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    final, (answer,) = await run.answers(request)
    if answer.reasoning:
        response.doc["output"].append(_reasoning_item(answer.reasoning))
    if answer.content.strip() or not answer.calls:
        response.doc["output"].append(_message_item(answer.content))
    response.doc["output"] += [_call_item(call, book) for call in answer.calls]
    doc = response.finish(final)
    return JSONResponse(doc, headers=timing_headers(doc["usage"]["kvflow_timings"]))


class _EventStream:
    def __init__(self) -> None:
        self.sequence = 0

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _events(request: Request, run: ChatRun, response: _Response, book: ToolBook) -> AsyncIterator[str]:
    events = _EventStream()
    output = response.doc["output"]
    yield events.event("response.created", response=response.doc)
    yield events.event("response.in_progress", response=response.doc)
    message: dict | None = None  # the message item being streamed, if any
    thinking: dict | None = None  # the reasoning item being streamed, if any

    def close_message():
        nonlocal message
        if message is None:
            return []
        index, part = output.index(message), message["content"][0]
        done = [events.event("response.output_text.done", item_id=message["id"], output_index=index,
                             content_index=0, text=part["text"], logprobs=[]),
                events.event("response.content_part.done", item_id=message["id"], output_index=index,
                             content_index=0, part=part)]
        message["status"] = "completed"
        done.append(events.event("response.output_item.done", output_index=index, item=message))
        message = None
        return done

    try:
        async for piece in run.pieces(request):
            if isinstance(piece, Reasoning):
                if thinking is None:
                    thinking = _reasoning_item("", status="in_progress")
                    output.append(thinking)
                    yield events.event("response.output_item.added", output_index=len(output) - 1, item=thinking)
                thinking["content"][0]["text"] += piece
                yield events.event("response.reasoning_text.delta", item_id=thinking["id"],
                                   output_index=output.index(thinking), content_index=0, delta=str(piece))
                continue
            if thinking is not None and thinking["status"] == "in_progress":
                thinking["status"] = "completed"
                index = output.index(thinking)
                yield events.event("response.reasoning_text.done", item_id=thinking["id"], output_index=index,
                                   content_index=0, text=thinking["content"][0]["text"])
                yield events.event("response.output_item.done", output_index=index, item=thinking)
            if isinstance(piece, str):
                if message is None:
                    message = _message_item(None)
                    output.append(message)
                    index = len(output) - 1
                    yield events.event("response.output_item.added", output_index=index, item=message)
                    part = _text_part("")
                    message["content"] = [part]
                    yield events.event("response.content_part.added", item_id=message["id"], output_index=index,
                                       content_index=0, part=part)
                message["content"][0]["text"] += piece
                yield events.event("response.output_text.delta", item_id=message["id"], output_index=output.index(message),
                                   content_index=0, delta=piece, logprobs=[])
            elif isinstance(piece, ToolCall):
                for line in close_message():
                    yield line
                item = _call_item(piece, book, status="in_progress")
                output.append(item)
                index = len(output) - 1
                yield events.event("response.output_item.added", output_index=index, item=item)
                done = _call_item(piece, book)
                key, kind = ("input", "custom_tool_call_input") if "input" in item else ("arguments", "function_call_arguments")
                yield events.event(f"response.{kind}.delta", item_id=item["id"], output_index=index, delta=done[key])
                item.update({key: done[key], "status": "completed"})
                yield events.event(f"response.{kind}.done", item_id=item["id"], output_index=index, **{key: done[key]})
                yield events.event("response.output_item.done", output_index=index, item=item)
            else:
                for line in close_message():
                    yield line
                yield events.event("response.completed" if piece.outputs[0].finish_reason != "length" else
                                   "response.incomplete", response=response.finish(piece))
    except EngineDeadError as exc:
        error = APIError(500, str(exc), None, "engine_error")
        response.doc.update(status="failed", error={"code": "server_error", "message": error.message})
        yield events.event("response.failed", response=response.doc)

