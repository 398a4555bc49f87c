"""Build and load kvflow's C++ CPU kernels: compiled once per machine, cached, loaded through ctypes
(kernels/abi gives the loaded library its signatures, from csrc/kvflow_cpu.h).

The sources are plain C++ with an `extern "C"` interface and no PyTorch headers, so a build takes a
second or two rather than the half minute a torch extension needs. They use OpenMP; the process already
holds PyTorch's libgomp, and the library's libgomp.so.1 dependency resolves to that one copy, so both
share one thread pool. Without a C++ compiler, `load()` returns None and callers use PyTorch ops.
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

log = logging.getLogger("kvflow")

SOURCES = ("tuning.cpp", "paged_attention.cpp", "packed_matmul.cpp", "packed_exact.cpp", "decoder_forward.cpp",
           "prefill_attention_amx.cpp")
HEADERS = ("kvflow_cpu.h", "tuning.h", "attention_rows.h", "packed_amx.h", "vector_exp.h", "row_ops.h", "amx_tiles.h")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-Wno-maybe-uninitialized")


def cache_dir() -> Path:
    root = os.environ.get("KVFLOW_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvflow"
    )
    return Path(root) / "kernels"


def compiler() -> str | None:
    """The C++ compiler on PATH ($CXX, default g++), or None. torch.compile's CPU code needs one too."""
    return shutil.which(os.environ.get("CXX", "g++"))


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("model name", "flags"))), "")
    except OSError:
        return platform.processor()


def _library_path(cxx: str) -> Path:
    src = Path(__file__).parent / "csrc"
    digest = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        digest.update((src / name).read_bytes())
    # -march=native code is only right for this CPU and compiler.
    digest.update(" ".join((cxx, *FLAGS, _cpu_name())).encode())
    return cache_dir() / f"libkvflow_cpu-{digest.hexdigest()[:16]}.so"


def build(cxx: str) -> Path:
    target = _library_path(cxx)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    sources = [str(Path(__file__).parent / "csrc" / name) for name in SOURCES]
    # Build beside the target and rename: concurrent processes never load a half-written file.
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    try:
        subprocess.run([cxx, *FLAGS, *sources, "-o", str(partial)], check=True, capture_output=True, text=True)
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    log.info("built CPU kernels: %s", target)
    return target


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernel library, or None where it cannot be built (no compiler, KVFLOW_CPU_KERNELS=0)."""
    if os.environ.get("KVFLOW_CPU_KERNELS", "1") == "0":
        return None
    cxx = compiler()
    if cxx is None:
        log.warning("no C++ compiler found: CPU attention runs through PyTorch ops (slower decode)")
        return None
    import torch  # noqa: F401 - PyTorch's libgomp must be loaded first, so the library shares it

    try:
        return ctypes.CDLL(str(build(cxx)))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        log.warning("CPU kernels failed to build, using PyTorch ops instead: %s", detail.strip()[:500])
        return None
