"""The tensor-parallel process group of this process, made once, before the model loads.

kvflow starts the ranks itself on one machine (launch.py: rank 0 is the process that serves, the others are
spawned), or torchrun starts them on one or several machines (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in
the environment). Either way every rank loads its own shard of the model and sums partial results with
all_reduce; rank 0 alone schedules, samples and serves.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger("kvflow")

# A collective waits this long for the other ranks. Ranks other than 0 wait for the next step between
# requests, possibly for hours: a dead peer is seen at once (its sockets close), so the bound is only for a
# peer that hangs without dying.
DEFAULT_TIMEOUT_S = 24 * 3600


class TensorParallelError(RuntimeError):
    """A rank of the group failed (died, or a collective failed): the group cannot run another step."""


@dataclass
class TensorParallelGroup:
    rank: int
    world_size: int
    backend: str

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks, in place; a failed peer raises TensorParallelError."""
        with _collective():
            dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x (same shape on each), joined along the last dimension in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        with _collective():
            dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


@contextmanager
def _collective():
    """A collective whose failure (a dead peer) is the group's: TensorParallelError, in one sentence."""
    try:
        yield
    except RuntimeError as exc:
        raise TensorParallelError(f"a tensor-parallel rank failed mid-step: {first_sentence(exc)}") from None


def first_sentence(exc: BaseException) -> str:
    """gloo's errors: "[file:line] Connection closed by peer [addr]. This is typically caused by ..." """
    text = str(exc).split("] ", 1)[-1] if str(exc).startswith("[") else str(exc)
    return text.split(". ", 1)[0]


_GROUP: TensorParallelGroup | None = None


def current() -> TensorParallelGroup | None:
    """The group this process belongs to, or None (one process runs the whole model)."""
    return _GROUP


def launched_by_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ and int(os.environ["WORLD_SIZE"]) > 1


def backend_for(device: str) -> str:
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    return "nccl" if cuda else "gloo"


def join(rank: int, world_size: int, init_method: str, device: str = "cpu",
         timeout_s: float | None = None) -> TensorParallelGroup:
    """Join the group as `rank` (every rank calls this; it returns once all have)."""
    global _GROUP
    if _GROUP is not None:
        raise RuntimeError("this process already belongs to a tensor-parallel group")
    timeout = timedelta(seconds=timeout_s or float(os.environ.get("KVFLOW_TP_TIMEOUT", DEFAULT_TIMEOUT_S)))
    backend = backend_for(device)
    _import_collectives_with_defaults()
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
    _GROUP = TensorParallelGroup(rank, world_size, backend)
    return _GROUP


def _import_collectives_with_defaults() -> None:
    """torch.distributed.nn's collectives take `group=group.WORLD` as a default argument, read once, when the
    module is imported. Imported after init_process_group (transformers imports it while it loads a
    tokenizer), those defaults hold the group: destroy_process_group cannot free it, and its gloo threads
    live on into interpreter teardown, where they abort the process now and then ("terminate called without
    an active exception"). Imported before, the defaults are None."""
    import torch.distributed.nn  # noqa: F401


def join_from_env(world_size: int, device: str = "cpu") -> TensorParallelGroup:
    """Join the group torchrun describes; its size must be the one asked for."""
    given = int(os.environ["WORLD_SIZE"])
    if given != world_size:
        raise ValueError(f"--tensor-parallel-size {world_size} but torchrun started {given} ranks "
                         "(run torchrun with --nproc-per-node x --nnodes equal to the tensor-parallel size)")
    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return join(int(os.environ["RANK"]), given, "env://", device)


def leave(together: bool = False) -> None:
    """Leave the group (at shutdown; a group with a dead rank is dropped without waiting for it).
    together: a healthy group's ranks first wait for each other (10 s at most), so that none tears its
    connections down while a peer still uses them (a rank under torchrun has no child to wait for)."""
    global _GROUP
    if _GROUP is None:
        return
    backend, _GROUP = _GROUP.backend, None
    if together:
        try:
            if backend == "gloo":
                dist.monitored_barrier(timeout=timedelta(seconds=10), wait_all_ranks=True)
            else:
                dist.barrier()
        except Exception as exc:  # noqa: BLE001 - a peer already gone: leave anyway
            log.warning("tensor-parallel group: the ranks did not meet before leaving (%s)", exc)
    try:
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - a broken group cannot be torn down cleanly; the process exits anyway
        log.warning("tensor-parallel group: not torn down cleanly (%s)", exc)
