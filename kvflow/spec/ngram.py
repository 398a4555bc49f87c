"""Prompt lookup: the draft is what followed the latest earlier occurrence of the sequence's longest
repeated suffix (in its prompt or its own output). Agents copy long spans of their context (the file they
edit, the tool output they quote), and there the lookup guesses right for many tokens in a row. How many
tokens matched says how far to trust it: a 12-token match is a copy in progress, a 2-token one a guess."""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, tokens: np.ndarray, k: int) -> tuple[list[int], int]:
        """(up to k tokens to guess after `tokens` (int64, the whole sequence so far), the length of the
        matched suffix); ([], 0) when no suffix of min_n tokens occurred before."""
        length = len(tokens)
        if length < 2 or k < 1:
            return [], 0
        # Earlier positions holding the last token, then kept while the tokens before them match too.
        ends = np.flatnonzero(tokens[: length - 1] == tokens[-1])
        matched, best = 1, ends
        for n in range(2, min(self.max_n, length - 1) + 1):
            ends = ends[ends >= n - 1]
            ends = ends[tokens[ends - (n - 1)] == tokens[length - n]]
            if ends.size == 0:
                break
            matched, best = n, ends
        if matched < self.min_n or best.size == 0:
            return [], 0
        start = int(best[-1]) + 1  # the latest occurrence: recent context predicts best
        return tokens[start:start + k].tolist(), matched
