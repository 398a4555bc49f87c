"""Scheduler: the token budget, chunked prefill, prefix-cache hits, preemption, abort, fork, stops."""

import zlib

import pytest

from kvflow.config import CacheConfig, SchedulerConfig
from kvflow.engine.request import Request, RequestStatus, ScheduledSequence, SchedulerOutput
from kvflow.engine.scheduler import Scheduler
from kvflow.sampling_params import SamplingParams

EOS = 2


def make_scheduler(num_blocks: int = 64, block_size: int = 4, caching: bool = True, **sched) -> Scheduler:
    sched.setdefault("max_num_batched_tokens", 64)
    return Scheduler(
        SchedulerConfig(**sched),
        CacheConfig(block_size=block_size, enable_prefix_caching=caching),
        num_blocks,
    )


def distinct_prompt(rid: str, length: int) -> list[int]:
    """Tokens no other request id shares, so prefix caching stays out of the way unless wanted."""
    base = 1000 * (zlib.crc32(rid.encode()) % 100_000)
    return list(range(base, base + length))


def make_request(rid: str, prompt: list[int] | int, **params) -> Request:
    tokens = distinct_prompt(rid, prompt) if isinstance(prompt, int) else prompt
    params.setdefault("max_tokens", 16)
    return Request(rid, tokens, SamplingParams(**params), eos_token_id=EOS)


def step(sched: Scheduler, token: int = 7) -> SchedulerOutput:
    """One engine step with a fake model that samples `token` wherever logits are needed."""
    out = sched.schedule()
    sched.update_from_output(out, {s.request_id: [token] for s in out.scheduled if s.sample})
    return out


def counts(out: SchedulerOutput) -> dict[str, int]:
    return {s.request_id: s.num_tokens for s in out.scheduled}


def test_decodes_go_first_and_prefill_fills_the_budget():
    sched = make_scheduler(max_num_batched_tokens=10)
    for rid in "abc":
        sched.add_request(make_request(rid, 3))
    assert counts(step(sched)) == {"a": 3, "b": 3, "c": 3}
    sched.add_request(make_request("long", 20))
    out = step(sched)
    assert counts(out) == {"a": 1, "b": 1, "c": 1, "long": 7}
    assert out.total_num_scheduled_tokens == 10
    assert [s.sample for s in out.scheduled] == [True, True, True, False]
    out = step(sched)
    assert counts(out) == {"a": 1, "b": 1, "c": 1, "long": 7}
    long_seq = out.scheduled[-1]
    assert (long_seq.start, long_seq.token_ids) == (7, distinct_prompt("long", 14)[7:])


def test_long_prefill_threshold_lets_prompts_progress_together():
    sched = make_scheduler(max_num_batched_tokens=32, long_prefill_token_threshold=8)
    sched.add_request(make_request("a", 20))
    sched.add_request(make_request("b", 20))
    sched.add_request(make_request("c", 20))
    history = [counts(step(sched)) for _ in range(3)]
    assert history[0] == {"a": 8, "b": 8, "c": 8}
    assert history[1] == {"a": 8, "b": 8, "c": 8}
    assert history[2] == {"a": 4, "b": 4, "c": 4}
    assert all(r.num_output_tokens == 1 for r in sched.running)


def test_chunked_prefill_disabled_schedules_whole_prompts_only():
    sched = make_scheduler(max_num_batched_tokens=30, enable_chunked_prefill=False, max_model_len=40)
    sched.add_request(make_request("a", 20, max_tokens=4))
    sched.add_request(make_request("b", 20, max_tokens=4))
    assert counts(step(sched)) == {"a": 20}  # b does not fit in the 10 left
    assert counts(step(sched)) == {"a": 1, "b": 20}
    with pytest.raises(ValueError, match="chunked prefill disabled"):
        sched.add_request(make_request("huge", 35, max_tokens=2))


def test_max_num_seqs_caps_a_step():
    sched = make_scheduler(max_num_seqs=2)
    for rid in "abc":
        sched.add_request(make_request(rid, 3))
    assert counts(step(sched)) == {"a": 3, "b": 3}
    assert sched.num_waiting == 1 and sched.num_running == 2


def test_second_request_skips_the_cached_shared_prefix():
    sched = make_scheduler(num_blocks=64, block_size=16, max_num_batched_tokens=512)
    prefix = list(range(1000, 1160))  # 10 blocks of 16
    first = make_request("first", prefix + list(range(30)))
    sched.add_request(first)
    step(sched)
    second = make_request("second", prefix + list(range(50, 75)))
    sched.add_request(second)
    out = step(sched)
    seq = {s.request_id: s for s in out.scheduled}["second"]
    assert (seq.start, seq.num_tokens) == (160, 25)
    assert second.num_cached_tokens == 160 and first.num_cached_tokens == 0
    assert seq.block_ids[:10] == sched.kv_cache_manager.get_block_ids("first")[:10]
    kv = sched.kv_cache_manager
    assert (kv.lookups, kv.hit_tokens, kv.queried_tokens) == (2, 160, 190 + 185)
    assert kv.misses == {"no_shared_prefix": 2, "prefix_shorter_than_block": 0, "evicted": 0}


def test_prefix_caching_off_recomputes_everything():
    sched = make_scheduler(num_blocks=64, block_size=16, caching=False, max_num_batched_tokens=512)
    prefix = list(range(1000, 1160))
    sched.add_request(make_request("first", prefix + [1]))
    step(sched)
    sched.add_request(make_request("second", prefix + [2]))
    assert counts(step(sched))["second"] == 161
    assert sched.kv_cache_manager.hit_tokens == 0


def test_preemption_evicts_the_latest_arrival_to_the_front_of_the_queue():
    # 7 blocks of 4: a and b take 2 each, c takes 3; every decode then needs a fresh block.
    sched = make_scheduler(num_blocks=7, block_size=4)
    a, b, c = make_request("a", 8), make_request("b", 8), make_request("c", 12)
    for r in (a, b, c):
        sched.add_request(r)
    step(sched)
    assert sched.kv_cache_manager.num_free_blocks == 0
    sched.add_request(make_request("d", 4))
    out = step(sched)
    assert out.preempted_request_ids == ["c"]
    assert counts(out) == {"a": 1, "b": 1}  # nothing new is admitted in a step that preempted
    assert list(sched.waiting) == [c, sched.get_request("d")]
    assert (c.status, c.num_preemptions, c.num_computed_tokens) == (RequestStatus.PREEMPTED, 1, 0)
    # a and b reused c's last two blocks (freed tail first); c's first block is still cached.
    sched.abort_request("a")
    sched.abort_request("b")
    out = step(sched)
    seq = out.scheduled[0]
    assert seq.request is c and (seq.start, seq.num_tokens) == (4, 9)  # 12 prompt + 1 output, 4 cached
    assert c.num_cached_tokens == 0  # recorded at the first scheduling only
    assert c.status == RequestStatus.RUNNING and c.output_token_ids == [7, 7]


def test_a_request_that_is_itself_the_victim_is_not_scheduled():
    sched = make_scheduler(num_blocks=4, block_size=4)
    a, b = make_request("a", 8, max_tokens=4), make_request("b", 8, max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    out = step(sched)  # both need a 3rd block and none is free: b, the latest, gives way
    assert out.preempted_request_ids == ["b"]
    assert counts(out) == {"a": 1}
    assert sched.waiting[0] is b and b.num_preemptions == 1


def test_requests_that_can_never_fit_are_rejected():
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=32)
    with pytest.raises(ValueError, match=r"20 tokens \+ max_tokens 16 = 36 .* max_model_len 32"):
        sched.add_request(make_request("a", 20))
    with pytest.raises(ValueError, match="needs 5 KV blocks .* only 4 blocks"):
        sched.add_request(make_request("b", 10, max_tokens=8))
    with pytest.raises(ValueError, match="leaves no room"):
        sched.add_request(make_request("c", 32, max_tokens=None))
    assert not sched.has_unfinished_requests()
    ok = make_request("d", 10, max_tokens=None)
    sched.add_request(ok)
    assert ok.max_tokens == 7  # capped by the pool: 16 slots, the last sampled token needs none


def test_max_tokens_none_is_capped_to_max_model_len():
    sched = make_scheduler(num_blocks=64, block_size=4, max_model_len=20)
    req = make_request("a", 5, max_tokens=None)
    sched.add_request(req)
    while sched.has_unfinished_requests():
        step(sched)
    assert req.num_tokens == 20 and req.status == RequestStatus.FINISHED_LENGTH


def test_abort_frees_blocks_at_once_and_is_reported():
    sched = make_scheduler(num_blocks=8)
    sched.add_request(make_request("a", 10))
    sched.add_request(make_request("w", 4))
    out = sched.schedule()
    assert sched.kv_cache_manager.num_free_blocks < 8
    sched.abort_request("a")
    sched.abort_request("w")  # running too by now
    assert sched.kv_cache_manager.num_free_blocks == 8
    assert sched.update_from_output(out, {"a": [5], "w": [5]}) == []  # stale results are dropped
    sched.add_request(make_request("queued", 4))
    sched.abort_request("queued")  # still waiting
    sched.abort_request("unknown")  # ignored
    nxt = sched.schedule()
    assert nxt.finished_request_ids == ["a", "w", "queued"] and nxt.is_empty
    assert not sched.has_unfinished_requests()


def test_fork_shares_blocks_and_reports_the_partial_block_copy():
    sched = make_scheduler(num_blocks=16, block_size=4)
    parent = make_request("p", 10, n=2)
    sched.add_request(parent)
    step(sched)  # 10 computed: 2 full blocks + a partial one; 1 token sampled
    child = Request("p-1", parent.prompt_token_ids, parent.sampling_params, eos_token_id=EOS)
    sched.fork_request(parent, child)
    assert child.output_token_ids == parent.output_token_ids and child.num_computed_tokens == 10
    p_ids = sched.kv_cache_manager.get_block_ids("p")
    c_ids = sched.kv_cache_manager.get_block_ids("p-1")
    assert c_ids[:2] == p_ids[:2] and c_ids[2] != p_ids[2]
    out = step(sched)
    assert out.block_copies == [(p_ids[2], c_ids[2])]
    assert counts(out) == {"p": 1, "p-1": 1}
    assert step(sched).block_copies == []
    sched.abort_request("p")
    sched.abort_request("p-1")
    assert sched.kv_cache_manager.num_free_blocks == 16


def test_eos_waits_for_min_tokens_and_stop_ids_are_reported():
    sched = make_scheduler()
    early = make_request("early", 3, min_tokens=2)
    sched.add_request(early)
    step(sched, token=EOS)
    assert early.status == RequestStatus.RUNNING
    step(sched, token=EOS)
    assert early.status == RequestStatus.FINISHED_STOPPED and early.stop_reason is None
    assert early.status.finish_reason == "stop" and early.timings.finished_time is not None
    stop = make_request("stop", 3, stop_token_ids=[9])
    sched.add_request(stop)
    out = sched.schedule()
    [returned] = sched.update_from_output(out, {"stop": [9]})
    assert returned is stop and stop.stop_reason == 9 and stop.is_finished
    ignore = make_request("ignore", 3, ignore_eos=True, max_tokens=3)
    sched.add_request(ignore)
    for _ in range(3):
        step(sched, token=EOS)
    assert ignore.output_token_ids == [EOS] * 3 and ignore.status == RequestStatus.FINISHED_LENGTH
    assert len(ignore.timings.token_times) == 3 and ignore.timings.first_token_time is not None
    assert sched.kv_cache_manager.num_free_blocks == 64


def test_finish_request_for_a_stop_string():
    sched = make_scheduler()
    req = make_request("a", 3)
    sched.add_request(req)
    step(sched)
    sched.finish_request("a", RequestStatus.FINISHED_STOPPED, stop_reason="\n\n")
    assert (req.status, req.stop_reason, sched.num_running) == (RequestStatus.FINISHED_STOPPED, "\n\n", 0)
    assert sched.schedule().finished_request_ids == ["a"]


def test_speculative_tokens_are_appended_until_a_stop():
    sched = make_scheduler()
    req = make_request("a", 3, max_tokens=3)
    sched.add_request(req)
    out = sched.schedule()
    sched.update_from_output(out, {"a": [5, 6, 7, 8]})
    assert req.output_token_ids == [5, 6, 7] and req.status == RequestStatus.FINISHED_LENGTH


def test_fork_between_schedule_and_update_as_the_engine_does_for_n():
    # The engine forks once the prompt's logits exist, before update_from_output, and adds a
    # zero-token entry so the child's first token is appended too.
    sched = make_scheduler(num_blocks=16, block_size=4)
    parent = make_request("p", 6, n=2)
    sched.add_request(parent)
    out = sched.schedule()
    child = Request("p#1", parent.prompt_token_ids, parent.sampling_params, eos_token_id=EOS)
    sched.fork_request(parent, child)
    assert child.num_computed_tokens == 6 and child.status == RequestStatus.RUNNING
    out.scheduled.append(
        ScheduledSequence(child, 6, 0, sched.kv_cache_manager.get_block_ids("p#1"), sample=True)
    )
    updated = sched.update_from_output(out, {"p": [5], "p#1": [8]})
    assert updated == [parent, child]
    assert (parent.output_token_ids, child.output_token_ids) == ([5], [8])
    nxt = sched.schedule()
    p_ids, c_ids = sched.kv_cache_manager.get_block_ids("p"), sched.kv_cache_manager.get_block_ids("p#1")
    assert nxt.block_copies == [(p_ids[1], c_ids[1])] and c_ids[0] == p_ids[0]
    assert [(s.request_id, s.start, s.token_ids) for s in nxt.scheduled] == [("p", 6, [5]), ("p#1", 6, [8])]
