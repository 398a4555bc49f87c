"""One torchrun rank of a tensor-parallel run (test_across_machines.py): rank 0 generates and saves its greedy
tokens and every step's logits; the other ranks run rank 0's steps on their shard.

    torchrun ... torchrun_rank.py MODEL_DIR OUT_FILE
"""

from __future__ import annotations

import faulthandler
import os
import sys

import torch

from kvflow import SamplingParams
from kvflow.config import ModelConfig
from kvflow.engine import rank_worker

PROMPTS = [{"prompt_token_ids": [5, 9, 33, 100, 7]}, {"prompt_token_ids": list(range(3, 70))}]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
OPTIONS = dict(dtype="float32", kv_cache_memory=8 << 20)


def main(model: str, out: str) -> int:
    world = int(os.environ["WORLD_SIZE"])
    if int(os.environ["RANK"]) != 0:
        return rank_worker.torchrun_main(ModelConfig(model=model, dtype="float32", device="cpu", threads=1,
                                                tensor_parallel_size=world))
    sys.path.insert(0, os.path.dirname(__file__))
    from tp_helpers import run_capturing_logits

    tokens, logits = run_capturing_logits(model, world, PROMPTS, PARAMS, **OPTIONS)
    torch.save({"tokens": tokens, "logits": logits}, out)
    return 0


if __name__ == "__main__":
    faulthandler.enable()  # a native abort prints this rank's Python stack into the test's log
    sys.exit(main(sys.argv[1], sys.argv[2]))
