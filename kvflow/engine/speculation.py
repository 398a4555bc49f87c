"""The engine's side of speculative decoding: before each step, give the decoding sequences that may
speculate their draft tokens (from a draft source: prompt lookup by default, in the middle of this file; as
many as pay: its last part); after it, learn from what was kept and from what the step cost. The scheduler gives drafts KV slots and rolls back the rejected ones; the
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

import heapq
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvflow.engine.request import Request
from kvflow.engine.step_budget import StepCosts
from kvflow.spec.config import SpeculativeConfig

# The step-cost fit that prices drafts may lag this many decode steps: a refit is a numpy solve, on a small
# model a few percent of a step, and a row's price moves little in eight steps.
FIT_STALE_STEPS = 8


class Speculator:
    def __init__(self, config: SpeculativeConfig, source: DraftSource, costs: StepCosts | None = None) -> None:
        """costs: decode steps' times as learned from every decode-only step (the engine's scheduler keeps
        them: engine/step_budget.py); a StepCosts of its own when none is given."""
        self.config = config
        self.source = source
        self.acceptance: dict[str, MatchAcceptance] = {}
        self.shared = MatchAcceptance()  # over every request: where a new request's estimates start
        self._judged: dict[str, tuple[Acceptance, Acceptance]] = {}  # this step's (own, shared) estimates
        self.costs = costs if costs is not None else StepCosts()
        self.num_draft_tokens = 0  # verified since start, over every request (metrics)
        self.num_accepted_tokens = 0

    def propose(self, running: Iterable[Request], eligible: Callable[[Request], bool]) -> None:
        """Set draft_token_ids on every running request (empty where it should not speculate)."""
        decoding = [r for r in running if r.num_computed_tokens == r.num_tokens - 1]
        for request in running:
            request.draft_token_ids = []
        candidates = [r for r in decoding if eligible(r)]
        if not candidates:
            return
        # A draft costs its verify row, and for a draft model its own forward as well.
        context = sum(r.num_tokens for r in decoding)
        row_fraction = self.costs.row_fraction(len(decoding), context, context // len(decoding), FIT_STALE_STEPS)
        step_seconds = self.costs.step_seconds(len(decoding), context, FIT_STALE_STEPS)
        if step_seconds > 0:
            row_fraction += self.source.seconds_per_draft() / step_seconds
        limit, batch, adaptive = self.config.num_speculative_tokens, len(decoding), self.config.adaptive

        # Before asking the source: sequences where even their best-earning drafts would get none verified
        # in this step (a big batch, drafts that never pay) are not asked (a lookup costs Python time, a draft
        # model forwards), and their estimates recover so that they try again later. A draft model drafts as
        # many as pay (its drafts carry no match length); a lookup gets the most, cut once its match is known.
        compute = self.source.drafts_cost_compute
        if adaptive:
            best = [self._own(r).of(0).rate if compute else self._own(r).best_rate() for r in candidates]
            counts = allocate_drafts(best, [limit] * len(candidates), row_fraction, batch)
        else:
            counts = [limit] * len(candidates)
        paying, limits = [], []
        for request, k in zip(candidates, counts):
            if k == 0:
                self._own(request).idle()
                continue
            paying.append(request)
            limits.append(k if compute else limit)
        if not paying:
            return
        drafted = [(request, draft, matched) for request, (draft, matched)
                   in zip(paying, self.source.propose(paying, limits)) if draft]
        if adaptive:  # the whole step's drafts, now that each one's match length is known
            rates = [self._own(request).of(matched).rate for request, _, matched in drafted]
            counts = allocate_drafts(rates, [len(draft) for _, draft, _ in drafted], row_fraction, batch)
        else:
            counts = [limit] * len(drafted)
        for (request, draft, matched), k in zip(drafted, counts):
            request.draft_token_ids = draft[:k]
            self._judged[request.request_id] = (self._own(request).of(matched), self.shared.of(matched))

    def _own(self, request: Request) -> MatchAcceptance:
        own = self.acceptance.get(request.request_id)
        if own is None:
            own = self.acceptance[request.request_id] = MatchAcceptance(self.shared)
        return own

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

    def forget(self, request: Request) -> None:
        """The request has left the engine."""
        self.acceptance.pop(request.request_id, None)
        self._judged.pop(request.request_id, None)
        self.source.finished(request)


def kept_tokens(model_tokens: list[int], drafts: list[int]) -> list[int]:
    """model_tokens[r] is the model's choice after the known tokens and drafts[:r]. The model's first
    choice is always kept; each next one while the draft before it equals what the model chose there."""
    kept = model_tokens[:1]
    for r in range(1, len(model_tokens)):
        if model_tokens[r - 1] != drafts[r - 1]:
            break
        kept.append(model_tokens[r])
    return kept


# ---- where drafts come from ------------------------------------------------------------------------
# A source is given the sequences about to decode and how many tokens each may draft, and returns a guess
# per sequence and how far to trust it (the matched suffix's length for a lookup; 0 where there is no such
# measure). The default, prompt lookup, is here: it needs no model and keeps no state. The others, and the
# choice among them (`speculative_config.method`), are in spec/sources.py.

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
    """The default source ("ngram"): prompt lookup over each request's own tokens."""

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


# ---- how many drafts pay -----------------------------------------------------------------------------
# How many draft tokens each sequence should verify this step, from what speculation has earned so far.
#
# A draft token j (1-based) is kept only if the j - 1 before it were, so with a per-token acceptance rate a
# it makes a**j tokens in expectation, where a plain step makes one per sequence. Each draft adds a row to
# the step, which costs `row_fraction` of a plain step of this batch (measured: engine/step_budget.StepCosts) and which every
# sequence in the batch waits for. The drafts are chosen for the whole step at once, to maximize its tokens
# per unit of time: (batch + the drafts' expected tokens) / (1 + row_fraction * rows). On a step where the
# weights' bytes dominate, a row is cheap and sequences draft many; in a big batch a row must earn what the
# others make in its time, and drafting falls to 0: speculation backs off by itself under load. Each
# sequence alone would over-draft when all of them draft: each would price its rows against a step where
# the others make one token each.

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
