"""The mixture-of-experts layer (kvflow/models/moe.py): routing as transformers does it, only the chosen
experts run, and the experts stay off the bfloat16 copies."""

from __future__ import annotations

import torch

from kvflow.config import ModelConfig
from kvflow.executors.model_setup import load_model, make_bf16_copies
from kvflow.models.moe import SparseMoE


def test_a_decode_token_runs_only_its_experts(tiny_checkpoints):
    loaded = load_model(ModelConfig(model=str(tiny_checkpoints["mixtral"]), dtype="float32", device="cpu"))
    moe = loaded.model.layers[0].mlp
    assert isinstance(moe, SparseMoE) and moe.top_k == 2 and len(moe.experts) == 4
    ran: list[int] = []
    hooks = [e.register_forward_hook(lambda m, args, out, i=i: ran.append(i)) for i, e in enumerate(moe.experts)]
    x = torch.randn(1, loaded.arch.hidden_size)
    try:
        out = moe(x)
    finally:
        for h in hooks:
            h.remove()
    chosen, weights = moe.route(x)
    assert sorted(ran) == sorted(chosen[0].tolist())  # two of four experts read, each once
    assert torch.allclose(weights.sum(-1), torch.ones(1))  # Mixtral renormalises the top two
    expected = sum(w * moe.experts[e](x) for e, w in zip(chosen[0].tolist(), weights[0]))
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_experts_and_router_get_no_bfloat16_copies(tiny_checkpoints):
    loaded = load_model(ModelConfig(model=str(tiny_checkpoints["qwen3_moe"]), dtype="float32", device="cpu",
                                    mode="exact"))
    make_bf16_copies(loaded.model, min_rows=32)
    layer = loaded.model.layers[0]
    assert layer.self_attn.qkv_proj.weight_bf16 is not None
    assert layer.mlp.gate.weight_bf16 is None
    assert all(e.gate_up_proj.weight_bf16 is None and e.down_proj.weight_bf16 is None for e in layer.mlp.experts)


def test_a_decode_token_through_two_kernel_calls_is_bitwise_the_batched_path(tiny_checkpoints):
    loaded = load_model(ModelConfig(model=str(tiny_checkpoints["qwen3_moe"]), device="cpu", mode="exact",
                                    quantization="int4"))
    moe = loaded.model.layers[0].mlp
    assert moe._packed_experts() is not None
    x = torch.randn(5, loaded.arch.hidden_size)
    with torch.inference_mode():
        batched = moe(x)  # five rows: the per-expert path
        alone = torch.cat([moe(x[i : i + 1]) for i in range(5)])  # one row each: the two-call path
    assert torch.equal(batched, alone)
