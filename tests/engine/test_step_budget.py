"""The decode-slowdown bound: a prompt beside decoding sequences goes in chunks of a step's room, as the
time saved up for it allows (learned step costs), never below one row; nothing is cut without decoders;
exact-mode outputs do not change."""

from __future__ import annotations

import json

import pytest
from engine_helpers import make_llm

from kvflow import SamplingParams
from kvflow.config import engine_config
from kvflow.engine.step_budget import PromptChunkCosts, StepBudget, attended_positions

from .test_scheduler import make_request, make_scheduler, step

PER_ROW, PER_ATTENDED, PER_DEPTH = 1e-3, 0.5e-3, 2e-3  # seconds; the last two per 1,000 positions


def chunk_seconds(start: int, rows: int) -> float:
    return PER_ROW * rows + (PER_ATTENDED * attended_positions(start, rows) + PER_DEPTH * start) / 1000


def taught_chunk_costs() -> PromptChunkCosts:
    costs = PromptChunkCosts()
    for start in range(0, 8000, 250):
        for rows in (1, 3, 17, 64):
            costs.observe(rows, attended_positions(start, rows), start, chunk_seconds(start, rows))
    return costs


def test_attended_positions_counts_each_row_up_to_itself():
    assert attended_positions(0, 1) == 1
    assert attended_positions(10, 3) == 11 + 12 + 13


def test_chunk_costs_learn_rows_attention_and_depth():
    costs = taught_chunk_costs()
    for start, rows in ((0, 512), (4000, 2), (7000, 40)):
        assert costs.seconds(start, rows) == pytest.approx(chunk_seconds(start, rows), rel=0.02)


def test_rows_within_is_the_most_that_fit():
    costs = taught_chunk_costs()
    for start, seconds in ((0, 0.05), (3000, 0.05), (6000, 0.2)):
        n = costs.rows_within(seconds, start)
        assert chunk_seconds(start, n) <= seconds * 1.02 and chunk_seconds(start, n + 1) >= seconds * 0.98, (start, n)
    assert costs.rows_within(1e-6, 5000) == 1  # not even the K/V read fits: one row still goes


def test_a_fit_that_says_rows_cost_nothing_grows_a_chunk_at_most_twofold():
    """A step's prompt part is its time less the predicted decode part: where that prediction runs high,
    thin chunks at depth seem to cost nothing, and the fit would grant any number of rows (the cause of a
    47 s step among decoders at depth 25K, planned at 200 ms). A chunk still grows at most GROWTH times
    the last ones."""
    costs = PromptChunkCosts()
    for start in range(20000, 20400, 8):
        costs.observe(8, attended_positions(start, 8), start, 0.0)
    assert costs.seconds(24000, 2000) < 1e-3  # the fit's view: rows are free
    assert costs.rows_within(0.2, 20400) == PromptChunkCosts.GROWTH * 8
    # After a chunk of 16 rows, the next may be 32.
    costs.observe(16, attended_positions(20400, 16), 20400, 0.0)
    assert costs.rows_within(10.0, 20416) == PromptChunkCosts.GROWTH * 16


def budget_with_decodes(slowdown: float, decode_seconds: float = 0.010) -> StepBudget:
    """A budget that has seen decode-only steps of 8 sequences taking decode_seconds, and prompt chunks."""
    budget = StepBudget(slowdown)
    for _ in range(40):
        budget.decode_costs.observe(8, 0, decode_seconds, 8 * 100)
        budget.decode_costs.observe(1, 0, decode_seconds / 4, 100)
    budget.chunk_costs = taught_chunk_costs()
    return budget


def test_a_prompt_beside_decoders_gets_what_the_slowdown_allows():
    sched = make_scheduler(num_blocks=512, block_size=16, max_num_batched_tokens=2048)
    sched.step_budget = budget_with_decodes(2.0)
    for i in range(8):
        sched.add_request(make_request(f"d{i}", 90, max_tokens=500, ignore_eos=True))
    step(sched)
    step(sched)  # all eight decode now
    sched.add_request(make_request("long", 3000, max_tokens=1))
    out = step(sched)
    chunk = next(s for s in out.scheduled if s.request_id == "long")
    decode = sched.step_budget.decode_costs.seconds(8, sum(r.num_tokens - 1 for r in sched.running[:8]))
    assert sched.step_budget.limit_seconds == pytest.approx(2 * decode, rel=0.05)
    assert 1 < chunk.num_tokens < 2048
    assert chunk_seconds(0, chunk.num_tokens) <= decode * 1.05 and chunk_seconds(0, chunk.num_tokens + 1) >= decode * 0.95
    assert all(s.num_tokens == 1 for s in out.scheduled if s.request_id != "long")  # every decoder went
    # Deeper in the prompt the same allowance buys fewer rows.
    first = chunk.num_tokens
    for _ in range(40):
        out = step(sched)
    deeper = next(s for s in out.scheduled if s.request_id == "long")
    assert deeper.start > first and deeper.num_tokens < first


def test_a_long_prompt_goes_in_whole_steps_between_plain_decode_steps():
    """With room for 40 ms of prompt a step and 10 ms decodes, the bucket fills in four steps: a chunk of
    40 ms, then plain decode steps until the next, so the decoders' pace averages twice their own."""
    sched = make_scheduler(num_blocks=1024, block_size=16, max_num_batched_tokens=2048)
    sched.step_budget = budget_with_decodes(2.0)
    sched.step_budget.max_step_seconds = 0.050
    for i in range(8):
        sched.add_request(make_request(f"d{i}", 90, max_tokens=500, ignore_eos=True))
    step(sched)
    step(sched)
    sched.add_request(make_request("long", 6000, max_tokens=1))
    chunks = []
    for _ in range(40):
        out = step(sched)
        assert sum(s.num_tokens == 1 for s in out.scheduled) >= 8  # the decoders go every step
        chunk = next((s for s in out.scheduled if s.request_id == "long"), None)
        chunks.append(None if chunk is None else (chunk.start, chunk.num_tokens))
        assert sched.step_budget.limit_seconds == 0.050
    taken = [c for c in chunks if c is not None]
    assert chunks[0] is not None  # the bucket starts full: a prompt after a quiet spell goes at once
    decode = sched.step_budget.decode_costs.seconds(8, 8 * 100)
    for start, rows in taken:  # each chunk a whole step's room
        assert chunk_seconds(start, rows) <= (0.050 - decode) * 1.1, (start, rows)
        assert chunk_seconds(start, rows + 1) >= (0.050 - decode) * 0.9, (start, rows)
    # Room 40 ms, refilled 10 ms a step: about one step in four carries the prompt.
    assert 8 <= len(taken) <= 13, chunks
    spent = sum(chunk_seconds(start, rows) for start, rows in taken)
    assert spent <= 40 * decode * 1.15 + (0.050 - decode)


def test_no_decoders_or_no_bound_leaves_the_token_budget_alone():
    for slowdown, decoders in ((2.0, 0), (0.0, 8)):
        sched = make_scheduler(num_blocks=512, block_size=16, max_num_batched_tokens=2048)
        sched.step_budget = budget_with_decodes(slowdown)
        for i in range(decoders):
            sched.add_request(make_request(f"d{i}", 90, max_tokens=500, ignore_eos=True))
        step(sched)
        step(sched)
        sched.add_request(make_request("long", 3000, max_tokens=1))
        out = step(sched)
        chunk = next(s for s in out.scheduled if s.request_id == "long")
        assert chunk.num_tokens == 2048 - decoders, (slowdown, decoders)
        assert sched.step_budget.limit_seconds == 0


def test_before_any_decode_step_nothing_is_cut():
    sched = make_scheduler(num_blocks=512, block_size=16, max_num_batched_tokens=2048)
    for i in range(4):
        sched.add_request(make_request(f"d{i}", 90, max_tokens=500, ignore_eos=True))
    step(sched)
    sched.add_request(make_request("long", 3000, max_tokens=1))
    chunk = next(s for s in step(sched).scheduled if s.request_id == "long")
    assert chunk.num_tokens == 2048 - 4


def test_the_bound_is_checked():
    with pytest.raises(ValueError, match="max_decode_slowdown"):
        engine_config(max_decode_slowdown=0.5)
    assert engine_config(max_decode_slowdown=0).scheduler.max_decode_slowdown == 0
    with pytest.raises(ValueError, match="max_decode_slowdown"):
        engine_config(max_decode_slowdown=1.0)  # nothing would ever be saved up for the prompts
    with pytest.raises(ValueError, match="max_step_ms"):
        engine_config(max_step_ms=0)


def test_exact_outputs_are_the_same_bounded_or_not_and_the_trace_shows_the_limit(tmp_path, tiny_packed):
    """Real steps on the tiny model: with the bound, the long prompt goes in small chunks beside the decoders
    (every such step records the limit it was planned to), and every greedy output is what it is without."""
    prompts = [list(range(3 + i, 40 + i)) for i in range(4)]
    long_prompt = [5 + (i * 7) % 200 for i in range(400)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs, traces = {}, {}
    bounded = 1.0001  # all but no time for prompt rows beside decodes: one row a step
    for slowdown in (0.0, bounded):
        trace = tmp_path / f"trace-{slowdown}.jsonl"
        llm = make_llm(tiny_packed, max_decode_slowdown=slowdown, max_step_ms=1e-6, max_num_batched_tokens=256,
                       trace_file=str(trace), enable_prefix_caching=False)
        engine = llm.engine
        for _ in range(3):  # decode-only steps to learn from
            engine.add_request("warm", prompts[0], SamplingParams(temperature=0, max_tokens=8))
            while engine.has_unfinished_requests():
                engine.step()
        ids = [engine.add_request(f"d{i}", p, params) for i, p in enumerate(prompts)]
        for _ in range(4):
            engine.step()
        ids.append(engine.add_request("long", long_prompt, params))
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        assert all(engine.scheduler.get_request(i) is None for i in ids)
        outputs[slowdown] = done
        traces[slowdown] = [json.loads(line) for line in trace.read_text().splitlines()]
    assert outputs[bounded] == outputs[0.0] and set(outputs[0.0]) == {"d0", "d1", "d2", "d3", "long"}
    limited = [r for r in traces[bounded] if r["limit_seconds"] > 0 and r["prefill_tokens"] > 0]
    assert limited, "no step carried the long prompt beside the decoders under a limit"
    assert max(r["prefill_tokens"] for r in limited) < 256 - 4
    assert all(r["limit_seconds"] == 0 for r in traces[0.0])
    unbounded = [r["prefill_tokens"] for r in traces[0.0] if r["prefill_tokens"] > 0]
    assert max(unbounded) >= 256 - 4  # without the bound the long prompt fills the token budget


def eight_decoders(max_step_seconds: float):
    """A scheduler whose step budget (slowdown 2) has learned decode steps, after the first step of eight
    decoding requests."""
    sched = make_scheduler(num_blocks=1024, block_size=16, max_num_batched_tokens=2048)
    budget = sched.step_budget = budget_with_decodes(2.0)
    budget.max_step_seconds = max_step_seconds
    for i in range(8):
        sched.add_request(make_request(f"d{i}", 90, max_tokens=500, ignore_eos=True))
    step(sched)
    return sched, budget


def test_what_a_chunk_overran_by_comes_out_of_the_bucket():
    """A chunk predicted at 40 ms that took 60 ms leaves the bucket 20 ms short, so the next chunk waits
    two more steps: the decoders' average pace holds even where the fit is wrong."""
    sched, budget = eight_decoders(max_step_seconds=0.050)
    step(sched)
    sched.add_request(make_request("long", 6000, max_tokens=1))
    out = sched.schedule()
    chunk = next(s for s in out.scheduled if s.request_id == "long")
    predicted = budget.chunk_costs.seconds(chunk.start, chunk.num_tokens)
    decode = budget.decode_seconds(8, sum(s.start + s.num_tokens for s in out.scheduled if s.num_tokens == 1))
    left = budget.bucket
    budget.observe(out, decode + predicted + 0.020)
    assert budget.bucket == pytest.approx(left - 0.020, abs=1e-3)
    sched.update_from_output(out, {s.request_id: [7] for s in out.scheduled if s.sample})


def test_steps_with_no_prompt_in_view_refill_the_bucket_by_what_they_took_without_a_fit():
    """Decode steps with nothing waiting plan nothing (no fit of the decode costs); each adds
    (slowdown - 1) times its measured time, and a prompt that then arrives finds that much saved up."""
    sched, budget = eight_decoders(max_step_seconds=0.050)
    budget.bucket = 0.0  # as after a chunk that took it all
    for _ in range(3):
        budget.decode_costs._theta = None  # what such a step does not need: a refit
        out = sched.schedule()
        assert budget.limit_seconds == 0 and budget.decode_costs._theta is None  # nothing planned
        budget.observe(out, 0.004)
        sched.update_from_output(out, {s.request_id: [7] for s in out.scheduled if s.sample})
    assert budget.bucket == 0.0
    sched.add_request(make_request("long", 6000, max_tokens=1))
    out = sched.schedule()
    decode = budget.decode_seconds(8, sum(r.num_tokens for r in sched.running if r.request_id != "long"))
    assert budget.limit_seconds == 0.050
    chunk = next((s for s in out.scheduled if s.request_id == "long"), None)
    spent = chunk_seconds(chunk.start, chunk.num_tokens) if chunk else 0.0
    # Three unplanned steps of 4 ms and this step's predicted decode, each times (2 - 1).
    assert budget.bucket + spent == pytest.approx(3 * 0.004 + decode, rel=0.02)
