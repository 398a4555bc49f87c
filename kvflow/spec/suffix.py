"""A suffix index over recent requests: agent loops repeat themselves across requests (the same tool-call
scaffolding, the same answer to the same question, one sample of n much like the next), so the tokens that
followed a phrase in an earlier request are a good guess for what follows it now.

Every position of a recorded request is filed under the `key_len` tokens that end there; a lookup takes
the candidates filed under the sequence's last key_len tokens, extends each match backward (up to max_n
tokens) and drafts what followed the longest one (on a tie, the most recent). Memory is bounded: at most
`max_requests` requests and `max_tokens` tokens over all of them (the oldest requests are dropped first),
and at most `per_key` positions per key (the oldest dropped first).
"""

from __future__ import annotations

from collections import OrderedDict, deque

import numpy as np


class SuffixIndex:
    def __init__(self, key_len: int, max_n: int, max_requests: int = 1000, max_tokens: int = 1 << 18,
                 per_key: int = 16) -> None:
        self.key_len, self.max_n = max(key_len, 1), max(max_n, key_len, 1)
        self.max_requests, self.max_tokens, self.per_key = max_requests, max_tokens, per_key
        # Recorded token sequences, oldest first, as lists: a lookup compares a few tokens at each of up to
        # per_key places, where numpy's per-call cost would be most of the work.
        self.docs: OrderedDict[int, list[int]] = OrderedDict()
        self.positions: dict[tuple[int, ...], deque[tuple[int, int]]] = {}  # key -> (doc, end), oldest first
        self.num_tokens = 0
        self._next_doc = 0

    def record(self, token_ids: list[int]) -> None:
        """File a finished request's tokens (prompt and output)."""
        tokens = list(token_ids)
        if len(tokens) <= self.key_len or len(tokens) > self.max_tokens:
            return
        while self.num_tokens + len(tokens) > self.max_tokens or len(self.docs) >= self.max_requests:
            self._drop_oldest()
        doc = self._next_doc
        self._next_doc += 1
        self.docs[doc] = tokens
        self.num_tokens += len(tokens)
        keys = self._keys(tokens)
        # The last position has nothing after it to draft: it is not filed.
        for end in range(self.key_len - 1, len(tokens) - 1):
            slot = self.positions.setdefault(keys[end], deque(maxlen=self.per_key))
            slot.append((doc, end))

    def lookup(self, tokens: np.ndarray, k: int) -> tuple[list[int], int]:
        """(up to k tokens guessed to follow `tokens`, the length of the suffix they matched); ([], 0)
        when no recorded request holds the last key_len tokens."""
        n = self.key_len
        if len(tokens) < n or k < 1 or not self.positions:
            return [], 0
        tail = tokens[-self.max_n:].tolist()
        candidates = self.positions.get(tuple(tail[-n:]))
        if not candidates:
            return [], 0
        best_len, best = 0, None
        for doc, end in reversed(candidates):  # newest first: a tie keeps the most recent
            source = self.docs.get(doc)
            if source is None:
                continue
            matched = self._match_length(tail, source, end)
            if matched > best_len:
                best_len, best = matched, (source, end)
        if best is None:
            return [], 0
        source, end = best
        return source[end + 1 : end + 1 + k], best_len

    @staticmethod
    def _match_length(tail: list[int], source: list[int], end: int) -> int:
        """How many tokens before and at source[end] equal the end of `tail` (the sequence's last max_n)."""
        longest = min(len(tail), end + 1)
        matched = 0
        while matched < longest and tail[-1 - matched] == source[end - matched]:
            matched += 1
        return matched

    def _keys(self, tokens: list[int]) -> list[tuple[int, ...]]:
        n = self.key_len
        return [tuple(tokens[i + 1 - n : i + 1]) if i + 1 >= n else () for i in range(len(tokens))]

    def _drop_oldest(self) -> None:
        doc, tokens = self.docs.popitem(last=False)
        self.num_tokens -= len(tokens)
        keys = self._keys(tokens)
        for end in range(self.key_len - 1, len(tokens) - 1):
            slot = self.positions.get(keys[end])
            if slot is None:
                continue
            kept = [entry for entry in slot if entry[0] != doc]
            if kept:
                self.positions[keys[end]] = deque(kept, maxlen=self.per_key)
            else:
                del self.positions[keys[end]]
