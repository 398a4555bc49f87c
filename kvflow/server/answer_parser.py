"""An answer as the APIs return it: thinking (reasoning.py), content, and tool calls (tool_calls.py), split
out of the model's text as it streams. Both parsers hold back only what may still turn out to be a tag.
The chat pipeline hands each new piece of text to answer_pieces, whose pieces its events carry."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvflow.server.reasoning import ReasoningParser
from kvflow.server.tool_calls import ToolCall, ToolCallParser


class Reasoning(str):
    """A piece of an answer's thinking (answer_pieces gives plain str for content)."""


@dataclass
class AnswerPiece:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def __iadd__(self, other: AnswerPiece) -> AnswerPiece:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls += other.calls
        return self


class AnswerParser:
    def __init__(self, tool_format: str | None, reasoning: str | None) -> None:
        self.thinking = ReasoningParser(reasoning) if reasoning is not None else None
        self.tools = ToolCallParser(tool_format) if tool_format is not None else None

    def feed(self, text: str) -> AnswerPiece:
        out = AnswerPiece()
        content = text
        if self.thinking is not None:
            split = self.thinking.feed(text)
            out.reasoning, content = split.reasoning, split.content
        self._content(out, content)
        return out

    def finish(self) -> AnswerPiece:
        out = AnswerPiece()
        if self.thinking is not None:
            split = self.thinking.finish()
            out.reasoning = split.reasoning
            self._content(out, split.content)
        if self.tools is not None:
            out += _from_tools(self.tools.finish())
        return out

    def whole(self, text: str) -> AnswerPiece:
        out = self.feed(text)
        out += self.finish()
        return out

    def _content(self, out: AnswerPiece, content: str) -> None:
        if self.tools is None:
            out.content += content
        elif content:
            out += _from_tools(self.tools.feed(content))


def _from_tools(parsed) -> AnswerPiece:
    return AnswerPiece(content=parsed.content, calls=list(parsed.calls))


def answer_pieces(parser: AnswerParser, text: str, finished: bool) -> list[str | ToolCall]:
    """What new text adds to an answer, in order: thinking (Reasoning), content (str), completed calls;
    with finished, what the parser held back too. Adjacent pieces of one kind are joined."""
    pieces: list[str | ToolCall] = []
    if text:
        _add(pieces, parser.feed(text))
    if finished:
        _add(pieces, parser.finish())
    return pieces


def _add(pieces: list[str | ToolCall], piece: AnswerPiece) -> None:
    for new in (Reasoning(piece.reasoning) if piece.reasoning else None, piece.content or None, *piece.calls):
        if new is None:
            continue
        last = pieces[-1] if pieces else None
        if isinstance(new, str) and isinstance(last, str) and type(last) is type(new):
            pieces[-1] = type(new)(last + new)
        else:
            pieces.append(new)
