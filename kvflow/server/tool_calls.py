"""Tool calls in a model's text: the format a chat template implies, and a parser that splits what the model
writes into plain content and calls, fed the text as it streams (the same calls come out whatever the
chunking).

Formats:
- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call (Qwen 2.5/3,
  Hermes, and the format kvflow describes itself to models whose template ignores tools); a custom tool's
  call may also be its name's JSON line and then its input, raw (custom_tools.py);
- llama3: the whole answer is `{"name": ..., "parameters": {...}}` (calls joined by `;`), maybe after
  `<|python_tag|>` (Llama 3.1-3.3);
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from kvflow.server.custom_tools import custom_arguments, custom_input

HERMES, LLAMA3, MISTRAL = "hermes", "llama3", "mistral"
_CONTENT = "content"  # a llama3/mistral answer found to be plain text
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG, _MISTRAL_TAG = "<|python_tag|>", "[TOOL_CALLS]"


def template_format(chat_template: str | None) -> str:
    """The tool-call format a chat template's text implies (hermes when it names none)."""
    template = chat_template or ""
    if _MISTRAL_TAG in template:
        return MISTRAL
    if _PYTHON_TAG in template or ("ipython" in template and "<|eot_id|>" in template):
        return LLAMA3
    return HERMES


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self, index: int | None = None, custom: bool = False) -> dict:
        """The call in chat completions' shape; a custom tool's call (custom) with its input."""
        if custom:
            call = {"id": self.id, "type": "custom", "custom": {"name": self.name, "input": custom_input(self.arguments)}}
        else:
            call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def _calls_from_json(text: str, args_key: str) -> list[ToolCall] | None:
    """Calls from one JSON object or a list of them; None when the text is not that."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = item.get(args_key, item.get("arguments", item.get("parameters", {})))
        calls.append(ToolCall(item["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
    return calls


@dataclass
class ParsedDelta:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ToolCallParser:
    """Feed it the model's text piece by piece; each feed returns the content that is certainly not part of
    a call, and the calls completed so far. `finish()` flushes what is held back: a call cut short by the
    token budget is given back as content."""

    def __init__(self, fmt: str) -> None:
        self.format = fmt
        self._held = ""  # text that may still turn out to be (part of) a call
        self._in_call = False
        self._started = False  # llama3/mistral: whether the answer began as a call
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> ParsedDelta:
        if self.format == _CONTENT:
            return ParsedDelta(text)
        self._held += text
        if self.format == HERMES:
            return self._feed_hermes()
        return self._feed_whole_answer()

    def finish(self) -> ParsedDelta:
        if self.format == HERMES:
            out = self._feed_hermes()
            rest = self._held if not (self.calls and not self._held.strip()) else ""
            if self._in_call:  # cut short before its closing tag: a complete call still counts
                calls = _calls_from_json(rest.strip(), "arguments")
                rest = _HERMES_OPEN + rest if calls is None else ""
                self.calls += calls or []
                out.calls += calls or []
        else:
            out = ParsedDelta()
            rest = self._held
            if self._started:
                calls = self._whole_answer_calls(rest)
                if calls is not None:
                    self.calls += calls
                    out.calls += calls
                    rest = ""
        self._held = ""
        out.content += rest
        return out

    # hermes: content streams freely; a call is held from its opening tag to its closing one.
    def _feed_hermes(self) -> ParsedDelta:
        out = ParsedDelta()
        while True:
            if not self._in_call:
                start = self._held.find(_HERMES_OPEN)
                if start < 0:
                    keep = _partial_suffix(self._held, _HERMES_OPEN)
                    if self.calls and not self._held[:len(self._held) - keep].strip():
                        return out  # blank lines after a call: held until text follows them
                    out.content += self._held[:len(self._held) - keep]
                    self._held = self._held[len(self._held) - keep:]
                    return out
                if not (self.calls and not self._held[:start].strip()):
                    out.content += self._held[:start]
                self._held = self._held[start + len(_HERMES_OPEN):]
                self._in_call = True
            body_start = self._held.lstrip()
            if body_start and not body_start.startswith("{"):  # not JSON: the tag was only text
                out.content += _HERMES_OPEN
                self._in_call = False
                continue
            calls, end = self._hermes_call()
            if calls is None:
                return out
            self._in_call = False
            self.calls += calls
            out.calls += calls
            self._held = self._held[end + len(_HERMES_CLOSE):]

    def _hermes_call(self) -> tuple[list[ToolCall] | None, int]:
        """The call held so far and where its closing tag starts; (None, -1) until one parses (a closing
        tag inside a JSON string is not the end)."""
        end = self._held.find(_HERMES_CLOSE)
        while end >= 0:
            calls = _hermes_body(self._held[:end])
            if calls is not None:
                return calls, end
            end = self._held.find(_HERMES_CLOSE, end + 1)
        return None, -1

    # llama3 / mistral: an answer that starts as a call is held whole and parsed at the end.
    def _feed_whole_answer(self) -> ParsedDelta:
        if self._started:
            return ParsedDelta()
        stripped = self._held.lstrip()
        tag = _PYTHON_TAG if self.format == LLAMA3 else _MISTRAL_TAG
        starts = (tag, "{", "[") if self.format == LLAMA3 else (tag,)
        if any(stripped.startswith(s) for s in starts):
            self._started = True
            return ParsedDelta()
        if not stripped or any(s.startswith(stripped) for s in starts):
            return ParsedDelta()  # too short to tell
        out = ParsedDelta(self._held)
        self._held = ""
        self.format = _CONTENT  # the answer is plain text: stream the rest as it comes
        return out

    def _whole_answer_calls(self, text: str) -> list[ToolCall] | None:
        text = text.strip()
        if self.format == MISTRAL:
            return _calls_from_json(text.removeprefix(_MISTRAL_TAG).strip(), "arguments")
        text = text.removeprefix(_PYTHON_TAG).strip()
        calls: list[ToolCall] = []
        for part in _split_top_level(text, ";"):
            found = _calls_from_json(part, "parameters")
            if found is None:
                return None
            calls += found
        return calls or None


def _hermes_body(body: str) -> list[ToolCall] | None:
    """The calls in what a hermes block holds: JSON, or a custom tool's raw call (a JSON line naming it, then
    its input up to the newline before the closing tag)."""
    calls = _calls_from_json(body.strip(), "arguments")
    if calls is not None:
        return calls
    header, newline, rest = body.lstrip().partition("\n")
    try:
        head = json.loads(header)
    except json.JSONDecodeError:
        return None
    if not newline or not isinstance(head, dict) or set(head) != {"name"} or not isinstance(head["name"], str):
        return None
    return [ToolCall(head["name"], custom_arguments(rest.removesuffix("\n")))]


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of text that is a proper start of marker."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _split_top_level(text: str, sep: str) -> list[str]:
    """text split at sep outside JSON strings, brackets and braces."""
    parts, depth, start, in_string, escaped = [], 0, 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
            continue
        if ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return [p for p in parts if p]
