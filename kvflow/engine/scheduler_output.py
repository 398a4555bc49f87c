"""What one scheduler step asks of the model runner: plain data, no behaviour."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvflow.engine.request import Request


@dataclass
class ScheduledSequence:
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
