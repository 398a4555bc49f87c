"""How many draft tokens a sequence should verify this step, from what speculation has earned so far.

A draft token j (1-based) is kept only if the j - 1 before it were, so with a per-token acceptance rate a,
k drafts make E(k) = 1 + a + ... + a**k tokens where the step made 1. Each draft adds a row to the step,
which costs `row_fraction` of a plain step of this batch (measured: StepCosts) and which every sequence in
the batch waits for. The batch's tokens per unit of time are then about (E(k) + others) / (1 + row_fraction
* k), `others` being the other sequences' one token each; k is chosen to maximize that. On a step where
the weights' bytes dominate, a row is cheap and k grows; in a big batch the other sequences' tokens
outweigh one sequence's gain and k falls to 0: speculation backs off by itself under load.
"""

from __future__ import annotations

from dataclasses import dataclass

PRIOR_ACCEPTANCE = 0.5  # before a sequence has shown anything
DECAY = 0.9  # weight of the history in the acceptance estimate, per judged draft token
RECOVERY = 0.02  # per step without drafts, the estimate drifts back toward the prior (so it probes again)


@dataclass
class Acceptance:
    """One sequence's running estimate of the chance that its next draft token is right."""

    rate: float = PRIOR_ACCEPTANCE
    proposed: int = 0
    accepted: int = 0

    def update(self, num_draft: int, num_accepted: int) -> None:
        """num_accepted of num_draft were kept: every kept one counts as a success, the first rejected
        one (if any) as a failure; the ones after it were never judged."""
        self.proposed += num_draft
        self.accepted += num_accepted
        for _ in range(num_accepted):
            self.rate = DECAY * self.rate + (1 - DECAY)
        if num_accepted < num_draft:
            self.rate = DECAY * self.rate

    def idle(self) -> None:
        self.rate += RECOVERY * (PRIOR_ACCEPTANCE - self.rate)


class StepCosts:
    """Measured step times: plain decode steps by batch size, and the extra time of each draft row."""

    def __init__(self, prior_row_fraction: float = 0.15) -> None:
        self.plain: dict[int, float] = {}  # batch size -> EMA of a plain decode step's seconds
        self.row: float | None = None  # EMA of one draft row's extra seconds
        self.prior_row_fraction = prior_row_fraction  # a row's cost as a fraction of a batch-1 step, unmeasured

    def observe(self, batch: int, draft_rows: int, seconds: float) -> None:
        if draft_rows == 0:
            old = self.plain.get(batch)
            self.plain[batch] = seconds if old is None else 0.8 * old + 0.2 * seconds
            return
        base = self.plain_step(batch)
        if base is None:
            return
        per_row = max(seconds - base, 0.0) / draft_rows
        self.row = per_row if self.row is None else 0.8 * self.row + 0.2 * per_row

    def plain_step(self, batch: int) -> float | None:
        if batch in self.plain:
            return self.plain[batch]
        known = [b for b in self.plain if b <= batch]
        if not known:
            return None
        nearest = max(known)
        return self.plain[nearest] * batch / nearest  # no faster than linear from a smaller batch: conservative

    def row_fraction(self, batch: int) -> float:
        """What one more row costs, as a fraction of a plain decode step of this batch."""
        step = self.plain_step(batch)
        if step is None or step <= 0:
            return self.prior_row_fraction / batch  # nothing measured yet
        row = self.row
        if row is None:
            row = self.prior_row_fraction * self.plain.get(1, step / batch)
        return row / step


def best_num_drafts(rate: float, row_fraction: float, others: int, limit: int) -> int:
    """The k in [0, limit] that maximizes (E(k) + others) / (1 + row_fraction * k)."""
    best_k, best, tokens, gain = 0, 1.0 + others, 1.0 + others, 1.0
    for k in range(1, limit + 1):
        gain *= rate
        tokens += gain
        value = tokens / (1.0 + row_fraction * k)
        if value > best:
            best_k, best = k, value
    return best_k
