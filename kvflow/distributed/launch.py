"""Starting a tensor-parallel group for rank 0: spawn the other ranks on this machine, or join torchrun's.

Ranks spawned here are watched: one that exits while the group is in use marks the group failed, which the
engine reports (on /health, and as the error of every request in flight) instead of waiting on it.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import socket
import subprocess
import sys
import threading
import time

import torch

from kvflow.config import ModelConfig
from kvflow.distributed import group, step_channel

log = logging.getLogger("kvflow")

POLL_S = 0.2  # how often the watcher looks at the spawned ranks


class Ranks:
    """Rank 0's handle on its group: the spawned processes (none under torchrun) and why the group failed."""

    def __init__(self, tp: group.TensorParallelGroup, processes: list) -> None:
        self.tp = tp
        self.processes = processes
        self.failure: str | None = None
        self._stopping = False
        self._watcher: threading.Thread | None = None
        if processes:
            self._watcher = threading.Thread(target=self._watch, name="kvflow-tp-watch", daemon=True)
            self._watcher.start()

    def _watch(self) -> None:
        while not self._stopping and self.failure is None:
            for rank, proc in enumerate(self.processes, start=1):
                code = proc.poll()
                if code is not None and not self._stopping:
                    self.fail(f"tensor-parallel rank {rank} exited (code {code})")
            time.sleep(POLL_S)

    def fail(self, reason: str) -> str:
        """Mark the group failed; returns the reason it keeps. A collective sees a dead peer as soon as its
        socket closes, before the watcher sees the process exit: a moment's wait names the rank and its code."""
        deadline = time.monotonic() + 5 * POLL_S
        while self.failure is None and self.processes and time.monotonic() < deadline:
            dead = [(rank, proc.returncode) for rank, proc in enumerate(self.processes, start=1)
                    if proc.poll() is not None]
            if dead:
                reason = f"tensor-parallel rank {dead[0][0]} exited (code {dead[0][1]})"
                break
            time.sleep(POLL_S / 4)
        if self.failure is None:
            self.failure = reason
            log.error("%s; the engine cannot run another step", reason)
        return self.failure

    def stop(self, timeout_s: float = 10.0) -> None:
        """Tell the other ranks to stop, wait for them a while, then leave the group."""
        if self._stopping:
            return
        self._stopping = True
        if self.failure is None:
            try:
                step_channel.send(step_channel.StepMessage("stop"))
            except group.TensorParallelError:
                pass
        group.leave(together=self.failure is None)
        deadline = time.monotonic() + timeout_s
        for proc in self.processes:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join()  # it sees _stopping within one poll


def start(model_config: ModelConfig, worker_module: str) -> Ranks | None:
    """Join (or make) the group model_config.tensor_parallel_size asks for; None for a single process.

    The other ranks run `python -m worker_module` (the engine's rank loop, named by the engine so that this
    package need not know it)."""
    size = model_config.tensor_parallel_size
    if size == 1 and not group.launched_by_torchrun():
        return None
    if group.current() is not None:
        gc.collect()  # an engine no longer referenced, held only by a reference cycle, stops its ranks
    if group.current() is not None:
        raise RuntimeError("this process already runs a tensor-parallel engine; close() it first")
    _check_shape(model_config)  # before any rank starts: a size that does not split the heads is refused
    if group.launched_by_torchrun():
        tp = group.join_from_env(size, model_config.device)
        if tp.rank != 0:
            raise RuntimeError(f"only rank 0 builds the engine; the other ranks run {worker_module}.run")
        return Ranks(tp, [])
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    # Fresh interpreters running kvflow's own entry point: no copied threads or torch state, and unlike
    # multiprocessing's spawn, the caller's script is not imported again (no `if __name__` guard needed).
    config = json.dumps(dataclasses.asdict(model_config))
    processes = [subprocess.Popen([sys.executable, "-m", worker_module, str(rank), str(size),
                                   init_method, config])
                 for rank in range(1, size)]
    log.info("tensor parallelism: %d ranks on this machine (gloo), rank 0 serves", size)
    return Ranks(group.join(0, size, init_method, model_config.device), processes)


def _check_shape(model_config: ModelConfig) -> None:
    from kvflow.distributed.sharding import check_divisible
    from kvflow.loader.model_loader import open_model_files, read_arch
    from kvflow.loader.resolve import resolve_model

    if model_config.device != "cpu" and group.backend_for(model_config.device) == "nccl" \
            and model_config.tensor_parallel_size > torch.cuda.device_count() and not group.launched_by_torchrun():
        raise ValueError(f"--tensor-parallel-size {model_config.tensor_parallel_size} needs as many GPUs; "
                         f"this machine has {torch.cuda.device_count()}")
    check_divisible(read_arch(open_model_files(resolve_model(model_config.model))), model_config.tensor_parallel_size)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
