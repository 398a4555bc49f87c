"""Scheduling for reuse: the "lpm" policy admits the waiting request whose prompt the prefix cache holds most
of, but passes over no request more than LPM_MAX_PASSES times; "fcfs" keeps arrival order. And the blocks a
waiting request will hit are the last ones the pool gives away."""

from __future__ import annotations

import pytest

from engine.test_scheduler import counts, distinct_prompt, make_request, make_scheduler, step
from kvflow.engine.scheduler import LPM_MAX_PASSES

SHARED = distinct_prompt("shared context", 40)


def warm(sched) -> None:
    """Run one request over SHARED to its end, so SHARED's ten blocks sit in the prefix cache."""
    sched.add_request(make_request("warm", SHARED + [5], max_tokens=1))
    while sched.has_unfinished_requests():
        step(sched)


@pytest.mark.parametrize("policy", ["lpm", "fcfs"])
def test_a_cached_turn_goes_ahead_of_a_cold_prompt_under_lpm(policy):
    sched = make_scheduler(max_num_batched_tokens=16, scheduling_policy=policy)
    warm(sched)
    sched.add_request(make_request("cold", 48))
    sched.add_request(make_request("turn", SHARED + [9, 9, 9]))
    out = step(sched)
    if policy == "lpm":  # the turn's 40 cached tokens count as computed: 3 to go, then the cold one's chunk
        assert counts(out) == {"turn": 3, "cold": 13}
        assert out.scheduled[0].start == 40
    else:
        assert counts(out) == {"cold": 16}


def test_no_request_is_passed_over_more_than_the_bound():
    sched = make_scheduler(max_num_batched_tokens=8, max_num_seqs=1, scheduling_policy="lpm")
    warm(sched)
    sched.add_request(make_request("cold", 8, max_tokens=1))
    for i in range(LPM_MAX_PASSES + 2):
        sched.add_request(make_request(f"turn{i}", SHARED + [10 + i], max_tokens=1))
    admitted = []
    while sched.has_unfinished_requests():
        out = step(sched)
        admitted += [s.request_id for s in out.scheduled if s.request_id not in admitted]
    assert admitted.index("cold") == LPM_MAX_PASSES
    assert sched.get_request("cold") is None and all(r.startswith(("turn", "cold")) for r in admitted)


@pytest.mark.parametrize("kept", [True, False])
def test_blocks_a_waiting_request_will_hit_are_given_away_last(kept, monkeypatch):
    # 24 blocks of 4. After 'warm' (11 blocks) and 'other' (6), SHARED's 10 blocks are the least recently
    # freed of the 15 cached ones, and 9 blocks hold nothing.
    sched = make_scheduler(num_blocks=24, max_num_batched_tokens=64, max_num_seqs=1, scheduling_policy="fcfs")
    warm(sched)
    sched.add_request(make_request("other", 20, max_tokens=1))
    while sched.has_unfinished_requests():
        step(sched)
    if not kept:  # the control: without moving them, the runner's allocation takes SHARED's last 3 blocks
        monkeypatch.setattr(sched.kv_cache_manager, "keep_for_waiting", lambda request: 0)
    sched.add_request(make_request("runner", 48, max_tokens=1))  # 12 blocks: the 9 empty ones and 3 cached
    sched.add_request(make_request("turn", SHARED + [3], max_tokens=1))  # waits behind it (one sequence a step)
    starts = {}
    while sched.has_unfinished_requests():
        for s in step(sched).scheduled:
            starts.setdefault(s.request_id, s.start)
    assert starts["turn"] == (40 if kept else 28)
