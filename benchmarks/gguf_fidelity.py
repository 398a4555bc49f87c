"""Fidelity across engines: which answer the float model gives on a GGUF file, and where the engines part.

For each file type (made from the default model's Q4_1 file by llama.cpp's quantizer, as
benchmarks/gguf_types.py makes them; Q4_1 is the file itself) the question is answered greedily, in the
model's chat template, by:

  float          transformers in float32 on the GGUF's dequantized weights (the gguf package's dequantizer);
                 the reference
  kvflow exact   LLM(file, mode="exact"): float32 weights from the same dequantizer, float32 cache
  kvflow fast    LLM(file): the packed weights, 16-bit kernel inputs at batch 1, float16 cache
  llama.cpp      llama-cpp-python (its own virtualenv, a subprocess): default settings (AMX and repacked
                 kernels where the CPU has them); "llama.cpp plain" turns the extra buffer types off
                 (use_extra_bufts=False), so every matmul is ggml's vec_dot on Q8 activations
  emu q8         the float model with each matmul's input rounded as llama.cpp rounds it (by llama.cpp's
                 own quantize_row_q8_*_ref / dequantize_row_q8_*): Q8_K, one scale per 256, for the K-quant
                 weights; Q8_0, one scale per 32, for the others (Q8_1 for Q4_1/Q5_1 rounds x the same way)
  emu q8+f16     emu q8, and attention as llama.cpp's float16 KV cache computes it: q, k, v and the
                 softmax weights rounded to float16
  emu no Q8_K    emu q8+f16 with the K-quant matmuls' inputs left in float32 (only for files with K-quants)

Every engine gets the same prompt token ids (checked against each engine's own chat path). Each engine is
also teacher-forced along the float model's answer (kvflow by a sampler that records the logits and
substitutes the float model's token; llama.cpp's own greedy pass is that up to where it parts), so its
log-probabilities at a position are conditioned on the same prefix as the float model's. The emulations'
answers turn on float32 noise (a forward over more rows, another blocking of a float32 matmul, flips them), so
at the decision point they are run 16 times with jittered inputs and reported as a spread. A third table
compares the gguf package's dequantization of every quantized tensor in the file with llama.cpp's
dequantize_row_* (max |difference|).

    python benchmarks/gguf_fidelity.py [--types Q6_K,Q4_K_M,Q5_K_M,Q5_1,Q8_0,Q4_1] [--tokens 24] [--record]

--record writes the text to benchmarks/fidelity_section.md (not RESULTS.md).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import pickle
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
from gguf_types import LLAMACPP_VENV, QUESTION, ggml_library, peer

HERE = Path(__file__).resolve().parent
TYPES = ("Q6_K", "Q4_K_M", "Q5_K_M", "Q5_1", "Q8_0", "Q4_1")
SECTION = HERE / "fidelity_section.md"
FORCED_SEED = 0x5EED  # marks the teacher-forced kvflow request (greedy: the seed changes nothing else)
FLOAT_TYPES = ("F32", "F16", "BF16")
# transformers' Llama module names -> GGUF tensor names
HF_TO_GGUF = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
Q8_BLOCKS = {"q8_0": (32, 34), "q8_K": (256, 292)}  # values per block, bytes per block

LLAMACPP = r"""
import json, sys
import numpy as np
import llama_cpp
import llama_cpp.llama_cpp as C
path, spec, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
default_params = C.llama_model_default_params
def model_params():
    params = default_params()
    params.use_extra_bufts = spec["extra_bufts"]
    return params
C.llama_model_default_params = model_params
llm = llama_cpp.Llama(model_path=path, n_ctx=512, n_threads=spec["threads"], verbose=False)
chat = llm.create_chat_completion([{"role": "user", "content": spec["question"]}], temperature=0,
                                  max_tokens=spec["tokens"])
chat_ids = llm.input_ids[: llm.n_tokens].tolist()
prompt, path_ids, eos = spec["prompt"], spec["path"], llm.token_eos()
def logits():
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy()
# One greedy pass: until it parts from the path its rows are the path's (teacher-forced) rows; the rows after
# that are never read (the decision point is at or before the first engine's parting), so they stay NaN.
llm.reset()
llm.eval(prompt)
free, forced = [], []
while len(free) < spec["tokens"]:
    row = logits()
    free.append(int(np.argmax(row)))
    if len(forced) < len(path_ids):
        on_path = free[:-1] == path_ids[: len(free) - 1]
        forced.append(row if on_path else np.full_like(row, np.nan))
    if free[-1] == eos:
        break
    llm.eval([free[-1]])
forced += [np.full(llm.n_vocab(), np.nan, np.float32)] * (len(path_ids) - len(forced))
np.save(out, np.stack(forced))
print(json.dumps({"chat": chat["choices"][0]["message"]["content"], "chat_prompt": chat_ids[: len(prompt)],
                  "free": free}))
"""


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


class Engine:
    """One engine's run on one file: its free greedy answer (token ids and text) and its log-probabilities
    along the float model's answer (row k: the next-token distribution after the prompt and path[:k])."""

    def __init__(self, name: str, tokens: list[int], text: str, forced: np.ndarray, note: str = ""):
        self.name, self.tokens, self.text, self.forced, self.note = name, tokens, text, log_softmax(forced), note

    def parts_at(self, path: list[int]) -> int | None:
        """The first position where its answer differs from `path` (None: the same answer)."""
        for k, (a, b) in enumerate(zip(self.tokens, path)):
            if a != b:
                return k
        return None if len(self.tokens) == len(path) else min(len(self.tokens), len(path))

    def check(self, path: list[int]) -> tuple[int, int, int] | None:
        """Where its forced run's greedy pick differs from its free run's over their shared prefix:
        (position, forced pick, free pick), or None."""
        at = self.parts_at(path)
        upto = len(path) if at is None else min(at + 1, len(path), len(self.tokens))
        free = path[:upto] if at is None else path[:at] + self.tokens[at:upto]
        for k in range(upto):
            if int(self.forced[k].argmax()) != free[k]:
                return k, int(self.forced[k].argmax()), free[k]
        return None


# ---------------------------------------------------------------- transformers, and llama.cpp's roundings

# What the float model's forward rounds as llama.cpp does (emulation), and the relative jitter put on every
# matmul input first (0: none; the spread estimate below sets it).
PLAIN = {"q8": False, "f16": False, "skip_q8k": False, "jitter": 0.0}
MODE = dict(PLAIN)
EMULATIONS = {"emu q8": {"q8": True}, "emu q8+f16": {"q8": True, "f16": True},
              "emu no Q8_K": {"q8": True, "f16": True, "skip_q8k": True}}
JITTER = 1e-6  # about what float32 accumulation order changes: 5e-5 on logits of 25 when a matmul's blocking changes
SAMPLES = 16


def q8_roundtrip(ggml: ctypes.CDLL, x, kind: str):
    """x through llama.cpp's own activation quantizer and back (quantize_row_<kind>_ref, dequantize_row_<kind>)."""
    import torch

    per, size = Q8_BLOCKS[kind]
    a = np.ascontiguousarray(x.detach().float().numpy())
    if a.shape[-1] % per:
        return x
    buf = np.empty(a.size // per * size, np.uint8)
    out = np.empty_like(a)
    vp = ctypes.c_void_p
    getattr(ggml, f"quantize_row_{kind}_ref")(a.ctypes.data_as(vp), buf.ctypes.data_as(vp), ctypes.c_int64(a.size))
    getattr(ggml, f"dequantize_row_{kind}")(buf.ctypes.data_as(vp), out.ctypes.data_as(vp), ctypes.c_int64(a.size))
    return torch.from_numpy(out)


def activation_type(weight_type: str) -> str | None:
    """ggml's vec_dot_type for a weight type on CPU: what its matmul's input is quantized to."""
    if weight_type in FLOAT_TYPES:
        return None
    return "q8_K" if weight_type.endswith("_K") or weight_type.startswith("IQ") else "q8_0"


def f16_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Eager attention; under MODE["f16"] q, k, v and the softmax weights are rounded to float16 (llama.cpp's
    float16 KV cache: K.Q with q converted to float16, softmax in float32, then V times the weights in float16)."""
    import torch
    from transformers.models.llama.modeling_llama import repeat_kv

    def h(t):
        return t.to(torch.float16).to(torch.float32) if MODE["f16"] else t

    k = repeat_kv(h(key), module.num_key_value_groups)
    v = repeat_kv(h(value), module.num_key_value_groups)
    w = torch.matmul(h(query), k.transpose(2, 3)) * scaling
    if attention_mask is None:
        q_len, k_len = w.shape[-2], w.shape[-1]
        w = w.masked_fill(~torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len), float("-inf"))
    elif attention_mask.dtype == torch.bool:
        w = w.masked_fill(~attention_mask, float("-inf"))
    else:
        w = w + attention_mask[..., : w.shape[-1]]
    p = h(torch.softmax(w, dim=-1, dtype=torch.float32))
    return torch.matmul(p, v).transpose(1, 2).contiguous(), p


def load_float_model(path: Path, types: dict[str, str], ggml: ctypes.CDLL):
    """transformers' model on the GGUF's dequantized weights, with hooks that round each matmul's input as
    llama.cpp does while MODE["q8"] is set."""
    import torch
    from transformers import AttentionInterface, AutoModelForCausalLM

    AttentionInterface.register("llamacpp_f16", f16_attention)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                 attn_implementation="llamacpp_f16")
    model.eval()
    global JITTER_GEN
    JITTER_GEN = torch.Generator()
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        if name == "lm_head":
            weight = types.get("output.weight", types["token_embd.weight"])
        else:
            parts = name.split(".")
            weight = types[f"blk.{parts[2]}.{HF_TO_GGUF[parts[-1]]}.weight"]
        kind = activation_type(weight)
        if kind is None:
            continue
        module.q8_kind = kind

        def hook(module, args, kind=kind):
            x = args[0]
            if MODE["jitter"]:
                x = x * (1 + MODE["jitter"] * torch.randn(x.shape, generator=JITTER_GEN))
            if MODE["q8"] and not (kind == "q8_K" and MODE["skip_q8k"]):
                x = q8_roundtrip(ggml, x, kind)
            return (x,)

        module.register_forward_pre_hook(hook)
    return model


def gap_spread(model, prompt: list[int], path: list[int], k: int, a: int, b: int, mode: dict) -> list[float]:
    """logprob(a) - logprob(b) after prompt + path[:k], over SAMPLES runs with each matmul input jittered by
    JITTER (relative): how far float32 noise moves the gap under this mode's roundings."""
    import torch

    torch.set_num_threads(1)  # see hf_run
    gaps = []
    ids = torch.tensor([prompt + path[:k]])
    for seed in range(SAMPLES):
        JITTER_GEN.manual_seed(seed)
        MODE.update({**PLAIN, **mode, "jitter": JITTER})
        with torch.no_grad():
            row = torch.log_softmax(model(ids).logits[0, -1].double(), -1)
        gaps.append(float(row[a] - row[b]))
    MODE.update(PLAIN)
    return gaps


def rounding_errors(model, ggml: ctypes.CDLL, prompt: list[int]) -> tuple[dict, dict]:
    """Per llama.cpp activation type, one entry per matmul, at the prompt's last row of the float forward:
    the relative RMS error of its input when rounded that way, and its input's max |x| / median |x|."""
    import torch

    torch.set_num_threads(1)  # see hf_run
    errors: dict[str, list[float]] = {}
    peaks: dict[str, list[float]] = {}
    handles = []
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and getattr(module, "q8_kind", None):
            def hook(module, args):
                x = args[0][0, -1:].float()
                y = q8_roundtrip(ggml, x, module.q8_kind)
                errors.setdefault(module.q8_kind, []).append(float((y - x).norm() / x.norm()))
                peaks.setdefault(module.q8_kind, []).append(float(x.abs().max() / x.abs().median()))
            handles.append(module.register_forward_pre_hook(hook))
    MODE.update(PLAIN)
    with torch.no_grad():
        model(torch.tensor([prompt]))
    for h in handles:
        h.remove()
    return errors, peaks


def hf_run(model, tokenizer, name: str, prompt: list[int], tokens: int, path: list[int] | None) -> Engine:
    """Greedy answer (generate), and the logits along `path` (one forward over prompt + path; its own
    answer when path is None)."""
    import torch

    # One thread for the float model (kvflow's LLM sets its own): on a shared CPU, two threads' barriers ran
    # its forward ten times slower.
    torch.set_num_threads(1)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        free = out[0, len(prompt):].tolist()
        follow = free if path is None else path
        logits = model(torch.tensor([prompt + follow[:-1]])).logits[0, len(prompt) - 1:].double().numpy()
    return Engine(name, free, tokenizer.decode(free, skip_special_tokens=True), logits)


# ---------------------------------------------------------------- kvflow


class ForcingSampler:
    """Wraps kvflow's sampler: for the marked request, records each position's logits and substitutes the
    path's token, so the engine decodes along the path with its own arithmetic (speculative verify rows
    included, as long as their drafts follow the path)."""

    def __init__(self, sampler, path: list[int]):
        self.sampler, self.path, self.rows = sampler, path, {}

    def __call__(self, logits, rows):
        out = self.sampler(logits, rows)
        for i, row in enumerate(rows):
            if row.params.seed != FORCED_SEED:
                continue
            pos = len(row.output_token_ids)
            if pos >= len(self.path) or list(row.output_token_ids) != self.path[:pos]:
                continue
            self.rows.setdefault(pos, logits[i].float().numpy().astype(np.float64).copy())
            out.token_ids[i] = self.path[pos]
        return out


def kvflow_run(path: Path, mode: str, prompt: list[int], tokens: int, float_path: list[int], threads: int) -> Engine:
    from kvflow import LLM, SamplingParams

    llm = LLM(str(path), threads=threads, max_model_len=1024, mode=mode, packed_cache="off",
              enable_prefix_caching=False, kv_cache_memory=64 << 20)
    try:
        free = llm.chat([{"role": "user", "content": QUESTION}], SamplingParams(temperature=0, max_tokens=tokens))[0]
        note = "" if list(free.prompt_token_ids) == prompt else "its chat prompt differs from transformers'"
        forcing = ForcingSampler(llm.engine.sampler, float_path)
        llm.engine.sampler = forcing
        llm.generate({"prompt_token_ids": prompt},
                     SamplingParams(temperature=0, max_tokens=len(float_path), seed=FORCED_SEED))
        forced = np.stack([forcing.rows[k] for k in range(len(float_path))])
        out = free.outputs[0]
        return Engine(f"kvflow {mode}", list(out.token_ids), out.text, forced, note)
    finally:
        llm.close()
        del llm
        gc.collect()


# ---------------------------------------------------------------- llama.cpp


def llamacpp_run(path: Path, name: str, extra_bufts: bool, prompt: list[int], tokens: int,
                 float_path: list[int], threads: int, tokenizer, tmp: Path) -> Engine:
    spec = {"extra_bufts": extra_bufts, "threads": threads, "question": QUESTION, "tokens": tokens,
            "prompt": prompt, "path": float_path}
    out = tmp / f"llamacpp-{int(extra_bufts)}.npy"
    proc = subprocess.run([str(LLAMACPP_VENV / "bin" / "python"), "-c", LLAMACPP, str(path), json.dumps(spec),
                           str(out)], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: {proc.stderr.strip()[-300:]}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    notes = []
    if got["chat_prompt"] != prompt:
        notes.append("its chat prompt differs from transformers'")
    text = tokenizer.decode(got["free"], skip_special_tokens=True)
    if got["chat"].strip() != text.strip():
        notes.append(f"create_chat_completion said {got['chat']!r}")
    return Engine(name, got["free"], got["chat"], np.load(out), "; ".join(notes))


# ---------------------------------------------------------------- dequantizers


def dequantizer_gaps(path: Path, ggml: ctypes.CDLL) -> dict[str, tuple[int, int, float, float]]:
    """Per quantized type: (tensors, tensors bitwise equal, max |gguf package - llama.cpp's dequantize_row_*|,
    that over the largest |w| of its tensor), over every tensor of the type in the file."""
    import gguf

    gaps: dict[str, list] = {}
    for tensor in gguf.GGUFReader(str(path)).tensors:
        name = tensor.tensor_type.name
        if name in FLOAT_TYPES:
            continue
        ours = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(-1)
        theirs = np.empty_like(ours)
        fn = getattr(ggml, f"dequantize_row_{name.lower()}".replace("_k", "_K"))
        raw = np.ascontiguousarray(tensor.data).view(np.uint8)
        fn(raw.ctypes.data_as(ctypes.c_void_p), theirs.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(ours.size))
        diff = float(np.abs(ours - theirs).max())
        entry = gaps.setdefault(name, [0, 0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += int(np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)))
        entry[2] = max(entry[2], diff)
        entry[3] = max(entry[3], diff / max(float(np.abs(theirs).max()), 1e-30))
    return {name: tuple(v) for name, v in gaps.items()}


# ---------------------------------------------------------------- one file


def study(path: Path, label: str, tokenizer, prompt: list[int], args, ggml, tmp: Path) -> dict:
    import gguf

    reader = gguf.GGUFReader(str(path))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    mix = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) == 2)
    has_k = any(activation_type(t) == "q8_K" for t in types.values())
    del reader

    start = time.perf_counter()
    clock = {}

    def lap(name: str) -> None:
        clock[name] = time.perf_counter() - start - sum(clock.values())

    model = load_float_model(path, types, ggml)
    MODE.update(PLAIN)
    ref = hf_run(model, tokenizer, "float", prompt, args.tokens, None)
    path_ids = ref.tokens
    emulations = {name: mode for name, mode in EMULATIONS.items() if has_k or not mode.get("skip_q8k")}
    engines = [ref]
    for name, mode in emulations.items():
        MODE.update({**PLAIN, **mode})
        engines.append(hf_run(model, tokenizer, name, prompt, args.tokens, path_ids))
    MODE.update(PLAIN)
    lap("float and emulations")
    for mode in ("exact", "fast"):
        engines.append(kvflow_run(path, mode, prompt, args.tokens, path_ids, args.threads))
    lap("kvflow")
    engines.append(llamacpp_run(path, "llama.cpp", True, prompt, args.tokens, path_ids, args.threads, tokenizer, tmp))
    engines.append(llamacpp_run(path, "llama.cpp plain", False, prompt, args.tokens, path_ids, args.threads,
                                tokenizer, tmp))
    lap("llama.cpp")
    result = {"label": label, "mix": mix, "engines": engines, "path": path_ids, "when": time.strftime("%Y-%m-%d %H:%M")}
    k = decision_point(result)
    a, b, _ = top2(ref, k)
    result["spread"] = {name: gap_spread(model, prompt, path_ids, k, a, b, mode)
                        for name, mode in {"float": {}, **emulations}.items()}
    result["rounding"], result["peaks"] = rounding_errors(model, ggml, prompt)
    result["kquant_tensors"] = sorted({name.split(".")[-2] for name, t in types.items()
                                       if activation_type(t) == "q8_K"})
    del model
    gc.collect()
    lap("spreads")
    result["gaps"] = dequantizer_gaps(path, ggml)
    lap("dequantizers")
    print(f"{label}: {time.perf_counter() - start:.0f} s ({', '.join(f'{k} {v:.0f} s' for k, v in clock.items())})",
          flush=True)
    return result


def tok(tokenizer, i: int) -> str:
    return repr(tokenizer.decode([int(i)]))


def top2(ref: Engine, k: int) -> tuple[int, int, float]:
    row = ref.forced[k]
    a, b = (int(i) for i in np.argsort(-row)[:2])
    return a, b, float(row[a] - row[b])  # log-softmax differences are logit differences


def answers_rows(result: dict, tokenizer) -> list[str]:
    ref: Engine = result["engines"][0]
    rows = [f"| {result['label']} | float (transformers) | {ref.text.strip()!r} | reference | | |"]
    engines = result["engines"][1:]
    for e in [e for e in engines if not e.name.startswith("emu")] + [e for e in engines if e.name.startswith("emu")]:
        at = e.parts_at(result["path"])
        odd = [e.note] if e.note else []
        if (bad := e.check(result["path"])) is not None:
            k, forced, free = bad
            odd.append(f"teacher-forced, one forward over the prompt and the float answer, it picks "
                       f"{tok(tokenizer, forced)} at token {k + 1}" if e.name.startswith("emu") else
                       f"odd: teacher-forced it picks {tok(tokenizer, forced)} at token {k + 1}, free {tok(tokenizer, free)}")
        odd = "; ".join(odd)
        answer = repr(e.text.strip()) + (f" ({odd})" if odd else "")
        if at is None:
            rows.append(f"| {result['label']} | {e.name} | {answer} | never | | |")
            continue
        if at >= len(result["path"]):
            rows.append(f"| {result['label']} | {e.name} | {answer} | after the float answer's end | | |")
            continue
        a, b, margin = top2(ref, at)
        mine = e.tokens[at] if at < len(e.tokens) else None
        took = "" if mine in (a, b) or mine is None else f"; it takes {tok(tokenizer, mine)} ({e.forced[at][mine]:.3f})"
        rows.append(f"| {result['label']} | {e.name} | {answer} | token {at + 1}: {tok(tokenizer, result['path'][at])}"
                    f" -> {tok(tokenizer, mine) if mine is not None else 'end'} | {tok(tokenizer, a)} vs "
                    f"{tok(tokenizer, b)}: {margin:.3f} | {e.forced[at][a]:.3f} / {e.forced[at][b]:.3f}{took} |")
    return rows


def decision_point(result: dict) -> int:
    """The first position where an engine parts from the float answer (else an emulation); where none does,
    the float answer's closest call."""
    for emulated in (False, True):
        ats = [at for e in result["engines"][1:] if e.name.startswith("emu") == emulated
               and (at := e.parts_at(result["path"])) is not None and at < len(result["path"])]
        if ats:
            return min(ats)
    ref = result["engines"][0]
    return min(range(len(result["path"])), key=lambda k: top2(ref, k)[2])


def gap_at(e: Engine, result: dict) -> float:
    k = decision_point(result)
    a, b, _ = top2(result["engines"][0], k)
    return float(e.forced[k][a] - e.forced[k][b])


def spread_text(gaps: list[float]) -> str:
    return f"{np.mean(gaps):+.3f} ± {np.std(gaps):.3f} ({sum(g < 0 for g in gaps)}/{len(gaps)} < 0)"


def margin_row(result: dict, names: list[str], tokenizer) -> str:
    k = decision_point(result)
    a, b, _ = top2(result["engines"][0], k)
    by = {e.name: e for e in result["engines"]}
    cells = []
    for n in names:
        if n == "float":
            cells.append(f"{gap_at(by[n], result):+.3f} ± {np.std(result['spread'][n]):.0e}")
        elif n.startswith("emu"):  # one run's gap turns on float32 noise: the jittered runs' spread
            cells.append(spread_text(result["spread"][n]) if n in result["spread"] else "-")
        else:
            cells.append(f"{gap_at(by[n], result):+.3f}")
    mix = ", ".join(f"{n} {c}" for n, c in result["mix"].most_common())
    return (f"| {result['label']} | {mix} | {k + 1} | {tok(tokenizer, a)} vs {tok(tokenizer, b)} | "
            + " | ".join(cells) + " |")


def rms_row(result: dict, names: list[str]) -> list[str]:
    """Centred logit RMS distance to the float model at the decision point, per engine."""
    ref = result["engines"][0]
    k = decision_point(result)
    by = {e.name: e for e in result["engines"]}

    def rms(e: Engine) -> str:
        d = (e.forced[k] - e.forced[k].mean()) - (ref.forced[k] - ref.forced[k].mean())
        return f"{float(np.sqrt((d * d).mean())):.3f}"

    return [rms(by[n]) if n in by else "-" for n in names]


def summary(results: list[dict], tokenizer) -> str:
    """The figures the conclusion rests on, over all files."""
    def gaps(name: str) -> list[float]:
        return [gap_at(next(e for e in r["engines"] if e.name == name), r) for r in results]

    def rms(name: str) -> list[float]:
        return [float(rms_row(r, [name])[0]) for r in results]

    ref, fast, llama, plain = gaps("float"), gaps("kvflow fast"), gaps("llama.cpp"), gaps("llama.cpp plain")
    tensors = sum(v[0] for r in results for v in r["gaps"].values())
    equal = sum(v[1] for r in results for v in r["gaps"].values())
    parted = [r["label"] for r in results if next(e for e in r["engines"] if e.name == "llama.cpp").parts_at(r["path"])
              is not None]
    kvflow_parted = [f"{r['label']} ({e.name})" for r in results for e in r["engines"]
                     if e.name.startswith("kvflow") and e.parts_at(r["path"]) is not None]
    emu = [r["spread"]["emu q8+f16"] for r in results]
    lines = [
        f"- Dequantizers: {equal} of {tensors} quantized tensors in the {len(results)} files dequantize bitwise "
        "equal in the gguf package (transformers', and kvflow's for what it does not keep packed) and in llama.cpp's "
        "dequantize_row_*" + ("." if equal == tensors else ": the others differ, see the table."),
        "- kvflow: exact and fast mode give the float model's answer on "
        f"{len(results) - len({x.split(' (')[0] for x in kvflow_parted})} of {len(results)} files"
        + (f" (not: {', '.join(kvflow_parted)})" if kvflow_parted else "")
        + f"; at the decision points the fast mode moves the float gap by at most "
        f"{max(abs(f - g) for f, g in zip(fast, ref)):.3f}, and its logits lie {max(rms('kvflow fast')):.3f} RMS or "
        "less from the float model's.",
        f"- llama.cpp parts from the float answer on {len(parted)} of {len(results)} files ({', '.join(parted)}), each "
        f"time at a float margin of {min(ref):.3f} to {max(ref):.3f} logits; its logits lie "
        f"{min(rms('llama.cpp')):.3f} to {max(rms('llama.cpp')):.3f} RMS from the float model's and move the gap by "
        f"{min(g - f for f, g in zip(ref, llama)):+.3f} to {max(g - f for f, g in zip(ref, llama)):+.3f}; its own two "
        f"kernel sets (AMX/repacked vs plain vec_dot) differ from each other by up to "
        f"{max(abs(a - b) for a, b in zip(llama, plain)):.3f} there.",
        f"- The float model with llama.cpp's 8-bit activations and float16 attention: logits "
        f"{min(rms('emu q8+f16')):.3f} to {max(rms('emu q8+f16')):.3f} RMS from float (llama.cpp's: "
        f"{min(rms('llama.cpp')):.3f} to {max(rms('llama.cpp')):.3f}), "
        f"gap sd {min(np.std(g) for g in emu):.3f} to {max(np.std(g) for g in emu):.3f} under a {JITTER:g} jitter "
        f"(without the roundings: {max(np.std(r['spread']['float']) for r in results):.0e}), picking the runner-up "
        f"in {sum(sum(x < 0 for x in g) for g in emu)} of {SAMPLES * len(emu)} runs over the files.",
    ]
    kq = [r for r in results if "emu no Q8_K" in r["spread"]]
    if kq:
        with_k = sum(sum(x < 0 for x in r["spread"]["emu q8+f16"]) for r in kq)
        without = sum(sum(x < 0 for x in r["spread"]["emu no Q8_K"]) for r in kq)
        lines.append(f"- On the files with K-quants ({', '.join(r['label'] for r in kq)}), the same emulation picks the "
                     f"runner-up in {with_k} of {SAMPLES * len(kq)} runs; with the K-quant matmuls' inputs left in "
                     f"float32 (no Q8_K), in {without}. Q8_K (one scale per 256) loses a median "
                     f"{np.median([x for r in kq for x in r['rounding']['q8_K']]):.2%} of an input's RMS (max "
                     f"{max(x for r in kq for x in r['rounding']['q8_K']):.2%}), Q8_0 (per 32) "
                     f"{np.median([x for r in kq for x in r['rounding'].get('q8_0', [])]):.2%} on their other matmuls; the K-quant "
                     f"matmuls are {', '.join(sorted({n for r in kq for n in r['kquant_tensors']}))}, whose inputs' "
                     f"largest |x| is {min(x for r in kq for x in r['peaks']['q8_K']):.0f} to "
                     f"{max(x for r in kq for x in r['peaks']['q8_K']):.0f} times their median (the other matmuls' "
                     f"inputs: up to {max(x for r in kq for x in r['peaks'].get('q8_0', [0])):.0f}).")
    return "\n".join(lines)


def conclusion(results: list[dict], tokenizer) -> str:
    lines = []
    for r in results:
        by = {e.name: e for e in r["engines"]}
        k = decision_point(r)
        a, b, margin = top2(by["float"], k)
        gap = {n: gap_at(e, r) for n, e in by.items()}
        parted = [n for n, e in by.items() if not n.startswith("emu") and e.parts_at(r["path"]) is not None]
        spread = r["spread"]
        dq = max(v[2] for v in r["gaps"].values())
        equal = sum(v[1] for v in r["gaps"].values())
        total = sum(v[0] for v in r["gaps"].values())
        line = (f"- **{r['label']}**: float answers {by['float'].text.strip()[:32]!r}...; "
                + (f"{', '.join(parted)} part from it at token {k + 1}" if parted else f"no engine parts from it; its "
                   f"closest call is token {k + 1}")
                + f", where float prefers {tok(tokenizer, a)} to {tok(tokenizer, b)} by {margin:.3f}. Gaps there: "
                f"kvflow exact {gap['kvflow exact']:+.3f}, fast {gap['kvflow fast']:+.3f}, llama.cpp "
                f"{gap['llama.cpp']:+.3f} (plain kernels {gap['llama.cpp plain']:+.3f}); float with llama.cpp's "
                f"8-bit activations and float16 attention {spread_text(spread['emu q8+f16'])} over {SAMPLES} "
                f"jitters of {JITTER:g} (float alone: ± {np.std(spread['float']):.1e})")
        if "emu no Q8_K" in spread:
            line += f", without the Q8_K rounding {spread_text(spread['emu no Q8_K'])}"
        line += ". llama.cpp's rounding of the matmul inputs (prompt's last row, relative RMS error, median / max " \
            "over the matmuls): " + ", ".join(f"{kind.upper()} {np.median(e):.2%} / {max(e):.2%} ({len(e)})"
                                              for kind, e in sorted(r["rounding"].items()))
        line += (f". Dequantizers: {equal} of {total} quantized tensors bitwise equal to llama.cpp's (max |diff| "
                 f"{dq:.1e}).")
        lines.append(line)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--record", action="store_true", help=f"write the text to {SECTION.name}")
    ap.add_argument("--dump", type=Path, help="also pickle the results here")
    ap.add_argument("--report", type=Path, help="only print the report of results pickled by --dump")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from kvflow.kernels import cpu_features
    from kvflow.loader.resolve import resolve_model

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    src = resolve_model(None).path
    ggml = ggml_library()
    # Every requantization keeps the source's vocabulary and chat template: one tokenizer for all files.
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                         add_generation_prompt=True)
    prompt = tokenizer(text, add_special_tokens=False).input_ids
    results = []
    if args.report:
        results = pickle.loads(args.report.read_bytes())
    with tempfile.TemporaryDirectory() as tmp:
        for ftype in [] if args.report else args.types.split(","):
            if ftype == "Q4_1":
                path = src
            else:
                path = Path(tmp) / f"smollm2.{ftype}.gguf"
                made = peer("quantize", str(src), str(path))
                if made.returncode != 0 or not path.exists():
                    print(f"{ftype}: llama.cpp's quantizer failed: {made.stderr.strip()[-200:]}")
                    continue
            results.append(study(path, ftype if ftype != "Q4_1" else "Q4_1 (original)", tokenizer, prompt,
                                 args, ggml, Path(tmp)))

    if args.dump:
        args.dump.write_bytes(pickle.dumps(results))
    names = ["float", "kvflow exact", "kvflow fast", "llama.cpp", "llama.cpp plain", "emu q8", "emu q8+f16",
             "emu no Q8_K"]
    out = [f"### Fidelity across engines on the default model's GGUF types ({results[0].get('when', '') if results else ''}, "
           f"CPU {cpu_features.cpu_name()}, kvflow tier {cpu_features.isa_tier()})", "",
           f"`python benchmarks/gguf_fidelity.py`: {QUESTION!r} in the chat template, greedy, {args.tokens} tokens, "
           f"{args.threads} threads. Float: transformers in float32 on the GGUF's dequantized weights. Where an "
           "engine's answer parts from the float model's: the float model's top two tokens there and their "
           "logit margin, and the engine's log-probabilities of those two, conditioned on the same prefix. The emu rows "
           "are one run each: their answers turn on float32 noise (spreads in the next table).", "",
           "| file | engine | answer | parts from float at | float's top 2 (margin) | engine's logprobs |",
           "|---|---|---|---|---|---|"]
    for r in results:
        out += answers_rows(r, tokenizer)
    out += ["", "At each file's decision point (the first token where an engine, else an emulation, parts from the "
            "float answer): the gap logprob(float's first) - logprob(float's second), teacher-forced along the float "
            "answer; a negative gap picks the second. emu: the float model with llama.cpp's roundings (q8: each "
            "matmul's input through llama.cpp's Q8_0/Q8_K quantizer; +f16: q, k, v and softmax weights in float16 "
            "as its KV cache; no Q8_K: the K-quant matmuls' inputs left in float32); one such run's gap turns on "
            f"float32 noise, so each is run {SAMPLES} times with every matmul input jittered by a relative {JITTER:g} "
            "(the float column's ± is the same jitter without the roundings): mean ± sd of the gap, and how many runs "
            "pick the second. Then the centred-logit RMS distance to the float model there.", "",
            "| file | 2-D tensors | token | float's top 2 | " + " | ".join(names) + " |",
            "|" + "---|" * (4 + len(names))]
    for r in results:
        out.append(margin_row(r, names, tokenizer))
    for r in results:
        out.append(f"| {r['label']} | RMS vs float | | | " + " | ".join(rms_row(r, names)) + " |")
    out += ["", "The gguf package's dequantizer (transformers' and kvflow's) against llama.cpp's dequantize_row_*, "
            "every quantized tensor of the file:", "",
            "| file | type | tensors | bitwise equal | max abs diff | max diff / max abs w |", "|---|---|---|---|---|---|"]
    for r in results:
        for name, (n, equal, diff, rel) in r["gaps"].items():
            out.append(f"| {r['label']} | {name} | {n} | {equal} | {diff:.2e} | {rel:.2e} |")
    out += ["", "Summary:", "", summary(results, tokenizer), "", "Per file:", "", conclusion(results, tokenizer), ""]
    text = "\n".join(out)
    print(text)
    if args.record:
        SECTION.write_text(text)


if __name__ == "__main__":
    main()
