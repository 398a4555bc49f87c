"""Machine probe: the limits every benchmark is measured against.

Decode cannot beat (bytes read per step) / memory bandwidth, prefill cannot beat FLOPs / matmul rate,
so we measure both here, once, and save them as JSON for the other benchmarks to reuse. Only what the
engine would use on this CPU is timed: float32 matmuls, kvflow's packed-integer kernel at a prefill
size, and bfloat16 matmuls only where they are native (AMX, AVX512-BF16; elsewhere PyTorch emulates
them, about 200 times slower, and one 2048^3 product alone would take a minute). The kernel tier found
(kernels/cpu_features) is recorded with the machine. A full probe takes a few seconds on any CPU.

Saved format (``kind: "probe"``)::

    {"kind": "probe", "device": "cpu", "quick": false,
     "machine": {"cpu_model", "cpu_tier", "logical_cores", "usable_cores", "torch_version", "date",
                 "platform", "gpu"?},
     "results": [{"threads": 1, "read_dram_gb_s", "copy_dram_gb_s", "copy_cache_gb_s", "matmul_f32_tflop_s",
                  "matmul_bf16_tflop_s" (None where bfloat16 is not native), "matmul_packed_tflop_s"
                  (None without the kernels or on CUDA)}, ...],
     "sizes": {"dram_bytes", "cache_bytes", "matmul_n"}}

Copy bandwidth counts bytes read plus bytes written (a copy of N bytes moves 2N); read bandwidth (a sum over
the array) the bytes read, and is the decode roofline's (`bandwidth_bytes_per_s`).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from kvflow.kernels import cpu_features

GiB = 1 << 30
MiB = 1 << 20

DEFAULT_DRAM_BYTES = 1 * GiB  # far beyond any last-level cache
DEFAULT_CACHE_BYTES = 16 * MiB  # fits in the LLC of the machines we run on
DEFAULT_MATMUL_N = 2048
CUDA_MATMUL_N = 8192  # 2048^3 finishes in microseconds on a datacenter GPU; too short to time well


def default_probe_path() -> Path:
    """Where the probe is saved and looked for: $KVFLOW_PROBE, else ~/.cache/kvflow/probe.json."""
    env = os.environ.get("KVFLOW_PROBE")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "kvflow" / "probe.json"


def cpu_model() -> str:
    return cpu_features.cpu_name()


def machine_info(device: str = "cpu") -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpu_model": cpu_model(),
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_version": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    else:
        info["cpu_tier"] = cpu_features.isa_tier()
    return info


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Temporarily set torch's intra-op thread count (no-op for None)."""
    old = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(fn: Callable[[], None], device: torch.device, reps: int, warmup: int) -> float:
    # Warm up right before timing: memory left idle reads slowly on its first pass.
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(nbytes: int, device: str = "cpu", reps: int = 5, warmup: int = 2) -> float:
    """Bytes/s of ``dst.copy_(src)`` over ``nbytes`` arrays, counting read + write."""
    dev = torch.device(device)
    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    seconds = _median_seconds(lambda: dst.copy_(src), dev, reps, warmup)
    return 2 * n * 4 / seconds


def read_bandwidth(nbytes: int, device: str = "cpu", reps: int = 5, warmup: int = 2) -> float:
    """Bytes/s of a float32 sum over an ``nbytes`` array: a read stream with no writes, which is what a
    decode step's weights are (a copy's writes cost more than its count of them, and under-reads it)."""
    return read_rate(torch.ones(nbytes // 4, dtype=torch.float32, device=torch.device(device)), reps, warmup)


def read_rate(src: torch.Tensor, reps: int = 5, warmup: int = 2) -> float:
    """Bytes/s of a sum over the float32 tensor src (read_bandwidth's measure, on an array kept for reuse)."""
    seconds = _median_seconds(lambda: src.sum(), src.device, reps, warmup)
    return src.numel() * 4 / seconds


def matmul_rate(n: int, dtype: torch.dtype, device: str = "cpu", reps: int = 5, warmup: int = 2) -> float:
    """FLOP/s of an n x n x n matmul (2 n^3 FLOPs) in ``dtype``."""
    dev = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(dev, dtype)
    b = torch.randn(n, n, generator=gen).to(dev, dtype)
    out = torch.empty(n, n, dtype=dtype, device=dev)
    seconds = _median_seconds(lambda: torch.matmul(a, b, out=out), dev, reps, warmup)
    return 2 * n**3 / seconds


def packed_rate(rows: int, reps: int = 5, warmup: int = 2) -> float | None:
    """FLOP/s of kvflow's packed 4-bit matmul at `rows` rows of a 1536 x 576 weight (a prefill chunk's
    gate/up projection of the default model), with the engine's kernel crossovers; None without kernels."""
    from kvflow.executors.thresholds import ROW_THRESHOLDS
    from kvflow.kernels import abi, packed_matmul

    if not packed_matmul.available():
        return None
    abi.native().kvflow_set_tuning(tuning=ROW_THRESHOLDS.kernel_tuning())
    n, k = 1536, 576
    pw = packed_matmul.random_weight(n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    out = torch.empty(rows, n)
    seconds = _median_seconds(lambda: packed_matmul.matmul(x, pw, out=out), torch.device("cpu"), reps, warmup)
    return 2 * rows * n * k / seconds


def run_probe(
    threads: list[int] | None = None,
    device: str = "cpu",
    quick: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Measure read and copy bandwidth (DRAM-sized; copy cache-sized too) and matmul rates for each thread count.

    ``quick`` uses small arrays and few repetitions: for tests, not for numbers.
    """
    is_cuda = device.startswith("cuda")
    if threads is None:
        threads = [1] if is_cuda else sorted({1, torch.get_num_threads()})
    if quick:
        dram, cache, mm_n, reps, warmup = 32 * MiB, 1 * MiB, 256, 2, 1
    else:
        dram, cache, reps, warmup = DEFAULT_DRAM_BYTES, DEFAULT_CACHE_BYTES, 5, 2
        mm_n = CUDA_MATMUL_N if is_cuda else DEFAULT_MATMUL_N
    results = []
    for t in threads:
        # Thread count only matters on the CPU; on CUDA it is recorded but has no effect.
        with torch_threads(None if is_cuda else t):
            bf16 = is_cuda or cpu_features.has_native_bf16_matmul()
            packed = None if is_cuda else packed_rate(64 if quick else 512, reps, warmup)
            row = {
                "threads": t,
                "read_dram_gb_s": read_bandwidth(dram, device, reps, warmup) / 1e9,
                "copy_dram_gb_s": copy_bandwidth(dram, device, reps, warmup) / 1e9,
                "copy_cache_gb_s": copy_bandwidth(cache, device, reps * 4, warmup) / 1e9,
                "matmul_f32_tflop_s": matmul_rate(mm_n, torch.float32, device, reps, warmup) / 1e12,
                "matmul_bf16_tflop_s": matmul_rate(mm_n, torch.bfloat16, device, reps, warmup) / 1e12 if bf16 else None,
                "matmul_packed_tflop_s": None if packed is None else packed / 1e12,
            }
        results.append(row)
        if log:
            log(format_row(row))
    return {
        "kind": "probe",
        "device": device,
        "quick": quick,
        "machine": machine_info(device),
        "sizes": {"dram_bytes": dram, "cache_bytes": cache, "matmul_n": mm_n},
        "results": results,
    }


def format_row(row: dict[str, Any]) -> str:
    def rate(key: str) -> str:
        value = row.get(key)
        return "      -" if value is None else f"{value:7.3f}"

    return (
        f"threads={row['threads']:>3}  read(DRAM) {row.get('read_dram_gb_s') or 0:7.2f} GB/s  "
        f"copy(DRAM) {row['copy_dram_gb_s']:7.2f} GB/s  "
        f"copy(cache) {row['copy_cache_gb_s']:7.2f} GB/s  "
        f"matmul f32 {rate('matmul_f32_tflop_s')}  bf16 {rate('matmul_bf16_tflop_s')}  "
        f"packed {rate('matmul_packed_tflop_s')} TFLOP/s"
    )


def save_probe(probe: dict[str, Any], path: str | Path | None = None) -> Path:
    out = Path(path) if path else default_probe_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(probe, indent=2) + "\n")
    return out


def load_probe(path: str | Path | None = None) -> dict[str, Any] | None:
    """The saved probe, or None when there is none yet."""
    p = Path(path) if path else default_probe_path()
    if not p.exists():
        return None
    return json.loads(p.read_text())


def _row_for(probe: dict[str, Any], threads: int | None) -> dict[str, Any]:
    rows = probe["results"]
    if threads is None:
        return max(rows, key=lambda r: r["threads"])
    for r in rows:
        if r["threads"] == threads:
            return r
    raise KeyError(f"probe has no row for {threads} threads (has {[r['threads'] for r in rows]})")


def bandwidth_bytes_per_s(probe: dict[str, Any], threads: int | None = None, cache: bool = False) -> float:
    """The bandwidth a decode step streams its weights at, in bytes/s at ``threads`` (default: the largest
    thread count probed): DRAM's read rate where the probe measured it (probes before 2026-12-04 did
    not: their copy rate, which under-reads it), or the copy rate of a cache-sized array (cache)."""
    row = _row_for(probe, threads)
    if not cache and row.get("read_dram_gb_s"):
        return row["read_dram_gb_s"] * 1e9
    return row["copy_cache_gb_s" if cache else "copy_dram_gb_s"] * 1e9


def matmul_flop_per_s(probe: dict[str, Any], dtype: str = "bf16", threads: int | None = None) -> float | None:
    """Matmul rate in FLOP/s for "bf16", "f32" or "packed" (kvflow's integer kernel); None where the probe
    did not time it (bfloat16 where it is not native)."""
    key = {"bf16": "matmul_bf16_tflop_s", "bfloat16": "matmul_bf16_tflop_s", "f32": "matmul_f32_tflop_s",
           "float32": "matmul_f32_tflop_s", "packed": "matmul_packed_tflop_s"}[dtype]
    value = _row_for(probe, threads).get(key)
    return None if value is None else value * 1e12
