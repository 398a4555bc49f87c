"""The engine's side of speculative decoding: before each step, give the decoding sequences that may
speculate their draft tokens (as many as pay, kvflow/spec/control.py); after it, learn from what was kept
and from what the step cost. The scheduler gives drafts KV slots and rolls back the rejected ones; the
runner returns logits for every draft position; the engine keeps the longest run the model agrees with.

Why it is lossless: each position of a verify step is sampled exactly as plain decoding would sample it
(the same logits, penalties counting the drafts before it as output, and for a seeded sequence the same
noise: layers/sampler.position_generator), and a draft is kept only while it equals that sample. A greedy
output is then identical; a sampled one too for a seeded request, and for any request its distribution
is the target's (a drafted token is kept with probability p(draft), and on a miss the sample is drawn from
p given that it is not the draft: the rejection-sampling rule for a draft that is a single token).
Sequences with an output grammar decode as usual (their matcher would have to advance over each draft).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from kvflow.engine.request import Request
from kvflow.spec.config import SpeculativeConfig
from kvflow.spec.control import Acceptance, MatchAcceptance, StepCosts, best_num_drafts
from kvflow.spec.ngram import NgramProposer


class Speculator:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.acceptance: dict[str, MatchAcceptance] = {}
        self.shared = MatchAcceptance()  # over every request: where a new request's estimates start
        self._judged: dict[str, tuple[Acceptance, Acceptance]] = {}  # this step's (own, shared) estimates
        self.costs = StepCosts()
        self.num_draft_tokens = 0  # verified since start, over every request (metrics)
        self.num_accepted_tokens = 0

    def propose(self, running: Iterable[Request], eligible: Callable[[Request], bool]) -> None:
        """Set draft_token_ids on every running request (empty where it should not speculate)."""
        decoding = [r for r in running if r.num_computed_tokens == r.num_tokens - 1]
        for request in running:
            request.draft_token_ids = []
        if not decoding:
            return
        row_fraction = self.costs.row_fraction(len(decoding))
        limit = self.config.num_speculative_tokens
        for request in decoding:
            if not eligible(request):
                continue
            draft, matched = self.proposer.propose(np.asarray(request.all_token_ids, dtype=np.int64), limit)
            if not draft:
                continue
            own = self.acceptance.get(request.request_id)
            if own is None:
                own = self.acceptance[request.request_id] = MatchAcceptance(self.shared)
            acceptance = own.of(matched)
            k = best_num_drafts(acceptance.rate, row_fraction, len(decoding) - 1, limit)
            request.draft_token_ids = draft[:k]
            self._judged[request.request_id] = (acceptance, self.shared.of(matched))

    def settle(self, request_id: str, num_draft: int, num_kept: int) -> None:
        """What came of the request's proposal this step (num_draft 0: proposed, but none were worth it)."""
        judged = self._judged.pop(request_id, None)
        if judged is None:
            return
        acceptance, shared = judged
        if num_draft:
            acceptance.update(num_draft, num_kept)
            shared.update(num_draft, num_kept)
            self.num_draft_tokens += num_draft
            self.num_accepted_tokens += num_kept
        else:
            acceptance.idle()

    def observe_step(self, batch: int, draft_rows: int, seconds: float) -> None:
        """A decode-only step's time: batch sequences, draft_rows rows beyond one per sequence."""
        self.costs.observe(batch, draft_rows, seconds)

    def forget(self, request_id: str) -> None:
        self.acceptance.pop(request_id, None)
        self._judged.pop(request_id, None)


def kept_tokens(model_tokens: list[int], drafts: list[int]) -> list[int]:
    """model_tokens[r] is the model's choice after the known tokens and drafts[:r]. The model's first
    choice is always kept; each next one while the draft before it equals what the model chose there."""
    kept = model_tokens[:1]
    for r in range(1, len(model_tokens)):
        if model_tokens[r - 1] != drafts[r - 1]:
            break
        kept.append(model_tokens[r])
    return kept
