"""One chat answer run for the APIs that wrap chat completions in their own shapes (the Responses API,
Anthropic's Messages API): the request is submitted as a chat completion, and its answer comes back
whole (content and tool calls) or as a stream of text pieces and completed calls."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request

from kvflow.engine.async_engine import RequestStream
from kvflow.outputs import RequestOutput
from kvflow.server.answer_parser import AnswerParser
from kvflow.server.chat_prompt import ChatPrompt, prepare_chat
from kvflow.server.errors import APIError
from kvflow.server.protocol import ChatCompletionRequest
from kvflow.server.serving import ServerState, abort_on_disconnect, check_constraint, collect, submit
from kvflow.server.tool_calls import ToolCall


@dataclass
class ChatRun:
    streams: list[RequestStream]
    chat: ChatPrompt
    prompt_tokens: int  # known before the first output (Anthropic's message_start reports it)


class Reasoning(str):
    """A piece of the answer's thinking (answer_pieces yields plain str for content)."""


@dataclass
class Answer:
    content: str
    calls: list[ToolCall]
    output: RequestOutput
    reasoning: str = ""

    @property
    def finish_reason(self) -> str | None:
        return self.output.outputs[0].finish_reason


async def start_chat(state: ServerState, body: ChatCompletionRequest, request_id: str) -> ChatRun:
    params = body.validate_request()
    if params.n != 1:
        raise APIError(400, "this API returns one answer per request", "n")
    chat = prepare_chat(state.tokenizer, body)
    params = chat.sampling(params)
    check_constraint(state, params, chat.constraint_field)
    _, ids = await state.engine.prompt_ids(chat.prompt)  # tokenized here (off the event loop), once
    return ChatRun(await submit(state, [ids], params, request_id), chat, len(ids))


async def whole_answer(request: Request, run: ChatRun) -> Answer:
    (final,) = await collect(request, run.streams)
    parser = run.chat.answer_parser()
    if parser is None:
        return Answer(final.outputs[0].text, [], final)
    piece = parser.whole(final.outputs[0].text)
    return Answer(piece.content, piece.calls, final, piece.reasoning)


async def answer_pieces(request: Request, run: ChatRun) -> AsyncIterator[str | ToolCall | RequestOutput]:
    """Thinking (Reasoning), text pieces (str) and completed calls (ToolCall) as they come, then the final
    RequestOutput. An engine failure raises EngineDeadError to the caller, which ends its stream its own way."""
    parser = run.chat.answer_parser() or AnswerParser(None, None)  # the latter passes all text through
    (stream,) = run.streams
    async with abort_on_disconnect(request, run.streams):
        async for out in stream:
            piece = parser.feed(out.outputs[0].delta_text)
            if out.finished:
                piece += parser.finish()
            if piece.reasoning:
                yield Reasoning(piece.reasoning)
            if piece.content:
                yield piece.content
            for call in piece.calls:
                yield call
            if out.finished:
                yield out

