"""The draft sources a plain request never runs, and the choice among all of them: the draft source
interface and the default source, prompt lookup, are the Speculator's (engine/speculation.py); a source
that keeps state of its own or a model is here, or named from here.

- PromptLookup ("ngram", the default): the request's own prompt and output (engine/speculation.py).
- SuffixLookup ("suffix"): that, and an index over recently finished requests (spec/suffix.py).
- DraftModel ("draft_model"): a smaller model run greedily on a KV cache of its own (spec/draft_model.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvflow.engine.speculation import DraftSource, PromptLookup
from kvflow.spec.config import SpeculativeConfig
from kvflow.spec.suffix import SuffixIndex

if TYPE_CHECKING:
    from kvflow.engine.request import Request
    from kvflow.executors.model_setup import LoadedModel


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
