"""One sequence's grammar state: its llguidance matcher, fed every token it samples, and, for JSON
outputs, where the text stands (inside a string or not) and whether it must wrap up: a request near its
token budget is steered to close what it has open, since a small model can repeat itself inside a string
until the budget runs out and a cut-off JSON value is of no use.

Wrapping up starts once the tokens left reach what closing would cost (measured by walking a copy of
the grammar state, masks.closing_cost) plus a margin, or at a point where the output may end while what
it could start next costs more to close than is left."""

from __future__ import annotations

import logging

from kvflow.structured.compiler import GrammarCompiler
from kvflow.structured.json_state import JsonStringState
from kvflow.structured.masks import closing_cost
from kvflow.structured.spec import StructuredOutput

log = logging.getLogger("kvflow")

WATCH_TOKENS = 160  # closing costs are measured only this close to the budget
MARGIN_TOKENS = 8
MIN_TOKENS = 4  # this close, a request always wraps up


class SequenceGrammar:
    def __init__(self, compiler: GrammarCompiler, spec: StructuredOutput) -> None:
        self.compiler = compiler
        self.matcher = compiler.matcher(spec)
        self.json_state = JsonStringState() if spec.closes_like_json else None
        self.wrap_up = False
        self._next_check = 0  # the output length at which to measure again what closing costs
        self._peak_cost = 0  # the most that closing has cost when measured

    @property
    def in_string(self) -> bool:
        return self.json_state is not None and self.json_state.in_string

    @property
    def finished(self) -> bool:
        """The grammar can take nothing more (a complete JSON value): the request is done."""
        return self.matcher.is_stopped()

    def accept(self, token: int, request_id: str) -> None:
        if self.json_state is not None:
            self.json_state.feed(self.compiler.token_texts[token])
        if not self.matcher.consume_token(token):
            log.warning("request %s: its grammar refused token %d: %s", request_id, token, self.matcher.get_error())

    def wrapping_up(self, num_output_tokens: int, max_tokens: int | None) -> bool:
        """Whether the request must close what it has open now to end within max_tokens."""
        if self.wrap_up or max_tokens is None or self.json_state is None:
            return self.wrap_up
        left = max_tokens - num_output_tokens
        if left <= MIN_TOKENS:
            self.wrap_up = True
        elif left > WATCH_TOKENS:
            return False
        elif self.matcher.is_accepting() and left <= self._peak_cost + MARGIN_TOKENS:
            # It could end here, and what it starts next (another call, another item) may cost as much to
            # close as the most it has cost so far: more than is left.
            self.wrap_up = True
        elif num_output_tokens >= self._next_check:
            cost = closing_cost(self.matcher, self.json_state, self.compiler.closing_ids, self.compiler.token_texts,
                                left)
            self._peak_cost = max(self._peak_cost, cost)
            slack = left - cost - MARGIN_TOKENS
            self.wrap_up = slack <= 0
            self._next_check = num_output_tokens + max(MIN_TOKENS, slack // 2)
        return self.wrap_up
