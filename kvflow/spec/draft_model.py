"""Drafts from a smaller model with the same tokenizer, run greedily by kvflow's own runner on a KV cache of
its own. Per sequence it remembers which tokens its cache holds; before drafting it keeps the longest part
of that which still agrees with the sequence (what the target kept), computes the rest in one pass, then
drafts one token per pass. A greedy draft is a single token with certainty, which is what the Speculator's
acceptance rule assumes (engine/speculation.py): the target's output is unchanged whatever it drafts.

Its cache is small and bounded (`draft_kv_cache_memory`): when blocks run short, the sequences it drafted
for longest ago lose theirs, and a sequence that still does not fit simply gets no draft this step.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from kvflow.config import CacheConfig, ModelConfig
from kvflow.engine.kv_cache_alloc import bytes_per_block
from kvflow.engine.request import Request, ScheduledSequence, SchedulerOutput
from kvflow.engine.runner import ModelRunner
from kvflow.executors.model_setup import LoadedModel, load_model
from kvflow.loader.model_loader import open_model_files, read_arch
from kvflow.loader.resolve import resolve_model
from kvflow.spec.config import SpeculativeConfig

BLOCK_SIZE = 16
CATCH_UP_CHUNK = 1024  # the most tokens of one sequence its draft cache computes per pass
SECONDS_DECAY = 0.9  # weight of the history in the measured cost of a draft pass


@dataclass
class _Cached:
    """What the draft model's cache holds for one sequence: the KV of `token_ids`, in `block_ids`."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)  # known tokens this step computes before drafting
    verified: int = 0  # how many of token_ids were the sequence's known tokens when it last drafted
    prompt_logits_from = None  # the runner's view of a request: no prompt rows wanted

    @property
    def all_token_ids(self) -> list[int]:
        return self.token_ids


class DraftModel:
    drafts_cost_compute = True

    def __init__(self, loaded: LoadedModel, kv_cache_memory: int, max_num_seqs: int) -> None:
        self.loaded = loaded
        self.max_len = loaded.max_model_len
        per_block = bytes_per_block(loaded.arch, BLOCK_SIZE, loaded.kv_cache_dtype or loaded.dtype)
        # Every KV group gets the same block table, so a sliding-window model drafts too (its window layers
        # keep more than they need).
        groups = len(loaded.arch.kv_group_windows)
        num_blocks = max(kv_cache_memory // (per_block * max(groups, 1)), 1)
        cache = CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks, enable_prefix_caching=False)
        self.runner = ModelRunner(loaded, cache, max_num_seqs=max_num_seqs, max_num_batched_tokens=CATCH_UP_CHUNK)
        self.num_groups = len(self.runner.group_windows)
        self.free = list(range(self.runner.num_blocks))
        self.cached: OrderedDict[str, _Cached] = OrderedDict()  # least recently drafted first
        self._seconds_per_pass = 0.0

    @classmethod
    def load(cls, config: SpeculativeConfig, target: LoadedModel, max_num_seqs: int) -> DraftModel:
        resolved = resolve_model(config.model)
        if resolved.path == target.resolved.path:
            loaded = target  # the model as its own draft: one copy of the weights serves both
        else:
            files = open_model_files(resolved)  # the tokenizer and shape first: a mismatch costs no weights
            if files.tokenizer().get_vocab() != target.tokenizer.get_vocab():
                raise ValueError(f"speculative_config.model: {config.model!r} has a different tokenizer "
                                 f"from the model it drafts for")
            context = read_arch(files).max_position_embeddings
            plan = target.plan
            loaded = load_model(ModelConfig(model=config.model, mode=plan.mode, device=str(plan.device),
                                            max_model_len=min(target.max_model_len, context)))
        return cls(loaded, config.draft_kv_cache_memory, max_num_seqs)

    # ---- the interface the Speculator uses --------------------------------------------------------------
    def propose(self, requests: list[Request], limits: list[int]) -> list[tuple[list[int], int]]:
        drafts: dict[str, list[int]] = {}
        active: list[tuple[_Cached, int]] = []
        for request, k in zip(requests, limits):
            if k < 1 or request.num_tokens + k > self.max_len:
                continue
            cached = self._prepare(request, k)
            if cached is not None:
                active.append((cached, k))
                drafts[request.request_id] = []
        if active:
            start = time.perf_counter()
            passes = self._draft(active, drafts)
            self._observe((time.perf_counter() - start) / max(passes, 1))
        return [(drafts.get(r.request_id, []), 0) for r in requests]

    def seconds_per_draft(self) -> float:
        return self._seconds_per_pass

    def finished(self, request: Request) -> None:
        cached = self.cached.pop(request.request_id, None)
        if cached is not None:
            self.free.extend(cached.block_ids)

    # ---- its cache ----------------------------------------------------------------------------------------
    def _prepare(self, request: Request, k: int) -> _Cached | None:
        """The sequence's cache entry, cut back to what still agrees with it and grown to hold its known
        tokens and k - 1 drafts (the last draft is never computed); None when the blocks do not fit."""
        known = request.all_token_ids
        cached = self.cached.pop(request.request_id, None) or _Cached(request.request_id)
        # A sequence's known tokens only grow, so what agreed last time still does: only the drafts
        # computed since need checking (not the whole sequence, every step).
        agree = min(cached.verified, len(cached.token_ids))
        for a, b in zip(cached.token_ids[agree:], known[agree:]):
            if a != b:
                break
            agree += 1
        cached.verified = len(known)
        agree = min(agree, len(known) - 1)  # the last known token is computed again: its logits draft
        del cached.token_ids[agree:]
        need = -(-(len(known) + k - 1) // BLOCK_SIZE)
        keep = -(-agree // BLOCK_SIZE)
        self.free.extend(cached.block_ids[keep:])
        del cached.block_ids[keep:]
        while len(self.free) < need - keep and self.cached:
            _, oldest = self.cached.popitem(last=False)
            self.free.extend(oldest.block_ids)
        if len(self.free) < need - keep:
            self.free.extend(cached.block_ids)
            return None
        cached.block_ids.extend(self.free.pop() for _ in range(need - keep))
        self.cached[request.request_id] = cached  # now the most recently drafted
        cached.pending = known[agree:]
        return cached

    def _draft(self, active: list[tuple[_Cached, int]], drafts: dict[str, list[int]]) -> int:
        """Catch each cache up with its sequence, then draft greedily, one token per sequence per pass.
        Returns the number of drafting passes."""
        while long := [c for c, _ in active if len(c.pending) > CATCH_UP_CHUNK]:
            self._run([(c, c.pending[:CATCH_UP_CHUNK], False) for c in long])
            for c in long:
                c.pending = c.pending[CATCH_UP_CHUNK:]
        feed = [(c, c.pending, True) for c, _ in active]
        passes = 0
        while active:
            chosen = self._run(feed)
            passes += 1
            still, feed = [], []
            for (cached, k), token in zip(active, chosen):
                mine = drafts[cached.request_id]
                mine.append(token)
                if len(mine) < k:
                    still.append((cached, k))
                    feed.append((cached, [token], True))
            active = still
        return passes

    def _run(self, feed: list[tuple[_Cached, list[int], bool]]) -> list[int]:
        """One forward of the draft model: each cache computes its tokens; the argmax after each sampled one."""
        scheduled = []
        for cached, tokens, sample in feed:
            start = len(cached.token_ids)
            cached.token_ids.extend(tokens)
            others = (cached.block_ids,) * (self.num_groups - 1)
            scheduled.append(ScheduledSequence(cached, start, len(tokens), cached.block_ids, sample, others))
        step = self.runner.execute(SchedulerOutput(scheduled, sum(s.num_tokens for s in scheduled)))
        return torch.argmax(step.sampled, dim=-1).tolist()

    def _observe(self, seconds: float) -> None:
        if self._seconds_per_pass == 0.0:
            self._seconds_per_pass = seconds
        else:
            self._seconds_per_pass = SECONDS_DECAY * self._seconds_per_pass + (1 - SECONDS_DECAY) * seconds

