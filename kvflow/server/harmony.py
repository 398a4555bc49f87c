"""gpt-oss's "harmony" answers, split as they stream. The model writes messages, each a header and a body:

    <|channel|>analysis<|message|>thinking...<|end|><|start|>assistant<|channel|>final<|message|>answer<|return|>

The analysis channel is thinking (reasoning_content), the final channel and a commentary message with no
recipient (a preamble) are content, and a message to a recipient (`to=functions.NAME`, before or after the
channel) is a tool call whose body is the arguments, ended by <|call|>. The tags are special tokens, which
the server keeps in the text for these models (chat_pipeline.py), so no tag reaches the client."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from kvflow.server.answer_parser import AnswerParser, AnswerPiece
from kvflow.server.tool_calls import ToolCall, _partial_suffix

HARMONY = "harmony"  # the tool-call format and reasoning mode of these models
START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN = "<|constrain|>"
RETURN, CALL, ENDOFTEXT = "<|return|>", "<|call|>", "<|endoftext|>"
TURN_ENDS = (RETURN, CALL, ENDOFTEXT)  # end the turn: generation stops at their tokens (gpt-oss's EOS ids)
ROLE = "assistant"

_BODY_ENDS = (END, *TURN_ENDS)  # consumed at the end of a body
_NEW_HEADERS = (START, CHANNEL)  # start the next header (so a message missing its <|end|> still ends)
_STRAY = (MESSAGE, CONSTRAIN)  # header tags in a body (a malformed answer): dropped, never shown
_TAGS = (*_BODY_ENDS, *_NEW_HEADERS, *_STRAY)
# What a header may start with after `<|start|>assistant`: a tag, a recipient or a channel name (gpt-oss at
# times drops the <|channel|> tag before the name). Anything else is plain text.
_HEADER_LEADS = ("<|", "to=", "analysis", "commentary", "final")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)|\b(analysis|commentary|final)\b")
REASONING, CONTENT, TOOL = "reasoning", "content", "tool"


def is_harmony(chat_template: str | None) -> bool:
    """Whether a chat template writes harmony messages (gpt-oss's)."""
    template = chat_template or ""
    return CHANNEL in template and START in template and MESSAGE in template


@dataclass
class Header:
    kind: str  # REASONING, CONTENT or TOOL
    recipient: str = ""  # TOOL: the function called


def parse_header(text: str) -> Header:
    """What a message's header (the text before its <|message|>) makes of its body."""
    recipient = _RECIPIENT.search(text)
    if recipient is not None and recipient.group(1) != ROLE:
        return Header(TOOL, recipient.group(1).removeprefix("functions."))
    channel = _CHANNEL.search(text)
    name = (channel.group(1) or channel.group(2)) if channel is not None else None
    return Header(REASONING if name == "analysis" else CONTENT)


def _may_be_header(text: str) -> bool:
    """Whether text (all held since the last message ended) may still be a header; False: plain text."""
    rest = text.lstrip()
    if START.startswith(rest):
        return True
    if rest.startswith(START):
        rest = rest[len(START):]
        if ROLE.startswith(rest):
            return True
        rest = rest.removeprefix(ROLE)
    rest = rest.lstrip()
    return any(rest.startswith(lead) or lead.startswith(rest) for lead in _HEADER_LEADS)


def _without_role(text: str) -> str:
    """text less the `<|start|>assistant` that opens a message (all of it, when it is only that cut short)."""
    rest = text.lstrip()
    if not rest.startswith(START):
        return "" if START.startswith(rest) else text
    rest = rest[len(START):]
    return "" if ROLE.startswith(rest) else rest.removeprefix(ROLE)


def _first_tag(text: str, tags: tuple[str, ...]) -> tuple[int, str]:
    """Where the earliest of tags starts in text, and which; (-1, "") when none does."""
    found = [(at, tag) for tag in tags if (at := text.find(tag)) >= 0]
    return min(found) if found else (-1, "")


class HarmonyParser(AnswerParser):
    """Fed the answer piece by piece, it returns the thinking, content and calls each piece completes. Held
    back: a header until its <|message|>, a call's arguments until the call ends, and at the end of any
    other body only what may be the start of a tag."""

    def __init__(self, prompt: str = "") -> None:
        super().__init__(None, None)
        self._held = ""
        self._header: Header | None = None  # the message whose body is being read; None: reading a header
        self._wrote: set[str] = set()  # kinds already written: the next message of a kind starts on a new line
        self._new_message = False
        # The prompt ends with the answer's first header begun (`<|start|>assistant`) or, continuing a final
        # message, inside a body: the parser starts where the prompt leaves it, and what it makes is not sent.
        if START in prompt:
            self.feed(prompt[prompt.rfind(START):])
        self._wrote.clear()

    def feed(self, text: str) -> AnswerPiece:
        self._held += text
        out = AnswerPiece()
        while self._step(out):
            pass
        return out

    def finish(self) -> AnswerPiece:
        """What is held, at the end of the answer: a body cut short stays what it was (a call only when its
        arguments are whole JSON, else they are content); a header cut short is dropped."""
        out = AnswerPiece()
        held, self._held = self._held, ""
        if self._header is None:
            text = _without_role(held)
            if "<|" not in text and "to=" not in text:
                self._write(out, CONTENT, text)
        elif self._header.kind == TOOL:
            if _is_json(held):
                out.calls.append(ToolCall(self._header.recipient, held.strip()))
            else:
                self._write(out, CONTENT, held)
        else:
            self._write(out, self._header.kind, held)
        self._header = None
        return out

    def _step(self, out: AnswerPiece) -> bool:
        """One move through the held text; False when it must wait for more."""
        if self._header is None:
            return self._read_header()
        at, tag = _first_tag(self._held, (*_BODY_ENDS, *_NEW_HEADERS))
        if self._header.kind == TOOL:
            if at < 0:
                return False
            out.calls.append(ToolCall(self._header.recipient, self._held[:at].strip()))
        else:
            if at < 0:
                keep = max(_partial_suffix(self._held, t) for t in _TAGS)
                self._write(out, self._header.kind, self._held[:len(self._held) - keep])
                self._held = self._held[len(self._held) - keep:]
                return False
            self._write(out, self._header.kind, self._held[:at])
        self._held = self._held[at + (len(tag) if tag in _BODY_ENDS else 0):]
        self._header = None
        return True

    def _read_header(self) -> bool:
        at = self._held.find(MESSAGE)
        if at >= 0:
            self._header = parse_header(self._held[:at])
            self._held = self._held[at + len(MESSAGE):]
        elif _may_be_header(self._held):
            return False
        else:  # not harmony after all: the text is content (up to the next tag)
            self._header = Header(CONTENT)
            self._held = _without_role(self._held)
        self._new_message = True
        return True

    def _write(self, out: AnswerPiece, kind: str, text: str) -> None:
        for tag in _STRAY:
            text = text.replace(tag, "")
        if not text:
            return
        if self._new_message and kind in self._wrote:
            text = "\n" + text
        self._new_message = False
        self._wrote.add(kind)
        if kind == REASONING:
            out.reasoning += text
        else:
            out.content += text


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True
