"""The C++ kernel sources compile for CPUs without AVX-512 too.

The library is built with -march=native; on a machine without AVX-512 the vector code drops out behind
#ifdefs, and everything left must still compile (else the whole library fails to build there and kvflow
falls back to PyTorch ops). CI's machines have AVX-512, so this checks the other builds' syntax."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kvflow.kernels import build

SOURCES = [str(Path(build.__file__).parent / "csrc" / name) for name in build.SOURCES]


# Without a compiler there is nothing to build (kvflow then runs PyTorch ops, tested elsewhere); CI has g++.
@pytest.mark.skipif(build.compiler() is None, reason="needs a C++ compiler")
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


@pytest.mark.skipif(build.compiler() is None, reason="needs a C++ compiler")
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


@pytest.mark.skipif(build.compiler() is None, reason="needs a C++ compiler")
def test_a_build_failing_for_another_reason_reports_its_own_error(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    cxx = compiler_wrapper(tmp_path / "g++", 'case "$a" in *packed_matmul.cpp) echo "disk full" >&2; exit 1;; esac')
    with pytest.raises(subprocess.CalledProcessError) as failed:
        build.build_threaded(cxx, "generic")
    assert "disk full" in failed.value.stderr
    assert "-fopenmp" in failed.value.cmd  # the OpenMP attempt's error, not the fallback's
