"""Random workloads driven through schedule()/update_from_output() against a fake model with a fake KV store.

The fake model writes each scheduled token into the slot its block table names and, when it must sample,
reads the whole context back from those slots: so a wrong block table, a bad prefix-cache hit, a missed
fork copy or a write into a shared block shows up as a wrong context (or a failed check), not silently.
The sampled token is a hash of the context, so every request's output is known in advance.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvflow.config import CacheConfig, SchedulerConfig
from kvflow.engine.block_pool import hash_block_tokens
from kvflow.engine.request import Request, RequestStatus, SchedulerOutput
from kvflow.engine.scheduler import Scheduler
from kvflow.sampling_params import SamplingParams

VOCAB = 12
EOS = 0
MAX_STEPS = 4000


def next_token(context: list[int]) -> int:
    return hash(tuple(context)) % VOCAB  # tuples of ints hash the same in every run


@dataclass
class Spec:
    rid: str
    arrival: int
    prompt: list[int]
    max_tokens: int | None
    min_tokens: int
    abort_at: int | None
    fork: bool


@st.composite
def workloads(draw):
    config = {
        "block_size": draw(st.sampled_from([1, 2, 4])),
        "num_blocks": draw(st.integers(3, 24)),
        "budget": draw(st.integers(2, 40)),
        "max_num_seqs": draw(st.integers(1, 6)),
        "chunked": draw(st.booleans()),
        "threshold": draw(st.integers(0, 6)),
        "caching": draw(st.sampled_from([True, True, False])),  # mostly on: it has more to check
        "max_model_len": draw(st.integers(8, 48)),
    }
    tokens = st.integers(0, VOCAB - 1)
    prefixes = draw(st.lists(st.lists(tokens, min_size=2, max_size=12), min_size=1, max_size=3))
    specs = []
    for i in range(draw(st.integers(1, 8))):
        max_tokens = draw(st.one_of(st.none(), st.integers(1, 10)))
        prompt = prefixes[draw(st.integers(0, len(prefixes) - 1))] + draw(st.lists(tokens, max_size=6))
        specs.append(
            Spec(
                rid=f"r{i}",
                arrival=draw(st.integers(0, 15)),
                prompt=prompt or [1],
                max_tokens=max_tokens,
                min_tokens=min(draw(st.integers(0, 3)), max_tokens or 3),
                abort_at=draw(st.one_of(st.none(), st.integers(0, 30))),
                fork=draw(st.booleans()),
            )
        )
    return config, specs


def output_cap(spec: Spec, cfg: dict) -> int | None:
    """The output cap the scheduler should enforce, or None if the request can never fit."""
    n = len(spec.prompt)
    cap = spec.max_tokens
    if cap is None:
        cap = min(cfg["max_model_len"] - n, cfg["num_blocks"] * cfg["block_size"] + 1 - n)
    if cap < 1 or n + cap > cfg["max_model_len"]:
        return None
    most_computed = n + cap - 1
    if -(-most_computed // cfg["block_size"]) > cfg["num_blocks"]:
        return None
    if not cfg["chunked"] and most_computed > cfg["budget"]:
        return None
    return cap


def expected_output(spec: Spec, cap: int, max_model_len: int) -> list[int]:
    tokens, out = list(spec.prompt), []
    while True:
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
        if t == EOS and len(out) >= spec.min_tokens:
            return out
        if len(out) >= cap or len(tokens) >= max_model_len:
            return out


class FakeRunner:
    """A KV store of token ids, one slot per (block, offset), written and read through block tables."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.bs = sched.block_size
        self.slots: dict[tuple[int, int], int] = {}

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        for src, dst in out.block_copies:
            for off in range(self.bs):
                if (src, off) in self.slots:
                    self.slots[(dst, off)] = self.slots[(src, off)]
        pool = self.sched.kv_cache_manager.pool
        sampled = {}
        for seq in out.scheduled:
            for pos, token in zip(seq.positions, seq.token_ids, strict=True):
                block = pool.blocks[seq.block_ids[pos // self.bs]]
                # Shared or cached blocks are immutable: writing one would corrupt another request.
                assert block.ref_cnt == 1 and block.block_hash is None, (seq.request_id, pos, block)
                self.slots[(block.block_id, pos % self.bs)] = token
            if seq.sample:
                n = seq.start + seq.num_tokens
                context = [self.slots[(seq.block_ids[p // self.bs], p % self.bs)] for p in range(n)]
                assert context == seq.request.all_token_ids, seq.request_id
                sampled[seq.request_id] = [next_token(context)]
        return sampled


def check_step(out: SchedulerOutput, cfg: dict) -> None:
    assert out.total_num_scheduled_tokens == sum(s.num_tokens for s in out.scheduled)
    assert out.total_num_scheduled_tokens <= cfg["budget"]
    assert len(out.scheduled) <= cfg["max_num_seqs"]
    assert len({s.request_id for s in out.scheduled}) == len(out.scheduled)
    for s in out.scheduled:
        end = s.start + s.num_tokens
        assert s.num_tokens >= 1 and end <= s.request.num_tokens
        assert s.sample == (end == s.request.num_tokens)
        assert len(s.block_ids) * cfg["block_size"] >= end
        if not cfg["chunked"]:
            assert end == s.request.num_tokens  # whole prompts (or recomputations) only
        elif cfg["threshold"]:
            assert s.num_tokens <= cfg["threshold"]


def check_pool(sched: Scheduler, seen: list[Request]) -> None:
    kv = sched.kv_cache_manager
    holders = Counter(b.block_id for blocks in kv.req_blocks.values() for b in blocks)
    assert set(kv.req_blocks) <= set(sched.requests)
    for block in kv.pool.blocks:
        assert block.ref_cnt >= 0
        assert block.ref_cnt == holders[block.block_id]
    assert {b.block_id for b in kv.pool.free_queue} == {b.block_id for b in kv.pool.blocks if b.ref_cnt == 0}
    assert kv.num_free_blocks == sum(1 for b in kv.pool.blocks if b.ref_cnt == 0)
    # Every cached block holds exactly the tokens its hash names, recomputed here from each request's tokens.
    named: dict[int, tuple[int, ...]] = {}
    bs = kv.block_size
    for req in seen:
        parent = None
        for i in range(req.num_tokens // bs):
            block_tokens = tuple(req.all_token_ids[i * bs : (i + 1) * bs])
            parent = hash_block_tokens(parent, block_tokens)
            named[parent] = block_tokens
    for block_hash, block in kv.pool.cached.items():
        assert block.block_hash == block_hash
        assert block.token_ids == named[block_hash]


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_finish_with_the_pool_intact(workload):
    cfg, specs = workload
    sched = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=cfg["budget"],
            max_num_seqs=cfg["max_num_seqs"],
            max_model_len=cfg["max_model_len"],
            enable_chunked_prefill=cfg["chunked"],
            long_prefill_token_threshold=cfg["threshold"],
        ),
        CacheConfig(block_size=cfg["block_size"], enable_prefix_caching=cfg["caching"]),
        cfg["num_blocks"],
    )
    runner = FakeRunner(sched)
    seen: list[Request] = []
    expected: dict[str, list[int]] = {}
    aborted: set[str] = set()
    forked: set[str] = set()
    step = 0
    while step <= max(s.arrival for s in specs) or sched.has_unfinished_requests():
        for spec in specs:
            if spec.arrival == step:
                params = SamplingParams(max_tokens=spec.max_tokens, min_tokens=spec.min_tokens)
                req = Request(spec.rid, spec.prompt, params, eos_token_id=EOS)
                cap = output_cap(spec, cfg)
                try:
                    sched.add_request(req)
                except ValueError:
                    assert cap is None, f"{spec} fits but was rejected"
                    continue
                assert cap is not None, f"{spec} can never fit but was accepted"
                seen.append(req)
                expected[spec.rid] = expected_output(spec, cap, cfg["max_model_len"])
            if spec.abort_at == step and spec.rid in sched.requests:
                sched.abort_request(spec.rid)
                aborted.add(spec.rid)
        out = sched.schedule()
        check_step(out, cfg)
        updated = sched.update_from_output(out, runner.execute(out))
        for req in updated:
            spec = next((s for s in specs if s.rid == req.request_id), None)
            if spec and spec.fork and req.request_id not in forked and not req.is_finished:
                forked.add(req.request_id)
                child = Request(f"{req.request_id}/1", req.prompt_token_ids, req.sampling_params, EOS)
                sched.fork_request(req, child)
                seen.append(child)
                expected[child.request_id] = expected[req.request_id]
        check_pool(sched, seen)
        step += 1
        assert step < MAX_STEPS, "the workload did not drain"

    kv = sched.kv_cache_manager
    # Shown by --hypothesis-show-statistics: how often the interesting paths ran.
    event(f"preempted: {any(r.num_preemptions for r in seen)}")
    event(f"prefix hits: {kv.hit_tokens > 0}")
    event(f"forked: {bool(forked)}")
    assert kv.num_free_blocks == cfg["num_blocks"] and kv.usage == 0.0
    assert not sched.running and not sched.waiting
    for req in seen:
        assert req.is_finished
        if req.request_id in aborted:
            assert req.status == RequestStatus.FINISHED_ABORTED
            assert req.output_token_ids == expected[req.request_id][: req.num_output_tokens]
        else:
            assert req.output_token_ids == expected[req.request_id], req
            assert req.status != RequestStatus.FINISHED_ABORTED
    if not cfg["caching"]:
        assert kv.hit_tokens == 0 and not kv.pool.cached
