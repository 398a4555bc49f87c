"""Reasoning models (Qwen3, DeepSeek-R1 and their kin) write their thinking between <think> and </think>
before the answer. That text goes to `reasoning_content` (OpenAI-style; Ollama's `thinking`), not to the
content, and a structured-output constraint or tool-call grammar applies to the answer after it.

Some templates open the think block in the prompt itself (DeepSeek-R1's ends with "<think>\\n"), so the
answer starts inside it; others close an empty one when thinking is off (Qwen3 with enable_thinking=False)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvflow.server.tool_calls import _partial_suffix
from kvflow.structured.compiler import lark_body
from kvflow.structured.spec import StructuredOutput

OPEN, CLOSE = "<think>", "</think>"
INSIDE, BEFORE = "inside", "before"  # the answer starts inside a think block / may open one


def reasoning_mode(chat_template: str | None, prompt: str) -> str | None:
    """INSIDE when the prompt leaves a think block open, BEFORE when the template thinks and the answer
    may open one, None when there is no thinking to split off (no tags, or the prompt closed the block)."""
    if OPEN not in (chat_template or ""):
        return None
    tail = prompt.rstrip()
    if tail.endswith(OPEN):
        return INSIDE
    if tail.endswith(CLOSE):
        return None
    return BEFORE


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """Fed the answer piece by piece, it returns the thinking and the content each piece adds (a tag split
    across pieces is held back until it is whole)."""

    def __init__(self, mode: str) -> None:
        self.inside = mode == INSIDE
        self.done = False  # the think block has closed (or the answer began without one)
        self._held = ""
        self._blank_after_close = False  # the newlines templates put after </think> are not content

    def _after_close(self, text: str) -> str:
        if self._blank_after_close:
            text = text.lstrip("\n")
            self._blank_after_close = not text
        return text

    def feed(self, text: str) -> Split:
        if self.done:
            return Split(content=self._after_close(text))
        self._held += text
        out = Split()
        if not self.inside:
            stripped = self._held.lstrip()
            if stripped.startswith(OPEN):
                self._held = stripped[len(OPEN):]
                self.inside = True
            elif OPEN.startswith(stripped):
                return out  # maybe the start of the tag
            else:
                self.done = True
                out.content, self._held = self._held, ""
                return out
        end = self._held.find(CLOSE)
        if end >= 0:
            out.reasoning = self._held[:end]
            self._blank_after_close = True
            out.content = self._after_close(self._held[end + len(CLOSE):])
            self._held, self.done = "", True
            return out
        keep = _partial_suffix(self._held, CLOSE)
        out.reasoning, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
        return out

    def finish(self) -> Split:
        """What is held: thinking cut short by the token budget stays thinking."""
        held, self._held = self._held, ""
        return Split(reasoning=held) if self.inside and not self.done else Split(content=held)


def think_rule(mode: str) -> str:
    """The Lark rule `think`: free text up to the first closing tag (with the opening one when the answer
    must open the block itself)."""
    return f'think[lazy]: {json.dumps(OPEN) + " " if mode == BEFORE else ""}/(.|\\n)*/ {json.dumps(CLOSE)}'


def after_thinking(spec: StructuredOutput, mode: str) -> StructuredOutput:
    """spec applied to the answer after the think block; the thinking itself is free text. (No wrapping up
    near the budget: quotes in the thinking would mislead the JSON string state.) A user's Lark grammar is
    left as it is: it applies from the first token."""
    answer = lark_body(spec)
    if answer is None:
        return spec
    return StructuredOutput(grammar=f"start: think answer\n{think_rule(mode)}\nanswer: {answer}")
