"""How much prompt a step may carry while other requests decode: their tokens come on average at most
`max_decode_slowdown` times slower than with their decodes alone, and no step waits longer than `max_step_ms`.

A token budget alone bounds neither: a prompt row's cost grows with its depth (at 32K tokens of context its
attention costs several times its matmuls), and on a CPU 2,048 prompt rows take seconds where eight decodes
take milliseconds. So step times are predicted from what the engine has run:
- the decode part: the median of the last decode-only steps at this batch size, scaled to the current
  contexts by StepCosts, the fit speculation prices its drafts with;
- a prompt chunk: per row, per position its rows attend, and per position before it (its sequence's K/V,
  read once per chunk), fitted on what each step with prompt rows took beyond its decode part.
The prompt's share is a token bucket of time. Each step with decoders adds (max_decode_slowdown - 1) times
its decode time (predicted where a prompt is in view; else what the step took, since nothing is planned
then), up to one step's room (max_step_ms, or max_decode_slowdown times the decode time if more, less the
decode time). A chunk is taken only as a whole step's room (or the prompt's whole rest) once the
bucket holds it, and what it then took beyond its prediction is paid back from the bucket. So a long prompt runs in full chunks between runs of plain decode steps, rather than in thin
chunks that would re-read its K/V every step. A short prompt after a quiet spell finds the bucket full and
goes at once. Without decoders, or before any decode-only step has been seen, the token budget alone applies
and the bucket refills.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable

import numpy as np

from kvflow.engine.request import Request, ScheduledSequence, SchedulerOutput


class DecayedFit:
    """Normal equations of a least-squares fit whose older observations weigh DECAY less per new one; a
    subclass sets DECAY and TERMS, and turns them into its terms in _solve (its prior and its floor)."""

    DECAY: float
    TERMS: int

    def __init__(self) -> None:
        self._xx = np.zeros((self.TERMS, self.TERMS))
        self._xt = np.zeros(self.TERMS)
        self._theta: np.ndarray | None = None
        self._fitted_at = 0  # self.steps when _theta was fitted
        self.steps = 0

    def _add(self, x: np.ndarray, seconds: float) -> None:
        self._xx = self.DECAY * self._xx + np.outer(x, x)
        self._xt = self.DECAY * self._xt + x * seconds
        self.steps += 1

    def _fit(self, stale_steps: int = 0) -> np.ndarray | None:
        """The fitted terms (None before any observation), refitted once the last fit has missed more than
        `stale_steps` observations. (A refit is a numpy solve, tens of microseconds: a caller that only
        weighs drafts every step can take a fit a few steps old.)"""
        if self.steps == 0:
            return None
        if self._theta is None or self.steps - self._fitted_at > stale_steps:
            self._theta, self._fitted_at = self._solve(), self.steps
        return self._theta

    def _solve(self) -> np.ndarray:
        raise NotImplementedError


class StepCosts(DecayedFit):
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
        super().__init__()
        self.prior_row_fraction = prior_row_fraction

    def observe(self, batch: int, draft_rows: int, seconds: float, context: int = 0,
                draft_row_context: int = 0) -> None:
        self._add(np.array([1.0, float(batch), context / 1000, float(draft_rows), draft_row_context / 1000]),
                  seconds)

    def _solve(self) -> np.ndarray:
        # The prior: a one-sequence step's mean time split evenly into fixed and per-sequence parts, a row
        # at prior_row_fraction of it, nothing per context; the data moves the fit away from it.
        mean = self._xt[0] / max(self._xx[0, 0], 1e-12)
        prior = np.array([mean / 2, mean / 2, 0.0, self.prior_row_fraction * mean, 0.0])
        scale = self.PRIOR_WEIGHT * max(self._xx[0, 0], 1.0)
        return np.maximum(nonnegative_fit(self._xx, self._xt, prior, scale), [0.0, 1e-6, 0.0, 1e-6, 0.0])

    def step_seconds(self, batch: int, context: int = 0, stale_steps: int = 0) -> float:
        """A plain decode step of this batch (over `context` tokens in all), as fitted (0 before any step);
        stale_steps: how many observations the fit may lag (_current)."""
        return self.seconds(batch, context, stale_steps=stale_steps)

    def seconds(self, batch: int, context: int = 0, rows: int = 0, row_context: int = 0,
                stale_steps: int = 0) -> float:
        """A decode step of this batch with `rows` draft rows (row_context: their sequences' lengths, summed
        over the rows), as fitted (0 before any step)."""
        theta = self._fit(stale_steps)
        if theta is None:
            return 0.0
        return float(theta[0] + theta[1] * batch + theta[2] * context / 1000 + theta[3] * rows
                     + theta[4] * row_context / 1000)

    def row_fraction(self, batch: int, context: int = 0, row_context: int = 0, stale_steps: int = 0) -> float:
        """What one more row (of a sequence `row_context` tokens long) costs, as a fraction of a plain
        decode step of this batch."""
        theta = self._fit(stale_steps)
        if theta is None:
            return self.prior_row_fraction / batch  # nothing measured yet
        return float((theta[3] + theta[4] * row_context / 1000) / self.step_seconds(batch, context, stale_steps))


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


def is_decode(s: ScheduledSequence) -> bool:
    """One known token past the prompt (and its drafts, if any): a decode, not a prompt chunk."""
    return s.num_tokens - len(s.draft_token_ids) == 1 and s.start >= s.request.num_prompt_tokens


RECENT_STEPS = 15  # decode-only steps per batch size whose median is the decode time


def attended_positions(start: int, rows: int) -> int:
    """Positions attended, summed over prompt rows start .. start + rows - 1 (each attends up to itself)."""
    return rows * start + rows * (rows + 1) // 2


class PromptChunkCosts(DecayedFit):
    """A prompt chunk's seconds as per_row * rows + per_attended * positions its rows attend + per_depth *
    positions before it (its sequence's K/V, read once per chunk: why many thin chunks of a deep prompt cost
    more than a few thick ones), positions in thousands; fitted by decayed non-negative least squares on
    steps' prompt parts."""

    DECAY = 0.95  # per observed step: a prefill's rows grow dearer as it goes deeper, the fit follows
    TERMS = 3
    # A chunk is at most GROWTH times the most rows of the last RECENT steps' prompt parts. Chunks of one
    # size at slowly growing depth leave the fit unable to tell a row's cost from a chunk's: noise can then
    # put all of it on the depth term, and a fit that says rows cost nothing would grant the whole token
    # budget (2,048 rows at depth 25K: a 47 s step among decoders planned at 200 ms). Growing by at most
    # GROWTH a step, a wrong fit costs at most GROWTH times a planned step, and the bigger chunk it ran
    # teaches the fit what rows cost.
    GROWTH = 2
    RECENT = 4

    def __init__(self) -> None:
        super().__init__()
        self._recent_rows: deque[int] = deque(maxlen=self.RECENT)

    def observe(self, rows: int, attended: int, depth: int, seconds: float) -> None:
        """A step's prompt chunks: `rows` in all, `attended` positions summed over their rows, `depth`
        positions before each chunk summed over the chunks; `seconds` what they took."""
        self._add(np.array([float(rows), attended / 1000, depth / 1000]), max(seconds, 0.0))
        self._recent_rows.append(rows)

    def _solve(self) -> np.ndarray:
        # Leans (weakly) on all of the cost being per row, until depths vary enough to split it.
        rows = max(self._xx[0, 0], 1e-12)
        prior = np.array([self._xt[0] / rows, 0.0, 0.0])
        return nonnegative_fit(self._xx, self._xt, prior, 1e-4 * max(rows, 1.0))

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
        n = min(n, self.GROWTH * max(self._recent_rows))
        return max(1, int(n))


class StepBudget:
    def __init__(self, max_decode_slowdown: float, max_step_seconds: float = 0.0) -> None:
        """max_decode_slowdown: how many times slower the decoders' tokens may come on average while prompts
        are prefilled (0: no bound beyond the token budget); max_step_seconds: the longest a step with prompt
        rows beside decoders may take (at least max_decode_slowdown times their decode time)."""
        self.max_decode_slowdown = max_decode_slowdown
        self.max_step_seconds = max_step_seconds
        self.decode_costs = StepCosts()
        self.chunk_costs = PromptChunkCosts()
        self.limit_seconds = 0.0  # this step's predicted limit (0: none), for the step record
        # The last decode-only steps per batch size, (seconds, context): their median is what such a step
        # takes now. The least-squares fit is a mean, and a fresh batch's first steps (its K/V pages touched
        # for the first time) run at 2 to 4 times the later ones, which would loosen the bound for long.
        self._recent: dict[int, deque[tuple[float, int]]] = {}
        self.bucket = math.inf  # prompt time saved up (seconds), at most one step's room
        self._room = math.inf  # this step's room for prompt rows (inf: no bound this step)
        self._charged = 0.0  # this step's prompt rows, as predicted when they were scheduled
        # Steps that could carry no prompt row are not planned (start_step): predicting their decode part
        # would refit the decode costs every step, the larger part of a small model's engine time between two
        # forwards. What their decoders took, times (max_decode_slowdown - 1), waits here for the bucket.
        self._planned = False
        self._unplanned_refill = 0.0

    # ---- before a step: the scheduler -----------------------------------------------------------------
    def start_step(self, running: Iterable[Request], prompts_waiting: bool = False) -> None:
        """Refill the bucket and set this step's room from the sequences about to decode in it. A step that
        can carry no prompt row (none waiting, none part-way through its prompt) is not planned: nothing
        would use the room, and the bucket takes what its decoders took once the step is observed."""
        self.limit_seconds, self._room, self._charged, self._planned = 0.0, math.inf, 0.0, False
        if self.max_decode_slowdown <= 0 or self.decode_costs.steps == 0:
            self.bucket = math.inf
            return
        batch = context = drafts = draft_context = 0
        prompt_rows = prompts_waiting
        for r in running:
            if r.num_tokens - r.num_computed_tokens == 1:
                batch += 1
                context += r.num_tokens
                drafts += len(r.draft_token_ids)
                draft_context += len(r.draft_token_ids) * r.num_tokens
            else:
                prompt_rows = True
        if batch == 0:
            self.bucket = math.inf
            return
        if not prompt_rows:
            return
        self._planned = True
        decode = self.decode_seconds(batch, context, drafts, draft_context)
        self.limit_seconds = max(self.max_step_seconds, self.max_decode_slowdown * decode)
        self._room = self.limit_seconds - decode
        refill = self._unplanned_refill + (self.max_decode_slowdown - 1) * decode
        self.bucket = min(self.bucket + refill, self._room)
        self._unplanned_refill = 0.0

    def decode_seconds(self, batch: int, context: int, drafts: int = 0, draft_context: int = 0) -> float:
        """A decode-only step of `batch` sequences over `context` tokens: the median of the last such steps
        at this batch size, scaled by the fit from their context to this one (plus the drafts' rows)."""
        fitted = self.decode_costs.seconds(batch, context, drafts, draft_context)
        recent = self._recent.get(batch)
        if not recent:
            return fitted
        plain_now = self.decode_costs.seconds(batch, context)
        plain_then = self.decode_costs.seconds(batch, int(statistics.median(c for _, c in recent)))
        scale = plain_now / plain_then if plain_then > 0 else 1.0
        return statistics.median(t for t, _ in recent) * scale + fitted - plain_now

    def prompt_rows(self, start: int, rows: int) -> int:
        """How many of `rows` prompt rows from position `start` to run this step: as many as a step's room
        takes, once the bucket holds their cost; 0 until then."""
        if not math.isfinite(self._room) or rows <= 1:
            return rows
        rows = min(rows, self.chunk_costs.rows_within(self._room, start))
        # A row that alone outgrows the room (deep in a long prompt) goes once the bucket is full.
        return rows if self.chunk_costs.seconds(start, rows) <= self.bucket or self.bucket >= self._room else 0

    def charge(self, start: int, rows: int) -> None:
        """Prompt rows start .. start + rows - 1 were scheduled: their predicted cost leaves the bucket."""
        if math.isfinite(self._room):
            cost = self.chunk_costs.seconds(start, rows)
            self.bucket -= cost
            self._room -= cost
            self._charged += cost

    # ---- after a step: the engine ---------------------------------------------------------------------
    def observe(self, sched: SchedulerOutput, seconds: float) -> None:
        """Learn from a step's time: decode-only steps teach the decode part, the rest the prompt rows'."""
        if not sched.scheduled:
            return
        batch = context = drafts = draft_context = rows = attended = depth = 0
        for s in sched.scheduled:
            n = len(s.draft_token_ids)
            if is_decode(s):
                length = s.start + s.num_tokens
                batch += 1
                context += length
                drafts += n
                draft_context += n * length
            else:
                rows += s.num_tokens
                attended += attended_positions(s.start, s.num_tokens)
                depth += s.start
        if rows == 0:
            self.decode_costs.observe(batch, drafts, seconds, context, draft_context)
            if not self._planned and batch and math.isfinite(self.bucket):
                self._unplanned_refill += (self.max_decode_slowdown - 1) * seconds
            if drafts == 0:
                self._recent.setdefault(batch, deque(maxlen=RECENT_STEPS)).append((seconds, context))
            return
        # Before any decode-only step the whole step is put on the rows: an overestimate, on the safe side.
        decode = self.decode_seconds(batch, context, drafts, draft_context) if self.decode_costs.steps else 0.0
        self.chunk_costs.observe(rows, attended, depth, seconds - decode)
        if self._charged and math.isfinite(self.bucket):
            # What the prompt rows took beyond their prediction comes out of the bucket too (or goes back
            # into it), so the fit's errors do not add up over a long prompt's thousands of steps.
            self.bucket -= (seconds - decode) - self._charged
            self._charged = 0.0
