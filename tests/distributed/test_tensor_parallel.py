"""Tensor parallelism on CPU over gloo: split models compute what the whole model computes, sizes that do not
split the heads are refused, and a rank that dies ends the request with an error instead of a hang."""

from __future__ import annotations

import time

import pytest
from tiny_models import TINY_ARCHS, TINY_VOCAB

from kvflow import LLM, SamplingParams
from kvflow.distributed.group import TensorParallelError
from kvflow.distributed.vocab_parallel import VocabParallelEmbedding, VocabParallelHead

from .tp_helpers import REL_TOL, run_capturing_logits, worst_relative_difference

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


# Every model class once: llama3.2 (one KV head, kept by both ranks) stands for llama and mistral, phi3 for
# phi3_longrope, gemma3 for gemma2 (the same classes with other rotary, window or cap settings, which no rank
# cuts: they act per head or on the whole hidden size).
SPLIT_ARCHS = [a for a in TINY_ARCHS if a not in ("llama", "mistral", "phi3_longrope", "gemma2")]


@pytest.mark.parametrize("arch", SPLIT_ARCHS)
def test_two_ranks_match_one_on_each_architecture(arch, tiny_checkpoints):
    prompts = [{"prompt_token_ids": [5, 9, 33, 100, 7]}, {"prompt_token_ids": list(range(3, 70))}]
    options = dict(dtype="float32", kv_cache_memory=8 << 20)
    whole, whole_logits = run_capturing_logits(str(tiny_checkpoints[arch]), 1, prompts, GREEDY, **options)
    split, split_logits = run_capturing_logits(str(tiny_checkpoints[arch]), 2, prompts, GREEDY, **options)
    assert split == whole
    assert worst_relative_difference(whole_logits, split_logits) < REL_TOL


def test_default_model_in_three_ranks(default_loaded):
    """SmolLM2's 9 query and 3 KV heads, one KV head a rank, in float32. (Its packed Q4_1 tensors cut by
    blocks are checked against the whole tensors in test_sharding.py; through the packed kernel, which rounds
    its inputs per block, a last-bit change from the ranks' sum order can move a rounding, and the logits
    then differ by up to 7e-4 relative over 30 layers.)"""
    prompts = ["<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
               "def fibonacci(n):\n    if n < 2:"]
    options = dict(kv_cache_memory=32 << 20, max_model_len=4096)
    params = SamplingParams(temperature=0, max_tokens=8)
    whole, whole_logits = run_capturing_logits(None, 1, prompts, params, loaded_model=default_loaded, **options)
    split, split_logits = run_capturing_logits(None, 3, prompts, params, dtype="float32", **options)
    assert split == whole
    assert worst_relative_difference(whole_logits, split_logits) < REL_TOL


def test_a_size_that_does_not_divide_the_heads_is_refused():
    with pytest.raises(ValueError, match="does not divide its 9 attention heads"):
        LLM(tensor_parallel_size=2, device="cpu")


def test_a_killed_rank_ends_the_request_with_an_error(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["llama"]), tensor_parallel_size=2, threads=1, device="cpu", dtype="float32",
              kv_cache_memory=8 << 20)
    try:
        # Rank 0 holds the first half of the vocabulary's rows, in the embedding and in the (untied) head.
        model = llm.engine.loaded.model
        assert isinstance(model.embed_tokens, VocabParallelEmbedding)
        assert isinstance(model.lm_head, VocabParallelHead)
        assert model.embed_tokens.inner.weight.shape[0] == model.lm_head.inner.weight.shape[0] == TINY_VOCAB // 2
        assert model.embed_tokens.start == 0
        stream = llm.stream({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=400, ignore_eos=True))
        next(stream)
        llm.engine.ranks.processes[0].kill()
        killed = time.monotonic()
        with pytest.raises(TensorParallelError, match="rank"):
            for _ in stream:
                pass
        assert time.monotonic() - killed < 10
        assert llm.engine.failure is not None
        with pytest.raises(TensorParallelError):  # and stays failed: no step runs on half a model
            llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=2))
    finally:
        llm.close()
