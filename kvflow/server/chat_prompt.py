"""A chat request made ready for the engine: its prompt (history, tools and earlier tool calls rendered by
the chat template), the constraint its answer must meet (tool_choice, response_format), and how to read
tool calls back out of the answer."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvflow.sampling_params import SamplingParams
from kvflow.server.answer_parser import AnswerParser
from kvflow.server.chat_tools import (
    Tool,
    history_tool_calls,
    named_choice,
    template_knows_tools,
    tool_call_grammar,
    with_tools_prompt,
)
from kvflow.server.harmony import CHANNEL, HARMONY, HarmonyParser, is_harmony
from kvflow.server.harmony_prompt import (
    harmony_answer,
    harmony_grammar,
    one_call_each,
    tag_ids,
    thinking_of,
    turn_end_ids,
)
from kvflow.server.protocol import ChatCompletionRequest
from kvflow.server.reasoning import OPEN as THINK_OPEN
from kvflow.server.reasoning import after_thinking, reasoning_mode
from kvflow.server.serving import render_chat
from kvflow.server.tool_calls import HERMES, MISTRAL, template_format
from kvflow.structured.spec import StructuredOutput


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


def _special_ids(tokenizer, names: list[str]) -> dict[str, int]:
    vocab = tokenizer.get_vocab()
    special = set(getattr(tokenizer, "all_special_tokens", [])) | {
        t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if getattr(t, "special", False)}
    return {name: vocab[name] for name in names if name in vocab and name in special}


def prepare_chat(tokenizer, body: ChatCompletionRequest) -> ChatPrompt:
    chat = _prepare_chat(tokenizer, body)
    customs = frozenset(t.function.name for t in body.tools or [] if t.custom is not None)
    return replace(chat, custom_names=customs) if customs else chat


def _prepare_chat(tokenizer, body: ChatCompletionRequest) -> ChatPrompt:
    template = getattr(tokenizer, "chat_template", None) or ""
    harmony = CHANNEL in template and is_harmony(template)  # (the first test keeps harmony.py off plain requests)
    tools = body.tools if body.calls_tools else None
    fmt = template_format(template) if tools else None
    uses_tools = bool(tools) or any(m.tool_calls or m.role == "tool" for m in body.messages)
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
    if tools and knows_tools:
        template_tools = [t.template_dict() for t in tools]
    elif tools:
        messages, fmt = with_tools_prompt(messages, tools), HERMES  # kvflow describes the hermes format
    prompt = render_chat(tokenizer, messages, tools=template_tools, template_kwargs=body.template_kwargs(),
                         continue_final=body.continue_final_message,
                         add_generation_prompt=body.add_generation_prompt)
    if harmony:
        return _harmony_chat(tokenizer, body, prompt, tools)
    thinking = reasoning_mode(template, prompt) if THINK_OPEN in template else None

    constraint, field = body.structured_output()
    if tools:
        chosen = named_choice(body.tool_choice)
        parallel = body.parallel_tool_calls is not False and chosen is None
        special = _special_ids(tokenizer, ["[TOOL_CALLS]"]) if fmt == MISTRAL else {}
        if chosen is not None or body.tool_choice == "required":
            picked = [t for t in tools if chosen is None or t.function.name == chosen]
            grammar = tool_call_grammar(picked, fmt, parallel, special, reasoning=thinking)
            return ChatPrompt(prompt, grammar, "tools", fmt, thinking)
        if constraint is not None and constraint.json is not None:
            # auto with a structured final answer: either calls or that JSON
            grammar = tool_call_grammar(tools, fmt, parallel, special, constraint.json, reasoning=thinking)
            return ChatPrompt(prompt, grammar, field, fmt, thinking)
    if constraint is not None and thinking is not None:
        constraint = after_thinking(constraint, thinking)
    return ChatPrompt(prompt, constraint, field, fmt if tools else None, thinking)


def _harmony_chat(tokenizer, body: ChatCompletionRequest, prompt: str, tools: list[Tool] | None) -> ChatPrompt:
    """A harmony model's prompt with its constraint: tool_choice and response_format apply to the messages
    after its free analysis."""
    ids = tag_ids(tokenizer)
    constraint, field = body.structured_output()
    chosen = named_choice(body.tool_choice) if tools else None
    if tools and (chosen is not None or body.tool_choice == "required"):
        picked = [t for t in tools if chosen is None or t.function.name == chosen]
        constraint, field = harmony_grammar(ids, picked), "tools"
    elif constraint is not None:
        constraint = harmony_answer(ids, constraint, tools)  # with tools: a call or that answer
    return ChatPrompt(prompt, constraint, field, HARMONY if tools else None, HARMONY, turn_end_ids(ids))
