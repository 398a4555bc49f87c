"""One chat answer run for the APIs that wrap chat completions in their own shapes (the Responses API,
Anthropic's Messages API): the request is submitted as a chat completion, and its answer comes back
whole (content and tool calls) or as a stream of text pieces and completed calls."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from fastapi import Request

from kvflow.engine.async_engine import RequestStream
from kvflow.outputs import RequestOutput
from kvflow.server.chat_prompt import ChatPrompt, prepare_chat
from kvflow.server.errors import APIError
from kvflow.server.protocol import ChatCompletionRequest
from kvflow.server.serving import ServerState, abort_on_disconnect, check_constraint, collect, submit
from kvflow.server.tool_calls import HERMES, ToolCall, ToolCallParser


@dataclass
class ChatRun:
    streams: list[RequestStream]
    chat: ChatPrompt


@dataclass
class Answer:
    content: str
    calls: list[ToolCall]
    output: RequestOutput

    @property
    def finish_reason(self) -> str | None:
        return self.output.outputs[0].finish_reason


async def start_chat(state: ServerState, body: ChatCompletionRequest, request_id: str) -> ChatRun:
    params = body.validate_request()
    if params.n != 1:
        raise APIError(400, "this API returns one answer per request", "n")
    chat = prepare_chat(state.tokenizer, body)
    params = replace(params, structured_output=chat.constraint,
                     skip_special_tokens=params.skip_special_tokens and chat.tool_format in (None, HERMES))
    check_constraint(state, params, chat.constraint_field)
    return ChatRun(await submit(state, [chat.prompt], params, request_id), chat)


def split_answer(text: str, tool_format: str | None) -> tuple[str, list[ToolCall]]:
    if tool_format is None:
        return text, []
    parser = ToolCallParser(tool_format)
    first, rest = parser.feed(text), parser.finish()
    return first.content + rest.content, first.calls + rest.calls


async def whole_answer(request: Request, run: ChatRun) -> Answer:
    (final,) = await collect(request, run.streams)
    content, calls = split_answer(final.outputs[0].text, run.chat.tool_format)
    return Answer(content, calls, final)


async def answer_pieces(request: Request, run: ChatRun) -> AsyncIterator[str | ToolCall | RequestOutput]:
    """Text pieces (str) and completed calls (ToolCall) as they come, then the final RequestOutput.
    An engine failure raises EngineDeadError to the caller, which ends its stream its own way."""
    parser = ToolCallParser(run.chat.tool_format) if run.chat.tool_format is not None else None
    (stream,) = run.streams
    async with abort_on_disconnect(request, run.streams):
        async for out in stream:
            delta = out.outputs[0].delta_text
            if parser is None:
                if delta:
                    yield delta
            else:
                parsed = parser.feed(delta)
                if out.finished:
                    rest = parser.finish()
                    parsed.content += rest.content
                    parsed.calls += rest.calls
                if parsed.content:
                    yield parsed.content
                for call in parsed.calls:
                    yield call
            if out.finished:
                yield out

