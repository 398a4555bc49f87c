"""The GGUF file types people download, on the default model, against llama.cpp on the same files.

Each type is made from the default model's file by llama.cpp's own quantizer (`llama_model_quantize`, in
the peer's virtualenv: benchmarks/setup_llamacpp.sh; never a kvflow dependency). For each file: whether
kvflow loads it, how many of its weight tensors stay packed, the greedy answer to one question from
kvflow (fast mode) and from llama.cpp; and, for every tensor type in the file, the `gguf` package's
dequantizer (what kvflow uses for the types it does not keep packed) against llama.cpp's own
`dequantize_row_*` on the file's first tensor of that type.

    python benchmarks/gguf_types.py [--types Q4_K_M,Q6_K] [--record]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
from results_file import publish, table_section

HERE = Path(__file__).resolve().parent
LLAMACPP_VENV = Path(os.environ.get("LLAMACPP_VENV", HERE.parent / ".venv-llamacpp"))
TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS", "Q3_K_M", "Q2_K")
QUESTION = "What is the capital of France?"

PEER = r"""
import ctypes, json, sys
import llama_cpp
mode, src, dst = sys.argv[1], sys.argv[2], sys.argv[3]
if mode == "quantize":
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + dst.rsplit(".", 2)[-2])
    params.allow_requantize = True
    params.nthread = 2
    sys.exit(llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params)))
llm = llama_cpp.Llama(model_path=src, n_ctx=512, n_threads=2, verbose=False)
out = llm.create_chat_completion([{"role": "user", "content": dst}], temperature=0, max_tokens=12)
print(json.dumps(out["choices"][0]["message"]["content"]))
"""


def peer(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(LLAMACPP_VENV / "bin" / "python"), "-c", PEER, *args], capture_output=True,
                          text=True, timeout=600)


def ggml_library() -> ctypes.CDLL:
    lib = next((LLAMACPP_VENV / "lib").glob("python3*/site-packages/llama_cpp/lib/libggml-base.so"))
    return ctypes.CDLL(str(lib))


def dequantizer_gap(path: Path, ggml: ctypes.CDLL) -> dict[str, float]:
    """Per quantized tensor type in the file: max |gguf package - llama.cpp| over its first tensor, relative
    to the tensor's largest |weight|."""
    import gguf

    gaps: dict[str, float] = {}
    for tensor in gguf.GGUFReader(str(path)).tensors:
        name = tensor.tensor_type.name
        if name in gaps or name in ("F32", "F16", "BF16"):
            continue
        ours = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(-1)
        theirs = np.empty_like(ours)
        fn = getattr(ggml, f"dequantize_row_{name.lower()}".replace("_k", "_K"), None)
        if fn is None:
            gaps[name] = float("nan")
            continue
        raw = np.ascontiguousarray(tensor.data).view(np.uint8)
        fn(raw.ctypes.data_as(ctypes.c_void_p), theirs.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(ours.size))
        gaps[name] = float(np.abs(ours - theirs).max() / max(np.abs(theirs).max(), 1e-30))
    return gaps


KVFLOW = r"""
import json, sys, time
from kvflow import LLM, SamplingParams
start = time.perf_counter()
llm = LLM(sys.argv[1], threads=2, max_model_len=1024)
load = time.perf_counter() - start
messages = [{"role": "user", "content": sys.argv[2]}]
out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=12))
del llm
# The float reference (exact mode: float32 over the dequantized weights, as transformers computes): its
# answer, and the smallest lead of a chosen token's log-probability over the runner-up's along it, in nats.
# A small lead is where rounding decides the answer.
exact = LLM(sys.argv[1], threads=2, max_model_len=1024, mode="exact", quantization="none")
ref = exact.chat(messages, SamplingParams(temperature=0, max_tokens=12, logprobs=2))[0].outputs[0]
tops = [sorted((lp.logprob for lp in step.values()), reverse=True) for step in ref.logprobs]
leads = [top[0] - top[1] for top in tops]
at = min(range(len(leads)), key=leads.__getitem__)
print(json.dumps([out[0].outputs[0].text.strip(), load, ref.text.strip(), leads[at], at + 1]))
"""


def kvflow_answer(path: Path) -> tuple[str, str]:
    """kvflow's answer and load time, and the float reference's answer with its smallest lead over a
    runner-up, in a process of its own (as a user starts it: one model a process)."""
    proc = subprocess.run([sys.executable, "-c", KVFLOW, str(path), QUESTION], capture_output=True, text=True,
                          timeout=900)
    if proc.returncode != 0:
        return f"refused: {proc.stderr.strip().splitlines()[-1][:120]}", ""
    text, load, ref, lead, at = json.loads(proc.stdout.strip().splitlines()[-1])
    same = "same as kvflow" if ref == text else repr(ref)
    return f"{text!r} (load {load:.1f} s)", f"{same}; smallest lead {lead:.3f} (token {at})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    import gguf

    from kvflow.kernels import cpu_features
    from kvflow.loader.gguf_file import PACKED_TYPES
    from kvflow.loader.resolve import resolve_model

    src = resolve_model(None).path
    ggml = ggml_library()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for ftype in args.types.split(","):
            dst = Path(tmp) / f"smollm2.{ftype}.gguf"
            made = peer("quantize", str(src), str(dst))
            if made.returncode != 0 or not dst.exists():
                rows.append(f"| {ftype} | llama.cpp's quantizer failed: {made.stderr.strip()[-120:]} | | | | | |")
                continue
            counts = Counter(t.tensor_type.name for t in gguf.GGUFReader(str(dst)).tensors if len(t.shape) == 2)
            packed = sum(n for name, n in counts.items() if name in PACKED_TYPES)
            mix = ", ".join(f"{name} {n}" for name, n in counts.most_common())
            ours, reference = kvflow_answer(dst)
            theirs = peer("chat", str(dst), QUESTION)
            theirs = json.loads(theirs.stdout).strip() if theirs.returncode == 0 else theirs.stderr.strip()[-120:]
            gaps = ", ".join(f"{name} {gap:.1e}" for name, gap in dequantizer_gap(dst, ggml).items())
            rows.append(f"| {ftype} | {mix} | {packed} of {sum(counts.values())} | {ours} | {theirs!r} | {reference} "
                        f"| {gaps} |")
            print(rows[-1], flush=True)
    publish(table_section(
        f"GGUF file types on the default model ({time.strftime('%Y-%m-%d %H:%M')}, CPU {cpu_features.cpu_name()})",
        "`python benchmarks/gguf_types.py`: SmolLM2-135M-Instruct requantized from its Q4_1 file by llama.cpp's "
        f"quantizer; the question {QUESTION!r}, greedy, 12 tokens, in kvflow's fast mode (kernel tier "
        f"{cpu_features.isa_tier()}) and in llama.cpp (llama-cpp-python). Dequantizer gap: max |gguf package - "
        "llama.cpp's dequantize_row| / max |w| on the file's first tensor of each type. Float reference: kvflow's "
        "exact mode (float32 over the dequantized weights, transformers' arithmetic), its answer and the smallest "
        "lead of a chosen token's log-probability over the runner-up's along it, in nats.",
        ["file type", "2-D tensors by type", "packed in kvflow", "kvflow", "llama.cpp", "float reference",
         "dequantizer gap"], rows),
        args.record)


if __name__ == "__main__":
    main()
