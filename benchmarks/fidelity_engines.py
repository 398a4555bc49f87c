"""The engines benchmarks/gguf_fidelity.py compares on a GGUF file, each run greedily and teacher-forced
along the float model's answer: transformers in float32 on the file's dequantized weights (the reference),
that model with llama.cpp's roundings emulated (MODE, set per run), kvflow exact and fast, llama.cpp
default and plain; and the gguf package's dequantizer against llama.cpp's.
"""

from __future__ import annotations

import ctypes
import gc
import json
import subprocess
from pathlib import Path

import numpy as np
from gguf_types import LLAMACPP_VENV, QUESTION

HERE = Path(__file__).resolve().parent
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
