"""Prompt lookup: the draft is what followed the latest earlier occurrence of the sequence's last n tokens
(in its prompt or its own output). Agents copy long spans of their context (the file they edit, the tool
output they quote), and there the lookup guesses right for many tokens in a row."""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, tokens: np.ndarray, k: int) -> list[int]:
        """Up to k tokens to guess after `tokens` (int64, the whole sequence so far); [] when no suffix of
        min_n..max_n tokens occurred before. Longer suffixes are tried first: they predict better."""
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[length - n:]
            # Windows of n tokens that start before the suffix itself and leave a token after them.
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start:start + k].tolist()
        return []
