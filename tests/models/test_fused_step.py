"""The fused C++ decoder step (kernels/decoder_step) against the same model run through its PyTorch layers.

Both paths multiply by the same packed weights with the same kernel; they differ in how norms, rotary
embedding and attention round, so logits agree closely rather than bitwise, and greedy text agrees."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import PROMPTS, make_llm

from kvflow import SamplingParams
from kvflow.kernels import decoder_step, packed_matmul
from kvflow.layers.attention.metadata import AttentionMetadata

# The fused step needs the packed kernel: a C++ compiler and AVX512-VNNI (CI's machines have both).
pytestmark = pytest.mark.skipif(not packed_matmul.available(), reason="needs a C++ compiler and AVX512-VNNI")

PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)


def run(loaded, fused: bool, prompts: list[str], counter: list[int] | None = None):
    """Greedy outputs with the fused step on or off; `counter` receives how many steps it ran."""
    model = loaded.model
    saved = model.fused_step
    taken = [0]
    if fused:
        original = saved.forward

        def counting(*args):
            out = original(*args)
            taken[0] += out is not None
            return out

        saved.forward = counting
    else:
        model.fused_step = None
    try:
        outs = make_llm(loaded).generate(prompts, PARAMS)
    finally:
        model.fused_step = saved
        if fused:
            del saved.forward
    if counter is not None:
        counter.append(taken[0])
    return outs


def test_fast_mode_loads_the_fused_step(fast_loaded):
    assert fast_loaded.model.fused_step is not None
    assert decoder_step.reason_unsupported(fast_loaded.model) is None


def test_same_greedy_text_and_close_logprobs(fast_loaded):
    prompts = PROMPTS[:6]
    steps: list[int] = []
    fused = run(fast_loaded, True, prompts, steps)
    eager = run(fast_loaded, False, prompts)
    assert steps[0] >= 23  # every decode step went through it (6 sequences decode together)
    for a, b in zip(fused, eager):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            shared = lp_a.keys() & lp_b.keys()
            assert shared
            # Norms, rotary and SiLU round differently in C++ and PyTorch, and the float16 cache rounds the
            # slightly different K/V; over 24 tokens that moved a logprob by up to 5.4e-3 nats here.
            assert max(abs(lp_a[t].logprob - lp_b[t].logprob) for t in shared) < 2e-2


def test_chat_answers_paris(fast_loaded):
    out = make_llm(fast_loaded).chat([{"role": "user", "content": "What is the capital of France?"}],
                                     SamplingParams(temperature=0, max_tokens=12))
    assert "Paris" in out[0].outputs[0].text, (out[0].outputs[0].text, torch.get_num_threads())


def test_float_model_is_not_taken(default_loaded):
    assert "not packed" in decoder_step.reason_unsupported(default_loaded.model)


def test_position_past_the_rotary_table_is_refused_before_any_write(fast_loaded):
    llm = make_llm(fast_loaded)  # binds a cache
    llm.generate(["hello"], SamplingParams(max_tokens=1))
    model = fast_loaded.model
    meta = AttentionMetadata.for_prompts([1])
    meta.slot_mapping = torch.zeros(1, dtype=torch.int64)
    meta.block_tables = torch.zeros(1, 1, dtype=torch.int32)
    before = model.layers[0].self_attn.k_cache.clone()
    with pytest.raises(ValueError, match="past the model's context"):
        model.fused_step.forward(torch.tensor([1]), torch.tensor([model.rotary.cos.shape[0]]), meta)
    assert torch.equal(model.layers[0].self_attn.k_cache, before)
    assert model.fused_step.forward(torch.tensor([1]), torch.tensor([0]), AttentionMetadata.for_prompts([1])) is None
