"""AsyncEngine in-process on a tiny model: streams, errors, aborts from other threads, idling, stats."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import pytest

from kvflow.config import engine_config
from kvflow.engine.async_engine import AsyncEngine, EngineDeadError, build_off_the_main_thread
from kvflow.engine.engine import LLMEngine
from kvflow.sampling_params import SamplingParams

LONG = SamplingParams(temperature=0, max_tokens=170, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    # 12 blocks of 16 tokens: small enough that four ~95-token requests must preempt each other.
    llm = LLMEngine(engine_config(model=str(tiny_model_dir), num_blocks=12, block_size=16))
    async_engine = AsyncEngine(llm)
    async_engine.start()
    yield async_engine
    async_engine.shutdown()


def wait_idle(engine: AsyncEngine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats
        if s.num_running == 0 and s.num_waiting == 0 and s.num_blocks_used == 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"engine not idle: {engine.stats}")


def test_stream_deltas_add_up_to_the_final_text(engine):
    async def run():
        deltas, last = [], None
        async for out in engine.generate("hello world", SamplingParams(temperature=0, max_tokens=20,
                                                                       ignore_eos=True)):
            deltas.append(out.outputs[0].delta_text)
            last = out
        return deltas, last

    deltas, last = asyncio.run(run())
    assert last.finished and last.outputs[0].finish_reason == "length"
    assert "".join(deltas) == last.outputs[0].text and len(last.outputs[0].token_ids) == 20
    wait_idle(engine)


def test_validation_errors_come_back_to_the_caller(engine):
    async def run():
        await engine.add_request([5] * 600, SamplingParams(max_tokens=1))

    with pytest.raises(ValueError, match="600 tokens"):
        asyncio.run(run())
    wait_idle(engine)


def test_abort_from_another_thread_frees_blocks(engine):
    async def run():
        stream = await engine.add_request("hello", LONG)
        first = await stream.__anext__()
        threading.Thread(target=engine.abort, args=(stream.request_id,)).start()
        outs = [out async for out in stream]
        return first, outs

    first, outs = asyncio.run(run())
    assert not first.finished
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert len(outs[-1].outputs[0].token_ids) < 170
    wait_idle(engine)


def test_a_slow_reader_gets_merged_outputs(engine):
    async def run():
        stream = await engine.add_request("hello", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        await asyncio.sleep(1.0)  # the engine runs ahead; nothing blocks it
        return [out async for out in stream]

    outs = asyncio.run(run())
    assert len(outs) < 30
    assert "".join(o.outputs[0].delta_text for o in outs) == outs[-1].outputs[0].text


def test_idle_engine_thread_sleeps(engine):
    wait_idle(engine)
    steps = engine.stats.num_steps
    cpu = time.thread_time()
    process_cpu = time.process_time()
    time.sleep(1.0)
    assert engine.stats.num_steps == steps
    spent = time.process_time() - process_cpu - (time.thread_time() - cpu)
    assert spent < 0.2  # a spinning loop would burn a whole core here


async def last(stream):
    outs = [out async for out in stream]
    return outs[-1]


def test_preemptions_are_counted(engine):
    params = SamplingParams(temperature=0, max_tokens=90, ignore_eos=True)

    async def run():
        streams = [await engine.add_request(f"prompt number {i}", params) for i in range(4)]
        return [await last(s) for s in streams]

    finals = asyncio.run(run())
    assert all(len(f.outputs[0].token_ids) == 90 for f in finals)
    assert engine.stats.num_preemptions > 0
    wait_idle(engine)


def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(engine, monkeypatch):
    real_step = engine.engine.step
    calls = []

    def broken_step():
        if not calls:
            calls.append(1)
            raise RuntimeError("injected fault")
        return real_step()

    monkeypatch.setattr(engine.engine, "step", broken_step)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

    async def run():
        with pytest.raises(EngineDeadError, match="injected fault"):
            await last(await engine.add_request("hello", params))
        return await last(await engine.add_request("hello", params))

    after = asyncio.run(run())
    assert len(after.outputs[0].token_ids) == 5
    wait_idle(engine)


def test_shutdown_refuses_new_requests(tiny_model_dir):
    own = AsyncEngine(LLMEngine(engine_config(model=str(tiny_model_dir), num_blocks=8)))
    own.start()
    own.shutdown()

    async def run():
        await own.add_request("hi", SamplingParams(max_tokens=1))

    with pytest.raises(EngineDeadError):
        asyncio.run(run())


def test_building_off_the_main_thread_returns_the_engine_or_raises_its_error():
    seen = []
    assert build_off_the_main_thread(lambda: seen.append(threading.current_thread()) or 7) == 7
    assert seen[0] is not threading.main_thread()
    with pytest.raises(FileNotFoundError, match="no such model"):
        build_off_the_main_thread(lambda: (_ for _ in ()).throw(FileNotFoundError("no such model")))


def test_building_off_the_main_thread_leaves_no_openmp_pool_behind():
    """The load's OpenMP workers end with its thread (in a fresh process, so no earlier test's pool is
    there): the engine thread's pool will be the only one, and libgomp keeps it spinning."""
    code = (
        "import os, time, torch\n"
        "from kvflow.engine.async_engine import build_off_the_main_thread\n"
        "torch.set_num_threads(2)\n"
        "before = len(os.listdir('/proc/self/task'))\n"
        "build_off_the_main_thread(lambda: (torch.randn(1024, 1024) @ torch.randn(1024, 1024)).sum())\n"
        "time.sleep(0.2)\n"
        "after = len(os.listdir('/proc/self/task'))\n"
        "(torch.randn(1024, 1024) @ torch.randn(1024, 1024)).sum()\n"
        "print(before, after, len(os.listdir('/proc/self/task')))\n")
    before, after, with_pool = map(int, subprocess.run([sys.executable, "-c", code], capture_output=True,
                                                       text=True, check=True).stdout.split())
    assert after == before
    assert with_pool > before  # the check can see a pool: one started on this thread stays


def test_a_request_the_step_fails_on_fails_alone(engine, monkeypatch):
    """Its stream raises RequestFailedError; the others in the same steps finish as usual."""
    from kvflow.engine.async_engine import RequestFailedError

    real = engine.engine._sampling_row
    doomed = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, min_p=0.03)

    def sampling_row(seq, *args):
        if seq.request.sampling_params.min_p == doomed.min_p and seq.request.num_output_tokens == 3:
            raise RuntimeError("injected failure")
        return real(seq, *args)

    monkeypatch.setattr(engine.engine, "_sampling_row", sampling_row)
    good = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    errors_before = engine.num_engine_errors

    async def one(params):
        last = None
        try:
            async for out in engine.generate("hello world", params):
                last = out
        except RequestFailedError as exc:
            return str(exc)
        return last.outputs[0].token_ids

    async def run():
        return await asyncio.gather(one(good), one(doomed), one(good))

    first, failed, third = asyncio.run(run())
    assert len(first) == 12 and first == third
    assert "injected failure" in failed
    assert engine.num_engine_errors == errors_before, "no step failed as a whole"
    wait_idle(engine)
