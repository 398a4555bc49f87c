"""Leaving the tensor-parallel group really tears it down: once the engine closes, rank 0's process has no
gloo thread left. One that lives on runs into interpreter teardown, where it aborted a torchrun rank now and
then ("terminate called without an active exception", SIGABRT after the run's work was done)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# In a fresh interpreter: what has been imported before the group is made decides what can pin it, and this
# test process has imported much already. The tokenizer's load imports transformers' FSDP support, which
# imports torch.distributed.nn: that is the import that pinned the group.
SCRIPT = """
import json, os, sys
from kvflow import LLM, SamplingParams

with LLM(sys.argv[1], tensor_parallel_size=2, threads=1, device="cpu", dtype="float32",
         kv_cache_memory=8 << 20, speculative_config="off") as llm:
    out = llm.generate([{"prompt_token_ids": [5, 9, 33]}], SamplingParams(temperature=0, max_tokens=3))
tokens = out[0].outputs[0].token_ids
threads = []
for task in os.listdir("/proc/self/task"):
    with open(f"/proc/self/task/{task}/comm") as comm:
        threads.append(comm.read().strip())
print(json.dumps({"tokens": tokens, "threads": threads, "imported": "torch.distributed.nn" in sys.modules}))
"""


# /proc/self/task names a process's threads on Linux only (CI runs Linux).
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux's /proc to list threads")
def test_no_gloo_thread_outlives_the_engine(tiny_checkpoints):
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_checkpoints["llama"])], capture_output=True,
                         text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(report["tokens"]) == 3
    assert report["imported"], "the import that used to pin the group did not happen: the test checks nothing"
    left = [name for name in report["threads"] if "gloo" in name]
    assert not left, f"gloo threads still running after the engine closed: {left}"
