"""What this CPU can run, read once from /proc/cpuinfo: its feature flags and the kernel tier they allow.

Tiers, lowest first. x86: generic (x86-64's baseline, SSE2), avx2 (AVX2 + FMA + F16C; its packed matmul
takes AVX-VNNI where the CPU has it, as Intel Core CPUs from Alder Lake on do), avx512 (AVX-512 F/BW/VL
with VNNI), amx (AVX-512 plus AMX int8 and bf16 tiles). ARM (aarch64): generic, neon (Advanced
SIMD; its packed dot products use `vdotq_s32` where the dotprod extension is there, and the generic
kernel's 16-bit multiplies on NEON vectors where it is not). Other CPUs: generic, in plain C++.
`KVFLOW_ISA=<tier>` forces a lower tier than the machine's, so every tier below it can be tested and
measured on one machine; a higher one is refused. kernels/build compiles one library per tier, with exactly
that tier's flags.
"""

from __future__ import annotations

import functools
import os
import platform

X86_TIERS = ("generic", "avx2", "avx512", "amx")
ARM_TIERS = ("generic", "neon")
_NEEDS = {
    "neon": {"asimd"},
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


def tiers(machine: str | None = None) -> tuple[str, ...]:
    """This architecture's tiers, lowest first."""
    return ARM_TIERS if (machine or platform.machine()) in ("aarch64", "arm64") else X86_TIERS


def machine_tier(flags: frozenset[str] | None = None) -> str:
    """The highest tier these flags allow."""
    flags = cpu_flags() if flags is None else flags
    best = "generic"
    for tier in tiers()[1:]:
        if _NEEDS[tier] <= flags:
            best = tier
    return best


def has_dotprod(flags: frozenset[str] | None = None) -> bool:
    """ARM's dotprod extension (vdotq_s32): without it the neon tier's library runs the generic kernel."""
    return "asimddp" in (cpu_flags() if flags is None else flags)


def runnable_tiers() -> tuple[str, ...]:
    """Every tier this CPU can run: its own and each one below."""
    all_tiers = tiers()
    return all_tiers[: all_tiers.index(machine_tier()) + 1]


@functools.cache
def isa_tier() -> str:
    """The tier kvflow's kernels use: the machine's, or the lower one KVFLOW_ISA names."""
    machine = machine_tier()
    forced = os.environ.get("KVFLOW_ISA", "").strip().lower()
    if not forced:
        return machine
    if forced not in tiers():
        raise ValueError(f"KVFLOW_ISA={forced!r} is not a tier here; use one of {', '.join(tiers())}")
    if tiers().index(forced) > tiers().index(machine):
        raise ValueError(f"KVFLOW_ISA={forced} asks for more than this CPU has (its tier is {machine})")
    return forced


def has_native_bf16_matmul() -> bool:
    """Whether a bfloat16 matmul runs on bfloat16 hardware at the tier in use: AMX tiles, or AVX512-BF16's
    dot products. Elsewhere PyTorch emulates it (about 200 times slower than float32 on an AVX2 CPU)."""
    tier = isa_tier()
    return tier == "amx" or (tier == "avx512" and "avx512_bf16" in cpu_flags())
