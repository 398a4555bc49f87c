"""The one chat pipeline every wire API runs on. An adapter (openai_api.py, responses_api.py,
anthropic_api.py, ollama_api.py) reads its own request shape and translates it into the internal chat
request, which is OpenAI's ChatCompletionRequest (protocol.py: messages, tools, tool_choice, the output
constraint and the sampling fields: the richest of the four shapes, so the others map onto it without loss);
the pipeline then:

    prepare_chat   renders the prompt (chat template, tools, earlier calls), picks the constraint the answer
                   is held to (tool_choice, response_format) and how the answer is read back (thinking,
                   tool calls: answer_parser.py)
    start_chat     checks the constraint compiles, tokenizes the prompt once, fits max_tokens into the room
                   left (fit_context) and submits it to the engine
    ChatRun        follows the answer, as one stream of internal events (ChoiceDelta: one choice's newest
                   text, thinking and completed tool calls, with its new tokens and their logprobs, and its
                   finish; then Finished, whose output holds usage and timings), or whole (answers)

and the adapter writes those events back as its own JSON or stream events. Templates, tool prompts,
grammars and answer parsing live here and below, once; tool-calling, thinking and harmony code runs only
for requests that use them (chat_tools.py, reasoning.py, harmony_prompt.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace

from fastapi import Request

from kvflow.engine.async_engine import EngineDeadError, RequestStream
from kvflow.outputs import CompletionOutput, RequestOutput
from kvflow.sampling_params import SamplingParams
from kvflow.server.answer_parser import AnswerParser, answer_pieces
from kvflow.server.chat_tools import (
    history_tool_calls,
    template_knows_tools,
    tool_constraint,
    with_tools_prompt,
)
from kvflow.server.errors import APIError, ContextLengthExceeded, bad_request, from_value_error
from kvflow.server.harmony import CHANNEL, HARMONY, HarmonyParser, is_harmony
from kvflow.server.harmony_prompt import harmony_constraint, one_call_each, tag_ids, thinking_of, turn_end_ids
from kvflow.server.protocol import ChatCompletionRequest
from kvflow.server.reasoning import OPEN as THINK_OPEN
from kvflow.server.reasoning import after_thinking, reasoning_mode
from kvflow.server.serving import MAX_PROMPTS, ServerState
from kvflow.server.tool_calls import HERMES, ToolCall, template_format
from kvflow.structured.compiler import GrammarError
from kvflow.structured.spec import StructuredOutput

DISCONNECT_POLL_S = 0.1


# ---- the prompt ------------------------------------------------------------------------------------------
@dataclass
class ChatPrompt:
    prompt: str
    constraint: StructuredOutput | None
    constraint_field: str | None  # the request field a bad constraint is reported against
    tool_format: str | None  # the tool-call format to parse the answer with; None: no tool calls
    # reasoning.INSIDE / BEFORE when the answer has thinking to split off; harmony.HARMONY for gpt-oss
    reasoning: str | None = None
    end_ids: tuple[int, ...] = ()  # tokens that end the answer besides the model's EOS (harmony's turn ends)
    custom_names: frozenset[str] = frozenset()  # the custom (freeform) tools' names (custom_tools.py)

    def sampling(self, params: SamplingParams) -> SamplingParams:
        """params with the answer's constraint and end tokens; special tokens kept in the text where the
        format marks calls or messages with them (Llama 3's <|python_tag|>, Mistral's [TOOL_CALLS], harmony's
        tags)."""
        keep_special = self.reasoning == HARMONY or self.tool_format not in (None, HERMES)
        ends = [] if params.ignore_eos else [t for t in self.end_ids if t not in params.stop_token_ids]
        return replace(params, structured_output=self.constraint, stop_token_ids=[*params.stop_token_ids, *ends],
                       skip_special_tokens=params.skip_special_tokens and not keep_special)

    def answer_parser(self) -> AnswerParser | None:
        """A parser for one answer's thinking, content and calls; None when the text is all content."""
        if self.reasoning == HARMONY:
            return HarmonyParser(self.prompt)
        if self.tool_format is None and self.reasoning is None:
            return None
        return AnswerParser(self.tool_format, self.reasoning)


def prepare_chat(tokenizer, body: ChatCompletionRequest) -> ChatPrompt:
    template = getattr(tokenizer, "chat_template", None) or ""
    harmony = CHANNEL in template and is_harmony(template)  # (the first test keeps harmony.py off plain requests)
    # Under tool_choice "none" the tools stay in the prompt (vLLM's default): an agent that alternates
    # "none" and "auto" over the same tools then reuses the prefix cache, where a prompt without them
    # would part from the other at its first lines. The answer is neither held to nor read for calls.
    shown = body.tools or None
    tools = shown if body.calls_tools else None
    fmt = template_format(template) if tools else None
    uses_tools = bool(shown) or any(m.tool_calls or m.role == "tool" for m in body.messages)
    knows_tools = uses_tools and template_knows_tools(template)
    messages = []
    for m in body.messages:
        message = m.as_template_dict()
        if m.tool_calls:
            calls, text = history_tool_calls([c.model_dump() for c in m.tool_calls], "tool_calls" in template)
            if calls is not None:
                message["tool_calls"] = calls
            else:
                message["content"] = "\n".join(t for t in (message["content"], text) if t)
        if m.role == "tool" and not knows_tools:
            # A template that ignores tools knows no tool role either: the result comes back the way the
            # hermes format has it, in a user turn.
            message = {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
        messages.append(thinking_of(message, m.reasoning_content) if harmony else message)
    if harmony:
        messages = one_call_each(messages)
    template_tools = None
    if shown and knows_tools:
        template_tools = [t.template_dict() for t in shown]
    elif shown:
        messages = with_tools_prompt(messages, shown)  # kvflow describes the hermes format
        fmt = HERMES if tools else None
    prompt = render_chat(tokenizer, messages, tools=template_tools, template_kwargs=body.template_kwargs(),
                         continue_final=body.continue_final_message,
                         add_generation_prompt=body.add_generation_prompt)
    customs = frozenset(t.function.name for t in body.tools or [] if t.custom is not None)
    constraint, field = body.structured_output()
    if harmony:
        ids = tag_ids(tokenizer)
        constraint, field = harmony_constraint(ids, constraint, field, tools, body.tool_choice)
        return ChatPrompt(prompt, constraint, field, HARMONY if tools else None, HARMONY, turn_end_ids(ids), customs)
    thinking = reasoning_mode(template, prompt) if THINK_OPEN in template else None
    calls = tool_constraint(tokenizer, tools, fmt, body.tool_choice, body.parallel_tool_calls, constraint, field,
                            thinking) if tools else None
    if calls is not None:
        constraint, field = calls
    elif constraint is not None and thinking is not None:
        constraint = after_thinking(constraint, thinking)
    return ChatPrompt(prompt, constraint, field, fmt if tools else None, thinking, custom_names=customs)


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


# ---- submitting ------------------------------------------------------------------------------------------
async def start_chat(state: ServerState, body: ChatCompletionRequest, request_id: str,
                     params: SamplingParams | None = None, constraint_field: str | None = None,
                     every_token: bool = False) -> ChatRun:
    """The internal chat request submitted. params: the adapter's own sampling (Ollama's options), else the
    body's; constraint_field: the field a bad response format is reported against, where the adapter's
    differs from OpenAI's; every_token: see ChatRun."""
    asked = body.validate_request()
    chat = prepare_chat(state.tokenizer, body)
    params = chat.sampling(asked if params is None else params)
    named = chat.constraint_field if constraint_field is None or chat.constraint_field == "tools" else constraint_field
    check_constraint(state, params, named)
    truncate = body.truncated if body.truncate_prompt_tokens is not None else None  # vLLM's
    return await start_prompt(state, chat, params, request_id, every_token, truncate)


async def start_prompt(state: ServerState, chat: ChatPrompt, params: SamplingParams, request_id: str,
                       every_token: bool = False, truncate: Callable | None = None) -> ChatRun:
    """A prompt already made (Ollama's /api/generate) submitted: tokenized here, off the event loop, once."""
    check_request_size(state, 1, params.n)
    _, ids = await state.engine.prompt_ids(chat.prompt)
    if truncate is not None:
        ids = truncate(ids, state.engine.engine.max_model_len)
    (stream,) = await submit(state, [ids], params, request_id)
    return ChatRun(stream, chat, ids, every_token)


def check_constraint(state: ServerState, params: SamplingParams, field: str | None) -> None:
    """A 400 naming `field` when the request's output constraint cannot be compiled (a bad schema, an
    unsupported keyword, a bad regex); compiled grammars are cached, so the engine's own compile is a hit."""
    if params.structured_output is None:
        return
    try:
        state.engine.engine.grammars.compile(params.structured_output)
    except GrammarError as exc:
        raise bad_request(str(exc), field, "invalid_schema") from None


def check_request_size(state: ServerState, num_prompts: int, n: int) -> None:
    """A 400 naming the field when one request asks for more sequences than a request may: n above --max-n,
    or more than MAX_PROMPTS prompts."""
    if n > state.settings.max_n:
        raise bad_request(f"n must be at most {state.settings.max_n} (--max-n), got {n}", "n")
    if num_prompts > MAX_PROMPTS:
        raise bad_request(f"a request may hold at most {MAX_PROMPTS} prompts, got {num_prompts}", "prompt")


async def submit(
    state: ServerState, prompts: Sequence[str | list[int]], params: SamplingParams, request_id: str
) -> list[RequestStream]:
    """Add every prompt (one engine request each); all or none: a refused prompt aborts the others. Each is
    tokenized here to fit it into the context (fit_context): max_tokens clamped to the room left."""
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


def fit_context(n_prompt: int, params: SamplingParams, max_model_len: int, strict: bool,
                pool_tokens: int | None = None) -> SamplingParams:
    """params for a prompt of n_prompt tokens: max_tokens clamped to the room left in the context and in
    the KV cache (pool_tokens: the most one request can hold; None: no bound past the context), unless
    strict, where the engine's own check then refuses it; ContextLengthExceeded when there is no room.

    Coding agents ask for more output than is left once their long prompts are in (Claude Code asks for
    max_tokens 32000 on a 20,000-token prompt): like llama-server and Ollama, kvflow then generates what
    fits, and the answer ends with finish_reason "length" (Anthropic: stop_reason "max_tokens");
    `--strict-max-tokens` refuses such a request with a 400 instead. The room is the context's and the KV
    cache's, whichever is less (a cache sized by --kv-cache-memory may hold fewer tokens than max_model_len)."""
    room = max_model_len - n_prompt
    if pool_tokens is not None:
        # Every token but the last sampled one takes a slot: a prompt of the pool's size leaves one.
        room = min(room, pool_tokens + 1 - n_prompt)
    if room < 1:
        raise ContextLengthExceeded(n_prompt, max_model_len, pool_tokens)
    if strict or params.max_tokens is None or params.max_tokens <= room:
        return params
    return replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))


# ---- following the answer --------------------------------------------------------------------------------
@dataclass
class ChoiceDelta:
    """What one choice's newest tokens added: its pieces in the order they were written (content as str,
    thinking as Reasoning, each tool call once complete), the raw text they came from, the new tokens and
    their logprob entries, and the choice's finish (on its last delta)."""

    index: int
    pieces: list[str | ToolCall]
    text: str
    token_ids: list[int]
    logprobs: list
    finish_reason: str | None


@dataclass
class Finished:
    """The request's last output: its prompt and generated tokens (usage), its timings, its choices."""

    output: RequestOutput


@dataclass
class Answer:
    """One choice's whole answer, split as the prompt's format says (all content where it has no parser)."""

    content: str
    reasoning: str
    calls: list[ToolCall]
    choice: CompletionOutput


@dataclass
class ChatRun:
    stream: RequestStream
    chat: ChatPrompt
    prompt_ids: list[int]  # known before the first output (Anthropic's message_start and vLLM's usage report it)
    # Every new token gets a delta even while its text is held back (a possible stop string, a partial
    # character): for the logprobs and token ids OpenAI's chunks carry.
    every_token: bool = False
    latest: RequestOutput | None = None  # the newest output while streaming (usage in every chunk)
    _parsers: dict[int, AnswerParser | None] = field(default_factory=dict)

    async def answers(self, request: Request) -> tuple[RequestOutput, list[Answer]]:
        """The final output and each choice's answer (for responses that are not streamed)."""
        (final,) = await collect(request, [self.stream])
        answers = []
        for c in final.outputs:
            parser = self.chat.answer_parser()
            if parser is None:
                answers.append(Answer(c.text, "", [], c))
            else:
                piece = parser.whole(c.text)
                answers.append(Answer(piece.content, piece.reasoning, piece.calls, c))
        return final, answers

    async def events(self, request: Request) -> AsyncIterator[ChoiceDelta | Finished]:
        """ChoiceDelta for every choice with something new, then Finished. A client that leaves aborts the
        request; an engine failure raises EngineDeadError to the adapter, which ends its stream its own way."""
        sent: dict[int, int] = {}  # tokens reported per choice
        done: set[int] = set()
        async with abort_on_disconnect(request, [self.stream]):
            async for out in self.stream:
                self.latest = out
                for c in out.outputs:
                    if c.index in done or not (c.delta_text or c.delta_token_ids or c.finish_reason is not None):
                        continue
                    start = sent.get(c.index, 0)
                    end = start + len(c.delta_token_ids)
                    sent[c.index] = end
                    if c.finish_reason is not None:
                        done.add(c.index)
                    elif not c.delta_text and not self.every_token:
                        continue
                    yield ChoiceDelta(c.index, self._pieces(c), c.delta_text, c.token_ids[start:end],
                                      (c.logprobs or [])[start:end], c.finish_reason)
                if out.finished:
                    yield Finished(out)

    async def pieces(self, request: Request) -> AsyncIterator[str | ToolCall | RequestOutput]:
        """For the APIs with one answer per request: its pieces as they come (thinking as Reasoning, text
        as str, completed calls), then the final RequestOutput."""
        async for event in self.events(request):
            if isinstance(event, Finished):
                yield event.output
                continue
            for piece in event.pieces:
                yield piece

    def _pieces(self, c: CompletionOutput) -> list[str | ToolCall]:
        if c.index not in self._parsers:
            self._parsers[c.index] = self.chat.answer_parser()
        parser = self._parsers[c.index]
        if parser is None:  # all content
            return [c.delta_text] if c.delta_text else []
        return answer_pieces(parser, c.delta_text, c.finish_reason is not None)


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


async def collect(request: Request, streams: Sequence[RequestStream]) -> list[RequestOutput]:
    """Each stream's final output (for responses that are not streamed), the streams read one after the
    other: each keeps its outputs until read."""
    finals: list[RequestOutput] = []
    async with abort_on_disconnect(request, streams):
        try:
            for stream in streams:
                final = None
                async for out in stream:
                    final = out if out.finished else final
                if final is not None:
                    finals.append(final)
        except EngineDeadError as exc:
            raise APIError(500, str(exc), None, "engine_error") from None
    return finals
