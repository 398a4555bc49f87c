"""Sliding-window layers keep only their window in the KV cache, and prefix caching still serves a long
context whose end changed: on a tiny Gemma 3 (two 20-token sliding layers, one global layer) and a tiny
Mistral whose every layer slides (window 24)."""

from __future__ import annotations

import pytest
import torch
from models.test_parity import random_prompts, reference_greedy
from tiny_models import make_tiny_checkpoint

from kvflow import LLM, SamplingParams
from kvflow.config import ModelConfig
from kvflow.engine.kv_cache_groups import KVCacheGroups
from kvflow.executors.model_setup import load_model

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma3(tiny_checkpoints):
    return load_model(ModelConfig(model=str(tiny_checkpoints["gemma3"]), device="cpu", mode="exact"))


@pytest.fixture(scope="module")
def windowed_mistral(tmp_path_factory):
    folder = make_tiny_checkpoint("mistral", tmp_path_factory.mktemp("mistral_sw") / "m", sliding_window=24)
    return folder, load_model(ModelConfig(model=str(folder), device="cpu", mode="exact"))


def run_watching_blocks(llm: LLM, prompt: list[int], params=GREEDY) -> tuple[list[int], list[list[int]]]:
    """Greedy tokens of one prompt, and after every step the blocks it holds in each KV group."""
    engine = llm.engine
    rid = engine.add_request(None, prompt, params)
    kv = engine.scheduler.kv_cache_manager
    groups = kv.groups if isinstance(kv, KVCacheGroups) else [kv]
    held, tokens = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
        if engine.has_unfinished_requests():
            held.append([g.num_held_blocks(engine.sequences[rid].request.request_id) for g in groups])
    return tokens, held


def test_sliding_layers_hold_only_their_window(gemma3):
    """A 400-token prompt in 64-token chunks, then 40 tokens: the sliding group never holds more than the
    window and a chunk need, while the global group holds the whole context."""
    llm = LLM(loaded_model=gemma3, kv_cache_memory=16 << 20, max_num_batched_tokens=64)
    (prompt,) = random_prompts(gemma3.arch.vocab_size, [400])
    _, held = run_watching_blocks(llm, prompt)
    bs = 16
    window_bound = -(-(20 - 1 + 64) // bs) + 1
    assert max(h[1] for h in held) <= window_bound
    assert max(h[0] for h in held) >= 400 // bs  # the global layers keep every position
    assert held[-1][1] <= -(-(20 + 1) // bs) + 1  # decoding: the window's blocks and the current one


def test_all_sliding_model_matches_transformers_and_stays_bounded(windowed_mistral):
    from transformers import AutoModelForCausalLM

    folder, loaded = windowed_mistral
    ref = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    llm = LLM(loaded_model=loaded, kv_cache_memory=16 << 20, max_num_batched_tokens=32)
    (prompt,) = random_prompts(loaded.arch.vocab_size, [150], seed=3)
    tokens, held = run_watching_blocks(llm, prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert tokens == reference_greedy(ref, prompt, 24)
    assert max(h[0] for h in held) <= -(-(24 - 1 + 32) // 16) + 1


@pytest.mark.parametrize("model", ["gemma3", "windowed_mistral"])
def test_prefix_cache_reuses_a_long_context_up_to_its_change(model, request):
    """An agent's turn: the same 300-token context with its last 40 tokens changed. The second request
    reuses the cache up to the change (every group: the global layers' blocks, the sliding layers' blocks
    inside the window before it) and answers as it does with the cache off."""
    loaded = request.getfixturevalue(model)
    loaded = loaded[1] if isinstance(loaded, tuple) else loaded
    first, second = random_prompts(loaded.arch.vocab_size, [300, 300], seed=5)
    second = first[:260] + second[260:]
    cold = LLM(loaded_model=loaded, kv_cache_memory=16 << 20, enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in cold.generate([{"prompt_token_ids": second}], GREEDY)]
    llm = LLM(loaded_model=loaded, kv_cache_memory=16 << 20)
    llm.generate([{"prompt_token_ids": first}], GREEDY)
    kv = llm.engine.scheduler.kv_cache_manager
    before = kv.stats.hit_tokens
    outs = llm.generate([{"prompt_token_ids": second}], GREEDY)
    assert kv.stats.hit_tokens - before == 260 // 16 * 16
    assert [o.outputs[0].token_ids for o in outs] == expected
