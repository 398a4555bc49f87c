"""One generation request as the engine core sees it: its tokens, its progress and its state.

The scheduler's single rule works on two numbers: `num_tokens` (prompt + output so far) and
`num_computed_tokens` (how many of those already have KV in the cache). Each step computes some of the
difference; when they meet, the last token's logits are sampled and a new token is appended.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvflow.sampling_params import SamplingParams

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
        self.status = RequestStatus.WAITING
        # What stopped it: a stop token id, a stop string (set by the detokenizer), or None
        # (EOS, length, abort), as in vLLM's OpenAI `stop_reason`.
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.timings = RequestTimings(arrival_time=now() if arrival_time is None else arrival_time)
        # Chained hashes of its full blocks, extended by the KV cache manager as blocks fill.
        self.block_hashes: list[int] = []

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
