#!/usr/bin/env bash
# Build llama-cpp-python (with its OpenAI server) into a virtualenv of its own, the llama.cpp peer
# for `kvflow bench`. Idempotent: exits at once when the venv already imports llama_cpp.
#
# Built with clang-16 on purpose: Debian's GCC 12 drops the AMX tile configuration and the AMX
# kernels then crash (segfault on Q4_1, illegal instruction on Q8_0).
#
# Env: LLAMACPP_ISA (native, the default: GGML_NATIVE=ON; or avx2: AVX2 + FMA + F16C only, the peer for
# kvflow's KVFLOW_ISA=avx2 tier on a bigger CPU), LLAMACPP_VENV (default: <repo>/.venv-llamacpp, or
# <repo>/.venv-llamacpp-avx2), PYTHON (interpreter for the venv, default python3).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=benchmarks/llamacpp_flags.sh
source "$repo_root/benchmarks/llamacpp_flags.sh"
venv="${LLAMACPP_VENV:-$default_venv}"
python="${PYTHON:-python3}"

if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import llama_cpp" 2>/dev/null; then
    echo "llama-cpp-python already installed in $venv: $("$venv/bin/python" -c 'import llama_cpp; print(llama_cpp.__version__)')"
    exit 0
fi

if ! command -v clang-16 >/dev/null || ! command -v clang++-16 >/dev/null; then
    sudo_cmd=""
    if [ "$(id -u)" != 0 ]; then sudo_cmd="sudo"; fi
    $sudo_cmd apt-get update
    $sudo_cmd apt-get install -y clang-16
fi
# The source build needs cmake and ninja/make; pip brings cmake via scikit-build-core if missing.

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --upgrade pip

export CMAKE_ARGS="-DCMAKE_C_COMPILER=clang-16 -DCMAKE_CXX_COMPILER=clang++-16 $isa_flags"
# Keep the build parallel but bounded: the machines are small and shared.
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
"$venv/bin/python" -m pip install --no-cache-dir --verbose 'llama-cpp-python[server]'

"$venv/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'installed in $venv')"
