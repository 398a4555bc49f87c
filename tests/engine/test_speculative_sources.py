"""Speculative decoding's other draft sources (issue 20): the suffix index over recent requests, and a
draft model run on its own KV cache. Whatever they draft, the output is what plain decoding gives."""

from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import PROMPTS, make_llm
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow import SamplingParams
from kvflow.config import ModelConfig
from kvflow.engine.kv_cache_alloc import bytes_per_block
from kvflow.executors.model_setup import load_model
from kvflow.loader.resolve import resolve_model
from kvflow.spec.config import SpeculativeConfig
from kvflow.spec.draft_model import DraftModel
from kvflow.spec.suffix import SuffixIndex

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def brute_force_lookup(docs: list[list[int]], tokens: list[int], key_len: int, max_n: int, k: int):
    """The longest match (at least key_len, at most max_n tokens) ending anywhere in docs but at a doc's
    last position; on a tie the latest doc, then the latest position."""
    best = (0, -1, -1)
    for d, doc in enumerate(docs):
        for end in range(len(doc) - 1):
            m = 0
            while m < min(max_n, len(tokens), end + 1) and doc[end - m] == tokens[len(tokens) - 1 - m]:
                m += 1
            if m >= key_len and (m, d, end) > best:
                best = (m, d, end)
    m, d, end = best
    return (docs[d][end + 1 : end + 1 + k], m) if m else ([], 0)


@settings(max_examples=60, deadline=None)
@given(docs=st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=30), min_size=1, max_size=5),
       tokens=st.lists(st.integers(0, 3), min_size=1, max_size=12), key_len=st.integers(1, 3),
       max_n=st.integers(3, 6), k=st.integers(1, 5))
def test_suffix_index_finds_the_longest_latest_match(docs, tokens, key_len, max_n, k):
    index = SuffixIndex(key_len, max_n, per_key=10_000)
    for doc in docs:
        index.record(doc)
    kept = [doc for doc in docs if len(doc) > key_len]  # shorter ones are not filed
    assert index.lookup(np.asarray(tokens, dtype=np.int64), k) == brute_force_lookup(kept, tokens, key_len, max_n, k)


def test_suffix_index_stays_within_its_bounds():
    index = SuffixIndex(2, 8, max_requests=3, max_tokens=100, per_key=4)
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 5, size=30).tolist() for _ in range(10)]
    for doc in docs:
        index.record(doc)
        assert len(index.docs) <= 3 and index.num_tokens <= 100
        assert all(len(slot) <= 4 for slot in index.positions.values())
        # Every filed position belongs to a request still held.
        assert all(d in index.docs for slot in index.positions.values() for d, _ in slot)
    # The newest request is always found: its own 8-token stretch is drafted from it.
    newest = docs[-1]
    draft, matched = index.lookup(np.asarray(newest[:20], dtype=np.int64), 4)
    assert matched >= 2 and len(draft) >= 1
    index.record(list(range(1000)))  # longer than the whole index: not filed, nothing else dropped
    assert len(index.docs) == 3


def test_suffix_drafts_from_an_earlier_request(tiny_packed):
    """The second of two identical requests copies the first one's answer from the index: nearly every
    draft is kept, and the answer is what plain decoding gives."""
    plain = make_llm(tiny_packed, kv_cache_memory=16 << 20)
    spec = make_llm(tiny_packed, kv_cache_memory=16 << 20, speculative_config={"method": "suffix", "adaptive": False,
                                                                            "num_speculative_tokens": 8})
    prompt = PROMPTS[1]
    want = plain.generate([prompt], GREEDY)[0].outputs[0].token_ids
    first = spec.generate([prompt], GREEDY)[0]
    second = spec.generate([prompt], GREEDY)[0]
    assert first.outputs[0].token_ids == want and second.outputs[0].token_ids == want
    metrics = second.metrics
    assert metrics.num_draft_tokens >= 20 and metrics.num_accepted_tokens >= 0.9 * metrics.num_draft_tokens
    assert len(spec.engine.speculator.source.index.docs) == 2


def draft_llm(target, draft_path: str, **spec_fields):
    config = {"method": "draft_model", "model": draft_path, "num_speculative_tokens": 4, **spec_fields}
    return make_llm(target, kv_cache_memory=16 << 20, speculative_config=config)


def test_the_model_as_its_own_draft_keeps_every_draft(tiny_packed, tiny_checkpoints):
    """The plumbing check: in the exact mode a model drafting for itself agrees with itself everywhere."""
    plain = make_llm(tiny_packed, kv_cache_memory=16 << 20)
    spec = draft_llm(tiny_packed, str(tiny_checkpoints["llama"]), adaptive=False)
    source = spec.engine.speculator.source
    assert source.loaded is tiny_packed  # the same file: one copy of the weights
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS[:4], GREEDY)]
    outs = spec.generate(PROMPTS[:4], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == want
    s = spec.engine.speculator
    assert s.num_draft_tokens >= 40 and s.num_accepted_tokens == s.num_draft_tokens
    assert sorted(source.free) == list(range(source.runner.num_blocks)) and not source.cached


def test_a_weaker_draft_model_changes_nothing_but_speed(tiny_packed, tiny_checkpoints):
    """Another random model with the same tokenizer drafts mostly wrong; sampled and greedy outputs are
    still plain decoding's, with a draft cache of one block (a sequence fits only while it is short) and of eight (two or
    three sequences fit at once: the others take blocks from the least recently drafted, or go without)."""
    plain = make_llm(tiny_packed, kv_cache_memory=16 << 20)
    weak = str(tiny_checkpoints["llama3.2"])
    spec = draft_llm(tiny_packed, weak, adaptive=False, draft_kv_cache_memory=1)
    weak_arch = spec.engine.speculator.source.loaded.arch
    eight_blocks = 8 * bytes_per_block(weak_arch, 16, spec.engine.speculator.source.runner.kv_dtype)
    tiny_cache = draft_llm(tiny_packed, weak, adaptive=False, draft_kv_cache_memory=eight_blocks)
    for params in (GREEDY, SamplingParams(temperature=0.7, seed=5, max_tokens=32, ignore_eos=True)):
        want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS[:6], params)]
        for llm in (spec, tiny_cache):
            assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:6], params)] == want, params
    one_block = spec.engine.speculator.source
    assert one_block.runner.num_blocks == 1 and one_block.free == [0]  # a short prompt fits, then gives it back
    s = tiny_cache.engine.speculator
    assert 0 <= s.num_accepted_tokens < s.num_draft_tokens and s.num_draft_tokens > 0
    source = s.source
    assert sorted(source.free) == list(range(source.runner.num_blocks))


def test_a_draft_model_with_another_tokenizer_is_refused(tiny_packed):
    default_model = str(resolve_model(None).path)  # SmolLM2's tokenizer, not the tiny model's
    with pytest.raises(ValueError, match="different tokenizer"):
        DraftModel.load(SpeculativeConfig(method="draft_model", model=default_model), tiny_packed, 4)


def test_draft_model_config_is_checked():
    with pytest.raises(ValueError, match="model"):
        SpeculativeConfig.parse({"method": "draft_model"})
    with pytest.raises(ValueError, match="model"):
        SpeculativeConfig.parse({"method": "ngram", "model": "x"})
    assert SpeculativeConfig.parse('{"method": "suffix"}').method == "suffix"


def test_a_draft_model_drafts_in_the_fast_mode_too(tiny_checkpoints):
    """The fast mode's kernels (and its bfloat16 arithmetic where the CPU has it) on a draft model: the
    output is the plain one, whatever the draft."""
    loaded = load_model(ModelConfig(model=str(tiny_checkpoints["llama"]), device="cpu", quantization="int4"))
    plain = make_llm(loaded, kv_cache_memory=16 << 20)
    spec = draft_llm(loaded, str(tiny_checkpoints["llama3.2"]))
    want = plain.generate(PROMPTS[:1], GREEDY)[0].outputs[0].token_ids
    assert spec.generate(PROMPTS[:1], GREEDY)[0].outputs[0].token_ids == want
