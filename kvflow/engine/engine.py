"""LLMEngine: the synchronous step loop. schedule -> forward -> sample -> update -> detokenize -> outputs;
each step leaves a StepRecord in the engine's StepHistory (the server's page draws them, --trace writes them).

Everything here runs on the caller's thread; the server wraps it in a background thread
(async_engine.py) so HTTP work never stalls a step. How requests enter and leave (validation, the
sequences of a request, aborts) is intake.py; the logprobs a request asks for, logprobs.py.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future
from dataclasses import asdict, dataclass

import torch

from kvflow.config import EngineConfig
from kvflow.distributed import launch as tp_launch
from kvflow.engine import rank_worker
from kvflow.engine.detokenizer import add_tokens
from kvflow.engine.intake import RequestIntake
from kvflow.engine.logprobs import LogprobRecording
from kvflow.engine.prefix_tier import open_disk_tier
from kvflow.engine.request import Request, RequestGroup, RequestStatus, SchedulerOutput, SequenceState
from kvflow.engine.runner import ModelRunner
from kvflow.engine.scheduler import Scheduler
from kvflow.engine.speculation import Speculator, kept_tokens
from kvflow.engine.step_budget import is_decode
from kvflow.executors.model_setup import LoadedModel, ModelSummary, load_model, set_threads
from kvflow.layers.sampler import Sampler, SamplingRow, position_generator
from kvflow.outputs import RequestOutput
from kvflow.sampling_params import SamplingParams
from kvflow.spec.config import resolve as resolve_speculation
from kvflow.spec.sources import build_source
from kvflow.structured.compiler import GrammarCompiler
from kvflow.structured.mask_prefetch import MaskPrefetcher, has_idle_core

log = logging.getLogger("kvflow")


@dataclass(frozen=True)
class StepRecord:
    """What one step ran: how many prompt (prefill) and decode tokens, how long it took, how full the KV
    cache was after it."""

    step: int  # the engine's step number, from 1
    t: float  # wall clock (time.time()) at the step's end
    seconds: float  # the step's duration
    prefill_tokens: int  # tokens of prompt chunks (and of outputs recomputed after a preemption)
    decode_tokens: int  # tokens of sequences decoding: one each, plus the drafts a speculative step verifies
    batch_size: int  # sequences in the step
    kv_usage: float  # fraction of KV blocks held by requests after the step
    # The time this step was planned to stay within, with sequences decoding beside prompt chunks
    # (engine/step_budget.py); 0 where no such bound applied.
    limit_seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


class StepHistory:
    """The engine's last steps, one StepRecord each. The engine thread appends one a step; any other thread
    reads those after a step number. A bounded deque under a lock: a step pays one append, a reader a copy
    of what it asks for. The server's page draws them (a long prompt's chunks between other users' decode
    steps); --trace writes the same records to a file."""

    def __init__(self, capacity: int = 1024) -> None:
        self._records: deque[StepRecord] = deque(maxlen=capacity)
        self._lock = threading.Lock()

    def add(self, record: StepRecord) -> None:
        with self._lock:
            self._records.append(record)

    def since(self, step: int, limit: int | None = None) -> list[StepRecord]:
        """The records after step number `step`, oldest first (at most the last `limit` of them)."""
        with self._lock:
            records = list(self._records)
        newer = [r for r in records if r.step > step]
        return newer[-limit:] if limit else newer


class LLMEngine(RequestIntake, LogprobRecording):
    """One model's engine: requests come in (intake.py), each step() schedules, runs the forward, samples,
    and hands back the outputs of the requests it moved (logprobs.py scores what was asked for)."""

    def __init__(
        self, config: EngineConfig, attention_backend: str = "auto", loaded: LoadedModel | None = None
    ) -> None:
        """`loaded` reuses a model already in memory (tests and benchmarks build several engines on one)."""
        self.config = config
        set_threads(config.model.threads)
        torch.manual_seed(config.model.seed)
        if loaded is not None and config.model.tensor_parallel_size > 1:
            raise ValueError("tensor parallelism loads each rank's shard itself: pass a model, not loaded_model")
        # The other ranks of a tensor-parallel group (kvflow/distributed), started before this rank loads.
        self.ranks = tp_launch.start(config.model, rank_worker.__name__) if loaded is None else None
        # An engine dropped without close() (a notebook's `LLM(...)` replaced by another) still stops its
        # ranks and leaves the group, when it is collected: the next engine starts from a clean process.
        self._stop_ranks = weakref.finalize(self, self.ranks.stop) if self.ranks is not None else None
        try:
            self.loaded = loaded or load_model(config.model, tensor_parallel=self.ranks and self.ranks.tp)
            # The speculative config, "auto" decided for this device: read here and by rank_worker.lead.
            self.speculative = resolve_speculation(config.speculative_config, self.loaded.device.type)
            self.tokenizer = self.loaded.tokenizer
            self.max_model_len = self.loaded.max_model_len
            config.scheduler.max_model_len = self.max_model_len
            self.runner = ModelRunner(self.loaded, config.cache, attention_backend, config.scheduler.max_num_seqs,
                                      max_num_batched_tokens=config.scheduler.max_num_batched_tokens)
            if self.ranks is not None:
                rank_worker.lead(self.runner, self.ranks, config, self.speculative, attention_backend)
        except BaseException:
            if self._stop_ranks is not None:
                self._stop_ranks()
            raise
        self.scheduler = Scheduler(config.scheduler, config.cache, self.runner.group_blocks, self.runner.group_windows)
        tier = open_disk_tier(config.cache, self.loaded, self.runner)  # the prefix cache's, if the options ask
        self.prefix_store = None if tier is None else tier.store
        if tier is not None:
            self.scheduler.kv_cache_manager.tier = tier
        self.sampler = Sampler()
        self.eos_token_ids = self._eos_ids()
        self.groups: dict[str, RequestGroup] = {}
        self.sequences: dict[str, SequenceState] = {}  # by engine request id
        self._trace = open(config.trace_file, "a") if config.trace_file else None  # noqa: SIM115
        self.step_history = StepHistory()
        # False in an engine core whose front end makes the text and matches stop strings
        # (engine/output_assembly.py): the core then sends token ids only, and decodes nothing.
        self.detokenize = True
        self._counter = 0
        self.num_steps = 0
        self._grammars: GrammarCompiler | None = None
        self._prefetcher: MaskPrefetcher | None = None
        # Token masks overlap the forward only with a core to spare (structured/mask_prefetch.py).
        self.mask_prefetch = has_idle_core()
        spec = self.speculative
        self.speculator = None
        if spec is not None:
            source = build_source(spec, self.loaded, config.scheduler.max_num_seqs)
            self.speculator = Speculator(spec, source, self.scheduler.step_budget.decode_costs)

    @property
    def failure(self) -> str | None:
        """Why this engine cannot run another step (a tensor-parallel rank died), or None."""
        return None if self.ranks is None else self.ranks.failure

    def close(self) -> None:
        """Finish what must outlive the engine: blocks queued for the prefix cache's disk tier; the other
        tensor-parallel ranks, told to stop."""
        if self.prefix_store is not None:
            self.prefix_store.close()
            atexit.unregister(self.prefix_store.close)
        if self._stop_ranks is not None:
            self._stop_ranks()

    @property
    def grammars(self) -> GrammarCompiler:
        """Compiles structured-output constraints for this model's tokenizer (built on first use)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.loaded.arch.vocab_size,
                                             self.eos_token_ids[0] if self.eos_token_ids else None)
        return self._grammars


    @functools.cached_property
    def model_summary(self) -> ModelSummary:
        return self.loaded.summary()

    def warm_up(self) -> None:
        """Run one short request and forget it, before the first real one. The first step maps the KV cache's
        first pages (on 2 MiB huge pages, which the kernel zeroes, and may first have to compact memory for)
        and wakes the thread team: on a 2-core AMD EPYC that was 0.35 s of the first user's TTFT (against
        0.04 s with KVFLOW_HUGE_PAGES=0). Its prompt fills no block, so nothing enters the prefix cache; the
        statistics it moved are reset."""
        request_id = "kvflow-warm-up"
        self.add_request(request_id, list(range(max(1, self.config.cache.block_size // 2))),
                         SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        while request_id in self.groups:
            self.step()
        self.scheduler.kv_cache_manager.reset_prefix_cache()  # (a block of one or two tokens may have filled)
        self.scheduler.kv_cache_manager.reset_stats()
        self.num_steps = 0
        self.step_history = StepHistory()

    # ---- one step --------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        drafting = 0.0  # what proposing cost (a draft model's forwards): not part of the step it verifies
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self._may_speculate)
            drafting = time.perf_counter() - t0
        sched = self.scheduler.schedule()
        masks = self._prefetch_masks(sched)
        step = self.runner.execute(sched)
        touched: set[str] = set()
        if step.prompt_spans:
            self._record_prompt_logprobs(step.logits[len(step.sample_request_ids):], step.prompt_spans, touched)
        sampled = self._sample(sched, step.sampled, step.sample_request_ids,
                               masks.result() if masks is not None else {}, touched)
        updated = self.scheduler.update_from_output(sched, sampled)
        for request in updated:
            try:
                self._process_tokens(request)
            except Exception as exc:  # noqa: BLE001 - one request's failure must not end the others'
                self._fail_group(self.sequences.get(request.request_id), exc, touched)
        self.num_steps += 1
        seconds = time.perf_counter() - t0
        self.scheduler.step_budget.observe(sched, seconds - drafting)
        if self.speculator is not None:
            self._settle_drafts(sched, sampled)
        self._record_step(sched, seconds)
        outputs = []
        for group_id in touched:
            group = self.groups.get(group_id)
            if group is None:
                continue
            outputs.append(group.output())
            if group.finished:
                self._drop(group)
        return outputs

    def _prefetch_masks(self, sched: SchedulerOutput) -> Future | None:
        """Start computing the token masks of this step's constrained sequences, to overlap the forward
        (structured/mask_prefetch.py); None where there is no idle core for it or nothing to mask."""
        if not self.mask_prefetch:
            return None
        matchers = {s.request.request_id: seq.grammar.matcher for s in sched.scheduled
                    if s.sample and (seq := self.sequences.get(s.request.request_id)) is not None
                    and seq.grammar is not None}
        if not matchers:
            return None
        if self._prefetcher is None:
            self._prefetcher = MaskPrefetcher()
        return self._prefetcher.start(matchers, self.loaded.arch.vocab_size)

    def _sample(
        self, sched: SchedulerOutput, logits: torch.Tensor, sample_ids: list[str], prefetched: dict,
        touched: set[str],
    ) -> dict[str, list[int]]:
        """The step's new token per sampled sequence; adds the groups it touched to `touched`.
        prefetched: token masks computed during the forward, by request id (_prefetch_masks)."""
        rows: list[SamplingRow] = []
        row_logits: list[int] = []
        runs: list[tuple[SequenceState, int, int]] = []  # (sequence, its first row, its number of rows)
        i = 0
        while i < len(sample_ids):
            rid, first = sample_ids[i], i
            while i < len(sample_ids) and sample_ids[i] == rid:
                i += 1  # a verify step's sequence owns a run of rows: its last known position, then each draft
            seq = self.sequences.get(rid)
            if seq is None:
                continue
            group = self._group_of(seq)
            touched.add(group.request_id)
            try:
                drafts = seq.request.draft_token_ids[: i - first - 1]
                targets = [seq] + self._fork_children(sched, group, seq)
                # max_tokens 0 asks for the prompt alone (its logprobs, its KV): nothing is sampled.
                built = [(t, [self._sampling_row(t, prefetched.get(t.request.request_id), drafts[:r])
                              for r in range(len(drafts) + 1)]) for t in targets if t.request.max_tokens != 0]
            except Exception as exc:  # noqa: BLE001 - one request's failure must not end the others'
                self._fail_group(seq, exc, touched)
                continue
            for target, target_rows in built:
                runs.append((target, len(rows), len(target_rows)))
                rows.extend(target_rows)
                row_logits.extend(range(first, first + len(target_rows)))
        if not rows:
            return {}
        if row_logits == list(range(logits.shape[0])):  # one row per logit row, in order: no copy needed
            result = self.sampler(logits, rows)
        else:
            result = self.sampler(logits.index_select(0, torch.tensor(row_logits, device=logits.device)), rows)
        sampled = {}
        for seq, j, count in runs:
            tokens = result.token_ids[j:j + count]
            if count > 1:
                tokens = kept_tokens(tokens, seq.request.draft_token_ids)
            try:
                for r, token in enumerate(tokens):
                    if seq.logprobs is not None:
                        self._record_logprobs(seq, token, result.logprobs[j + r], result.top_logprobs[j + r])
                    if seq.grammar is not None and token not in rows[j + r].end_token_ids:
                        seq.grammar.accept(token, seq.request.request_id)
            except Exception as exc:  # noqa: BLE001 - one request's failure must not end the others'
                self._fail_group(seq, exc, touched)
                continue
            sampled[seq.request.request_id] = tokens
        return sampled

    def _may_speculate(self, request: Request) -> bool:
        """Whether a request's drafts can be checked exactly: every one but those with a grammar to advance
        per draft. (Greedy or sampled: each draft position is sampled as plain decoding would sample it,
        and a draft is kept while it equals that sample; see engine/speculation.py.)"""
        seq = self.sequences.get(request.request_id)
        return seq is not None and seq.grammar is None

    def _settle_drafts(self, sched: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        """What each speculating sequence's drafts came to (its acceptance estimates)."""
        for s in sched.scheduled:
            if s.sample and self._may_speculate(s.request):
                n = len(s.draft_token_ids)
                self.speculator.settle(s.request_id, n, max(len(sampled.get(s.request_id, [])) - 1, 0))

    def _fail_group(self, seq: SequenceState | None, exc: Exception, touched: set[str]) -> None:
        """The engine failed on one request: it alone ends, with the error in its output; the others go on."""
        if seq is None or seq.group_id not in self.groups:
            return
        log.error("request %s failed in the engine step: %s", seq.group_id, exc, exc_info=exc)
        group = self.groups[seq.group_id]
        group.error = f"{type(exc).__name__}: {exc}"
        group.children_to_fork = 0
        for s in group.sequences:
            self.scheduler.abort_request(s.request.request_id)
            if s.finish_reason is None:
                s.finish_reason = "abort"
        touched.add(group.request_id)

    def _sampling_row(self, seq: SequenceState, mask_words=None, drafted: list[int] | None = None) -> SamplingRow:
        """drafted: in a verify step, the draft tokens this row's position comes after (they count as
        output for penalties and min_tokens, as they will if kept)."""
        req = seq.request
        params = req.sampling_params
        grammar = seq.grammar
        output = req.output_token_ids + drafted if drafted else req.output_token_ids
        below_min = len(output) < params.min_tokens
        ends = self._end_tokens(params) if below_min or grammar is not None else []
        suppress = ends if below_min else []
        generator = None if seq.seed is None else position_generator(seq.seed, len(output), self.loaded.device)
        if grammar is None:
            return SamplingRow(params, req.prompt_token_ids, output, generator, suppress)
        wrap_up = grammar.wrapping_up(req.num_output_tokens, req.max_tokens)
        return SamplingRow(params, req.prompt_token_ids, req.output_token_ids, generator, suppress,
                           grammar.matcher, ends, self.grammars.closing_tokens if wrap_up else None,
                           grammar.in_string, mask_words)

    def _end_tokens(self, params: SamplingParams) -> list[int]:
        """The tokens that end a request: its stop ids, and EOS unless it ignores it."""
        return list(params.stop_token_ids) + ([] if params.ignore_eos else self.eos_token_ids)

    def _process_tokens(self, request: Request) -> None:
        seq = self.sequences.get(request.request_id)
        if seq is None:
            return
        processed = seq.num_processed
        new_ids = request.output_token_ids[processed:]
        result, keep = add_tokens(seq.detokenizer, new_ids)
        if keep < len(new_ids):  # a stop string ended the text among kept drafts: the tokens after it go
            drop = len(new_ids) - keep
            del request.output_token_ids[-drop:], request.all_token_ids[-drop:]
            del request.timings.token_times[-drop:]
            if seq.logprobs is not None:
                del seq.logprobs[-drop:]
        seq.num_processed = request.num_output_tokens
        seq.delta_token_ids += request.output_token_ids[processed:]
        seq.delta_text += result.text_delta
        if result.finished and not request.is_finished:
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED, result.stop_string)
        elif seq.grammar is not None and not request.is_finished and seq.grammar.finished:
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED, None)
        if request.is_finished:
            if not result.finished:
                seq.delta_text += seq.detokenizer.flush()
            seq.finish_reason = request.status.finish_reason

    def _record_step(self, sched: SchedulerOutput, seconds: float) -> None:
        """The step's summary into the history the server's page draws (and the --trace file)."""
        decode = 0
        for s in sched.scheduled:
            if is_decode(s):
                decode += s.num_tokens
        record = StepRecord(step=self.num_steps, t=time.time(), seconds=seconds,
                            prefill_tokens=sched.total_num_scheduled_tokens - decode, decode_tokens=decode,
                            batch_size=len(sched.scheduled), kv_usage=self.scheduler.kv_cache_manager.usage,
                            limit_seconds=self.scheduler.step_budget.limit_seconds)
        self.step_history.add(record)
        if self._trace is not None:
            self._trace.write(json.dumps(record.as_dict()) + "\n")
            self._trace.flush()

    # ---- stats -----------------------------------------------------------------------------------------
    @property
    def kv_capacity_tokens(self) -> int:
        return self.runner.capacity_tokens

    @property
    def longest_request_tokens(self) -> int:
        """The most tokens one request can hold in the KV pool (the server fits max_tokens to it)."""
        return self.scheduler.kv_cache_manager.capacity_tokens(self.config.scheduler.max_num_batched_tokens)
