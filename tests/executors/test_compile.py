"""The torch.compile'd PyTorch layers (the fast CPU mode where the native decoder cannot run) against the
same model run eagerly."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import make_llm

from kvflow import SamplingParams
from kvflow.config import ModelConfig
from kvflow.executors.compile import compiler_available
from kvflow.executors.model_setup import load_model, set_threads
from kvflow.layers.attention.forward_context import forward_context
from kvflow.layers.attention.metadata import AttentionMetadata

# Only machines without g++ skip (CI has one); there compile="auto" runs eager, which every other test covers.
pytestmark = pytest.mark.skipif(not compiler_available(), reason="torch.compile on CPU needs a C++ compiler")


@pytest.fixture(scope="module")
def fast(tiny_checkpoints):
    """The fast CPU mode on the tiny random Llama (its weights int4-packed, float16 KV), compiled, and with the
    native decoder set aside so that every step runs the compiled PyTorch layers. (The default model's 30
    layers took 46 s to compile here; two layers run the same graphs' code.)"""
    set_threads(None)  # the count the engines below set: the compiled graphs are guarded on it
    loaded = load_model(ModelConfig(model=str(tiny_checkpoints["llama"]), compile="on", quantization="int4"))
    assert loaded.compiled is not None
    assert loaded.plan.mode == "fast" and loaded.quantization == "int4" and loaded.kv_cache_dtype == torch.float16
    loaded.native = None
    return loaded


def forward_logits(loaded, token_lists: list[list[int]], compiled: bool) -> torch.Tensor:
    model = loaded.model
    run = loaded.compiled if compiled else model.hidden_states
    with torch.inference_mode():
        ids = torch.tensor([t for seq in token_lists for t in seq])
        positions = torch.cat([torch.arange(len(seq)) for seq in token_lists])
        with forward_context(AttentionMetadata.for_prompts([len(s) for s in token_lists]), model.attention_layers):
            hidden = run(ids, positions)
        return model.compute_logits(hidden).float()


@pytest.mark.parametrize("lengths", [[1], [5], [3, 9, 40]], ids=["one token", "few rows", "prefill-sized"])
def test_compiled_logits_match_eager(fast, lengths):
    """Each graph (1 token, a few rows, many rows) against eager. Differences come from fused float32
    arithmetic rounding differently, then the packed layers rounding activations to bfloat16; they stay
    far below the gaps that decide greedy tokens in all but near ties."""
    seqs = [[3 + (i * 37 + j * 11) % 300 for j in range(n)] for i, n in enumerate(lengths)]
    eager = forward_logits(fast, seqs, compiled=False)
    compiled = forward_logits(fast, seqs, compiled=True)
    # Logits here are bfloat16 values (an ulp is 0.0625 to 0.125 at these magnitudes, ~15) and the
    # many-row path rounds activations to bfloat16 in each of 30 layers: a few ulps of drift is expected.
    assert (compiled - eager).abs().max().item() < 1.0
    agree = (compiled.argmax(-1) == eager.argmax(-1)).float().mean().item()
    assert agree >= 0.95, f"top-1 agreement {agree:.3f}"


def test_engine_runs_without_recompiling(fast):
    """After start-up warm-up, a workload of mixed prefill and decode steps of many sizes compiles nothing."""
    llm = make_llm(fast, max_num_batched_tokens=64)
    prompts = [{"prompt_token_ids": [3 + (i * 29 + j * 13) % 300 for j in range(5 + 9 * i)]} for i in range(7)]
    with torch.compiler.set_stance("fail_on_recompile"):
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    eager = make_llm(fast, max_num_batched_tokens=64)
    eager.engine.runner.executor.hidden_states = fast.model.hidden_states  # the same steps, eager
    again = eager.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outs, again))
    assert same >= 6, f"{same} of 7 greedy outputs equal eager's"
