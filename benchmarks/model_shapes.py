"""kvflow against llama.cpp on the model sizes people run (1B to 8B), on random weights of the real shapes.

    python benchmarks/model_shapes.py [--shapes llama-3.2-1b,llama-3.1-8b] [--types Q4_K_M,Q4_0,Q8_0]
        [--threads 2] [--reps 2] [--dir DIR] [--keep] [--record]

For each shape an F16 GGUF is written tensor by tensor with the `gguf` package (never the whole model in
memory), with the default model's tokenizer padded by plain tokens to the shape's vocabulary size.
llama.cpp's own quantizer (`llama_model_quantize`, in the peer's virtualenv: benchmarks/setup_llamacpp.sh;
never a kvflow dependency) makes each file type from it, and the float file is deleted before the next
shape. Each quantized file then runs in both engines, each in fresh processes:
- load to first token (wall seconds from the imports and constructor to one generated token, the file
  read once beforehand so that both read it from the page cache) and peak RSS (VmHWM) at a 1024-token
  context; kvflow's twice, from empty packed-weight and tokenizer caches (its first load of a file, which
  packs the weights, builds the tokenizer and keeps both) and again (every later load, which maps them);
- pp512 and tg128 at batch 1 (kvflow through `kvflow.bench.latency`, llama.cpp through llama-cpp-python),
  alternating which engine goes first.
Random weights are fine for speed: every weight is read and multiplied whatever its value.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from results_file import publish, table_section
from side_by_side import LLAMACPP_VENV, default_gguf, ensure_llamacpp

CONTEXT = 1024


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    rope_base: float = 500000.0
    arch: str = "llama"  # or "qwen3moe": q/k norms and routed experts; "gpt-oss": biases, sinks, experts
    head_size: int | None = None  # where it is not hidden / heads
    experts: int = 0
    experts_used: int = 0  # per token
    sliding_window: int = 0  # gemma3: five of every six layers see this many positions (llama.cpp's pattern)

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """(GGUF name, [out, in], [experts, out, in] or [n]) in file order."""
        h, q, kv, ff = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        out = [("token_embd.weight", (self.vocab, h))]
        if self.arch == "gpt-oss":
            return out + [t for i in range(self.layers) for t in self._gpt_oss_layer(i)] + [
                ("output_norm.weight", (h,)), ("output.weight", (self.vocab, h))]
        for i in range(self.layers):
            out += [(f"blk.{i}.attn_norm.weight", (h,)), (f"blk.{i}.attn_q.weight", (q, h)),
                    (f"blk.{i}.attn_k.weight", (kv, h)), (f"blk.{i}.attn_v.weight", (kv, h)),
                    (f"blk.{i}.attn_output.weight", (h, q)), (f"blk.{i}.ffn_norm.weight", (h,))]
            if self.arch == "gemma3":  # per-head q/k norms, and norms on each sublayer's output
                out += [(f"blk.{i}.attn_q_norm.weight", (self.head_dim,)),
                        (f"blk.{i}.attn_k_norm.weight", (self.head_dim,)),
                        (f"blk.{i}.post_attention_norm.weight", (h,)), (f"blk.{i}.post_ffw_norm.weight", (h,))]
            if self.experts:
                e = self.experts
                out += [(f"blk.{i}.attn_q_norm.weight", (self.head_dim,)),
                        (f"blk.{i}.attn_k_norm.weight", (self.head_dim,)),
                        (f"blk.{i}.ffn_gate_inp.weight", (e, h)), (f"blk.{i}.ffn_gate_exps.weight", (e, ff, h)),
                        (f"blk.{i}.ffn_up_exps.weight", (e, ff, h)), (f"blk.{i}.ffn_down_exps.weight", (e, h, ff))]
            else:
                out += [(f"blk.{i}.ffn_gate.weight", (ff, h)), (f"blk.{i}.ffn_up.weight", (ff, h)),
                        (f"blk.{i}.ffn_down.weight", (h, ff))]
        out.append(("output_norm.weight", (h,)))
        if not self.tied:
            out.append(("output.weight", (self.vocab, h)))
        return out


    def _gpt_oss_layer(self, i: int) -> list[tuple[str, tuple[int, ...]]]:
        """gpt-oss's layer as llama.cpp names it: biases on attention, router and experts; the sinks."""
        h, q, kv, ff, e = (self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim,
                           self.intermediate, self.experts)
        return [(f"blk.{i}.attn_norm.weight", (h,)), (f"blk.{i}.attn_q.weight", (q, h)), (f"blk.{i}.attn_q.bias", (q,)),
                (f"blk.{i}.attn_k.weight", (kv, h)), (f"blk.{i}.attn_k.bias", (kv,)),
                (f"blk.{i}.attn_v.weight", (kv, h)), (f"blk.{i}.attn_v.bias", (kv,)),
                (f"blk.{i}.attn_output.weight", (h, q)), (f"blk.{i}.attn_output.bias", (h,)),
                (f"blk.{i}.attn_sinks.weight", (self.heads,)), (f"blk.{i}.post_attention_norm.weight", (h,)),
                (f"blk.{i}.ffn_gate_inp.weight", (e, h)), (f"blk.{i}.ffn_gate_inp.bias", (e,)),
                (f"blk.{i}.ffn_gate_exps.weight", (e, ff, h)), (f"blk.{i}.ffn_gate_exps.bias", (e, ff)),
                (f"blk.{i}.ffn_up_exps.weight", (e, ff, h)), (f"blk.{i}.ffn_up_exps.bias", (e, ff)),
                (f"blk.{i}.ffn_down_exps.weight", (e, h, ff)), (f"blk.{i}.ffn_down_exps.bias", (e, h))]


SHAPES = {
    "llama-3.2-1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, vocab=128256, tied=True),
    "llama-3.1-8b": Shape(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256, tied=False),
    # Qwen3-30B-A3B's layers (128 experts of 768, 8 a token; q/k norms; head size 128) but 12 of its 48:
    # the whole model's F16 file (61 GB) does not fit this machine's disk. Per token it reads a quarter of
    # the real model's expert bytes and the same output head.
    "gemma-3-1b": Shape(hidden=1152, layers=26, heads=4, kv_heads=1, intermediate=6912, vocab=262144, tied=True,
                        rope_base=1000000.0, arch="gemma3", head_size=256, sliding_window=512),
    "qwen3-30b-a3b-12-layers": Shape(hidden=2048, layers=12, heads=32, kv_heads=4, intermediate=768, vocab=151936,
                                     tied=False, rope_base=1000000.0, arch="qwen3moe", head_size=128, experts=128,
                                     experts_used=8),
    # gpt-oss-20b's layers (32 experts of 2880, 4 a token; 64 query heads of 64; sinks; a 128-token window
    # on every other layer; YaRN) but 8 of its 24: the F16 file of all 24 (39 GB) does not fit this disk.
    # Its experts quantize to MXFP4 (llama.cpp's MXFP4_MOE, as the released GGUF files are).
    "gpt-oss-20b-8-layers": Shape(hidden=2880, layers=8, heads=64, kv_heads=8, intermediate=2880, vocab=201088,
                                  tied=False, rope_base=150000.0, arch="gpt-oss", head_size=64, experts=32,
                                  experts_used=4, sliding_window=128),
}

QUANTIZE = r"""
import ctypes, sys
import llama_cpp
src, dst, ftype = sys.argv[1], sys.argv[2], sys.argv[3]
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + ftype)
params.nthread = int(sys.argv[4])
sys.exit(llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params)))
"""

PEER_LOAD = r"""
import json, sys, time
start = time.perf_counter()
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=int(sys.argv[3]), n_threads=int(sys.argv[2]), verbose=False)
llm.eval([100, 200, 300]); llm.sample()
load = time.perf_counter() - start
print(json.dumps({"load_s": load, "rss_mib": [int(l.split()[1]) / 1024 for l in open("/proc/self/status")
                                              if l.startswith("VmHWM:")][0]}))
"""

PEER_SPEED = r"""
import json, sys, time
from llama_cpp import Llama
path, threads, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = Llama(model_path=path, n_ctx=1024, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False)
prompt = [100 + (i * 7919) % 20000 for i in range(512)]
def pp():
    llm.reset(); t = time.perf_counter(); llm.eval(prompt); return 512 / (time.perf_counter() - t)
def tg():
    llm.reset(); llm.eval(prompt[:1]); t = time.perf_counter()
    for i in range(128):
        llm.eval([200 + i])
    return 128 / (time.perf_counter() - t)
pp(); tg()  # warm-up
print(json.dumps({"pp": sorted(pp() for _ in range(reps))[(reps - 1) // 2],
                  "tg": sorted(tg() for _ in range(reps))[(reps - 1) // 2]}))
"""

KVFLOW_LOAD = r"""
import json, sys, time
start = time.perf_counter()
from kvflow import LLM, SamplingParams
llm = LLM(sys.argv[1], threads=int(sys.argv[2]), max_model_len=int(sys.argv[3]), max_num_seqs=1,
          kv_cache_memory=int(sys.argv[4]))
llm.generate([{"prompt_token_ids": [100, 200, 300]}], SamplingParams(max_tokens=1, temperature=0))
load = time.perf_counter() - start
print(json.dumps({"load_s": load, "rss_mib": [int(l.split()[1]) / 1024 for l in open("/proc/self/status")
                                              if l.startswith("VmHWM:")][0]}))
"""

KVFLOW_SPEED = r"""
import json, sys
import torch
from kvflow.bench.latency import run_latency
from kvflow.machine.probe import load_probe
threads = int(sys.argv[2])
torch.set_num_threads(threads)
run = run_latency(sys.argv[1], [512], 128, [0], [1], reps=int(sys.argv[3]), probe=load_probe(), threads=threads)
out = {r["test"]: r for r in run["results"]}
print(json.dumps({"pp": out["pp512"]["tokens_per_s"], "tg": out["tg128"]["tokens_per_s"],
                  "tg_roofline": out["tg128"]["fraction_of_roofline"],
                  "weight_mib": run["weight_bytes_per_step"] / 2**20}))
"""


def write_f16(shape: Shape, path: Path, context: int = 8192) -> None:
    """The shape's tensors, random (a pool of N(0, 0.02) float16 values, sliced at varying offsets), one
    tensor in memory at a time; norms are ones; the default model's tokenizer padded to shape.vocab."""
    import gguf

    src = gguf.GGUFReader(str(default_gguf()))
    writer = gguf.GGUFWriter(str(path), shape.arch)
    writer.add_block_count(shape.layers)
    writer.add_context_length(context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_base)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    if shape.head_size:
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    if shape.sliding_window:
        writer.add_sliding_window(shape.sliding_window)
        if shape.arch == "gemma3":
            writer.add_rope_freq_base_swa(10000.0)
    if shape.arch == "gpt-oss":  # YaRN from 4K to 128K positions
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(32.0)
        writer.add_rope_scaling_orig_ctx_len(4096)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
        writer.add_expert_feed_forward_length(shape.intermediate)
    writer.add_vocab_size(shape.vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for field in src.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        value = field.contents()
        if field.name == "tokenizer.ggml.tokens":
            value = value + [f"<|filler_{i}|>" for i in range(shape.vocab - len(value))]
        elif field.name == "tokenizer.ggml.token_type":
            # Plain tokens: a real vocabulary of this size has a few hundred special tokens, not tens of
            # thousands (which would cost each engine's tokenizer build what no real model asks of it).
            value = value + [gguf.TokenType.NORMAL] * (shape.vocab - len(value))
        vtype = field.types[0]
        writer.add_key_value(field.name, value, vtype, sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    tensors = shape.tensors()
    for name, dims in tensors:
        # Routers and biases stay float32, as llama.cpp's converter keeps them.
        dtype = np.float32 if len(dims) == 1 or "gate_inp" in name or name.endswith(".bias") else np.float16
        writer.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    pool = (rng.standard_normal(1 << 24, dtype=np.float32) * 0.02).astype(np.float16)
    for i, (name, dims) in enumerate(tensors):
        if len(dims) == 1 and not name.endswith(".bias"):
            writer.write_tensor_data(np.ones(dims, dtype=np.float32))
            continue
        start = (i * 7919) % (pool.size // 2)
        data = np.resize(pool[start:], dims)
        float32 = "gate_inp" in name or name.endswith(".bias")
        writer.write_tensor_data(data.astype(np.float32) if float32 else data)
    writer.close()


def python_of_peer() -> str:
    return str(LLAMACPP_VENV / "bin" / "python")


def last_json(cmd: list[str], env: dict | None = None) -> dict:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:3]} failed: {proc.stderr.strip()[-400:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def warm_page_cache(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def kv_cache_bytes(shape: Shape) -> int:
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * 2 * CONTEXT  # K and V, float16


def measure(path: Path, shape: Shape, threads: int, reps: int) -> dict:
    """Both engines on one file: load and RSS in fresh processes, then speed, alternating who goes first."""
    peer_py = python_of_peer()
    warm_page_cache(path)  # both loads then read the file from memory, as a second start does
    figures = {"peer_load": last_json([peer_py, "-c", PEER_LOAD, str(path), str(threads), str(CONTEXT)])}
    load_cmd = [sys.executable, "-c", KVFLOW_LOAD, str(path), str(threads), str(CONTEXT), str(kv_cache_bytes(shape))]
    with tempfile.TemporaryDirectory(dir=path.parent) as packed:
        # kvflow's first load packs the weights and builds the tokenizer, and leaves both in its caches (fresh
        # folders here); every later load maps and reads them (loader/packed_cache.py, tokenizer_cache.py).
        # Both are reported; the speed runs map. Before the later load its cache files are read once, as the
        # model file is before every load: on a host short of memory they were otherwise read back from disk.
        env = {**os.environ, "KVFLOW_PACKED_CACHE": packed, "KVFLOW_TOKENIZER_CACHE": os.path.join(packed, "tok")}
        warm_page_cache(path)
        figures["ours_first_load"] = last_json(load_cmd, env)
        warm_page_cache(path)
        for cached in Path(packed).rglob("*"):
            if cached.is_file():
                warm_page_cache(cached)
        figures["ours_load"] = last_json(load_cmd, env)
        peer_cmd = [peer_py, "-c", PEER_SPEED, str(path), str(threads), str(reps)]
        ours_cmd = [sys.executable, "-c", KVFLOW_SPEED, str(path), str(threads), str(reps)]
        figures["ours_speed"] = last_json(ours_cmd, env)
        figures["peer_speed"] = last_json(peer_cmd)
    return figures


def row(shape_name: str, ftype: str, size_gib: float, f: dict) -> str:
    ours, peer, ol, pl = f["ours_speed"], f["peer_speed"], f["ours_load"], f["peer_load"]
    return (f"| {shape_name} | {ftype} | {size_gib:.2f} | {ours['pp']:.1f} / {peer['pp']:.1f} = {ours['pp'] / peer['pp']:.2f} "
            f"| {ours['tg']:.2f} / {peer['tg']:.2f} = {ours['tg'] / peer['tg']:.2f} | {100 * ours['tg_roofline']:.0f}% "
            f"({ours['weight_mib']:.0f} MiB a step) | {ol['load_s']:.1f} / {pl['load_s']:.1f} = "
            f"{ol['load_s'] / pl['load_s']:.2f} | {f['ours_first_load']['load_s']:.1f} / {pl['load_s']:.1f} = "
            f"{f['ours_first_load']['load_s'] / pl['load_s']:.2f} | {ol['rss_mib']:.0f} / {pl['rss_mib']:.0f} = "
            f"{ol['rss_mib'] / pl['rss_mib']:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--types", default="Q4_K_M,Q4_0,Q8_0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where the files go (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the quantized files (and reuse ones already there)")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    from kvflow.kernels import cpu_features

    ensure_llamacpp()
    workdir = Path(args.dir or tempfile.mkdtemp(prefix="kvflow-shapes-"))
    workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    for shape_name in args.shapes.split(","):
        shape = SHAPES[shape_name]
        f16 = workdir / f"{shape_name}.F16.gguf"
        targets = {t: workdir / f"{shape_name}.{t}.gguf" for t in args.types.split(",")}
        missing = [t for t, p in targets.items() if not p.exists()]
        if missing:
            started = time.perf_counter()
            write_f16(shape, f16)
            print(f"{shape_name}: F16 written in {time.perf_counter() - started:.0f} s", flush=True)
            for ftype in missing:
                started = time.perf_counter()
                subprocess.run([python_of_peer(), "-c", QUANTIZE, str(f16), str(targets[ftype]), ftype,
                                str(args.threads)], check=True, capture_output=True)
                print(f"{shape_name}: {ftype} in {time.perf_counter() - started:.0f} s", flush=True)
            f16.unlink()
        for ftype, path in targets.items():
            figures = measure(path, shape, args.threads, args.reps)
            rows.append(row(shape_name, ftype, path.stat().st_size / 2**30, figures))
            print(rows[-1], flush=True)
            if not args.keep:
                path.unlink()
    publish(table_section(
        f"Model shapes against llama.cpp ({time.strftime('%Y-%m-%d %H:%M')}, CPU {cpu_features.cpu_name()}, "
        f"{args.threads} threads)",
        f"`python benchmarks/model_shapes.py --shapes {args.shapes} --types {args.types}`: random weights of the "
        "real shapes, quantized by llama.cpp's quantizer; each cell is kvflow / llama.cpp = ratio (for load "
        f"and RSS, lower is better). Kernel tier {cpu_features.isa_tier()}; load = constructor to first token; "
        f"peak RSS at a {CONTEXT}-token context; medians of {args.reps} repetitions.",
        ["shape", "type", "file GiB", "pp512 tok/s", "tg128 tok/s", "kvflow tg128 % of roofline",
         "load to first token s", "first load (packs) s", "peak RSS MiB"], rows), args.record)


if __name__ == "__main__":
    main()
