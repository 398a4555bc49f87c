"""How much prompt a step may carry while other requests decode, so that a long prefill never makes their
tokens wait more than `max_decode_slowdown` times what a step of their decodes alone takes.

A token budget alone cannot bound that: a prompt row's cost grows with its depth (at 32K tokens of context
its attention costs several times its matmuls), and on a CPU 2,048 prompt rows take seconds while eight
decodes take milliseconds. So the step's time is predicted from two models learned from the steps run:
- the decode part, StepCosts fitted on decode-only steps (the same fit speculation prices drafts with);
- a prompt chunk's cost, per row, per position its rows attend and per position before it (its K/V read),
  fitted on what every step with prompt rows took beyond its predicted decode part.
A step with decoding sequences may take max_decode_slowdown times the predicted decode time, or the floor
(`step_floor_ms`: thin chunks cost throughput, and a short prompt's one-off 50 ms is not felt) if that is
more; its prompt chunks get what that leaves, and at least one row, so a prefill always advances. Without decoding sequences, or before any
decode-only step has been seen, the token budget alone applies.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from kvflow.engine.request import Request
from kvflow.engine.scheduler_output import SchedulerOutput


class StepCosts:
    """A decode step's time, learned as fixed + per_sequence * sequences + per_context * context + per_row *
    draft_rows + per_row_context * draft_row_context: a least-squares fit over the decode-only steps seen,
    older ones weighing less. `context` is the tokens the step's sequences attend over (their KV reads),
    `draft_row_context` the same summed over the draft rows (a row's attention compute): without them a
    batch at depth 2,000 and one at depth 300 look alike, and a row's cost learned on one misleads the
    other. Before the steps vary enough to separate the terms, the fit leans on `prior_row_fraction` (a
    row as a fraction of a one-sequence step). Contexts are counted in thousands of tokens."""

    DECAY = 0.98  # weight of the history, per observed step
    PRIOR_WEIGHT = 1e-4  # how strongly the fit leans on the prior split
    TERMS = 5

    def __init__(self, prior_row_fraction: float = 0.15) -> None:
        self.prior_row_fraction = prior_row_fraction
        self._xx = np.zeros((self.TERMS, self.TERMS))
        self._xt = np.zeros(self.TERMS)
        self._theta: np.ndarray | None = None
        self.steps = 0

    def observe(self, batch: int, draft_rows: int, seconds: float, context: int = 0,
                draft_row_context: int = 0) -> None:
        x = np.array([1.0, float(batch), context / 1000, float(draft_rows), draft_row_context / 1000])
        self._xx = self.DECAY * self._xx + np.outer(x, x)
        self._xt = self.DECAY * self._xt + x * seconds
        self.steps += 1
        self._theta = None

    def _fit(self) -> np.ndarray | None:
        if self.steps == 0:
            return None
        if self._theta is None:
            # The prior: a one-sequence step's mean time split evenly into fixed and per-sequence parts,
            # a row at prior_row_fraction of it, nothing per context; the data moves the fit away from it.
            mean = self._xt[0] / max(self._xx[0, 0], 1e-12)
            prior = np.array([mean / 2, mean / 2, 0.0, self.prior_row_fraction * mean, 0.0])
            scale = self.PRIOR_WEIGHT * max(self._xx[0, 0], 1.0)
            theta = nonnegative_fit(self._xx, self._xt, prior, scale)
            self._theta = np.maximum(theta, [0.0, 1e-6, 0.0, 1e-6, 0.0])
        return self._theta

    def step_seconds(self, batch: int, context: int = 0) -> float:
        """A plain decode step of this batch (over `context` tokens in all), as fitted (0 before any step)."""
        return self.seconds(batch, context)

    def seconds(self, batch: int, context: int = 0, rows: int = 0, row_context: int = 0) -> float:
        """A decode step of this batch with `rows` draft rows (row_context: their sequences' lengths, summed
        over the rows), as fitted (0 before any step)."""
        theta = self._fit()
        if theta is None:
            return 0.0
        return float(theta[0] + theta[1] * batch + theta[2] * context / 1000 + theta[3] * rows
                     + theta[4] * row_context / 1000)

    def row_fraction(self, batch: int, context: int = 0, row_context: int = 0) -> float:
        """What one more row (of a sequence `row_context` tokens long) costs, as a fraction of a plain
        decode step of this batch."""
        theta = self._fit()
        if theta is None:
            return self.prior_row_fraction / batch  # nothing measured yet
        return float((theta[3] + theta[4] * row_context / 1000) / self.step_seconds(batch, context))


def nonnegative_fit(xx: np.ndarray, xt: np.ndarray, prior: np.ndarray, scale: float) -> np.ndarray:
    """Least squares from the normal equations (xx, xt), pulled toward `prior` with weight `scale`, no term
    negative. Where terms move together (a batch of one, at one depth), an unconstrained fit may trade a
    negative term against a positive one, and clamping one afterwards would skew every prediction; so a
    term that comes out negative is dropped (held at 0) and the rest refitted, until none is (an active-set
    non-negative fit)."""
    terms = len(xt)
    a, b = xx + scale * np.eye(terms), xt + scale * prior
    active = list(range(terms))
    while True:
        theta = np.zeros(terms)
        theta[active] = np.linalg.solve(a[np.ix_(active, active)], b[active])
        if theta.min() >= 0 or len(active) == 1:
            return theta
        active.remove(int(np.argmin(theta)))


def attended_positions(start: int, rows: int) -> int:
    """Positions attended, summed over prompt rows start .. start + rows - 1 (each attends up to itself)."""
    return rows * start + rows * (rows + 1) // 2


class PromptChunkCosts:
    """A prompt chunk's seconds as per_row * rows + per_attended * positions its rows attend + per_depth *
    positions before it (its sequence's K/V, read once per chunk: why many thin chunks of a deep prompt cost
    more than a few thick ones), positions in thousands; fitted by decayed non-negative least squares on
    steps' prompt parts."""

    DECAY = 0.95  # per observed step: a prefill's rows grow dearer as it goes deeper, the fit follows
    TERMS = 3

    def __init__(self) -> None:
        self._xx = np.zeros((self.TERMS, self.TERMS))
        self._xt = np.zeros(self.TERMS)
        self._theta: np.ndarray | None = None
        self.steps = 0

    def observe(self, rows: int, attended: int, depth: int, seconds: float) -> None:
        """A step's prompt chunks: `rows` in all, `attended` positions summed over their rows, `depth`
        positions before each chunk summed over the chunks; `seconds` what they took."""
        x = np.array([float(rows), attended / 1000, depth / 1000])
        self._xx = self.DECAY * self._xx + np.outer(x, x)
        self._xt = self.DECAY * self._xt + x * max(seconds, 0.0)
        self.steps += 1
        self._theta = None

    def _fit(self) -> np.ndarray:
        if self._theta is None:
            # Leans (weakly) on all of the cost being per row, until depths vary enough to split it.
            rows = max(self._xx[0, 0], 1e-12)
            prior = np.array([self._xt[0] / rows, 0.0, 0.0])
            self._theta = nonnegative_fit(self._xx, self._xt, prior, 1e-4 * max(rows, 1.0))
        return self._theta

    def seconds(self, start: int, rows: int) -> float:
        """One chunk: rows start .. start + rows - 1 of a sequence, as fitted (0 before any step)."""
        if self.steps == 0 or rows <= 0:
            return 0.0
        per_row, per_attended, per_depth = self._fit()
        return float(per_row * rows + (per_attended * attended_positions(start, rows) + per_depth * start) / 1000)

    def rows_within(self, seconds: float, start: int) -> int:
        """The most rows of one chunk from `start` whose predicted cost is within `seconds` (at least 1)."""
        if self.steps == 0:
            return 1
        per_row, per_attended, per_depth = self._fit()
        seconds -= per_depth * start / 1000
        # per_row * n + per_attended / 1000 * (n * start + n * (n + 1) / 2) <= seconds: a quadratic in n.
        a = per_attended / 2000
        b = per_row + per_attended * (start + 0.5) / 1000
        if seconds <= 0:
            return 1
        if a <= 0:
            n = seconds / b if b > 0 else math.inf
        else:
            n = (-b + math.sqrt(b * b + 4 * a * seconds)) / (2 * a)
        return max(1, int(n)) if math.isfinite(n) else 1 << 30


class StepBudget:
    def __init__(self, max_decode_slowdown: float, floor_seconds: float = 0.0) -> None:
        """max_decode_slowdown: how many times a decode-only step's time a step carrying prompt rows may
        take while sequences decode (0: no limit beyond the token budget); floor_seconds: what such a step
        may take whatever the slowdown says."""
        self.max_decode_slowdown = max_decode_slowdown
        self.floor_seconds = floor_seconds
        self.decode_costs = StepCosts()
        self.chunk_costs = PromptChunkCosts()
        self.limit_seconds = 0.0  # this step's predicted limit (0: none), for the step record
        self._left = math.inf

    # ---- before a step: the scheduler -----------------------------------------------------------------
    def start_step(self, running: Iterable[Request]) -> None:
        """Set this step's allowance for prompt rows from the sequences about to decode in it."""
        self.limit_seconds, self._left = 0.0, math.inf
        if self.max_decode_slowdown <= 0 or self.decode_costs.steps == 0:
            return
        batch = context = drafts = draft_context = 0
        for r in running:
            if r.num_tokens - r.num_computed_tokens == 1:
                batch += 1
                context += r.num_tokens
                drafts += len(r.draft_token_ids)
                draft_context += len(r.draft_token_ids) * r.num_tokens
        if batch == 0:
            return
        decode = self.decode_costs.seconds(batch, context, drafts, draft_context)
        self.limit_seconds = max(self.max_decode_slowdown * decode, self.floor_seconds)
        self._left = self.limit_seconds - decode

    def prompt_rows(self, start: int, rows: int) -> int:
        """How many of `rows` prompt rows from position `start` fit what is left of this step's allowance
        (at least one)."""
        if not math.isfinite(self._left) or rows <= 1:
            return rows
        return min(rows, self.chunk_costs.rows_within(max(self._left, 0.0), start))

    def charge(self, start: int, rows: int) -> None:
        """Prompt rows start .. start + rows - 1 were scheduled: their predicted cost leaves the allowance."""
        if math.isfinite(self._left):
            self._left -= self.chunk_costs.seconds(start, rows)

    # ---- after a step: the engine ---------------------------------------------------------------------
    def observe(self, sched: SchedulerOutput, seconds: float) -> None:
        """Learn from a step's time: decode-only steps teach the decode part, the rest the prompt rows'."""
        batch = context = drafts = draft_context = rows = attended = depth = 0
        for s in sched.scheduled:
            n = len(s.draft_token_ids)
            if s.num_tokens == 1 + n and s.start >= s.request.num_prompt_tokens:  # a decode (and its drafts)
                length = s.start + s.num_tokens
                batch += 1
                context += length
                drafts += n
                draft_context += n * length
            else:
                rows += s.num_tokens
                attended += attended_positions(s.start, s.num_tokens)
                depth += s.start
        if not sched.scheduled:
            return
        if rows == 0:
            self.decode_costs.observe(batch, drafts, seconds, context, draft_context)
            return
        # Before any decode-only step the whole step is put on the rows: an overestimate, on the safe side.
        decode = self.decode_costs.seconds(batch, context, drafts, draft_context) if self.decode_costs.steps else 0.0
        self.chunk_costs.observe(rows, attended, depth, seconds - decode)
