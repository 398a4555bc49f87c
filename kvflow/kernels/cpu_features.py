"""What this CPU can run, read once (from /proc/cpuinfo, or sysctl on macOS): its feature flags and the
kernel tier they allow.

Tiers, lowest first. x86: generic (x86-64's baseline, SSE2), avx2 (AVX2 + FMA + F16C; its packed matmul
takes AVX-VNNI where the CPU has it, as Intel Core CPUs from Alder Lake on do), avx512 (AVX-512 F/BW/VL
with VNNI), amx (AVX-512 plus AMX int8 and bf16 tiles). ARM (aarch64): generic, neon (Advanced
SIMD; its packed dot products use `vdotq_s32` where the dotprod extension is there, and for row pairs
`vusmmlaq_s32` where i8mm is too; the generic kernel's 16-bit multiplies on NEON vectors where dotprod
is not). Other CPUs: generic, in plain C++.
`KVFLOW_ISA=<tier>` forces a lower tier than the machine's, so every tier below it can be tested and
measured on one machine; a higher one is refused. kernels/build compiles one library per tier, with exactly
that tier's flags.
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess

X86_TIERS = ("generic", "avx2", "avx512", "amx")
ARM_TIERS = ("generic", "neon")
_NEEDS = {
    "neon": {"asimd"},
    "avx2": {"avx2", "fma", "f16c"},
    "avx512": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"},
    "amx": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "amx_int8", "amx_bf16",
            "amx_tile"},
}


# macOS has no /proc/cpuinfo: its sysctl keys for the features the tiers need, as Linux names them.
# Apple Silicon: NEON always, dotprod from M1, i8mm from M2. Intel Macs list their features in two keys,
# upper case ("AVX1.0 FMA F16C", "AVX2 AVX512F AVX512VNNI").
_DARWIN_ARM_KEYS = {"hw.optional.AdvSIMD": "asimd", "hw.optional.neon": "asimd",
                    "hw.optional.arm.FEAT_DotProd": "asimddp", "hw.optional.arm.FEAT_I8MM": "i8mm"}
_DARWIN_X86_KEYS = ("machdep.cpu.features", "machdep.cpu.leaf7_features")
_DARWIN_X86_NAMES = {"avx1.0": "avx", "avx512vnni": "avx512_vnni", "avx512bf16": "avx512_bf16"}


def _sysctl(key: str) -> str:
    """A sysctl value, or "" where the key (or sysctl) is missing."""
    try:
        done = subprocess.run(["sysctl", "-n", key], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def darwin_flags() -> frozenset[str]:
    """A Mac's CPU features from sysctl, with Linux's names."""
    flags = {name for key, name in _DARWIN_ARM_KEYS.items() if _sysctl(key) == "1"}
    for key in _DARWIN_X86_KEYS:
        flags |= {_DARWIN_X86_NAMES.get(word, word) for word in _sysctl(key).lower().split()}
    return frozenset(flags)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (from sysctl on macOS; empty where neither can be read)."""
    if platform.system() == "Darwin":
        return darwin_flags()
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
    brand = _sysctl("machdep.cpu.brand_string") if platform.system() == "Darwin" else ""
    if brand:
        return brand  # "Apple M2 Pro"
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
