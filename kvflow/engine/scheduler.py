"""The scheduler: one token budget per step, shared by every request that has tokens left to compute.

A request needs `num_tokens - num_computed_tokens` tokens computed. Each step, running requests are
served first (a decode costs one token, a prompt still being prefilled gets a chunk), then waiting
requests fill what is left of the budget: in arrival order ("fcfs"), or by default the one whose prompt
the prefix cache holds most of first ("lpm": an agent's next turn does not queue behind a cold prompt),
never passing over a request more than LPM_MAX_PASSES times. While requests decode, prompt chunks also
wait for the time the step budget saves up for them (engine/step_budget.py), so a long prompt slows the
decoders' tokens by a bounded factor instead of freezing them for seconds. Prefix-cache hits count as computed for
free, and the blocks a waiting request will hit are the last the pool gives away meanwhile. When the pool runs out of blocks for a running request, the most recently arrived running
request is preempted: it drops its blocks and its progress and waits, first in line, to be recomputed.

Progress is advanced in `schedule()`: once a chunk is handed to the runner, num_computed_tokens already
includes it. `update_from_output()` then registers the newly full blocks, appends sampled tokens and
checks the stop conditions.
"""

from __future__ import annotations

from collections import deque

from kvflow.config import CacheConfig, SchedulerConfig
from kvflow.engine.kv_cache_groups import KVCacheGroups
from kvflow.engine.kv_cache_manager import KVCacheManager
from kvflow.engine.request import Request, RequestStatus, ScheduledSequence, SchedulerOutput, now
from kvflow.engine.step_budget import StepBudget

PROMPT_LOGITS_CHUNK = 512  # at most this many prompt tokens a step for a request that wants their logits
# The "lpm" policy looks this far down the waiting queue for the longest cached prefix, and admits the head
# anyway once this many later requests have gone ahead of it (SGLang's lpm, with a bound on the wait).
LPM_WINDOW = 32
LPM_MAX_PASSES = 8


def check_stop(request: Request, max_model_len: int) -> RequestStatus | None:
    """Whether the request's last output token ends it. EOS and stop ids wait for min_tokens outputs;
    they win over the length limits when both apply, since they say more."""
    params = request.sampling_params
    token = request.output_token_ids[-1]
    if request.num_output_tokens >= params.min_tokens:
        if token == request.eos_token_id and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
    if request.max_tokens is not None and request.num_output_tokens >= request.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    if request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int | list[int],
                 windows: list[int] | None = None) -> None:
        """num_blocks per KV cache group (one int: one group) and, per group, its sliding window (0: none);
        see engine/kv_cache_groups.py."""
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        sizes = [num_blocks] if isinstance(num_blocks, int) else list(num_blocks)
        managers = [KVCacheManager(n, cache_config.block_size, cache_config.enable_prefix_caching, window)
                    for n, window in zip(sizes, windows or [0] * len(sizes), strict=True)]
        self.kv_cache_manager = managers[0] if len(managers) == 1 else KVCacheGroups(managers)
        self.requests: dict[str, Request] = {}  # every unfinished request, waiting or running
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is the first to be preempted
        self._finished_ids: list[str] = []  # reported in the next SchedulerOutput
        self._pending_copies: list[tuple[int, int]] = []  # from forks, done before the next forward
        self.num_preemptions = 0  # since start, for metrics
        # Bounds the prompt rows of a step in which others decode; the engine feeds it each step's time.
        self.step_budget = StepBudget(scheduler_config.max_decode_slowdown, scheduler_config.max_step_ms / 1000)

    # ---- queues -------------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def add_request(self, request: Request) -> None:
        """Queue a request, or raise ValueError if it could never run to its end. Resolves
        request.max_tokens: when max_tokens is None, the cap is what fits in max_model_len and the pool."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self._resolve_max_tokens(request)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        request.cached_prefix_hint = self.kv_cache_manager.keep_for_waiting(request)
        self.waiting.append(request)

    def _resolve_max_tokens(self, request: Request) -> None:
        max_len = self.config.max_model_len
        pool_tokens = self.kv_cache_manager.capacity_tokens(self.config.max_num_batched_tokens)
        n_prompt = request.num_prompt_tokens
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is None:
            # The last sampled token is never computed, so it needs no KV slot: hence the + 1.
            max_tokens = min(max_len - n_prompt, pool_tokens + 1 - n_prompt)
            if max_tokens < 1:
                raise ValueError(
                    f"prompt of {n_prompt} tokens leaves no room to generate: max_model_len is {max_len} "
                    f"and the KV cache holds {pool_tokens} tokens"
                )
        elif n_prompt + max_tokens > max_len:
            raise ValueError(
                f"prompt of {n_prompt} tokens + max_tokens {max_tokens} = {n_prompt + max_tokens} tokens "
                f"exceeds max_model_len {max_len}"
            )
        # KV is needed for every token but the last sampled one (max_tokens 0: the prompt alone).
        most_computed = n_prompt + max(max_tokens, 1) - 1
        if most_computed > pool_tokens:
            blocks_needed = self.kv_cache_manager.blocks_needed(most_computed)
            raise ValueError(
                f"request needs {blocks_needed} KV blocks ({most_computed} tokens of {self.block_size} per "
                f"block) but the whole pool has only {pool_tokens // self.block_size} blocks"
            )
        if not self.config.enable_chunked_prefill and most_computed > self.config.max_num_batched_tokens:
            raise ValueError(
                f"with chunked prefill disabled, a request must fit one step: it may need {most_computed} "
                f"tokens at once but max_num_batched_tokens is {self.config.max_num_batched_tokens}"
            )
        request.max_tokens = max_tokens

    def finish_request(
        self, request_id: str, status: RequestStatus, stop_reason: int | str | None = None
    ) -> None:
        """End a request now (abort, or a stop string seen by the detokenizer): it leaves its queue,
        its blocks are freed, and the next SchedulerOutput lists it. Unknown or finished ids are ignored."""
        assert status.is_finished(), f"{status} is not a finished status"
        request = self.requests.get(request_id)
        if request is None:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        if stop_reason is not None:
            request.stop_reason = stop_reason
        self._finish(request, status)

    def abort_request(self, request_id: str) -> None:
        self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Bookkeeping for a request already taken out of its queue."""
        request.status = status
        request.timings.finished_time = now()
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)

    def fork_request(self, parent: Request, child: Request) -> None:
        """Start child as a copy of parent's progress (its output so far and its KV), for n > 1 sampling.
        The child shares the parent's full blocks; a partly filled last block is copied, and that copy
        is listed in the next SchedulerOutput.block_copies. If no block is free for the copy, the child
        waits first in line and recomputes (its prefix mostly from the cache)."""
        if child.prompt_token_ids != parent.prompt_token_ids or child.output_token_ids:
            raise ValueError("a forked child must have the parent's prompt and no output of its own")
        if parent.request_id not in self.requests:
            raise ValueError(f"parent request {parent.request_id!r} is not in the scheduler")
        if child.request_id in self.requests:
            raise ValueError(f"request id {child.request_id!r} is already in use")
        self._resolve_max_tokens(child)
        child.output_token_ids = list(parent.output_token_ids)
        child.all_token_ids = list(parent.all_token_ids)
        child.block_hashes = list(parent.block_hashes)
        child.num_cached_tokens = parent.num_cached_tokens
        child.timings.first_scheduled_time = parent.timings.first_scheduled_time
        self.requests[child.request_id] = child
        copies = None
        if parent.status == RequestStatus.RUNNING:
            copies = self.kv_cache_manager.fork(parent, child)
        if copies is None:
            child.num_computed_tokens = 0
            child.status = RequestStatus.WAITING
            child.cached_prefix_hint = self.kv_cache_manager.keep_for_waiting(child)
            self.waiting.appendleft(child)
            return
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = RequestStatus.RUNNING
        self.running.append(child)
        self._pending_copies.extend(copies)

    # ---- one step -----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._finished_ids, block_copies=self._pending_copies)
        self._finished_ids, self._pending_copies = [], []
        budget = self.config.max_num_batched_tokens
        self.step_budget.start_step(self.running, bool(self.waiting))
        budget = self._schedule_running(out, budget)
        # After a preemption the pool is short: admitting new work now would only cause more of it.
        if not out.preempted_request_ids:
            budget = self._schedule_waiting(out, budget)
        out.total_num_scheduled_tokens = self.config.max_num_batched_tokens - budget
        return out

    def _chunk_size(self, request: Request, start: int, num_left: int, budget: int) -> int:
        """How many of a request's num_left tokens from position `start` to compute now; 0 means not this
        step. Without chunked prefill a request runs whole or waits, so the per-request threshold and the
        decode-slowdown bound do not apply."""
        if not self.config.enable_chunked_prefill:
            return num_left if num_left <= budget else 0
        if self.config.long_prefill_token_threshold > 0:
            num_left = min(num_left, self.config.long_prefill_token_threshold)
        if request.prompt_logits_from is not None:
            num_left = min(num_left, PROMPT_LOGITS_CHUNK)  # bounds the float32 logits a step holds
        return min(self.step_budget.prompt_rows(start, num_left), budget)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0 and len(out.scheduled) < self.config.max_num_seqs:
            request = self.running[i]
            num_new = self._chunk_size(request, request.num_computed_tokens,
                                       request.num_tokens - request.num_computed_tokens, budget)
            if num_new == 0:
                i += 1
                continue
            drafts = self._drafts_that_fit(request, num_new, budget)
            if drafts:
                self._add_scheduled(out, request, 1 + len(drafts), drafts)
                budget -= 1 + len(drafts)
                i += 1
                continue
            if not self._allocate_or_preempt(out, request, num_new):
                break  # it was itself the last running request, and is now preempted
            self._add_scheduled(out, request, num_new)
            budget -= num_new
            i += 1
        return budget

    def _drafts_that_fit(self, request: Request, num_new: int, budget: int) -> tuple[int, ...]:
        """The request's draft tokens to verify this step, already given their KV slots: as many as the
        budget, the context, max_tokens and the free blocks allow (none never preempts anyone)."""
        drafts = request.draft_token_ids
        if not drafts or num_new != 1 or request.num_computed_tokens != request.num_tokens - 1:
            return ()
        room = min(budget - 1, self.config.max_model_len - request.num_tokens - 1)
        if request.max_tokens is not None:
            room = min(room, request.max_tokens - request.num_output_tokens - 1)
        # Drafts may fill the last block the next token needs anyway; a block more only while every running
        # request could still take one (so speculation never makes another request wait or be preempted).
        kv = self.kv_cache_manager
        within = kv.blocks_needed(request.num_tokens) * self.block_size - request.num_tokens
        spare = kv.num_free_blocks - len(self.running)
        room = min(room, within + max(spare, 0) * self.block_size)
        drafts = tuple(drafts[: max(room, 0)])
        if drafts and not kv.allocate_slots(request, 1 + len(drafts)):
            return ()
        return drafts

    def _allocate_or_preempt(self, out: SchedulerOutput, request: Request, num_new: int) -> bool:
        """Find blocks for a running request, preempting from the back of the running list until they
        fit. Returns False if the request itself had to go."""
        while not self.kv_cache_manager.allocate_slots(request, num_new):
            victim = self.running.pop()  # never one already scheduled this step: those come before it
            self._preempt(victim)
            out.preempted_request_ids.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        kv = self.kv_cache_manager
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
            and len(out.scheduled) < self.config.max_num_seqs
        ):
            request = self._next_waiting()
            if request.prompt_logits_from is None:
                hit_block_ids, num_hit_tokens = kv.get_computed_blocks(request)
            else:  # cached blocks hold K/V but no logits: the prompt is computed again
                hit_block_ids, num_hit_tokens = None, 0
            num_new = self._chunk_size(request, num_hit_tokens, request.num_tokens - num_hit_tokens, budget)
            # If the request chosen cannot run, nothing else jumps the queue.
            if num_new == 0 or not kv.allocate_slots(request, num_new, hit_block_ids):
                break
            self._admit(request)
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            if request.timings.first_scheduled_time is None:
                request.timings.first_scheduled_time = now()
            self._add_scheduled(out, request, num_new)
            budget -= num_new
        return budget

    def _next_waiting(self) -> Request:
        """The waiting request to admit next (see the module's docstring)."""
        head = self.waiting[0]
        if (self.config.scheduling_policy == "fcfs" or len(self.waiting) == 1 or head.num_passed_over >= LPM_MAX_PASSES
                or head.status == RequestStatus.PREEMPTED):
            return head
        best = head
        for i, request in enumerate(self.waiting):
            if i == LPM_WINDOW:
                break
            if request.cached_prefix_hint > best.cached_prefix_hint:
                best = request
        return best

    def _admit(self, request: Request) -> None:
        if request is self.waiting[0]:
            self.waiting.popleft()
            return
        for earlier in self.waiting:
            if earlier is request:
                break
            earlier.num_passed_over += 1
        self.waiting.remove(request)

    def _add_scheduled(self, out: SchedulerOutput, request: Request, num_new: int,
                       drafts: tuple[int, ...] = ()) -> None:
        start = request.num_computed_tokens
        request.num_computed_tokens += num_new
        if num_new > 1 and not drafts:
            self.step_budget.charge(start, num_new)
        primary, *others = self.kv_cache_manager.group_block_ids(request.request_id)
        out.scheduled.append(
            ScheduledSequence(
                request=request,
                start=start,
                num_tokens=num_new,
                block_ids=primary,
                sample=request.num_computed_tokens == request.num_tokens + len(drafts),
                other_block_ids=tuple(others),
                draft_token_ids=drafts,
            )
        )

    def _preempt(self, request: Request) -> None:
        """Recompute-style preemption: drop the KV (full blocks stay in the prefix cache) and requeue first."""
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, sampled: dict[str, list[int]]
    ) -> list[Request]:
        """Apply one step's results. sampled maps request id to its new tokens (a list, so speculative
        decoding can accept several); only sequences with sample=True take tokens. Returns the requests
        that received tokens, finished ones already out of the scheduler with a finished status."""
        updated = []
        for seq in scheduler_output.scheduled:
            request = seq.request
            if request.status != RequestStatus.RUNNING:  # aborted or finished since schedule()
                continue
            if seq.draft_token_ids:
                self._settle_drafts(seq, sampled.get(request.request_id) or [])
            if seq.sample and request.max_tokens == 0:  # the prompt alone was asked for: it is done
                self.kv_cache_manager.cache_full_blocks(request)
                self.running.remove(request)
                self._finish(request, RequestStatus.FINISHED_LENGTH)
                updated.append(request)
                continue
            new_ids = (sampled.get(request.request_id) or []) if seq.sample else []
            status = None
            for token in new_ids:
                request.append_output_token_ids([token])
                status = check_stop(request, self.config.max_model_len)
                if status is not None:
                    break
            # A stop among kept drafts: what follows it was computed but is not the request's.
            request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
            # Blocks are registered once their tokens are known (kept drafts become tokens just above).
            self.kv_cache_manager.cache_full_blocks(request)
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
            if new_ids:
                updated.append(request)
        return updated

    def _settle_drafts(self, seq: ScheduledSequence, new_ids: list[int]) -> None:
        """After a verify step: of the drafts, the first len(new_ids) - 1 were right (new_ids holds them and
        the model's own next token). The KV of the rejected ones is rolled back (computed tokens end with
        the last kept draft), before any block is registered in the prefix cache, and blocks holding only
        rejected positions go back to the pool."""
        request = seq.request
        kept = max(len(new_ids) - 1, 0)
        request.num_computed_tokens -= len(seq.draft_token_ids) - kept
        request.num_draft_tokens += len(seq.draft_token_ids)
        request.num_accepted_tokens += kept
        request.draft_token_ids = []
        self.kv_cache_manager.trim(request, request.num_computed_tokens + 1)
