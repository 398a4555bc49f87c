"""A request as the engine core sees it (Request: its tokens, progress and status; ScheduledSequence: its
share of one step) and as the engine front end tracks it (RequestGroup: the n sequences of one user
request; SequenceState: one sequence's text, logprobs and generator).

The scheduler's single rule works on two numbers: `num_tokens` (prompt + output so far) and
`num_computed_tokens` (how many of those already have KV in the cache). Each step computes some of the
difference (a ScheduledSequence, one of a step's SchedulerOutput); when they meet, the last token's logits
are sampled and a new token is appended.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvflow.engine.detokenizer import IncrementalDetokenizer
from kvflow.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvflow.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvflow.structured.sequence_grammar import SequenceGrammar

# One clock for every engine-side timestamp, so differences (TTFT, ITL) are meaningful.
now = time.monotonic


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI finish reason ("stop", "length", "abort"), or None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


def finish_reason(status: RequestStatus) -> str | None:
    """The OpenAI finish reason for a status, or None while the request is unfinished."""
    return status.finish_reason


@dataclass
class RequestTimings:
    """Engine-side timestamps on the `now` clock; None until the event happens."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per generated token
    finished_time: float | None = None


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt must hold at least one token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)  # prompt + output, kept in sync
        # The output cap the scheduler enforces: sampling_params.max_tokens, or when that is None,
        # what is left of max_model_len (and of the KV pool). Resolved by Scheduler.add_request.
        self.max_tokens: int | None = sampling_params.max_tokens
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit tokens at first scheduling; -1 before
        self.num_disk_hit_tokens = 0  # tokens whose K/V the prefix cache's disk tier brought back
        # While waiting: prompt tokens the prefix cache held when it arrived (the "lpm" policy's key), and
        # how many times a later request was admitted ahead of it.
        self.cached_prefix_hint = 0
        self.num_passed_over = 0
        self.status = RequestStatus.WAITING
        # What stopped it: a stop token id, a stop string (set by the detokenizer), or None
        # (EOS, length, abort), as in vLLM's OpenAI `stop_reason`.
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.timings = RequestTimings(arrival_time=now() if arrival_time is None else arrival_time)
        # Chained hashes of its full blocks, extended by the KV cache manager as blocks fill.
        self.block_hashes: list[int] = []
        # Prompt logprobs: the first prompt position whose logits are still wanted (None: none wanted).
        # While set, the scheduler computes the prompt in full and the runner returns those rows' logits.
        self.prompt_logits_from: int | None = None
        # Speculative decoding: tokens guessed to follow, verified in the next decode step (engine/speculation.py).
        self.draft_token_ids: list[int] = []
        self.num_draft_tokens = 0  # guessed tokens verified so far
        self.num_accepted_tokens = 0  # of those, the ones kept

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished()

    def append_output_token_ids(self, ids: list[int]) -> None:
        t = now()
        if ids and self.timings.first_token_time is None:
            self.timings.first_token_time = t
        self.output_token_ids.extend(ids)
        self.all_token_ids.extend(ids)
        self.timings.token_times.extend([t] * len(ids))

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )


@dataclass
class ScheduledSequence:
    """A request's share of one step (scheduler.py decides it): of the difference between its two numbers,
    the `num_tokens` tokens computed from position `start`."""

    request: Request
    start: int  # num_computed_tokens before this step: the position of the first token computed
    num_tokens: int  # tokens computed this step: request.all_token_ids[start : start + num_tokens]
    block_ids: list[int]  # the request's whole block table after allocation (the primary KV group's)
    sample: bool  # this chunk reaches the end of the known tokens, so the last one's logits are needed
    other_block_ids: tuple[list[int], ...] = ()  # the block tables of KV groups 1.. (engine/kv_cache_groups)
    # Speculative decoding: guessed tokens computed after the known ones (counted in num_tokens); each of
    # the last len(draft_token_ids) + 1 positions is then sampled, to check the guess after it.
    draft_token_ids: tuple[int, ...] = ()

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def token_ids(self) -> list[int]:
        known = self.num_tokens - len(self.draft_token_ids)
        return self.request.all_token_ids[self.start : self.start + known] + list(self.draft_token_ids)

    @property
    def positions(self) -> range:
        return range(self.start, self.start + self.num_tokens)


@dataclass
class SchedulerOutput:
    """What one scheduler step asks of the model runner: plain data, no behaviour."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    preempted_request_ids: list[str] = field(default_factory=list)
    # Requests that left the engine since the last step (finished, stopped or aborted), so the runner
    # can drop whatever it keeps per request.
    finished_request_ids: list[str] = field(default_factory=list)
    # (src, dst) block copies to perform before this step's forward (copy-on-write after a fork).
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SequenceState:
    """One of the n completions of a request, backed by one engine Request."""

    group_id: str
    index: int
    request: Request
    detokenizer: IncrementalDetokenizer
    seed: int | None  # a seeded sequence's seed (the request's + its index): its noise per position
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    num_processed: int = 0  # output tokens already detokenized
    grammar: SequenceGrammar | None = None  # structured output: its grammar state, fed every output token

    def completion(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.detokenizer.output_text,
            token_ids=list(self.request.output_token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.request.stop_reason,
            delta_text=self.delta_text,
            delta_token_ids=list(self.delta_token_ids),
        )


@dataclass
class RequestGroup:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[SequenceState] = field(default_factory=list)
    children_to_fork: int = 0  # n - 1 until the first sequence's prompt is computed
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # by prompt position, as computed
    error: str | None = None  # why the engine failed on this request alone

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # the first prompt token has no logprob: nothing predicts it

    @property
    def finished(self) -> bool:
        return self.children_to_fork == 0 and all(s.finish_reason is not None for s in self.sequences)

    def metrics(self) -> RequestMetrics:
        first = self.sequences[0].request
        t = first.timings
        finished = [s.request.timings.finished_time for s in self.sequences]
        scheduled, first_token, times = t.first_scheduled_time, t.first_token_time, t.token_times
        return RequestMetrics(
            arrival_time=t.arrival_time,
            first_scheduled_time=scheduled,
            first_token_time=first_token,
            finished_time=max(finished) if all(f is not None for f in finished) else None,
            token_times=list(times),
            num_prompt_tokens=len(self.prompt_token_ids),
            num_cached_tokens=max(first.num_cached_tokens, 0),
            num_disk_cached_tokens=first.num_disk_hit_tokens,
            num_generated_tokens=sum(s.request.num_output_tokens for s in self.sequences),
            num_preemptions=sum(s.request.num_preemptions for s in self.sequences),
            num_draft_tokens=sum(s.request.num_draft_tokens for s in self.sequences),
            num_accepted_tokens=sum(s.request.num_accepted_tokens for s in self.sequences),
            queue_time=None if scheduled is None else scheduled - t.arrival_time,
            ttft=None if first_token is None else first_token - t.arrival_time,
            prefill_time=None if first_token is None or scheduled is None else first_token - scheduled,
            decode_time=None if first_token is None or not times else times[-1] - first_token,
            tpot=None if len(times) < 2 else (times[-1] - times[0]) / (len(times) - 1),
        )

    def output(self) -> RequestOutput:
        out = RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[s.completion() for s in self.sequences],
            finished=self.finished or self.error is not None,
            metrics=self.metrics(),
            prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs),
            error=self.error,
        )
        for s in self.sequences:
            s.delta_text, s.delta_token_ids = "", []
        return out
