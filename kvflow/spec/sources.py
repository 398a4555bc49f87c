"""Where draft tokens come from, behind one interface: given the sequences about to decode and how many
tokens each may draft, a guess per sequence and how far to trust it (the matched suffix's length for a
lookup; 0 where there is no such measure). The Speculator (engine/speculation.py) decides how many of
them to verify and learns from what the model kept.

- PromptLookup ("ngram"): the request's own prompt and output (NgramProposer, below).
- SuffixLookup ("suffix"): that, and an index over recently finished requests (spec/suffix.py).
- DraftModel ("draft_model"): a smaller model run greedily on a KV cache of its own (spec/draft_model.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

from kvflow.spec.config import SpeculativeConfig
from kvflow.spec.suffix import SuffixIndex

if TYPE_CHECKING:
    from kvflow.engine.request import Request
    from kvflow.executors.model_setup import LoadedModel


class DraftSource(Protocol):
    # True where each draft token costs a forward of its own (a draft model): the Speculator then decides
    # how many a sequence drafts before asking, not after.
    drafts_cost_compute: bool

    def propose(self, requests: list[Request], limits: list[int]) -> list[tuple[list[int], int]]:
        """Per request, (at most limits[i] guessed tokens after its known ones, the match length)."""
        ...

    def seconds_per_draft(self) -> float:
        """What drafting one token costs beyond verifying it (0 for lookups)."""
        ...

    def finished(self, request: Request) -> None:
        """The request has left the engine (finished or aborted)."""
        ...


class NgramProposer:
    """Prompt lookup: the draft is what followed the latest earlier occurrence of the sequence's longest
    repeated suffix (in its prompt or its own output). Agents copy long spans of their context (the file they
    edit, the tool output they quote), and there the lookup guesses right for many tokens in a row. How many
    tokens matched says how far to trust it: a 12-token match is a copy in progress, a 2-token one a guess."""

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


class PromptLookup:
    drafts_cost_compute = False

    def __init__(self, config: SpeculativeConfig) -> None:
        self.ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)

    def propose(self, requests: list[Request], limits: list[int]) -> list[tuple[list[int], int]]:
        return [self._best(np.asarray(r.all_token_ids, dtype=np.int64), k) for r, k in zip(requests, limits)]

    def _best(self, tokens: np.ndarray, k: int) -> tuple[list[int], int]:
        return self.ngram.propose(tokens, k)

    def seconds_per_draft(self) -> float:
        return 0.0

    def finished(self, request: Request) -> None:
        pass


class SuffixLookup(PromptLookup):
    """The longer of two matches: in the request's own tokens, and in recently finished requests (a tie
    goes to the request's own, which is nearer)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        super().__init__(config)
        self.index = SuffixIndex(config.prompt_lookup_min, config.prompt_lookup_max,
                                 max_requests=config.suffix_decoding_max_cached_requests)

    def _best(self, tokens: np.ndarray, k: int) -> tuple[list[int], int]:
        own = self.ngram.propose(tokens, k)
        other = self.index.lookup(tokens, k)
        return other if other[1] > own[1] else own

    def finished(self, request: Request) -> None:
        self.index.record(request.all_token_ids)


def build_source(config: SpeculativeConfig, target: LoadedModel, max_num_seqs: int) -> DraftSource:
    if config.method == "ngram":
        return PromptLookup(config)
    if config.method == "suffix":
        return SuffixLookup(config)
    from kvflow.spec.draft_model import DraftModel  # loads a model: only when asked for

    return DraftModel.load(config, target, max_num_seqs)
