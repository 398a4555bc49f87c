"""Structured output in exact mode (the default model with packed Q4_1/Q8_0 weights, float32 around them): a constrained request gives the same
tokens alone and batched, free requests give the same tokens whether or not constrained ones share their
batch, and a request's grammar state survives preemption and prefix-cache hits (same, valid output)."""

from __future__ import annotations

import pytest
from engine_helpers import PROMPTS, llm_builder
from structured.schema_suite import CASES, chat_prompt, violation

from kvflow import SamplingParams
from kvflow.structured.spec import StructuredOutput

FREE = PROMPTS[:4]
CONSTRAINED = [c for c in CASES if c["name"] in ("weather_args", "nested_order", "ref_tree", "plan_steps")]


@pytest.fixture(scope="module")
def model(packed_loaded):
    return llm_builder(packed_loaded)


def _constrained(llm) -> tuple[list[str], list[SamplingParams]]:
    tokenizer = llm.engine.tokenizer
    prompts = [tokenizer.apply_chat_template(chat_prompt(c), tokenize=False, add_generation_prompt=True)
               for c in CONSTRAINED]
    params = [SamplingParams(temperature=0, max_tokens=64, structured_output=StructuredOutput(json=c["schema"]))
              for c in CONSTRAINED]
    return prompts, params


FREE_PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _run(llm, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def alone(model) -> dict[str, list[int]]:
    llm = model(enable_prefix_caching=False)
    prompts, params = _constrained(llm)
    result = {p: _run(llm, [p], [FREE_PARAMS])[0] for p in FREE}
    result.update({p: _run(llm, [p], [sp])[0] for p, sp in zip(prompts, params)})
    return result


def _check_valid(llm, outs) -> None:
    for case, tokens in zip(CONSTRAINED, outs):
        assert violation(llm.engine.tokenizer.decode(tokens), case["schema"]) is None


def test_mixed_batch_changes_neither_kind(model, alone):
    llm = model(enable_prefix_caching=False)
    prompts, params = _constrained(llm)
    mixed_prompts = [x for pair in zip(FREE, prompts) for x in pair]
    mixed_params = [x for pair in zip([FREE_PARAMS] * len(FREE), params) for x in pair]
    outs = _run(llm, mixed_prompts, mixed_params)
    assert outs == [alone[p] for p in mixed_prompts]
    _check_valid(llm, outs[1::2])


def test_preemption_keeps_grammar_state(model, alone):
    llm = model(num_blocks=14, block_size=16, enable_prefix_caching=False)
    prompts, params = _constrained(llm)
    outs = llm.generate(prompts, params)
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "the pool was meant to force preemption"
    tokens = [o.outputs[0].token_ids for o in outs]
    assert tokens == [alone[p] for p in prompts]
    _check_valid(llm, tokens)


def test_prefix_cache_hits_keep_grammar_state(model, alone):
    llm = model(enable_prefix_caching=True, block_size=4)
    prompts, params = _constrained(llm)
    cold = _run(llm, prompts, params)
    stats = llm.engine.scheduler.kv_cache_manager.stats
    before = stats.hit_tokens
    warm = _run(llm, prompts, params)
    assert stats.hit_tokens > before
    assert cold == warm == [alone[p] for p in prompts]
    _check_valid(llm, warm)


def test_n_samples_each_follow_the_grammar(model):
    llm = model()
    prompts, params = _constrained(llm)
    sampled = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=64,
                             structured_output=params[0].structured_output)
    (out,) = llm.generate(prompts[:1], sampled)
    assert len(out.outputs) == 3
    for completion in out.outputs:
        assert violation(completion.text, CONSTRAINED[0]["schema"]) is None


@pytest.mark.parametrize("prefetch", [True, False], ids=["masks during the forward", "masks after it"])
def test_masks_computed_during_the_forward_change_nothing(model, alone, prefetch):
    llm = model(enable_prefix_caching=False)
    llm.engine.mask_prefetch = prefetch  # by default only where a core is idle (structured/mask_prefetch.py)
    prompts, params = _constrained(llm)
    assert _run(llm, prompts, params) == [alone[p] for p in prompts]
