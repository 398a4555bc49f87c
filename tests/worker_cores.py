"""Under pytest-xdist (`-n 2`), each worker process keeps to its own share of the CPUs, as if it ran on a
machine of its own: torch's threads (and the servers a test starts, which inherit the mask) never wait on
the other worker's; torch's thread pool is sized to the share."""

from __future__ import annotations

import os

import torch


def pin_this_worker() -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ...
    if worker is None or not hasattr(os, "sched_setaffinity"):
        return
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cpus = sorted(os.sched_getaffinity(0))
    share = cpus[int(worker.removeprefix("gw")) % count::count]
    if share:
        os.sched_setaffinity(0, share)
        torch.set_num_threads(len(share))
