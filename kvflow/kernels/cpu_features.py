"""What this CPU can run, read once from /proc/cpuinfo: its feature flags and the kernel tier they allow.

Tiers, lowest first: generic (no vector kernels), avx2 (AVX2 + FMA + F16C), avx512 (AVX-512 F/BW/VL with
VNNI), amx (AVX-512 plus AMX int8 and bf16 tiles). `KVFLOW_ISA=<tier>` forces a lower tier than the
machine's, so every tier below it can be tested and measured on one machine; a higher one is refused.
"""

from __future__ import annotations

import functools
import os
import platform

TIERS = ("generic", "avx2", "avx512", "amx")
_NEEDS = {
    "avx2": {"avx2", "fma", "f16c"},
    "avx512": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"},
    "amx": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "amx_int8", "amx_bf16",
            "amx_tile"},
}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (empty where /proc/cpuinfo cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):  # x86, arm64
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_tier(flags: frozenset[str] | None = None) -> str:
    """The highest tier these flags allow."""
    flags = cpu_flags() if flags is None else flags
    best = "generic"
    for tier in TIERS[1:]:
        if _NEEDS[tier] <= flags:
            best = tier
    return best


@functools.cache
def isa_tier() -> str:
    """The tier kvflow's kernels use: the machine's, or the lower one KVFLOW_ISA names."""
    machine = machine_tier()
    forced = os.environ.get("KVFLOW_ISA", "").strip().lower()
    if not forced:
        return machine
    if forced not in TIERS:
        raise ValueError(f"KVFLOW_ISA={forced!r} is not a tier; use one of {', '.join(TIERS)}")
    if TIERS.index(forced) > TIERS.index(machine):
        raise ValueError(f"KVFLOW_ISA={forced} asks for more than this CPU has (its tier is {machine})")
    return forced


def has_native_bf16_matmul() -> bool:
    """Whether a bfloat16 matmul runs on bfloat16 hardware here (AMX tiles) rather than being emulated or
    converted. Only then do the fast mode's bfloat16 weight copies pay for their memory."""
    return isa_tier() == "amx"
