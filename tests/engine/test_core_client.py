"""The engine core in its own process against the same engine in-process, on the default model in float32:
the core sends token ids only, and the front end makes the text, matches stop strings and names the logprob
tokens (engine/output_assembly.py). Every output must equal the in-process engine's, field by field."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvflow.config import engine_config
from kvflow.engine.async_engine import AsyncEngine
from kvflow.engine.core_client import EngineCoreClient
from kvflow.engine.engine import LLMEngine
from kvflow.sampling_params import SamplingParams

# n-gram speculation in both: kept drafts put several ids in one step, so a stop string can end the text
# among them (the ids after it are dropped in both).
OPTIONS = dict(dtype="float32", device="cpu", max_model_len=4096, num_blocks=256, threads=1,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})

CAPITALS = "<|im_start|>user\nName the capital of France, then the capital of Italy.<|im_end|>\n<|im_start|>assistant\n"
STORY = "Once upon a time, in a land far away, there lived a"
CASES = [
    ("greedy, no stop", CAPITALS, SamplingParams(temperature=0, max_tokens=40)),
    ("stop string", CAPITALS, SamplingParams(temperature=0, max_tokens=60, stop=["Italy", "Rome"])),
    ("stop string kept", STORY, SamplingParams(temperature=0, max_tokens=60, stop=["the"],
                                               include_stop_str_in_output=True)),
    ("logprobs and prompt logprobs", STORY, SamplingParams(temperature=0, max_tokens=12, logprobs=3,
                                                           prompt_logprobs=2, stop=["."])),
    ("n=3 seeded, a stop string", STORY, SamplingParams(temperature=0.9, seed=7, n=3, max_tokens=30,
                                                         stop=[" a "], logprobs=1)),
    ("repeated text, drafts kept", "one two three four five six seven eight nine ten. one two three four five six "
     "seven eight nine ten. one two", SamplingParams(temperature=0, max_tokens=30, stop=["seven eight"])),
]


@pytest.fixture(scope="module")
def core():
    client = EngineCoreClient(engine_config(**OPTIONS))
    client.start()
    yield client
    client.shutdown()


@pytest.fixture(scope="module")
def in_process(default_loaded):
    engine = AsyncEngine(LLMEngine(engine_config(**OPTIONS), loaded=default_loaded))
    engine.start()
    yield engine
    engine.shutdown()


async def collect(engine, prompt: str, params: SamplingParams) -> tuple[list, object]:
    """Every output's (index, delta text, delta ids) and the last output."""
    deltas, last = [], None
    async for out in engine.generate(prompt, params):
        deltas += [(c.index, c.delta_text, c.delta_token_ids) for c in out.outputs]
        last = out
    return deltas, last


def joined(deltas: list) -> dict[int, tuple[str, list[int]]]:
    """Per sequence: its deltas put together."""
    parts: dict[int, tuple[str, list[int]]] = {}
    for index, text, ids in deltas:
        old_text, old_ids = parts.get(index, ("", []))
        parts[index] = (old_text + text, old_ids + ids)
    return parts


def logprob_view(entries) -> list | None:
    if entries is None:
        return None
    return [None if e is None else {t: (round(lp.logprob, 4), lp.rank, lp.decoded_token) for t, lp in e.items()}
            for e in entries]


@pytest.mark.parametrize("name, prompt, params", CASES, ids=[c[0] for c in CASES])
def test_outputs_equal_the_in_process_engine(core, in_process, name, prompt, params):
    got_deltas, got = asyncio.run(collect(core, prompt, params))
    want_deltas, want = asyncio.run(collect(in_process, prompt, params))
    assert got.finished and want.finished
    if params.stop:  # each case's stop string does end its text: the front end's matching is exercised
        assert all(c.stop_reason in params.stop for c in got.outputs), got.outputs
    assert got.prompt == want.prompt and got.prompt_token_ids == want.prompt_token_ids
    assert len(got.outputs) == len(want.outputs) == params.n
    for g, w in zip(sorted(got.outputs, key=lambda c: c.index), sorted(want.outputs, key=lambda c: c.index)):
        assert (g.index, g.text, g.token_ids) == (w.index, w.text, w.token_ids), name
        assert (g.finish_reason, g.stop_reason) == (w.finish_reason, w.stop_reason), name
        assert logprob_view(g.logprobs) == logprob_view(w.logprobs)
        if g.cumulative_logprob is not None:
            assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-3)
    assert logprob_view(got.prompt_logprobs) == logprob_view(want.prompt_logprobs)
    assert got.metrics.num_generated_tokens == sum(len(c.token_ids) for c in got.outputs)
    # The stream's deltas add up to the final text and ids, for every sequence.
    assert joined(got_deltas) == {c.index: (c.text, c.token_ids) for c in got.outputs}
    assert joined(want_deltas) == joined(got_deltas)


def test_a_stop_string_matched_in_the_front_end_frees_the_sequence_in_the_core(core):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, stop=["Italy"])
    _, out = asyncio.run(collect(core, CAPITALS, params))
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == "Italy"
    assert out.metrics.finished_time is not None
    deadline = time.monotonic() + 10
    while (core.stats.num_running or core.stats.num_blocks_used) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert core.stats.num_running == 0 and core.stats.num_blocks_used == 0, core.stats
    # The core goes on serving.
    _, again = asyncio.run(collect(core, STORY, SamplingParams(temperature=0, max_tokens=5)))
    assert again.outputs[0].finish_reason == "length" and len(again.outputs[0].token_ids) == 5
