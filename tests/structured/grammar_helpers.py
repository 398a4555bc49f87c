"""What the structured tests ask of a matcher: its allowed tokens as the sampler sees them."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvflow.structured.masks import mask_words, unpack_allowed


def allowed_tokens(matchers: Sequence, vocab_size: int, extra_allowed: Sequence[Sequence[int]]) -> np.ndarray:
    """bool [len(matchers), vocab_size]: the masks computed for all matchers at once, unpacked row by row."""
    words = mask_words(matchers, vocab_size)
    return np.stack([unpack_allowed(words[row], vocab_size, m, extra)
                     for row, (m, extra) in enumerate(zip(matchers, extra_allowed))])
