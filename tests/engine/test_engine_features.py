"""Engine features on the default model: prefix caching, seeds, top_k=1, stop strings, logprobs, n > 1, abort."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import GREEDY_32, PROMPTS, greedy_tokens, make_llm

from kvflow import SamplingParams


@pytest.fixture(scope="module")
def llm(packed_loaded):
    """The default model's packed weights in the exact mode: the features behave as on float weights, and
    decode is several times quicker. (The logprob test compares against transformers: float32 there.)"""
    return make_llm(packed_loaded)


@pytest.fixture(scope="module")
def float_llm(default_loaded):
    return make_llm(default_loaded)


def test_shared_ten_block_prefix_is_computed_once(llm):
    tok = llm.get_tokenizer()
    base = tok(" ".join(["The history of science is a long story of careful measurement."] * 20)).input_ids
    prefix = base[:160]  # exactly 10 blocks of 16
    a, b = prefix + tok(" First question:").input_ids, prefix + tok(" A different ending here").input_ids
    stats = llm.engine.scheduler.kv_cache_manager.stats
    llm.engine.scheduler.kv_cache_manager.reset_prefix_cache()
    stats.reset()
    params = SamplingParams(temperature=0, max_tokens=4)
    first = llm.generate({"prompt_token_ids": a}, params)[0]
    second = llm.generate({"prompt_token_ids": b}, params)[0]
    assert first.metrics.num_cached_tokens == 0
    assert second.metrics.num_cached_tokens == 160
    assert stats.hit_tokens == 160 and stats.lookups == 2
    assert stats.misses["no_shared_prefix"] == 1  # the first request found nothing


def test_seeded_request_same_alone_and_in_batch(llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate(PROMPTS[3], seeded)[0].outputs[0].text
    others = [SamplingParams(temperature=1.0, max_tokens=24), SamplingParams(temperature=0.7, seed=7, max_tokens=24)]
    batch = llm.generate(PROMPTS[:3] + [PROMPTS[3]], others + [others[0], seeded])
    assert batch[3].outputs[0].text == alone
    different_seed = SamplingParams(temperature=0.9, top_p=0.95, seed=4321, max_tokens=24, ignore_eos=True)
    assert llm.generate(PROMPTS[3], different_seed)[0].outputs[0].text != alone


def test_top_k_one_equals_greedy(llm):
    top1 = SamplingParams(temperature=0.8, top_k=1, max_tokens=32, ignore_eos=True, seed=3)
    assert greedy_tokens(llm, PROMPTS[:4], top1) == greedy_tokens(llm, PROMPTS[:4], GREEDY_32)


def test_stop_string_cut_exactly(llm):
    full = llm.generate(PROMPTS[5], GREEDY_32)[0].outputs[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 4]
    assert len(stop.strip()) >= 2, full
    expected = full[: full.index(stop)]
    out = llm.generate(PROMPTS[5], SamplingParams(temperature=0, max_tokens=32, stop=[stop]))[0].outputs[0]
    assert out.text == expected and out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(PROMPTS[5], SamplingParams(temperature=0, max_tokens=32, stop=[stop],
                                                   include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == expected + stop


def test_logprobs_equal_log_softmax_of_reference(float_llm, hf_default):
    llm = float_llm
    tok = llm.get_tokenizer()
    prompt = tok(PROMPTS[1]).input_ids
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5))[0].outputs[0]
    with torch.inference_mode():
        ref = torch.log_softmax(hf_default(torch.tensor([prompt + out.token_ids])).logits[0].float(), -1)
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert abs(entry[token].logprob - row[token].item()) < 1e-3
        top = torch.topk(row, 5)
        ranked = sorted((lp.rank, tid) for tid, lp in entry.items() if lp.rank > 0)
        assert [tid for _, tid in ranked] == top.indices.tolist()
        for tid, lp in entry.items():
            assert abs(lp.logprob - row[tid].item()) < 1e-3
    assert abs(out.cumulative_logprob - sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs))) < 1e-4


def test_n_samples_share_the_prompt(llm):
    greedy = llm.generate(PROMPTS[2], GREEDY_32)[0].outputs[0].token_ids
    out = llm.generate(PROMPTS[2], SamplingParams(n=3, temperature=0, max_tokens=32, ignore_eos=True))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(o.token_ids == greedy for o in out.outputs), "forked copies must continue from the same KV"
    sampled = llm.generate(PROMPTS[2], SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=16))[0]
    assert len({tuple(o.token_ids) for o in sampled.outputs}) > 1
    manager = llm.engine.scheduler.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks


def test_abort_frees_blocks_and_engine_keeps_serving(llm):
    engine = llm.engine
    rid = engine.add_request(None, PROMPTS[0], SamplingParams(max_tokens=100))
    engine.step()
    engine.step()
    final = engine.abort_request(rid)
    assert final.finished and final.outputs[0].finish_reason == "abort"
    manager = engine.scheduler.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks and not engine.has_unfinished_requests()
    assert greedy_tokens(llm, [PROMPTS[0]])[0]


def test_oversized_prompt_is_refused_with_both_lengths(llm):
    too_long = [5] * (llm.engine.max_model_len + 3)
    with pytest.raises(ValueError, match=f"{len(too_long)} tokens.*{llm.engine.max_model_len}"):
        llm.generate({"prompt_token_ids": too_long}, SamplingParams(max_tokens=1))
    assert not llm.engine.has_unfinished_requests()


def test_chat_uses_the_template(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=16))[0]
    assert "Paris" in out.outputs[0].text
    assert out.prompt.startswith("<|im_start|>system")
