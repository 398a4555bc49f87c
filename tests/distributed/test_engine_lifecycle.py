"""Engines of different tensor-parallel sizes, one after another in one process (a notebook's life): each
starts from a clean process, whether the one before was closed or only dropped.

Each scenario runs in a fresh interpreter: a group left over by a failure must not poison the test process,
and a hang (rank 0 waiting on a group whose other rank waits for another message) becomes a timeout."""

from __future__ import annotations

import json
import subprocess
import sys

TIMEOUT_S = 180

PRELUDE = """
import gc, json, os, sys, threading
from kvflow import LLM, SamplingParams
from kvflow.distributed import group

TINY = sys.argv[1]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPT = [{"prompt_token_ids": [5, 9, 33, 100]}]
OPTIONS = dict(threads=1, device="cpu", dtype="float32", kv_cache_memory=8 << 20, speculative_config="off")

def tokens(llm):
    return llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids

def alive(pids):
    gone = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            gone.append(pid)
    return [pid for pid in pids if pid not in gone]

def watchers():
    return [t.name for t in threading.enumerate() if t.name == "kvflow-tp-watch"]
"""

CLOSED = PRELUDE + """
report = {}
split = LLM(TINY, tensor_parallel_size=2, **OPTIONS)
pids = [p.pid for p in split.engine.ranks.processes]
report["tp2"] = tokens(split)
# A whole model beside the split one: it loads all of its heads, whatever group the process is in.
whole = LLM(TINY, **OPTIONS)
report["tp1"] = tokens(whole)
report["tp1_split"] = whole.engine.loaded.tensor_parallel is not None
split.close()
report["after_close"] = {"group": group.current() is not None, "ranks": alive(pids), "watchers": watchers()}
report["tp1_after_close"] = tokens(whole)
whole.close()
with LLM(TINY, tensor_parallel_size=2, **OPTIONS) as llm:
    report["tp2_again"] = tokens(llm)
print(json.dumps(report))
"""

DROPPED = PRELUDE + """
report = {}
# The issue's case: a split engine used and dropped without close(), then one of SmolLM2 (9 heads, which
# 2 does not divide) with no tensor parallelism asked.
llm = LLM(TINY, tensor_parallel_size=2, **OPTIONS)
pids = [p.pid for p in llm.engine.ranks.processes]
report["tp2"] = tokens(llm)
del llm
default = LLM(None, max_model_len=512, **OPTIONS)
report["default"] = len(tokens(default))
report["default_split"] = default.engine.loaded.tensor_parallel is not None
# Dropped again, held only by a reference cycle: a new split engine collects it instead of refusing.
cyclic = LLM(TINY, tensor_parallel_size=2, **OPTIONS)
cyclic.itself = cyclic
del cyclic
llm = LLM(TINY, tensor_parallel_size=2, **OPTIONS)
report["tp2_again"] = tokens(llm)
del llm
gc.collect()
report["after_drop"] = {"group": group.current() is not None, "ranks": alive(pids), "watchers": watchers()}
print(json.dumps(report))
"""


def run_script(script: str, tiny: str) -> dict:
    run = subprocess.run([sys.executable, "-c", script, tiny], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_closed_engines_of_other_sizes_follow_each_other(tiny_checkpoints):
    report = run_script(CLOSED, str(tiny_checkpoints["llama"]))
    assert report["after_close"] == {"group": False, "ranks": [], "watchers": []}
    assert not report["tp1_split"], "the engine with no tensor parallelism loaded a rank's share"
    assert report["tp1"] == report["tp2"] == report["tp1_after_close"] == report["tp2_again"]


def test_an_engine_dropped_without_close_takes_its_ranks_with_it(tiny_checkpoints):
    report = run_script(DROPPED, str(tiny_checkpoints["llama"]))
    assert report["default"] == 4
    assert not report["default_split"], "the engine with no tensor parallelism loaded a rank's share"
    assert report["tp2_again"] == report["tp2"]
    assert report["after_drop"] == {"group": False, "ranks": [], "watchers": []}
