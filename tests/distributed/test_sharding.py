"""What each tensor-parallel rank keeps of a weight, checked without starting any rank: a packed GGUF tensor cut
by whole quantization blocks dequantizes to exactly the cut of the whole tensor, KV heads are shared out (or
kept by several ranks) as the query heads that read them are, and sizes that do not divide are refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from kvflow.distributed.sharding import WeightSharder, check_divisible, head_share, shard_arch
from kvflow.loader import gguf_file
from kvflow.models.arch import ArchConfig

ARCH = ArchConfig(architecture="LlamaForCausalLM", vocab_size=100, hidden_size=64, intermediate_size=96,
                  num_layers=1, num_heads=8, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
                  rope_scaling=None, max_position_embeddings=64, tie_word_embeddings=False)


def _dequantized(raw) -> torch.Tensor:
    return torch.from_numpy(dequantize(raw.data, GGMLQuantizationType[raw.qtype]).copy())


def test_packed_tensors_cut_by_blocks_dequantize_to_the_cut_of_the_whole(default_gguf):
    reader = gguf_file.open_gguf(default_gguf)
    cfg = gguf_file.hf_config_from_gguf(reader, default_gguf)
    arch = ArchConfig.from_hf_config(cfg)
    layer0 = [r for r in gguf_file.iter_gguf_raw(reader, cfg) if r.hf_name.startswith("model.layers.0.")]
    assert {r.hf_name.split(".")[-2] for r in layer0} >= {"q_proj", "k_proj", "o_proj", "gate_proj", "down_proj"}
    for rank in range(3):
        sharder = WeightSharder(arch, rank, 3)
        for raw in layer0:
            cut = sharder.narrow_raw(raw)
            assert cut is not None, f"{raw.hf_name} ({raw.qtype}) should cut on block boundaries"
            whole, name = _dequantized(raw), raw.hf_name.removeprefix("model.")
            rows = sharder.row_segments(name, whole.shape[0])
            if rows is not None:
                expected = torch.cat([whole[start: start + count] for start, count in rows])
            else:
                start, count = sharder.column_segment(name, whole.shape[1])
                expected = whole[:, start: start + count]
            assert torch.equal(_dequantized(cut), expected), raw.hf_name
            if raw.rope_heads is not None:  # llama.cpp's per-head row order is undone with the rank's heads
                assert cut.rope_heads == (3 if "q_proj" in name else 1)


def test_kv_heads_go_with_the_query_heads_that_read_them():
    assert [dataclasses.astuple(head_share(ARCH, r, 2)) for r in range(2)] == [(0, 4, 0, 1), (4, 4, 1, 1)]
    # Fewer KV heads than ranks: each is kept by the two ranks whose query heads read it.
    assert [(s.q_start, s.kv_start) for s in (head_share(ARCH, r, 4) for r in range(4))] == \
        [(0, 0), (2, 0), (4, 1), (6, 1)]
    shard = shard_arch(ARCH, 3, 4)
    assert (shard.num_heads, shard.num_kv_heads, shard.intermediate_size) == (2, 1, 24)


def test_fused_checkpoint_tensors_are_cut_part_by_part():
    sharder = WeightSharder(ARCH, 1, 2)
    q, k, v = torch.randn(64, 64), torch.randn(16, 64), torch.randn(16, 64)
    cut = sharder.narrow("layers.0.self_attn.qkv_proj.weight", torch.cat([q, k, v]))
    assert torch.equal(cut, torch.cat([q[32:], k[8:], v[8:]]))
    gate, up = torch.randn(96, 64), torch.randn(96, 64)
    assert torch.equal(sharder.narrow("layers.0.mlp.gate_up_proj.weight", torch.cat([gate, up])),
                       torch.cat([gate[48:], up[48:]]))
    down = torch.randn(64, 96)
    assert torch.equal(sharder.narrow("layers.0.mlp.down_proj.weight", down), down[:, 48:])
    norm = torch.randn(64)
    assert sharder.narrow("layers.0.input_layernorm.weight", norm) is norm


@pytest.mark.parametrize("change, message", [
    (dict(num_heads=9, num_kv_heads=3), "does not divide its 9 attention heads or its 3 KV heads"),
    (dict(intermediate_size=102), "its MLP width 102"),
])
def test_sizes_that_do_not_divide_are_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        check_divisible(dataclasses.replace(ARCH, **change), 4)


def test_the_vocabulary_is_split_by_rows_where_it_divides(default_gguf):
    assert [shard_arch(ARCH, r, 2).vocab_shard for r in range(2)] == [(0, 50), (50, 50)]
    odd = dataclasses.replace(ARCH, vocab_size=101)
    assert shard_arch(odd, 1, 2).vocab_shard is None  # 101 rows do not halve: every rank keeps them all
    assert WeightSharder(odd, 1, 2).row_segments("embed_tokens.weight", 101) is None
    # The default model's packed embedding table (its head's too: they are tied), cut to each rank's rows.
    reader = gguf_file.open_gguf(default_gguf)
    cfg = gguf_file.hf_config_from_gguf(reader, default_gguf)
    arch = ArchConfig.from_hf_config(cfg)
    table = next(r for r in gguf_file.iter_gguf_raw(reader, cfg) if r.hf_name == "model.embed_tokens.weight")
    whole = _dequantized(table)
    rows = arch.vocab_size // 3
    for rank in range(3):
        cut = WeightSharder(arch, rank, 3).narrow_raw(table)
        assert torch.equal(_dequantized(cut), whole[rank * rows: (rank + 1) * rows])
