"""Prompt logprobs (scoring a text), max_tokens=0, and one request's failure kept to itself, on the default
model in the exact mode, against transformers' float32 logits on the same weights."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import PROMPTS, greedy_tokens, make_llm

from kvflow import SamplingParams
from kvflow.engine.scheduler import PROMPT_LOGITS_CHUNK

GREEDY_8 = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(default_loaded):
    return make_llm(default_loaded)


@pytest.fixture(scope="module")
def long_prompt(llm) -> list[int]:
    """More tokens than a prompt-logits chunk, so the prompt is scored over several steps."""
    tok = llm.get_tokenizer()
    text = " ".join(PROMPTS) + " " + " ".join(reversed(PROMPTS))
    ids = tok(text * 3).input_ids
    assert len(ids) > PROMPT_LOGITS_CHUNK + 16
    return ids[: PROMPT_LOGITS_CHUNK + 40]


def reference_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)


def check_against_reference(scored, ids: list[int], ref: torch.Tensor, k: int) -> None:
    assert len(scored) == len(ids) and scored[0] is None
    for pos in range(1, len(ids)):
        entry, row = scored[pos], ref[pos - 1]
        token = ids[pos]
        assert abs(entry[token].logprob - row[token].item()) < 1e-3, pos
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        if k:
            top = torch.topk(row, k).indices.tolist()
            assert set(top) <= set(entry), pos
        for tid, lp in entry.items():
            assert abs(lp.logprob - row[tid].item()) < 1e-3


def test_prompt_logprobs_equal_reference_cold_and_warm(llm, hf_default, long_prompt):
    ref = reference_logprobs(hf_default, long_prompt)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    llm.engine.scheduler.kv_cache_manager.reset_prefix_cache()
    cold = llm.generate({"prompt_token_ids": long_prompt}, params)[0]
    check_against_reference(cold.prompt_logprobs, long_prompt, ref, 3)
    # The same prompt again finds its blocks cached: the logprobs must not lose the cached positions.
    warm = llm.generate({"prompt_token_ids": long_prompt}, params)[0]
    check_against_reference(warm.prompt_logprobs, long_prompt, ref, 3)
    assert warm.metrics.num_cached_tokens == 0, "a prompt to score is computed, not read from the cache"
    # A plain request afterwards still hits the blocks the scored prompt left in the cache.
    plain = llm.generate({"prompt_token_ids": long_prompt}, SamplingParams(temperature=0, max_tokens=2))[0]
    assert plain.metrics.num_cached_tokens > 0
    assert plain.outputs[0].token_ids == cold.outputs[0].token_ids == warm.outputs[0].token_ids


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(llm, hf_default):
    ids = llm.get_tokenizer()(PROMPTS[9]).input_ids
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert out.finished and out.outputs[0].token_ids == [] and out.outputs[0].text == ""
    assert out.outputs[0].finish_reason == "length"
    check_against_reference(out.prompt_logprobs, ids, reference_logprobs(hf_default, ids), 0)
    assert all(len(e) == 1 for e in out.prompt_logprobs[1:]), "k = 0: the prompt token's own logprob only"
    two = llm.generate({"prompt_token_ids": ids}, SamplingParams(n=2, max_tokens=0))[0]
    assert [o.token_ids for o in two.outputs] == [[], []] and two.prompt_logprobs is None
    manager = llm.engine.scheduler.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks


def test_scoring_in_a_batch_changes_nothing_else(llm, hf_default, long_prompt):
    """Scored alongside plain requests, chunked into small steps: the others' greedy tokens stay theirs."""
    alone = greedy_tokens(llm, PROMPTS[:3], GREEDY_8)
    small = make_llm(llm.engine.loaded, max_num_batched_tokens=96)
    prompts = PROMPTS[:1] + [{"prompt_token_ids": long_prompt}] + PROMPTS[1:3]
    params = [GREEDY_8, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1), GREEDY_8, GREEDY_8]
    outs = small.generate(prompts, params)
    assert [outs[i].outputs[0].token_ids for i in (0, 2, 3)] == alone
    assert all(outs[i].prompt_logprobs is None for i in (0, 2, 3))
    check_against_reference(outs[1].prompt_logprobs, long_prompt, reference_logprobs(hf_default, long_prompt), 1)


def test_a_request_that_fails_in_the_step_fails_alone(packed_loaded, monkeypatch):
    llm = make_llm(packed_loaded)
    alone = greedy_tokens(llm, PROMPTS[:3], GREEDY_8)
    engine = llm.engine
    real = engine._sampling_row
    doomed = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, min_p=0.01)

    def sampling_row(seq, *args):
        if seq.request.sampling_params.min_p == doomed.min_p:
            raise RuntimeError("injected setup failure")
        return real(seq, *args)

    monkeypatch.setattr(engine, "_sampling_row", sampling_row)
    outs = llm.generate(PROMPTS[:2] + [PROMPTS[5]] + PROMPTS[2:3], [GREEDY_8, GREEDY_8, doomed, GREEDY_8])
    assert [outs[i].outputs[0].token_ids for i in (0, 1, 3)] == alone
    assert all(outs[i].error is None for i in (0, 1, 3))
    assert outs[2].finished and "injected setup failure" in outs[2].error
    assert not engine.has_unfinished_requests()
    manager = engine.scheduler.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks
