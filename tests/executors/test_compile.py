"""The torch.compile'd PyTorch layers (the fast CPU mode where the native decoder cannot run) against the
same model run eagerly."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import PROMPTS, make_llm

from kvflow import SamplingParams
from kvflow.config import ModelConfig
from kvflow.executors.compile import compiler_available
from kvflow.executors.model_setup import load_model
from kvflow.layers.attention.forward_context import forward_context
from kvflow.layers.attention.metadata import AttentionMetadata

# Only machines without g++ skip (CI has one); there compile="auto" runs eager, which every other test covers.
pytestmark = pytest.mark.skipif(not compiler_available(), reason="torch.compile on CPU needs a C++ compiler")


@pytest.fixture(scope="module")
def fast():
    """The default configuration on CPU (packed Q4_1/Q8_0 weights, float16 KV), compiled, and with the
    native decoder set aside so that every step runs the compiled PyTorch layers."""
    loaded = load_model(ModelConfig(compile="on", max_model_len=2048))
    assert loaded.compiled is not None
    assert loaded.quantization == "gguf" and loaded.kv_cache_dtype == torch.float16
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
    seqs = [fast.tokenizer.encode(" ".join([PROMPTS[i]] * n))[:n] for i, n in enumerate(lengths)]
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
    with torch.compiler.set_stance("fail_on_recompile"):
        outs = llm.generate(PROMPTS[:7], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                        SamplingParams(temperature=0, max_tokens=12))
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    assert "Paris" in chat[0].outputs[0].text
