"""Incremental detokenization with stop strings, for one request.

Each step decodes only a small window of ids: the text of ids[prefix_offset:] minus the text of
ids[prefix_offset:read_offset] is what the new ids added. Decoding a window, rather than a lone id, keeps
tokenizer context (leading-space rules, byte-level pieces); starting it a few prompt ids back gives the
first output id that context too. While the window's text ends in U+FFFD a multi-byte character is still
split across ids, so nothing is emitted until it is whole.

Stop strings are matched in the output text only. Text that might still grow into a stop string (the
longest pending suffix that is a prefix of one) is held back; once a stop string matches, the output ends
right before it (or right after, with include_stop_str_in_output) and the request is finished.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvflow.sampling_params import SamplingParams

# Prompt ids decoded ahead of the first output id, as context; a handful covers any merge or space rule.
CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


@dataclass
class DetokenizerResult:
    text_delta: str  # new text, safe to send now
    stop_string: str | None = None  # the stop string that matched in this call, if any
    finished: bool = False  # True once a stop string matched; later ids are ignored


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        self._stops: list[str] = list(params.stop or [])
        self._include_stop = params.include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self._stops), default=0)

        # Only a window of ids is kept: those before prefix_offset are never decoded again.
        self._ids: list[int] = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

        self._text = ""  # all output text decoded so far (whole characters only)
        self._emitted = 0  # how much of _text has been handed out
        self.stop_string: str | None = None
        self.finished = False

    @property
    def output_text(self) -> str:
        """All text emitted so far."""
        return self._text[: self._emitted]

    def add(self, new_token_ids: list[int]) -> DetokenizerResult:
        if self.finished:
            return DetokenizerResult("", self.stop_string, True)
        self._ids.extend(new_token_ids)
        self._text += self._decode_new(final=False)
        return self._release(final=False)

    def flush(self) -> str:
        """Emit everything held back, for a request that ends for a reason other than a stop string.

        An incomplete character at the very end is emitted as U+FFFD here, as a full decode would show it.
        """
        if self.finished:
            return ""
        self._text += self._decode_new(final=True)
        return self._release(final=True).text_delta

    def _decode(self, ids: list[int]) -> str:
        # No clean-up of tokenization spaces: it would act differently at window edges than on the full text.
        return self._tokenizer.decode(
            ids, skip_special_tokens=self._skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _decode_new(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or (full_text.endswith(REPLACEMENT_CHAR) and not final):
            return ""  # nothing visible yet (special id skipped) or a character is still incomplete
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        del self._ids[: self._prefix_offset]  # keep the window small
        self._read_offset -= self._prefix_offset
        self._prefix_offset = 0
        return full_text[len(prefix_text) :]

    def _release(self, final: bool) -> DetokenizerResult:
        start = self._emitted
        stop, cut = self._find_stop()
        if stop is not None:
            self._text = self._text[:cut]
            self.stop_string, self.finished = stop, True
            end = cut
        elif final:
            end = len(self._text)
        else:
            end = len(self._text) - self._partial_stop_len()
        self._emitted = end
        return DetokenizerResult(self._text[start:end], stop, self.finished)

    def _find_stop(self) -> tuple[str | None, int]:
        """The earliest stop string in the unsent text and where the output should end.

        A match cannot start in text already sent: that text was released only after being ruled out as
        the start of any stop string.
        """
        best: str | None = None
        best_at = len(self._text)
        for stop in self._stops:
            at = self._text.find(stop, self._emitted)
            if at != -1 and at < best_at:
                best, best_at = stop, at
        if best is None:
            return None, len(self._text)
        return best, best_at + len(best) if self._include_stop else best_at

    def _partial_stop_len(self) -> int:
        """Length of the longest unsent suffix that is a proper prefix of some stop string."""
        pending = self._text[self._emitted :]
        for n in range(min(len(pending), self._max_stop_len - 1), 0, -1):
            tail = pending[-n:]
            if any(stop.startswith(tail) for stop in self._stops):
                return n
        return 0


class NoDetokenizer:
    """For an engine core whose front end makes the text (engine/output_assembly.py): ids only, no stop strings."""

    output_text = ""
    stop_string = None
    finished = False

    def add(self, new_token_ids: list[int]) -> DetokenizerResult:
        return DetokenizerResult("")

    def flush(self) -> str:
        return ""


NO_DETOKENIZER = NoDetokenizer()


def add_tokens(detokenizer: IncrementalDetokenizer | NoDetokenizer,
               new_token_ids: list[int]) -> tuple[DetokenizerResult, int]:
    """Feed a step's new ids; returns the result and how many of the ids to keep.

    Several ids at once (kept draft tokens) go in one at a time: where a stop string ends the text among
    them, the ids after it are dropped, so the output is what one token a step would have made."""
    if len(new_token_ids) <= 1:
        return detokenizer.add(new_token_ids), len(new_token_ids)
    text, kept = "", 0
    for token in new_token_ids:
        result = detokenizer.add([token])
        text += result.text_delta
        kept += 1
        if result.finished:
            break
    result.text_delta = text
    return result, kept
