"""Which part of each weight a tensor-parallel rank keeps, and where the ranks' partial results are summed.

Megatron's split, as vLLM and SGLang make it: each rank keeps a contiguous share of the attention heads and
of the MLP's hidden columns.
  q/k/v, gate/up   "column parallel": the rank's rows of the weight (its heads' rows, its MLP columns'
                   rows); its output is the rank's share of the heads or hidden columns, with no exchange.
  o_proj, down     "row parallel": the rank's input columns; its output is a partial sum over the hidden
                   size, and one all_reduce per layer output joins them (after o_proj, after the whole MLP,
                   so a mixture of experts sums its experts locally, then once across ranks).
Norms stay whole on every rank. The embedding and the output head are split by vocabulary rows where it
divides evenly (vocab_parallel.py), else kept whole. With fewer KV heads than ranks, each
KV head is kept by the ranks whose query heads read it (vLLM replicates them the same way).

Weights are cut as they load (`WeightSharder`): a float tensor after its name is known, a packed GGUF tensor
before it is packed (whole quantization blocks along its input; a width that splits a block loads as float).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import nn

from kvflow.distributed.group import TensorParallelGroup
from kvflow.distributed.vocab_parallel import VocabParallelEmbedding, VocabParallelHead
from kvflow.models.arch import ArchConfig

Segments = list[tuple[int, int]]  # (start, count) along one dimension of the whole tensor


@dataclasses.dataclass(frozen=True)
class HeadShare:
    """The heads a rank keeps: query heads [q_start, q_start + q_count), KV heads likewise."""

    q_start: int
    q_count: int
    kv_start: int
    kv_count: int


def check_divisible(arch: ArchConfig, world: int) -> None:
    """Refuse a size that does not split the model's heads and MLP evenly, naming what does not divide."""
    if world < 1:
        raise ValueError(f"tensor-parallel size must be >= 1, got {world}")
    problems = []
    if arch.num_heads % world:
        problems.append(f"its {arch.num_heads} attention heads")
    kv = arch.num_kv_heads
    if kv % world and world % kv:
        problems.append(f"its {kv} KV heads (nor is {world} a multiple of them)")
    if arch.intermediate_size % world:
        problems.append(f"its MLP width {arch.intermediate_size}")
    if arch.num_experts and arch.moe_intermediate_size % world:
        problems.append(f"its experts' width {arch.moe_intermediate_size}")
    if problems:
        raise ValueError(f"tensor-parallel size {world} does not divide {' or '.join(problems)} "
                         f"({arch.architecture}); choose a size that divides the heads")


def head_share(arch: ArchConfig, rank: int, world: int) -> HeadShare:
    q_count = arch.num_heads // world
    kv = arch.num_kv_heads
    if kv >= world:
        kv_count, kv_start = kv // world, rank * (kv // world)
    else:  # fewer KV heads than ranks: the one this rank's query heads read
        kv_count, kv_start = 1, rank * q_count // (arch.num_heads // kv)
    return HeadShare(rank * q_count, q_count, kv_start, kv_count)


def shard_arch(arch: ArchConfig, rank: int, world: int) -> ArchConfig:
    """The shape of one rank's model: its heads and MLP columns; every other size whole."""
    check_divisible(arch, world)
    share = head_share(arch, rank, world)
    return dataclasses.replace(
        arch, num_heads=share.q_count, num_kv_heads=share.kv_count,
        intermediate_size=arch.intermediate_size // world,
        moe_intermediate_size=arch.moe_intermediate_size // world,
        vocab_shard=vocab_share(arch, rank, world),
    )


def vocab_share(arch: ArchConfig, rank: int, world: int) -> tuple[int, int] | None:
    """The (first row, rows) of the vocabulary a rank keeps (vocab_parallel.py); None where the vocabulary
    does not divide evenly, and every rank keeps it whole."""
    if world == 1 or arch.vocab_size % world:
        return None
    rows = arch.vocab_size // world
    return rank * rows, rows


class WeightSharder:
    """Cuts checkpoint tensors (kvflow's names, without "model.") to one rank's share."""

    def __init__(self, arch: ArchConfig, rank: int, world: int) -> None:
        self.arch, self.rank, self.world = arch, rank, world
        self.share = head_share(arch, rank, world)
        self.vocab = vocab_share(arch, rank, world)

    # --- where a tensor is cut --------------------------------------------------------------------
    def row_segments(self, name: str, rows: int) -> Segments | None:
        """The whole tensor's rows this rank keeps, for a column-parallel weight (or its bias)."""
        proj = name.split(".")[-2] if "." in name else name
        a, s, hd = self.arch, self.share, self.arch.head_dim
        q_rows = (s.q_start * hd, s.q_count * hd)
        kv_rows = (s.kv_start * hd, s.kv_count * hd)
        if proj == "q_proj":
            return [q_rows]
        if proj in ("k_proj", "v_proj"):
            return [kv_rows]
        if proj == "qkv_proj":
            q_size, kv_size = a.num_heads * hd, a.num_kv_heads * hd
            return [q_rows, (q_size + kv_rows[0], kv_rows[1]), (q_size + kv_size + kv_rows[0], kv_rows[1])]
        if proj in ("embed_tokens", "lm_head"):
            return None if self.vocab is None else [self.vocab]
        if proj in ("gate_proj", "up_proj"):
            return [self._even(rows)]
        if proj == "gate_up_proj":
            half = rows // 2
            start, count = self._even(half)
            return [(start, count), (half + start, count)]
        return None

    def column_segment(self, name: str, columns: int) -> tuple[int, int] | None:
        """The input columns this rank keeps, for a row-parallel weight."""
        proj = name.split(".")[-2]
        if proj == "o_proj":
            hd = self.arch.head_dim
            return self.share.q_start * hd, self.share.q_count * hd
        if proj == "down_proj":
            return self._even(columns)
        return None

    def _even(self, size: int) -> tuple[int, int]:
        count = size // self.world
        return self.rank * count, count

    # --- float tensors ------------------------------------------------------------------------------
    def narrow(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name.endswith(".sinks"):  # gpt-oss: one per query head, so this rank's heads'
            return tensor.narrow(0, self.share.q_start, self.share.q_count)
        if not name.endswith((".weight", ".bias")):
            return tensor
        rows = self.row_segments(name, tensor.shape[0])
        if rows is not None:
            return torch.cat([tensor.narrow(0, start, count) for start, count in rows])
        cols = self.column_segment(name, tensor.shape[-1])
        if cols is None:
            return tensor
        if tensor.dim() == 1:  # a row-parallel bias is added once, after the sum: rank 0 keeps it
            return tensor if self.rank == 0 else torch.zeros_like(tensor)
        return tensor.narrow(1, *cols)

    # --- packed GGUF tensors ------------------------------------------------------------------------
    def narrow_raw(self, raw):
        """A GGUF RawTensor cut to this rank's share, or None where the cut would split quantization
        blocks (that tensor then loads through the float path, cut there)."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        name = raw.hf_name.removeprefix("model.")
        data = raw.data
        rows = self.row_segments(name, data.shape[0])
        if rows is not None:
            heads = raw.rope_heads
            if heads is not None:  # llama.cpp's rope order is per head: the rank's heads keep theirs
                heads = self.share.q_count if name.endswith("q_proj.weight") else self.share.kv_count
            part = data[rows[0][0]: rows[0][0] + rows[0][1]] if len(rows) == 1 else np.concatenate(
                [data[start: start + count] for start, count in rows])
            return dataclasses.replace(raw, data=part, rope_heads=heads)
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[raw.qtype]]
        columns = data.shape[1] // type_size * block
        cols = self.column_segment(name, columns)
        if cols is None:
            return raw
        start, count = cols
        if start % block or count % block:
            return None
        blocks = data.reshape(data.shape[0], -1, type_size)[:, start // block: (start + count) // block]
        return dataclasses.replace(raw, data=np.ascontiguousarray(blocks).reshape(data.shape[0], -1))


def install_reductions(model: nn.Module, group: TensorParallelGroup) -> None:
    """Sum each decoder layer's attention output (after o_proj) and MLP output across the ranks; with the
    vocabulary split, sum the embedding's lookups and join the head's logits."""
    def summed(_module, _inputs, output):
        return group.all_reduce(output.contiguous())

    for layer in model.layers:
        layer.self_attn.o_proj.register_forward_hook(summed)
        layer.mlp.register_forward_hook(summed)
    if model.arch.vocab_shard is not None:
        start, rows = model.arch.vocab_shard
        model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, start, rows, group)
        model.lm_head = VocabParallelHead(model.lm_head, group)
