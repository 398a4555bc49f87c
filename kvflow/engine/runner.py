"""ModelRunner: turns a SchedulerOutput into one forward pass over a flat batch and returns logits.

Every prefill chunk and decode token of the step goes into one 1-D token tensor, with positions,
cache slots, per-sequence query offsets, context lengths and block tables. The runner owns the KV cache;
how the step then runs (which kernels, which device path) is its executor's business (kvflow/executors).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from kvflow.config import CacheConfig
from kvflow.distributed.group import TensorParallelError
from kvflow.engine.kv_cache_alloc import (
    allocate_kv_cache,
    bytes_per_block,
    default_kv_cache_memory,
    group_num_blocks,
)
from kvflow.executors.model_setup import LoadedModel, build_executor
from kvflow.executors.plan import DTYPES
from kvflow.kernels import kv_int8
from kvflow.layers.attention.metadata import AttentionMetadata

log = logging.getLogger("kvflow")

GRAPH_RESERVE = 1 << 30  # CUDA bytes kept out of the default KV budget for graph pools and workspaces


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the flat batch whose logits are returned: sampled ones first
    sample_request_ids: list[str]  # per sampled row (a verify step's sequence has several, in a run)
    prompt_spans: list[PromptSpan]  # then the prompt rows whose logits are wanted, in this order
    # Rows that hold draft tokens (speculative decoding). Executors whose arithmetic depends on a step's
    # row count decide by the rows without them, so a verified token is computed as plain decoding would.
    num_draft_rows: int = 0
    # Sequences computing one known token (decoding; their drafts aside): executors choose their arithmetic
    # for these as in a step of decodes alone, whatever prompt chunks run beside them.
    num_decode_rows: int = 0


@dataclass
class PromptSpan:
    """Rows of a step's logits that score prompt tokens: the logits at positions [start, start + count) of
    request_id, each of which predicts the prompt token one position later."""

    request_id: str
    start: int
    count: int


@dataclass
class StepLogits:
    """What a step returns: float32 logits [sampled rows + prompt rows, vocab]."""

    logits: torch.Tensor
    sample_request_ids: list[str]
    prompt_spans: list[PromptSpan]

    @property
    def sampled(self) -> torch.Tensor:
        n = len(self.sample_request_ids)
        return self.logits if self.logits.shape[0] == n else self.logits[:n]


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        cache_config: CacheConfig,
        attention_backend: str = "auto",
        max_num_seqs: int = 64,
        cuda_graphs: bool = True,
        max_num_batched_tokens: int = 2048,
        group_blocks: list[int] | None = None,
    ) -> None:
        """group_blocks: blocks per KV cache group, where they must equal another runner's (a
        tensor-parallel rank's cache is laid out as rank 0's); None: sized from cache_config."""
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.block_size = cache_config.block_size
        if cache_config.kv_cache_dtype == "auto":
            self.kv_dtype = loaded.kv_cache_dtype or loaded.dtype
        elif cache_config.kv_cache_dtype == "int8":
            if self.device.type != "cpu":
                raise ValueError("kv_cache_dtype int8 runs on the CPU kernels only, for now")
            self.kv_dtype = torch.int8
        else:
            self.kv_dtype = DTYPES[cache_config.kv_cache_dtype]
        arch = loaded.arch
        # Bytes a K or V value takes in the cache (an 8-bit cache's scales included): for rooflines.
        self.kv_element_bytes = kv_int8.element_bytes(self.kv_dtype, arch.head_dim)
        self.group_windows = arch.kv_group_windows  # KV cache groups (engine/kv_cache_groups.py)
        if group_blocks is not None:
            self.group_blocks = list(group_blocks)
        elif cache_config.num_blocks is None:
            memory = cache_config.kv_cache_memory or default_kv_cache_memory(self.device, GRAPH_RESERVE)
            self.group_blocks = group_num_blocks(memory, arch, self.block_size, self.kv_dtype, max_num_seqs,
                                                 max_num_batched_tokens)
            cache_config.num_blocks = self.group_blocks[0]
        else:
            self.group_blocks = [cache_config.num_blocks] * len(self.group_windows)
        self.num_blocks = self.group_blocks[0]
        if min(self.group_blocks) < 1:
            per_block = bytes_per_block(arch, self.block_size, self.kv_dtype)
            raise ValueError(f"kv_cache_memory is too small for even one block ({per_block} bytes)")
        self.kv_caches = allocate_kv_cache(arch, self.group_blocks, self.block_size, self.kv_dtype, self.device)
        # Rank 0 of a tensor-parallel group hands each step to the other ranks first (engine.LLMEngine sets it).
        self.tp_driver = None
        max_blocks = -(-loaded.max_model_len // self.block_size)
        self.executor = build_executor(loaded, self.kv_caches, attention_backend, max_num_seqs, max_blocks, cuda_graphs)
        kv_bytes = sum(k.nbytes + v.nbytes for k, v in self.kv_caches)
        log.info(
            "KV cache: %s blocks of %d tokens = %d tokens (%.1f MiB, %s)",
            " + ".join(f"{n} ({f'window {w}' if w else 'global'})" for n, w in zip(self.group_blocks,
                                                                                   self.group_windows))
            if len(self.group_blocks) > 1 else self.num_blocks,
            self.block_size, self.capacity_tokens, kv_bytes / 2**20, str(self.kv_dtype).split(".")[-1],
        )

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def prepare(self, scheduled) -> StepInputs:
        # Plain lists, one tensor each at the end: a decode step's few numbers cost more as arrays.
        tokens: list[int] = []
        positions: list[int] = []
        query_starts, seq_lens, logits_indices, sample_ids = [0], [], [], []
        prompt_rows: list[int] = []
        spans: list[PromptSpan] = []
        draft_rows = decode_rows = 0
        for seq in scheduled:
            req, start, n = seq.request, seq.start, seq.num_tokens
            draft_rows += len(seq.draft_token_ids)
            decode_rows += n - len(seq.draft_token_ids) == 1
            if req.prompt_logits_from is not None:
                # The last prompt position predicts the first output token: that row is the sampled one.
                first, end = max(start, req.prompt_logits_from), min(start + n, req.num_prompt_tokens - 1)
                if end > first:
                    prompt_rows.extend(range(len(tokens) + first - start, len(tokens) + end - start))
                    spans.append(PromptSpan(req.request_id, first, end - first))
            tokens.extend(seq.token_ids if seq.draft_token_ids else req.all_token_ids[start : start + n])
            positions.extend(range(start, start + n))
            query_starts.append(query_starts[-1] + n)
            seq_lens.append(start + n)
            if seq.sample:
                # A verify step samples its last known position and every draft's: one row each, in order.
                rows = 1 + len(seq.draft_token_ids)
                logits_indices.extend(range(len(tokens) - rows, len(tokens)))
                sample_ids.extend([req.request_id] * rows)
        logits_indices += prompt_rows
        dev = self.device
        common = dict(query_start_loc=torch.tensor(query_starts, dtype=torch.int32, device=dev),
                      seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
                      query_lens_cpu=[seq.num_tokens for seq in scheduled], seq_lens_cpu=seq_lens)
        metas = [AttentionMetadata(**common, **self._cache_places(scheduled, g)) for g in range(len(self.group_windows))]
        meta = metas[0]
        meta.group_metas = metas[1:]
        return StepInputs(
            input_ids=torch.tensor(tokens, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            meta=meta,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=dev),
            sample_request_ids=sample_ids,
            prompt_spans=spans,
            num_draft_rows=draft_rows,
            num_decode_rows=decode_rows,
        )

    def _cache_places(self, scheduled, group: int) -> dict:
        """Slots and block tables of the step's sequences in one KV group."""
        bs = self.block_size
        slots: list[int] = []
        tables = [seq.block_ids if group == 0 else seq.other_block_ids[group - 1] for seq in scheduled]
        for seq, table in zip(scheduled, tables):
            if seq.num_tokens == 1:  # a decode: one slot
                slots.append(table[seq.start // bs] * bs + seq.start % bs)
            else:
                pos = np.arange(seq.start, seq.start + seq.num_tokens)
                slots.extend((np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs).tolist())
        table_arr = np.zeros((len(tables), max(max(map(len, tables), default=1), 1)), dtype=np.int32)
        for i, t in enumerate(tables):
            table_arr[i, : len(t)] = t
        dev = self.device
        return dict(slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
                    block_tables=torch.from_numpy(table_arr).to(dev), host_block_tables=tables)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write for forked sequences: duplicate a partly filled block before anyone writes to it."""
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    @torch.inference_mode()
    def execute(self, scheduler_output) -> StepLogits:
        """Run one step: the logits of its sampled sequences, then of the prompt rows asked for."""
        inputs = self.prepare(scheduler_output.scheduled) if scheduler_output.scheduled else None
        if self.tp_driver is not None:
            self.tp_driver.send_step(scheduler_output.block_copies, inputs)
        self.copy_blocks(scheduler_output.block_copies)
        if inputs is None:
            return StepLogits(torch.empty(0, self.loaded.arch.vocab_size), [], [])
        try:
            logits = self.executor.execute(inputs)
        except TensorParallelError as exc:  # a rank died mid-step: the group is done
            if self.tp_driver is None:  # a group this runner does not lead (none should reach here)
                raise
            raise TensorParallelError(self.tp_driver.ranks.fail(str(exc))) from None
        return StepLogits(logits, inputs.sample_request_ids, inputs.prompt_spans)

    @torch.inference_mode()
    def run_shard_step(self, block_copies: list[tuple[int, int]], inputs: StepInputs | None) -> None:
        """A tensor-parallel rank other than 0: rank 0's step on this rank's shard (its sums join rank 0's;
        so do its rows of the logits, which rank 0 alone samples from)."""
        self.copy_blocks(block_copies)
        if inputs is None:
            return
        if self.loaded.arch.vocab_shard is not None:
            self.executor.execute(inputs)
        else:
            self.executor.bind()
            self.executor.forward(inputs.input_ids, inputs.positions, inputs.meta)
