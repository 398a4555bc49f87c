"""The kernels built where the Python tests cannot load them, checked by tests/kernel_tests/native/check_kernels.cpp
(packed matmul bitwise against a reference of its arithmetic, paged attention against a double softmax,
row ops):

- this CPU's own tier, with csrc/threads.h's std::thread pool instead of OpenMP (what a compiler without
  OpenMP, such as Apple's clang, builds); the lower tiers are checked through Python (test_tiers.py);
- aarch64, the generic and NEON (dotprod) tiers, cross-compiled with Debian's g++-aarch64-linux-gnu and
  run under qemu-aarch64 user emulation, with the thread pool and with OpenMP.

.ci/run installs the cross compiler and qemu and sets KVFLOW_REQUIRE_CROSS=1: there a missing tool fails
the test instead of skipping it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kvflow.kernels import build, cpu_features

HARNESS = Path(__file__).parent / "native" / "check_kernels.cpp"
SOURCES = [str(build.CSRC / name) for name in build.SOURCES]
REQUIRED = os.environ.get("KVFLOW_REQUIRE_CROSS") == "1"


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if REQUIRED:
            pytest.fail(f"{name} is missing (.ci/run installs it)")
        # Outside CI a developer's machine may lack the cross tools; CI (KVFLOW_REQUIRE_CROSS) fails instead.
        pytest.skip(f"{name} is not installed (apt-get install g++-aarch64-linux-gnu qemu-user)")
    return path


def compile_harness(cxx: str, flags: tuple[str, ...], out: Path, openmp: bool) -> Path:
    threading = ("-fopenmp",) if openmp else ("-DKVFLOW_NO_OPENMP", "-pthread")
    cmd = [cxx, "-O2", "-std=c++17", "-Wno-maybe-uninitialized", *flags, *threading, f"-I{build.CSRC}",
           str(HARNESS), *SOURCES, "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def run_checks(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith("all kernels ok"), done.stdout


def test_this_cpu_with_the_thread_pool(tmp_path):
    cxx = build.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")  # nothing to build; CI has g++
    flags = build.tier_flags(cpu_features.machine_tier())
    run_checks([str(compile_harness(cxx, flags, tmp_path / "check", openmp=False))])


# The neon tier under both thread models. (The generic tier is the same plain C++ on every machine, built and
# checked on this CPU by test_tiers.py.)
@pytest.mark.parametrize(("tier", "openmp"), [("neon", False), ("neon", True)], ids=["thread pool-neon", "openmp-neon"])
def test_aarch64_tiers_under_qemu(tier, openmp, tmp_path):
    cxx, qemu = tool("aarch64-linux-gnu-g++"), tool("qemu-aarch64")
    flags = (*build.tier_flags(tier, machine="aarch64", flags=frozenset({"asimd", "asimddp"})), "-static")
    binary = compile_harness(cxx, flags, tmp_path / "check", openmp)
    run_checks([qemu, "-cpu", "max", str(binary)])
