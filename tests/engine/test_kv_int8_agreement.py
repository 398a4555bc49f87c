"""The 8-bit KV cache against the 16-bit one on the default model (exact mode, packed weights): teacher-forced
over the parity prompts and their 16-bit greedy answers, the most likely next token agrees at >= 99% of
positions; and the cache takes about half the bytes per token."""

from __future__ import annotations

from engine_helpers import PROMPTS, make_llm

from kvflow import SamplingParams


def top1(llm, sequences: list[list[int]]) -> list[list[int]]:
    """Per sequence, the most likely token at each position after the first (prompt logprobs, rank 1)."""
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences],
                        SamplingParams(max_tokens=0, prompt_logprobs=1))
    return [[next(t for t, lp in d.items() if lp.rank == 1) for d in o.prompt_logprobs[1:]] for o in outs]


def test_top1_agreement_with_the_16_bit_cache(packed_loaded):
    f16 = make_llm(packed_loaded, kv_cache_dtype="float16")
    answers = f16.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    sequences = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in answers]
    int8 = make_llm(packed_loaded, kv_cache_dtype="int8")
    a, b = top1(f16, sequences), top1(int8, sequences)
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    total = sum(len(r) for r in a)
    print(f"top-1 agreement {same}/{total}")
    assert total > 16 * 32 and same / total >= 0.99, f"{same}/{total}"
    runner, f16_runner = int8.engine.runner, f16.engine.runner
    assert runner.kv_caches[0][0].dtype.itemsize == 1
    per_token = sum(k[0, 0].nbytes + v[0, 0].nbytes for k, v in runner.kv_caches)
    f16_per_token = sum(k[0, 0].nbytes + v[0, 0].nbytes for k, v in f16_runner.kv_caches)
    assert per_token / f16_per_token == (64 + 4) / 128  # the default model's heads are 64 wide
