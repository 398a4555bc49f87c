"""Random workloads through the whole engine on a tiny random model (hypothesis).

Arrivals at random steps, prompts sharing prefixes, random max_tokens, aborts at random steps, a small
pool. Every request must end finished or aborted, no step may exceed its budget, reference counts stay
non-negative, cached blocks hold the tokens their hashes name, the pool is whole again when idle, and
every request that ran to the end produced exactly the greedy tokens it produces alone. Half the examples
run with the prefix cache's disk tier, in one folder for the whole module, so blocks that earlier
examples (earlier engines) wrote are read back; every file it holds must then pass its checks.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvflow import LLM, SamplingParams
from kvflow.config import ModelConfig
from kvflow.engine.block_pool import hash_block_tokens
from kvflow.executors.model_setup import load_model

BUDGET, MAX_SEQS, BLOCK, BLOCKS = 24, 4, 4, 40


@dataclass(frozen=True)
class Spec:
    arrival: int
    prompt: tuple[int, ...]
    max_tokens: int
    abort_at: int | None


@st.composite
def workloads(draw) -> list[Spec]:
    prefixes = [tuple(draw(st.lists(st.integers(3, 300), min_size=1, max_size=12))) for _ in range(2)]
    specs = []
    for _ in range(draw(st.integers(1, 7))):
        prefix = draw(st.sampled_from(prefixes + [()]))
        tail = tuple(draw(st.lists(st.integers(3, 300), min_size=1, max_size=20)))
        specs.append(Spec(
            arrival=draw(st.integers(0, 6)),
            prompt=prefix + tail,
            max_tokens=draw(st.integers(1, 10)),
            abort_at=draw(st.one_of(st.none(), st.integers(0, 12))),
        ))
    return specs


@pytest.fixture(scope="module")
def tiny_loaded(tiny_checkpoints):
    return load_model(ModelConfig(model=str(tiny_checkpoints["llama"]), dtype="float32", device="cpu"))


@pytest.fixture(scope="module")
def reference(tiny_loaded):
    llm = LLM(loaded_model=tiny_loaded, kv_cache_memory=8 << 20, enable_prefix_caching=False)
    memo: dict[tuple, list[int]] = {}

    def alone(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
        key = (prompt, max_tokens)
        if key not in memo:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            memo[key] = llm.generate({"prompt_token_ids": list(prompt)}, params)[0].outputs[0].token_ids
        return memo[key]

    return alone


def check_pool(llm: LLM) -> None:
    manager = llm.engine.scheduler.kv_cache_manager
    pool = manager.pool
    for block in pool.blocks:
        assert block.ref_cnt >= 0
        if block.block_hash is not None:
            assert block.token_ids is not None and len(block.token_ids) == BLOCK
    for request in llm.engine.scheduler.requests.values():
        parent = None
        for i, block_hash in enumerate(request.block_hashes):
            tokens = request.all_token_ids[i * BLOCK : (i + 1) * BLOCK]
            assert block_hash == hash_block_tokens(parent, tokens)
            cached = pool.get_cached_block(block_hash)
            if cached is not None:
                assert cached.token_ids == tuple(tokens)
            parent = block_hash


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("prefix-store"))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workload=workloads(), disk=st.booleans())
def test_random_workloads(workload, disk, tiny_loaded, reference, store_dir):
    llm = LLM(loaded_model=tiny_loaded, num_blocks=BLOCKS, block_size=BLOCK, max_num_batched_tokens=BUDGET,
              max_num_seqs=MAX_SEQS, long_prefill_token_threshold=8, prefix_cache_dir=store_dir if disk else None)
    engine = llm.engine
    schedule = engine.scheduler.schedule
    budgets = []

    def recording_schedule():
        out = schedule()
        budgets.append((out.total_num_scheduled_tokens, len(out.scheduled)))
        return out

    engine.scheduler.schedule = recording_schedule
    ids: dict[int, str] = {}
    finals = {}
    step = 0
    while step < 400 and (len(ids) < len(workload) or engine.has_unfinished_requests()):
        for i, spec in enumerate(workload):
            if spec.arrival == step:
                params = SamplingParams(temperature=0, max_tokens=spec.max_tokens, ignore_eos=True)
                ids[i] = engine.add_request(None, list(spec.prompt), params)
            if spec.abort_at == step and i in ids and ids[i] not in finals:
                out = engine.abort_request(ids[i])
                if out is not None:
                    finals[ids[i]] = out
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        check_pool(llm)
        step += 1

    assert not engine.has_unfinished_requests()
    assert all(tokens <= BUDGET and seqs <= MAX_SEQS for tokens, seqs in budgets)
    manager = engine.scheduler.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks
    for i, spec in enumerate(workload):
        out = finals[ids[i]]
        completion = out.outputs[0]
        assert completion.finish_reason in ("length", "abort")
        expected = reference(spec.prompt, spec.max_tokens)
        if completion.finish_reason == "length":
            assert completion.token_ids == expected
        else:
            assert completion.token_ids == expected[: len(completion.token_ids)]
    if disk:
        llm.close()
        store = engine.prefix_store
        assert store.stats.refused == 0
        for block in engine.scheduler.kv_cache_manager.pool.blocks:
            if block.block_hash is not None and block.block_hash in store:
                stored = store.get(block.block_hash)
                assert stored is not None and stored.token_ids == block.token_ids
