"""Token masks for the constrained rows of a batch: llguidance writes each row's allowed tokens as bits
(32 tokens per 32-bit word), computed for all rows at once on its own threads; the sampler turns them into
-inf on every token a row's grammar cannot take. Free rows are not touched, so their tokens are the same
whatever constrained requests share their batch.

The per-row work stays in numpy: a decode step is a few milliseconds, and each torch call on a
49K-entry row costs tens of microseconds of overhead."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvflow.structured.json_state import JsonStringState


def mask_words(matchers: Sequence, vocab_size: int) -> np.ndarray:
    """uint32 [len(matchers), words]: bit t % 32 of word t // 32 is set where each matcher allows token t.

    One after another on the calling thread: llguidance's own thread pool (LLExecutor) was slower here,
    since the decoder's OpenMP threads keep spinning on the same cores between steps (8 rows on 2 cores:
    about 0.9 ms through the pool against 0.25 ms in turn)."""
    words = (vocab_size + 31) // 32
    bits = np.zeros((len(matchers), words), dtype=np.uint32)
    for row, matcher in enumerate(matchers):
        matcher.unsafe_compute_mask_ptr(bits[row].ctypes.data, words * 4)
    return bits


def unpack_allowed(words: np.ndarray, vocab_size: int, matcher, extra_allowed: Sequence[int]) -> np.ndarray:
    """bool [vocab_size] from one row of mask_words. Where the matcher allows its end-of-sequence token,
    `extra_allowed` (the request's other stop tokens) is allowed as well."""
    allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab_size].view(bool)
    if extra_allowed and matcher.is_accepting():
        allowed[list(extra_allowed)] = True
    return allowed


def apply_masks(logits: torch.Tensor, rows: Sequence[int], allowed: np.ndarray) -> torch.Tensor:
    """Writes -inf into `logits` (in place) wherever allowed[j] is False, for logits row rows[j]; other rows
    are not touched. Each row is written through the smaller of its allowed and blocked sets (a grammar
    allows a few tokens, or, inside a string, nearly all): a masked_fill over whole rows costs far more at
    this vocabulary size, and so does a copy of the logits."""
    for j, i in enumerate(rows):
        if np.count_nonzero(allowed[j]) <= allowed.shape[1] // 2:
            keep = torch.from_numpy(np.flatnonzero(allowed[j])).to(logits.device)
            values = logits[i, keep]
            logits[i] = float("-inf")
            logits[i, keep] = values
        else:
            logits[i, torch.from_numpy(np.flatnonzero(~allowed[j])).to(logits.device)] = float("-inf")
    return logits


def wrap_up(allowed: np.ndarray, closing: np.ndarray, end_token_ids: Sequence[int], in_string: bool) -> np.ndarray:
    """For a request near its token budget: the first non-empty of the end tokens, then inside a string the
    tokens closing it, outside one the closing brackets and then the quote-led tokens (an empty string where
    a value must come; compiler.closing_tokens), each within what its grammar allows; all allowed tokens
    where none of them is (a required key, a digit, an e-mail address that is not complete yet)."""
    ends = list(end_token_ids)
    if ends and allowed[ends].any():
        narrowed = np.zeros_like(allowed)
        narrowed[ends] = allowed[ends]
        return narrowed
    for preferred in (closing[0],) if in_string else (closing[1], closing[0]):
        narrowed = allowed & preferred
        if narrowed.any():
            return narrowed
    return allowed


def _walk_choice(walker, words: np.ndarray, kinds: Sequence[np.ndarray]) -> int | None:
    """The lowest token of the first kind the walker's grammar takes (each kind is a handful of tokens, and
    checking one token costs far less than a mask), else the lowest token it takes at all."""
    for candidates in kinds:
        for token in candidates.tolist():
            if walker.validate_tokens([token]) == 1:
                return token
    walker.unsafe_compute_mask_ptr(words.ctypes.data, words.size * 4)
    nonzero = np.flatnonzero(words)
    if not len(nonzero):
        return None
    word = int(words[nonzero[0]])
    return int(nonzero[0]) * 32 + (word & -word).bit_length() - 1


def closing_cost(matcher, state: JsonStringState, closing_ids: Sequence[np.ndarray], texts: Sequence[str],
                 limit: int) -> int:
    """How many tokens wrapping up would take from this state (at most limit): copies of the matcher and
    the string state walk along wrap_up's choices, the lowest token id of the first kind that fits each
    time (or the tokens the grammar forces), until the grammar may end. closing_ids: the token ids of compiler.closing_tokens' two rows."""
    walker, state = matcher.deep_copy(), state.copy()
    words = np.zeros((len(texts) + 31) // 32, dtype=np.uint32)
    steps = 0
    while steps < limit:
        if walker.is_accepting() or walker.is_error():
            return steps
        forced = walker.compute_ff_tokens()  # text the grammar forces (a key, a tag), as it would be tokenized
        if forced:
            if not walker.consume_tokens(forced):
                return steps
            for token in forced:
                state.feed(texts[token])
            steps += len(forced)
            continue
        token = _walk_choice(walker, words, closing_ids[:1] if state.in_string else closing_ids[::-1])
        if token is None or not walker.consume_token(token):
            return steps
        state.feed(texts[token])
        steps += 1
    return limit
