"""Build and load kvflow's C++ CPU kernels: one library per CPU tier, compiled on first use, cached, loaded
through ctypes (kernels/abi gives it its signatures, from csrc/kvflow_cpu.h).

The sources are plain C++ with an `extern "C"` interface and no PyTorch headers, so a build takes a few
seconds rather than the half minute a torch extension needs. Each tier (kernels/cpu_features) is built
with exactly its instruction sets, never -march=native, so a lower tier forced with KVFLOW_ISA runs the
code that CPUs of that tier run. They use OpenMP; the process already holds PyTorch's libgomp, and the
library's libgomp.so.1 dependency resolves to that one copy, so both share one thread pool. Without
OpenMP (`openmp=False`, or a compiler without it) the kernels thread through csrc/threads.h's pool.
Without a C++ compiler, `load()` returns None and callers use PyTorch ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from kvflow.kernels import cpu_features

log = logging.getLogger("kvflow")

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("tuning.cpp", "paged_attention.cpp", "packed_matmul.cpp", "packed_exact.cpp", "gguf_repack.cpp",
           "decoder_forward.cpp", "moe_mlp.cpp", "prefill_attention_amx.cpp")
COMMON_FLAGS = ("-O3", "-shared", "-fPIC", "-std=c++17", "-Wno-maybe-uninitialized")

_X86_AVX2 = ("-mavx", "-mavx2", "-mfma", "-mf16c", "-mbmi", "-mbmi2", "-mpopcnt")
_X86_AVX512 = _X86_AVX2 + ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512cd", "-mavx512vnni")
_X86_AMX = _X86_AVX512 + ("-mavx512bf16", "-mamx-tile", "-mamx-int8", "-mamx-bf16")
# The AVX2 tier's VNNI path (csrc/packed_avx2_vnni.h) in AVX512-VNNI's EVEX form of the same instruction,
# registers 16 to 31 left unused as AVX-VNNI has none: how a CPU with AVX-512 but not AVX-VNNI (an AMD
# EPYC Zen 4) tests that path and measures it. For tests and benchmarks; a library for use never has it.
AVX2_VNNI_EVEX_FLAGS = ("-DKVFLOW_AVX2_VNNI_EVEX", *(f"-ffixed-xmm{i}" for i in range(16, 32)))


def tier_flags(tier: str, machine: str | None = None, flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """The instruction-set flags of a tier, for this machine's architecture (or `machine`, e.g. aarch64)."""
    machine = machine or platform.machine()
    flags = cpu_features.cpu_flags() if flags is None else flags
    if machine in ("aarch64", "arm64"):
        if tier == "neon":  # dotprod, and i8mm with it where the CPU has both (packed_neon_i8mm.h)
            if not cpu_features.has_dotprod(flags):
                return ("-march=armv8-a",)
            return ("-march=armv8.2-a+dotprod+i8mm",) if "i8mm" in flags else ("-march=armv8.2-a+dotprod",)
        return ("-march=armv8-a",)
    base = ("-march=x86-64",)
    if tier == "avx2":  # AVX-VNNI where the CPU has it (Intel Core from Alder Lake on): packed_avx2_vnni.h
        return base + _X86_AVX2 + (("-mavxvnni",) if "avx_vnni" in flags else ())
    if tier == "avx512":  # AVX512-BF16 where the CPU has it: the dense path's bfloat16 conversions
        return base + _X86_AVX512 + (("-mavx512bf16",) if "avx512_bf16" in flags else ())
    if tier == "amx":
        return base + _X86_AMX
    return base


def cache_root() -> Path:
    """kvflow's cache folder: $KVFLOW_CACHE_DIR, else $XDG_CACHE_HOME/kvflow or ~/.cache/kvflow."""
    return Path(os.environ.get("KVFLOW_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvflow"))


def cache_dir() -> Path:
    return cache_root() / "kernels"


def compiler() -> str | None:
    """The C++ compiler on PATH ($CXX, default g++), or None. torch.compile's CPU code needs one too."""
    return shutil.which(os.environ.get("CXX", "g++"))


# Flags for a feature within a tier that an older compiler may not know (AVX-VNNI: GCC 11, clang 12), and
# what to build with instead there: the tier's plain path, rather than no library at all.
_NEWER_FLAGS = {"-mavxvnni": None, "-march=armv8.2-a+dotprod+i8mm": "-march=armv8.2-a+dotprod"}


@functools.cache
def compiler_accepts(cxx: str, flag: str) -> bool:
    """Whether the compiler takes this flag (a preprocessor run over nothing: a few milliseconds)."""
    try:
        done = subprocess.run([cxx, flag, "-x", "c++", "-E", "-o", os.devnull, "-"], input="", capture_output=True,
                              text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def avx2_vnni_evex_runs(cxx: str | None) -> bool:
    """Whether a build with AVX2_VNNI_EVEX_FLAGS runs here: a CPU with AVX512-VNNI and VL, and a compiler
    that takes those flags (GCC; clang has neither -ffixed-xmm nor the header's GCC target pragma)."""
    return (cxx is not None and {"avx2", "fma", "f16c", "avx512_vnni", "avx512vl"} <= cpu_features.cpu_flags()
            and compiler_accepts(cxx, AVX2_VNNI_EVEX_FLAGS[1]))


def compile_flags(tier: str, cxx: str, openmp: bool = True) -> tuple[str, ...]:
    """A tier's flags for the compiler cxx (each newer one it refuses replaced: _NEWER_FLAGS), then
    $KVFLOW_KERNEL_FLAGS (space-separated; for measuring a variant end to end, as
    `KVFLOW_ISA=avx2 KVFLOW_KERNEL_FLAGS="$(python -m kvflow.kernels.build --avx2-vnni-evex)"`). They name
    the library too, so a variant never replaces the plain build."""
    flags = []
    for flag in tier_flags(tier):
        if flag in _NEWER_FLAGS and not compiler_accepts(cxx, flag):
            log.info("%s does not take %s: the %s tier's plain path instead", cxx, flag, tier)
            flag = _NEWER_FLAGS[flag]
        if flag is not None:
            flags.append(flag)
    threading = ("-fopenmp",) if openmp else ("-DKVFLOW_NO_OPENMP", "-pthread")
    return (*COMMON_FLAGS, *flags, *threading, *os.environ.get("KVFLOW_KERNEL_FLAGS", "").split())


@functools.cache
def sources_digest() -> str:
    """A digest of every kernel source and header: what names a build, and the packed layout it writes."""
    digest = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):  # every source and header, so none is forgotten
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def _library_path(cxx: str, tier: str, openmp: bool) -> Path:
    digest = hashlib.sha256(sources_digest().encode())
    digest.update(" ".join((cxx, *compile_flags(tier, cxx, openmp), platform.machine())).encode())
    suffix = "" if openmp else "-threads"
    return cache_dir() / f"libkvflow_cpu-{tier}{suffix}-{digest.hexdigest()[:16]}.so"


def compile_library(cxx: str, tier: str, csrc: Path, out: Path, openmp: bool = True,
                    extra_flags: tuple[str, ...] = ()) -> None:
    """Compile the kernel sources in `csrc` (this package's, or another version of them) into `out`."""
    subprocess.run([cxx, *compile_flags(tier, cxx, openmp), *extra_flags, *[str(csrc / name) for name in SOURCES], "-o",
                    str(out)], check=True, capture_output=True, text=True)


def build(cxx: str, tier: str, openmp: bool = True) -> Path:
    target = _library_path(cxx, tier, openmp)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes never load a half-written file.
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    try:
        compile_library(cxx, tier, CSRC, partial, openmp)
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    log.info("built CPU kernels (%s tier): %s", tier, target)
    return target


def build_threaded(cxx: str, tier: str) -> Path:
    """The OpenMP build, or the thread-pool one where the compiler has no OpenMP (Apple's clang rejects
    -fopenmp). A marker beside the OpenMP library's name remembers that, so later starts do not try again."""
    no_openmp = _library_path(cxx, tier, True).with_suffix(".no-openmp")
    if no_openmp.exists():
        return build(cxx, tier, openmp=False)
    try:
        return build(cxx, tier, openmp=True)
    except subprocess.CalledProcessError as openmp_failed:
        try:
            built = build(cxx, tier, openmp=False)
        except subprocess.CalledProcessError:
            raise openmp_failed from None  # not OpenMP's doing: the first error says what is wrong
        log.info("%s builds the kernels without OpenMP: they thread through their own pool", cxx)
        no_openmp.write_text(openmp_failed.stderr or "")
        return built


@functools.cache
def load(tier: str | None = None, openmp: bool = True) -> ctypes.CDLL | None:
    """The kernel library of a tier (default: the one this CPU runs, kernels/cpu_features.isa_tier), or
    None where it cannot be built (no compiler, KVFLOW_CPU_KERNELS=0). openmp: OpenMP where the compiler
    has it (build_threaded), else the thread pool always."""
    if os.environ.get("KVFLOW_CPU_KERNELS", "1") == "0":
        return None
    cxx = compiler()
    if cxx is None:
        log.warning("no C++ compiler found: CPU attention runs through PyTorch ops (slower decode)")
        return None
    import torch  # noqa: F401 - PyTorch's libgomp must be loaded first, so the library shares it

    tier = tier or cpu_features.isa_tier()
    try:
        return ctypes.CDLL(str(build_threaded(cxx, tier) if openmp else build(cxx, tier, openmp=False)))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        log.warning("CPU kernels failed to build, using PyTorch ops instead: %s", detail.strip()[:500])
        return None


if __name__ == "__main__":  # the flags of a test build, for KVFLOW_KERNEL_FLAGS
    import sys

    if sys.argv[1:] == ["--avx2-vnni-evex"]:
        print(" ".join(AVX2_VNNI_EVEX_FLAGS))
    else:
        sys.exit("usage: python -m kvflow.kernels.build --avx2-vnni-evex")
