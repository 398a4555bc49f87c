"""The kernels built where the Python tests cannot load them, checked by tests/kernels/native/check_kernels.cpp
(packed matmul bitwise against a reference of its arithmetic, paged attention against a double softmax,
row ops):

- this CPU's own tier, with csrc/threads.h's std::thread pool instead of OpenMP (what a compiler without
  OpenMP, such as Apple's clang, builds); the lower tiers are checked through Python (test_tiers.py);
- the generic tier as this CPU builds it (SSE2 on x86-64: its fused multiply-add is emulated), and with the
  plain C++ vectors that CPUs with neither SSE2 nor NEON get (KVFLOW_PLAIN_VECTORS), which no tier here
  would otherwise compile;
- the AVX2 tier's VNNI path (packed_avx2_vnni.h) as an AVX-VNNI CPU's library builds it, run where this
  CPU has AVX-VNNI; and in AVX512-VNNI's form of the same instruction, run where it has that;
- aarch64, cross-compiled with Debian's g++-aarch64-linux-gnu and run under qemu-aarch64 user emulation:
  the NEON tier with dotprod (thread pool and OpenMP), with dotprod and i8mm (row pairs through
  vusmmlaq_s32), and without dotprod (ARMv8.0, such as the Raspberry Pi 4's Cortex-A72: the generic
  packed matmul on NEON).

.ci/run installs the cross compiler and qemu and sets KVFLOW_REQUIRE_CROSS=1: there a missing tool fails
the test instead of skipping it.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from kvflow.kernels import build, cpu_features, packed_matmul

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


def run_checks(command: list[str], path: str | None = None) -> None:
    """Run a built harness; path: the packed-matmul path (packed_matmul.PATHS) it must have taken."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith("all kernels ok"), done.stdout
    if path is not None:
        number = {name: n for n, name in packed_matmul.PATHS.items()}[path]
        assert f"packed matmul path {number}\n" in done.stdout, (path, done.stdout[:200])


def host_compiler() -> str:
    cxx = build.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")  # nothing to build; CI has g++
    return cxx


def test_this_cpu_with_the_thread_pool(tmp_path):
    flags = build.tier_flags(cpu_features.machine_tier())
    run_checks([str(compile_harness(host_compiler(), flags, tmp_path / "check", openmp=False))])


# An x86 flag: the host compiler of an ARM machine cannot build it (its ARM variants are tested under qemu below).
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="an x86 tier")
def test_the_avx2_tier_as_an_avx_vnni_cpu_builds_it(tmp_path):
    flags = build.tier_flags("avx2", flags=frozenset({"avx2", "fma", "f16c", "avx_vnni"}))
    assert "-mavxvnni" in flags
    binary = compile_harness(host_compiler(), flags, tmp_path / "check", openmp=True)
    if "avx_vnni" not in cpu_features.cpu_flags():  # built, which checks the VEX code compiles; running it
        # needs the instruction (qemu 7.2 lacks it too), and the next test runs the same code in EVEX form
        pytest.skip("built; this CPU has no AVX-VNNI to run it (the next test runs the same code in its EVEX form)")
    run_checks([str(binary)], "AVX2 and AVX-VNNI")


def test_the_avx2_tier_with_vnni_in_its_avx512_form(tmp_path):
    if not build.avx2_vnni_evex_runs(host_compiler()):  # a CPU without AVX512-VNNI cannot run it, and clang
        # cannot build it; an AVX-VNNI CPU runs the same code in the test above instead
        pytest.skip("needs AVX512-VNNI with AVX512VL, and GCC")
    flags = (*build.tier_flags("avx2", flags=frozenset({"avx2", "fma", "f16c"})), *build.AVX2_VNNI_EVEX_FLAGS)
    run_checks([str(compile_harness(host_compiler(), flags, tmp_path / "check", openmp=True))], "AVX2 and AVX-VNNI")


@pytest.mark.parametrize("plain", [False, True], ids=["generic", "generic-plain-vectors"])
def test_the_generic_tier(plain, tmp_path):
    flags = (*build.tier_flags("generic"), *(("-DKVFLOW_PLAIN_VECTORS",) if plain else ()))
    run_checks([str(compile_harness(host_compiler(), flags, tmp_path / "check", openmp=True))])


@pytest.mark.parametrize(("cpu_flags", "openmp"), [({"asimd", "asimddp"}, False), ({"asimd", "asimddp"}, True),
                                                   ({"asimd", "asimddp", "i8mm"}, True), ({"asimd"}, True)],
                         ids=["thread pool-neon", "openmp-neon", "openmp-neon-i8mm", "openmp-neon-without-dotprod"])
def test_aarch64_tiers_under_qemu(cpu_flags, openmp, tmp_path):
    cxx, qemu = tool("aarch64-linux-gnu-g++"), tool("qemu-aarch64")
    flags = (*build.tier_flags("neon", machine="aarch64", flags=frozenset(cpu_flags)), "-static")
    binary = compile_harness(cxx, flags, tmp_path / "check", openmp)
    path = ("NEON dotprod and i8mm" if "i8mm" in cpu_flags else "NEON dotprod") if "asimddp" in cpu_flags \
        else "generic 16-bit multiplies"
    run_checks([qemu, "-cpu", "max", str(binary)], path)
