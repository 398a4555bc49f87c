"""A chat request made ready for a harmony model (gpt-oss; the answer's format is in harmony.py): the tokens
that end its turn, the history as its template takes it, and the grammar that tool_choice and
response_format impose on the answer's messages."""

from __future__ import annotations

import json

from kvflow.server.chat_tools import Tool, closed_objects, named_choice
from kvflow.server.harmony import (
    CALL,
    CHANNEL,
    CONSTRAIN,
    END,
    ENDOFTEXT,
    MESSAGE,
    RETURN,
    ROLE,
    START,
    TURN_ENDS,
)
from kvflow.structured.compiler import lark_body, lark_json
from kvflow.structured.spec import StructuredOutput


def tag_ids(tokenizer) -> dict[str, int]:
    """The harmony tags' token ids in this vocabulary (a tag missing from it is left out)."""
    names = [START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL, ENDOFTEXT]
    ids = tokenizer.convert_tokens_to_ids(names)  # a lookup per tag, not a copy of the whole vocabulary
    unknown = getattr(tokenizer, "unk_token_id", None)
    return {name: i for name, i in zip(names, ids) if isinstance(i, int) and i != unknown}


def turn_end_ids(ids: dict[str, int]) -> tuple[int, ...]:
    """<|return|>, <|call|> and <|endoftext|>: gpt-oss's generation config lists all three as EOS, while a
    model's own files (config.json, a GGUF's metadata) name one; a tool call ends at <|call|>."""
    return tuple(ids[name] for name in TURN_ENDS if name in ids)


def thinking_of(message: dict, thinking: str | None) -> dict:
    """message with the thinking a client sent back (reasoning_content) as the template's `thinking`:
    gpt-oss wants its analysis before a tool call kept. The template refuses both content and thinking
    beside tool calls; there the content (which it renders as analysis) stays."""
    if message["role"] != ROLE or not thinking or (message.get("tool_calls") and message["content"]):
        return message
    return {**message, "thinking": thinking}


def one_call_each(messages: list[dict]) -> list[dict]:
    """messages with each assistant message of several tool calls split into one per call, each followed by
    its result: a harmony template renders only an assistant message's first call, and names a tool result
    after the call before it. Results pair with calls by tool_call_id, else in order."""
    out: list[dict] = []
    i = 0
    while i < len(messages):
        message, calls = messages[i], messages[i].get("tool_calls") or []
        i += 1
        if len(calls) < 2:
            out.append(message)
            continue
        results = []
        while i < len(messages) and messages[i]["role"] == "tool":
            results.append(messages[i])
            i += 1
        by_id = {r.get("tool_call_id"): r for r in results}
        paired = ([by_id.get(c.get("id")) for c in calls] if all(c.get("id") in by_id for c in calls)
                  else [results[k] if k < len(results) else None for k in range(len(calls))])
        for k, (call, result) in enumerate(zip(calls, paired)):
            head = message if k == 0 else {"role": ROLE, "content": ""}  # the thinking and content go first
            out.append({**head, "tool_calls": [call]})
            if result is not None:
                out.append(result)
        out += [r for r in results if not any(r is p for p in paired)]
    return out


def harmony_answer(ids: dict[str, int], spec: StructuredOutput,
                   tools: list[Tool] | None = None) -> StructuredOutput:
    """spec applied to the final message, after free analysis (or, with tools, a call instead); a user's
    Lark grammar is left as it is: it applies from the first token."""
    return spec if spec.grammar is not None else harmony_grammar(ids, tools, spec)


def harmony_grammar(ids: dict[str, int], tools: list[Tool] | None = None,
                    answer: StructuredOutput | None = None) -> StructuredOutput:
    """A Lark grammar (llguidance's) for a harmony answer: free analysis messages, then a call to one of
    tools (`commentary to=functions.NAME <|constrain|>json<|message|>ARGS`), or, with answer, a final message
    that meets it. Generation ends where the grammar does (at the end of the arguments or the answer)."""
    def tag(name: str) -> str:  # a tag's token, or its text where the vocabulary lacks it
        return f"<[{ids[name]}]>" if name in ids else json.dumps(name)

    rules = [f'think: {tag(CHANNEL)} "analysis" {tag(MESSAGE)} TEXT {tag(END)} {tag(START)} "{ROLE}"',
             "TEXT: /(.|\\n)*/"]
    choices = []
    for i, tool in enumerate(tools or []):
        schema = closed_objects(tool.function.parameters or {"type": "object"})
        head = json.dumps(f"commentary to=functions.{tool.function.name} ")
        rules.append(f'call{i}: {tag(CHANNEL)} {head} {tag(CONSTRAIN)} "json" {tag(MESSAGE)} {lark_json(schema)}')
        choices.append(f"call{i}")
    if answer is not None:
        rules.append(f'final: {tag(CHANNEL)} "final" {tag(MESSAGE)} {lark_body(answer)}')
        choices.append("final")
    # JSON near the budget is not steered to close: quotes in the thinking would mislead it.
    return StructuredOutput(grammar="\n".join([f"start: think* ({' | '.join(choices)})", *rules]))


def harmony_constraint(ids: dict[str, int], answer: StructuredOutput | None, answer_field: str | None,
                       tools: list[Tool] | None, tool_choice: str | dict | None
                       ) -> tuple[StructuredOutput | None, str | None]:
    """A harmony answer's constraint and the request field it is reported against: tool_choice and
    response_format apply to the messages after its free analysis."""
    chosen = named_choice(tool_choice) if tools else None
    if tools and (chosen is not None or tool_choice == "required"):
        picked = [t for t in tools if chosen is None or t.function.name == chosen]
        return harmony_grammar(ids, picked), "tools"
    if answer is not None:
        return harmony_answer(ids, answer, tools), answer_field  # with tools: a call or that answer
    return None, answer_field
