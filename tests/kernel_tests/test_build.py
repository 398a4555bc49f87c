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
