"""Tensor parallelism's two ends of the engine. Rank 0's engine leads (`lead`): it sends the other ranks
the layout of its KV cache, then every step. A rank other than 0 (`run`): load this rank's shard, build a
KV cache laid out as rank 0's, run every step it sends.

The other ranks are started by kvflow/distributed/launch.py (spawned on this machine; the engine names this
module) or by torchrun (`kvflow serve --tensor-parallel-size N` on each node: ranks other than 0 land here
instead of serving). They never sample, schedule or answer anyone.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import sys
from typing import TYPE_CHECKING

import torch

from kvflow.config import CacheConfig, EngineConfig, ModelConfig
from kvflow.distributed import group, step_channel
from kvflow.distributed.group import TensorParallelError
from kvflow.distributed.step_channel import CacheLayout, Driver

if TYPE_CHECKING:
    from kvflow.engine.runner import ModelRunner
    from kvflow.spec.config import SpeculativeConfig

log = logging.getLogger("kvflow")


def lead(runner: ModelRunner, ranks, config: EngineConfig, speculative: SpeculativeConfig | None,
         attention_backend: str) -> None:
    """Rank 0 of a tensor-parallel group (`ranks`, as kvflow/distributed/launch.py started them): refuse what
    cannot run split yet, lay the other ranks' KV caches out as this one's, then hand them every step."""
    if config.cache.prefix_cache_dir is not None:
        raise ValueError("--prefix-cache-dir does not run with tensor parallelism yet (each rank holds a "
                         "share of every block)")
    if speculative is not None and speculative.method == "draft_model":
        raise ValueError("a draft model does not run with tensor parallelism yet; use ngram or suffix")
    sched = config.scheduler
    layout = CacheLayout(runner.group_blocks, runner.block_size, config.cache.kv_cache_dtype,
                         attention_backend, sched.max_num_seqs, sched.max_num_batched_tokens)
    runner.tp_driver = Driver(ranks)
    runner.tp_driver.send_layout(layout)


def spawned_main(argv: list[str]) -> int:
    """Entry of a rank launch.py starts: RANK WORLD_SIZE INIT_METHOD MODEL_CONFIG_JSON."""
    rank, world_size, init_method, config = int(argv[0]), int(argv[1]), argv[2], json.loads(argv[3])
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {rank} %(levelname)s %(message)s")
    model_config = ModelConfig(**config)
    if group.backend_for(model_config.device) == "nccl":  # one GPU per rank on this machine
        torch.cuda.set_device(rank)
    group.join(rank, world_size, init_method, model_config.device)
    return run(model_config)


def torchrun_main(model_config: ModelConfig) -> int:
    """A rank other than 0 that torchrun started (`kvflow serve --tensor-parallel-size N` on every node)."""
    tp = group.join_from_env(model_config.tensor_parallel_size, model_config.device)
    log.info("rank %d of %d (torchrun): running rank 0's steps", tp.rank, tp.world_size)
    return run(model_config)


def run(model_config: ModelConfig) -> int:
    """Load this rank's shard and run rank 0's steps until it says stop (0) or a rank fails (1)."""
    from kvflow.engine.runner import ModelRunner
    from kvflow.executors.model_setup import load_model, set_threads

    # This process is the rank (spawned by launch.py, or by torchrun through `kvflow serve`): one that dies
    # in native code prints its Python stack to its own stderr.
    faulthandler.enable()
    set_threads(model_config.threads)
    torch.manual_seed(model_config.seed)
    tp = group.current()
    stopped = False  # by rank 0's "stop": the group is healthy, and its ranks leave it together
    try:
        loaded = load_model(model_config, with_tokenizer=False, tensor_parallel=tp)
        first = step_channel.receive()
        if first.kind != "layout":  # rank 0 stopped before its first step
            stopped = first.kind == "stop"
            return 0
        layout = first.layout
        cache = CacheConfig(block_size=layout.block_size, kv_cache_dtype=layout.kv_cache_dtype)
        runner = ModelRunner(loaded, cache, layout.attention_backend, layout.max_num_seqs,
                             max_num_batched_tokens=layout.max_num_batched_tokens, group_blocks=layout.group_blocks)
        log.info("rank %d of %d ready: %d of %d attention heads", tp.rank, tp.world_size, loaded.arch.num_heads,
                 loaded.arch.num_heads * tp.world_size)
        while True:
            message = step_channel.receive()
            if message.kind == "stop":
                stopped = True
                return 0
            runner.run_shard_step(message.block_copies, message.inputs)
    except TensorParallelError as exc:
        log.error("rank %d stops: %s", tp.rank, exc)
        return 1
    finally:
        group.leave(together=stopped)


if __name__ == "__main__":
    sys.exit(spawned_main(sys.argv[1:]))
