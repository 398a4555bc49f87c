"""Choices that depend on the machine, measured once on it and kept (in ~/.cache/kvflow/measured.json).

`bf16_copies_pay()`: whether many-row steps should multiply bfloat16 copies of the weights (oneDNN)
rather than stay on the packed-integer kernel. The copies cost 2 bytes a weight of memory (212 MB for the
default model, 16 GB for an 8B one), so they are made only where bfloat16 matmuls are native: on AMX
(where sessions 3 to 7 measured oneDNN's bfloat16 ahead of the packed kernel from about 64 rows, and the
whole fast mode was tuned with the copies), and on AVX512-BF16 where a prefill-sized matmul measures at
least MIN_SPEEDUP times the packed kernel's rate (a Zen 4 EPYC: about 1.5 times, not worth the memory).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvflow.kernels import build, cpu_features, packed_matmul, packed_weight

log = logging.getLogger("kvflow")

MIN_SPEEDUP = 2.0
# A prefill chunk's gate/up projection of a small model: large enough to be compute-bound, quick to time.
ROWS, IN, OUT = 256, 576, 1536


def _cache_file() -> Path:
    return build.cache_dir().parent / "measured.json"


def _key(name: str) -> str:
    return "|".join((name, cpu_features.cpu_name(), cpu_features.isa_tier(), torch.__version__,
                     str(torch.get_num_threads())))


def _remembered(name: str, measure) -> object:
    path, key = _cache_file(), _key(name)
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if key not in known:
        known[key] = measure()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1))
        tmp.replace(path)
    return known[key]


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median_time_ratio(slow, fast, rounds: int = 9) -> float:
    """The median over rounds of slow's time over fast's, the two timed back to back in each round.

    Side by side, so a co-tenant's burst slows both of a round's timings rather than one whole series;
    the order swaps each round so neither always runs on the warmer cache. One series of medians taken
    apart once put this machine's bfloat16 speed-up at 2.4 where it is about 1.5.
    """
    slow(), fast()
    ratios = []
    for i in range(rounds):
        if i % 2:
            b, a = _seconds(fast), _seconds(slow)
        else:
            a, b = _seconds(slow), _seconds(fast)
        ratios.append(a / b)
    return statistics.median(ratios)


def measure_bf16_speedup() -> float:
    """The packed kernel's time over oneDNN bfloat16's on the same prefill-sized matmul (4-bit codes)."""
    from kvflow.executors.thresholds import ROW_THRESHOLDS
    from kvflow.kernels import abi

    abi.native().kvflow_set_tuning(tuning=ROW_THRESHOLDS.kernel_tuning())  # the kernel as the engine runs it
    pw = packed_matmul.random_weight(OUT, IN)
    x = torch.randn(ROWS, IN, generator=torch.Generator().manual_seed(1))
    dense = packed_weight.dequantize(pw).to(torch.bfloat16)
    xb = x.to(torch.bfloat16)
    return median_time_ratio(lambda: packed_matmul.matmul(x, pw), lambda: F.linear(xb, dense))


def bf16_copies_pay() -> bool:
    if not cpu_features.has_native_bf16_matmul() or not packed_matmul.available():
        return False
    if cpu_features.isa_tier() == "amx":
        return True
    speedup = float(_remembered("bf16_speedup_paired", measure_bf16_speedup))
    log.info("bfloat16 matmuls run %.2fx the packed kernel here: bfloat16 weight copies %s", speedup,
             "pay" if speedup >= MIN_SPEEDUP else "do not pay")
    return speedup >= MIN_SPEEDUP
