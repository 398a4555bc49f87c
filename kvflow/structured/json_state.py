"""Whether a JSON text written so far stands inside a string: the one fact about a JSON output that its
token mask does not say, and that wrapping up needs (a closing bracket closes a nesting outside a string,
but is only more text inside one)."""

from __future__ import annotations


class JsonStringState:
    def __init__(self) -> None:
        self.in_string = False
        self._escaped = False

    def feed(self, text: str) -> None:
        for ch in text:
            if self._escaped:
                self._escaped = False
            elif ch == "\\" and self.in_string:
                self._escaped = True
            elif ch == '"':
                self.in_string = not self.in_string

    def copy(self) -> JsonStringState:
        other = JsonStringState()
        other.in_string, other._escaped = self.in_string, self._escaped
        return other
