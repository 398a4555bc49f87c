"""The fast mode's many-row forward (kernels/many_rows: oneDNN bfloat16 matmuls with the C++ elementwise
ops between them and every row through the paged attention kernel) against the PyTorch layers.

Both multiply the same bfloat16 weight copies; they differ in how norms, rotary, SiLU and attention round
(the C++ side in one pass, PyTorch op by op), so logits agree closely and greedy text agrees."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import make_llm

from kvflow import SamplingParams
from kvflow.config import ModelConfig
from kvflow.kernels import many_rows, packed_matmul
from kvflow.layers.attention.metadata import AttentionMetadata
from kvflow.layers.linear import cpu_has_amx
from kvflow.loader.model_loader import load_model

# The fast mode makes the bfloat16 copies only where AMX runs them; CI's machines have it (and g++).
needs_fast_mode = pytest.mark.skipif(not (packed_matmul.available() and cpu_has_amx()),
                                     reason="needs a C++ compiler, AVX512-VNNI and AMX")

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
TOLERANCE = 0.15  # nats, between the two paths' logprobs (see the first test)
LONG = ("The history of the Roman Empire began with the founding of the city and grew over centuries of war, "
        "trade and law. Historians still argue about why it fell, and the reasons they give include")


def generate(loaded, prompts, use_many_rows: bool, monkeypatch, **options):
    """Greedy outputs with many-row steps through kernels/many_rows or through the PyTorch layers, and
    how many steps many_rows ran."""
    calls = [0]
    original = many_rows.forward

    def counting(*args):
        calls[0] += 1
        return original(*args)

    monkeypatch.setattr(many_rows, "forward", counting)
    monkeypatch.setattr(many_rows, "MIN_ROWS", many_rows.MIN_ROWS if use_many_rows else 1 << 30)
    outs = make_llm(loaded, enable_prefix_caching=False, **options).generate(prompts, PARAMS)
    return outs, calls[0]


def assert_close_outputs(a_outs, b_outs, tolerance: float):
    for a, b in zip(a_outs, b_outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            shared = lp_a.keys() & lp_b.keys()
            assert shared
            assert max(abs(lp_a[t].logprob - lp_b[t].logprob) for t in shared) < tolerance


@needs_fast_mode
def test_default_model_prefill_matches_pytorch_layers(fast_loaded, monkeypatch):
    prompts = [LONG, LONG.replace("Roman", "Ottoman") + " the economy", "Hello " * 70]  # prefilled as one step
    ours, calls = generate(fast_loaded, prompts, True, monkeypatch)
    theirs, none = generate(fast_loaded, prompts, False, monkeypatch)
    assert calls >= 1 and none == 0
    # Both round activations to bfloat16 before every matmul. On 17 long prompts each path's first-token
    # logprobs sat 0.06 nats from the float32 model's on average (0.19 at most), the two paths alike.
    assert_close_outputs(ours, theirs, TOLERANCE)


@needs_fast_mode
def test_chunked_prefill_with_cached_context(fast_loaded, monkeypatch):
    """Chunks of 64 rows: every chunk after the first attends to context already in the cache."""
    prompts = [" ".join([LONG] * 4)]  # about 150 tokens: chunks of 64, 64 and the rest
    ours, calls = generate(fast_loaded, prompts, True, monkeypatch, max_num_batched_tokens=64)
    theirs, _ = generate(fast_loaded, prompts, False, monkeypatch, max_num_batched_tokens=64)
    assert calls >= 2
    assert_close_outputs(ours, theirs, TOLERANCE)


@needs_fast_mode
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_bias_and_head_norms(tiny_checkpoints, arch, monkeypatch):
    """Qwen2's q/k/v bias and Qwen3's per-head q/k norms (int4-packed tiny models in the fast mode)."""
    loaded = load_model(ModelConfig(model=str(tiny_checkpoints[arch]), device="cpu", quantization="int4"))
    assert loaded.model.fused_step is not None
    prompts = [{"prompt_token_ids": list(range(3, 3 + 90))}, {"prompt_token_ids": list(range(200, 270))}]
    ours, calls = generate(loaded, prompts, True, monkeypatch, kv_cache_memory=16 << 20)
    theirs, _ = generate(loaded, prompts, False, monkeypatch, kv_cache_memory=16 << 20)
    assert calls >= 1
    assert_close_outputs(ours, theirs, TOLERANCE)


# Only machines without g++ skip (CI has one); there the many-row path never runs.
@pytest.mark.skipif(many_rows._ops() is None, reason="needs a C++ compiler")
def test_elementwise_ops_against_torch():
    add_norm, _, silu_mul = many_rows._ops()
    rows, width, inter = 70, 100, 88  # not multiples of 16: the scalar tails run too
    torch.manual_seed(0)
    hidden = torch.randn(rows, width)
    delta = torch.randn(rows, width).to(torch.bfloat16)
    weight = torch.rand(width) + 0.5
    expected_hidden = hidden + delta.float()
    expected = torch.nn.functional.rms_norm(expected_hidden, (width,), weight, 1e-5)
    out = torch.empty(rows, width, dtype=torch.bfloat16)
    add_norm(hidden.data_ptr(), delta.data_ptr(), weight.data_ptr(), rows, width, 1e-5, out.data_ptr(), None, 2)
    assert torch.equal(hidden, expected_hidden)
    torch.testing.assert_close(out.float(), expected, rtol=8e-3, atol=1e-5)  # bfloat16 output
    out32 = torch.empty(rows, width)
    add_norm(hidden.data_ptr(), None, weight.data_ptr(), rows, width, 1e-5, None, out32.data_ptr(), 1)
    torch.testing.assert_close(out32, expected, rtol=1e-5, atol=1e-6)

    gate_up = torch.randn(rows, 2 * inter).to(torch.bfloat16)
    act = torch.empty(rows, inter, dtype=torch.bfloat16)
    silu_mul(gate_up.data_ptr(), rows, inter, act.data_ptr(), 2)
    g, u = gate_up.float().chunk(2, dim=-1)
    torch.testing.assert_close(act.float(), torch.nn.functional.silu(g) * u, rtol=8e-3, atol=1e-5)


@needs_fast_mode
def test_position_past_the_rotary_table_is_refused_before_any_write(fast_loaded):
    make_llm(fast_loaded).generate(["hello"], SamplingParams(max_tokens=1))  # binds a cache
    model = fast_loaded.model
    rows = many_rows.MIN_ROWS
    meta = AttentionMetadata.for_prompts([rows])
    meta.slot_mapping = torch.arange(rows, dtype=torch.int64)
    meta.block_tables = torch.arange(rows, dtype=torch.int32)[None]
    positions = torch.arange(rows, dtype=torch.int64)
    positions[-1] = model.rotary.cos.shape[0]
    before = model.layers[0].self_attn.k_cache.clone()
    with pytest.raises(ValueError, match="past the model's context"):
        model.fused_step.forward(torch.ones(rows, dtype=torch.int64), positions, meta)
    assert torch.equal(model.layers[0].self_attn.k_cache, before)
