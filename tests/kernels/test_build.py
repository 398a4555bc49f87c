"""The C++ kernel sources compile for CPUs without AVX-512 too.

The library is built with -march=native; on a machine without AVX-512 the vector code drops out behind
#ifdefs, and everything left must still compile (else the whole library fails to build there and kvflow
falls back to PyTorch ops). CI's machines have AVX-512, so this checks the other builds' syntax."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import pytest

from kvflow.kernels import build

SOURCES = [str(Path(build.__file__).parent / "csrc" / name) for name in build.SOURCES]


# Without a compiler there is nothing to build (kvflow then runs PyTorch ops, tested elsewhere); CI has g++.
needs_compiler = pytest.mark.skipif(build.compiler() is None, reason="needs a C++ compiler")


@needs_compiler
@pytest.mark.parametrize("arch", ["x86-64-v2", "x86-64-v3"])  # SSE4.2 only; AVX2 without AVX-512
def test_sources_compile_without_avx512(arch):
    result = subprocess.run([build.compiler(), "-std=c++17", "-fopenmp", "-fsyntax-only", f"-march={arch}",
                             *SOURCES], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def compiler_wrapper(path: Path, rule: str) -> str:
    """A C++ compiler that runs this machine's, but first applies a rule to its arguments (a shell test that
    exits 1 with a message to refuse them)."""
    path.write_text(f'#!/bin/sh\nfor a in "$@"; do {rule}; done\nexec {build.compiler()} "$@"\n')
    path.chmod(0o755)
    return str(path)


@needs_compiler
def test_a_compiler_without_openmp_builds_the_thread_pool_library(tmp_path, monkeypatch):
    """Apple's clang rejects -fopenmp: the kernels are built with their own thread pool instead, and later
    starts take that library at once rather than failing the OpenMP build again."""
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    log = tmp_path / "calls"
    cxx = compiler_wrapper(tmp_path / "clang++", f'echo "$a" >> {log}; '
                           '[ "$a" = -fopenmp ] && { echo "unsupported option -fopenmp" >&2; exit 1; }')
    tier = "generic"
    first = build.build_threaded(cxx, tier)
    assert first.name.startswith("libkvflow_cpu-generic-threads-")
    assert "-DKVFLOW_NO_OPENMP" in log.read_text()
    log.write_text("")
    assert build.build_threaded(cxx, tier) == first
    assert log.read_text() == ""  # no compiler run at all the second time


@needs_compiler
def test_a_build_failing_for_another_reason_reports_its_own_error(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    cxx = compiler_wrapper(tmp_path / "g++", 'case "$a" in *packed_matmul.cpp) echo "disk full" >&2; exit 1;; esac')
    with pytest.raises(subprocess.CalledProcessError) as failed:
        build.build_threaded(cxx, "generic")
    assert "disk full" in failed.value.stderr
    assert "-fopenmp" in failed.value.cmd  # the OpenMP attempt's error, not the fallback's


@needs_compiler
# The x86 tiers' flags: an ARM host's compiler does not take -mavxvnni at all (test_cpu_features checks
# the ARM tiers' flags and test_native_builds their builds).
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the x86 tiers' flags")
def test_a_compiler_too_old_for_avx_vnni_builds_the_plain_avx2_path(tmp_path, monkeypatch):
    """GCC before 11 has no -mavxvnni: on an AVX-VNNI CPU the avx2 library is then built without it (the
    plain AVX2 path), not refused altogether."""
    monkeypatch.setattr(build.cpu_features, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c", "avx_vnni"}))
    old = compiler_wrapper(tmp_path / "g++-10",
                           '[ "$a" = -mavxvnni ] && { echo "unrecognized option -mavxvnni" >&2; exit 1; }')
    assert "-mavxvnni" in build.compile_flags("avx2", cxx=build.compiler())
    flags = build.compile_flags("avx2", cxx=old)
    assert "-mavxvnni" not in flags and "-mavx2" in flags
    neon = build.tier_flags("neon", machine="aarch64", flags=frozenset({"asimd", "asimddp", "i8mm"}))
    assert build._NEWER_FLAGS[neon[0]] == "-march=armv8.2-a+dotprod"  # i8mm's flag falls back to dotprod's
