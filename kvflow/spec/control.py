"""How many draft tokens each sequence should verify this step, from what speculation has earned so far.

A draft token j (1-based) is kept only if the j - 1 before it were, so with a per-token acceptance rate a
it makes a**j tokens in expectation, where a plain step makes one per sequence. Each draft adds a row to
the step, which costs `row_fraction` of a plain step of this batch (measured: engine/step_budget.StepCosts) and which every
sequence in the batch waits for. The drafts are chosen for the whole step at once, to maximize its tokens
per unit of time: (batch + the drafts' expected tokens) / (1 + row_fraction * rows). On a step where the
weights' bytes dominate, a row is cheap and sequences draft many; in a big batch a row must earn what the
others make in its time, and drafting falls to 0: speculation backs off by itself under load. Each
sequence alone would over-draft when all of them draft: each would price its rows against a step where
the others make one token each.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

PRIOR_ACCEPTANCE = 0.5  # before a sequence has shown anything
DECAY = 0.9  # weight of the history in the acceptance estimate, per judged draft token
RECOVERY = 0.02  # per step without drafts, the estimate drifts back toward the prior (so it probes again)


@dataclass
class Acceptance:
    """One sequence's running estimate of the chance that its next draft token is right."""

    rate: float = PRIOR_ACCEPTANCE

    def update(self, num_draft: int, num_accepted: int) -> None:
        """num_accepted of num_draft were kept: every kept one counts as a success, the first rejected
        one (if any) as a failure; the ones after it were never judged."""
        for _ in range(num_accepted):
            self.rate = DECAY * self.rate + (1 - DECAY)
        if num_accepted < num_draft:
            self.rate = DECAY * self.rate

    def idle(self) -> None:
        self.rate += RECOVERY * (PRIOR_ACCEPTANCE - self.rate)


# Drafts are judged separately by how long a suffix they matched: bucket i holds matches of up to
# MATCH_BUCKETS[i] tokens (the last bucket: longer ones).
MATCH_BUCKETS = (2, 3, 5, 8, 12)


class MatchAcceptance:
    """Acceptance estimates, one per matched-suffix length bucket: a sequence's own, starting from
    `start` (what all sequences so far have shown: a new request of a kind that never pays starts low)."""

    def __init__(self, start: MatchAcceptance | None = None) -> None:
        self.buckets = [Acceptance(rate=b.rate) if start else Acceptance()
                        for b in (start.buckets if start else [None] * (len(MATCH_BUCKETS) + 1))]

    def best_rate(self) -> float:
        """The highest estimate over the buckets: what the best draft this sequence could get has earned."""
        return max(b.rate for b in self.buckets)

    def idle(self) -> None:
        """A step without drafts: every bucket drifts back toward the prior (so it probes again)."""
        for b in self.buckets:
            b.idle()

    def of(self, matched: int) -> Acceptance:
        return self.buckets[next((i for i, top in enumerate(MATCH_BUCKETS) if matched <= top), len(MATCH_BUCKETS))]


def allocate_drafts(rates: Sequence[float], limits: Sequence[int], row_fraction: float, batch: int) -> list[int]:
    """How many drafts each sequence (acceptance rates[i], at most limits[i] drafts) verifies in a step of
    `batch` decoding sequences (those not listed make their one token too). Draft j of sequence i earns
    rates[i]**j tokens and costs a row. The step's tokens / time rises with a row exactly while the row
    earns more than row_fraction times the tokens per unit of time so far; so the drafts are taken in order
    of what they earn (each sequence's in its order, since they earn less and less) while that holds."""
    counts = [0] * len(rates)
    heap = [(-rate, i) for i, (rate, limit) in enumerate(zip(rates, limits)) if limit > 0 and rate > 0]
    heapq.heapify(heap)
    tokens, cost = float(batch), 1.0
    while heap:
        earns, i = heapq.heappop(heap)
        earns = -earns
        if earns <= row_fraction * tokens / cost:
            break
        counts[i] += 1
        tokens, cost = tokens + earns, cost + row_fraction
        if counts[i] < limits[i]:
            heapq.heappush(heap, (-earns * rates[i], i))
    return counts
