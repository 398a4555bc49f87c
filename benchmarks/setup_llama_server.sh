#!/usr/bin/env bash
# Build llama.cpp's own server binary (llama-server) from the llama.cpp source that llama-cpp-python's
# sdist carries, into the peer's virtualenv: <venv>/bin/llama-server. side_by_side.py serves the peer
# through it when present. Unlike llama-cpp-python's Python server it honours ignore_eos and runs
# parallel slots (-np), so concurrency-8 throughput compares like for like.
#
# Same compiler as setup_llamacpp.sh (clang-16: Debian's GCC 12 breaks llama.cpp's AMX path). About
# 10 minutes on 2 cores. Idempotent. Env: LLAMACPP_ISA and LLAMACPP_VENV, as setup_llamacpp.sh.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=benchmarks/llamacpp_flags.sh
source "$repo_root/benchmarks/llamacpp_flags.sh"
venv="${LLAMACPP_VENV:-$default_venv}"
export LLAMACPP_VENV="$venv"
target="$venv/bin/llama-server"
if [ -x "$target" ]; then
    echo "llama-server already built: $target"
    exit 0
fi
bash "$repo_root/benchmarks/setup_llamacpp.sh"  # the venv, clang-16, and the version to match
version="$("$venv/bin/python" -c 'import llama_cpp; print(llama_cpp.__version__)')"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$venv/bin/python" -m pip download --no-deps --no-binary :all: --dest "$work" "llama-cpp-python==$version"
tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
src="$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)"

cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_C_COMPILER=clang-16 -DCMAKE_CXX_COMPILER=clang++-16 $isa_flags \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DBUILD_SHARED_LIBS=OFF
cmake --build "$work/build" --target llama-server -j "${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
install -m 755 "$work/build/bin/llama-server" "$target"
echo "built $target ($("$target" --version 2>&1 | head -n 1))"
