"""Turn a tiny Hugging Face checkpoint folder into a GGUF file, the way llama.cpp's converter lays it out.

This is the tests' stand-in for llama.cpp's ``convert_hf_to_gguf.py``: kvflow's GGUF loader has to read files
that llama.cpp produced, so the tests need such files for the tiny random checkpoints of ``tiny_models.py``
without depending on a llama.cpp checkout. It is written for those folders (safetensors + config.json + a
byte-level BPE tokenizer.json) and follows llama.cpp's conventions: its tensor names, its metadata keys, the
row permutation it applies to Llama's q/k projections, the fused tensors it keeps fused, the +1 it folds into
Gemma's norm weights. It is never a dependency of kvflow itself.

Tensors keep Hugging Face's (out_features, in_features) layout; GGUF records the dimensions reversed, as ggml
does, so a reader sees ``ne = (in, out)``. Where llama.cpp's converter would not cope with a tiny checkpoint
(it cannot name our tiny tokenizer's pre-tokenizer, and wants sentencepiece for Phi-3 and Gemma 2) this module
does the nearest thing, noted where it happens.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

# Hugging Face `architectures[0]` -> GGUF `general.architecture`
ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "MixtralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "GptOssForCausalLM": "gpt-oss",
}

GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",  # absent when the embeddings are tied: readers fall back to token_embd
}

# Per-layer names: "model.layers.{i}.<HF>" -> "blk.{i}.<GGUF>".
_ATTN = {
    f"self_attn.{p}_proj.{kind}": f"attn_{g}.{kind}"
    for p, g in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output")) for kind in ("weight", "bias")
}
_MLP = {"mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight"}
_NORMS = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight"}
_QK_NORMS = {"self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight"}
# Gemma 2/3 norm both sides of each block: HF's "post_attention_layernorm" is a post-norm there, not the FFN's.
_GEMMA = {**_ATTN, **_MLP, "input_layernorm.weight": "attn_norm.weight",
          "post_attention_layernorm.weight": "post_attention_norm.weight",
          "pre_feedforward_layernorm.weight": "ffn_norm.weight",
          "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}

LAYER_NAMES: dict[str, dict[str, str]] = {
    "llama": {**_ATTN, **_MLP, **_NORMS, "block_sparse_moe.gate.weight": "ffn_gate_inp.weight"},  # + Mixtral router
    "qwen2": {**_ATTN, **_MLP, **_NORMS},
    "qwen3": {**_ATTN, **_MLP, **_NORMS, **_QK_NORMS},
    # Dense layers (mlp_only_layers) get the usual ffn_* names here; llama.cpp's own converter and runtime know
    # no dense FFN for qwen3moe and refuse such checkpoints.
    "qwen3moe": {**_ATTN, **_MLP, **_NORMS, **_QK_NORMS, "mlp.gate.weight": "ffn_gate_inp.weight"},
    # Phi-3 keeps its fused projections: attn_qkv = [q; k; v] rows, ffn_up = [gate; up] rows.
    "phi3": {**_ATTN, **_NORMS, "self_attn.qkv_proj.weight": "attn_qkv.weight",
             "mlp.gate_up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"},
    "gemma2": _GEMMA,
    "gemma3": {**_GEMMA, **_QK_NORMS},
    # gpt-oss: the norm before the MLP is llama.cpp's post_attention_norm; the sinks get a ".weight".
    "gpt-oss": {**_ATTN, "input_layernorm.weight": "attn_norm.weight",
                "post_attention_layernorm.weight": "post_attention_norm.weight",
                "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
                "mlp.router.bias": "ffn_gate_inp.bias"},
}

# Per-expert weights, which llama.cpp stacks into one (n_expert, rows, cols) tensor per layer and projection.
EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight")
EXPERT_KIND = {"w1": "gate", "w2": "down", "w3": "up", "gate_proj": "gate", "down_proj": "down", "up_proj": "up"}


def hf_to_gguf(folder: Path, path: Path, tensor_type: str = "F32") -> Path:
    """Write the checkpoint in `folder` as a GGUF file at `path`: all F32, or 2-D weights F16 (norms, biases and
    the MoE router stay F32, as llama.cpp keeps them). Returns `path`."""
    folder, path = Path(folder), Path(path)
    if tensor_type not in ("F32", "F16"):
        raise ValueError(f"tensor_type must be 'F32' or 'F16', not {tensor_type!r}")
    cfg = json.loads((folder / "config.json").read_text())
    cfg = {**cfg, **cfg.get("text_config", {})}
    hf_arch = cfg["architectures"][0]
    if hf_arch not in ARCHS:
        raise ValueError(f"no GGUF conversion for {hf_arch!r}; known: {sorted(ARCHS)}")
    arch = ARCHS[hf_arch]
    ftype = gguf.LlamaFileType.ALL_F32 if tensor_type == "F32" else gguf.LlamaFileType.MOSTLY_F16

    writer = gguf.GGUFWriter(path, arch)  # writes general.architecture
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(folder.name)
    write_hparams(writer, arch, cfg, ftype)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    write_vocab(writer, folder, cfg)
    for name, tensor in convert_tensors(folder, arch, cfg):
        data = tensor.to(torch.float32).numpy()
        keep_f32 = (data.ndim <= 1 or name.endswith(("_norm.weight", ".bias")) or ".ffn_gate_inp." in name)
        writer.add_tensor(name, data if tensor_type == "F32" or keep_f32 else data.astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def permute_for_llama(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's row order for Llama's q/k (its rotary pairs adjacent values; HF's pairs the two halves of each
    head): within each head, rows [0, d/2) and [d/2, d) are interleaved as 0, d/2, 1, d/2+1, ... Also for biases."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """The rope settings wherever the config keeps them (transformers 5's `rope_parameters`, older configs'
    top-level `rope_theta` + `rope_scaling`), possibly split per attention type (Gemma 3)."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if "full_attention" not in rope and "sliding_attention" not in rope:
        if cfg.get("rope_local_base_freq") is not None:
            rope["sliding_attention"] = {"rope_theta": cfg["rope_local_base_freq"]}
        for key, value in (("rope_theta", cfg.get("rope_theta")), ("rope_type", rope.get("type")),
                           ("partial_rotary_factor", cfg.get("partial_rotary_factor")),
                           ("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))):
            if rope.get(key) is None and value is not None:
                rope[key] = value
    return rope


def head_dim(cfg: dict[str, Any]) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def write_hparams(w: gguf.GGUFWriter, arch: str, cfg: dict[str, Any], ftype: gguf.LlamaFileType) -> None:
    """The `{arch}.*` keys, each written by the same rule as llama.cpp's converter for that architecture."""
    rope = rope_parameters(cfg)
    full = rope.get("full_attention", rope)
    n_head, n_embd = cfg["num_attention_heads"], cfg["hidden_size"]
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(cfg.get("num_key_value_heads", n_head))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_file_type(ftype)

    if arch == "phi3":  # llama.cpp writes Phi-3's keys by hand, none of the generic ones below
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        # the rotated part of each head, reckoned from hidden_size / heads as llama.cpp does
        w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * n_embd) // n_head)
        w.add_rope_freq_base(full["rope_theta"])
        w.add_sliding_window(cfg.get("sliding_window") or 0)  # 0: no window (llama.cpp disables Phi-3's anyway)
        if rope.get("long_factor"):  # LongRoPE: the factors are tensors (below), the attention scale a key
            scale = cfg["max_position_embeddings"] / rope["original_max_position_embeddings"]
            attn = rope.get("attention_factor") or (
                math.sqrt(1 + math.log(scale) / math.log(rope["original_max_position_embeddings"])) if scale > 1 else 1.0)
            w.add_rope_scaling_attn_factors(attn)
        return
    if arch == "gemma2":  # by hand too; note: no rope.freq_base (llama.cpp assumes 10000)
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window(cfg["sliding_window"])
        write_gemma_layer_pattern(w, cfg, every=2)
        return

    # the generic keys (llama, qwen2, qwen3, qwen3moe, gemma3)
    rope_type = full.get("rope_type")
    if rope_type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    elif rope_type == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(full["factor"])
        w.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
        for key, add in (("extrapolation_factor", w.add_rope_scaling_yarn_ext_factor),
                         ("attention_factor", w.add_rope_scaling_yarn_attn_factor),
                         ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
            if full.get(key) is not None:
                add(full[key])
    elif rope_type not in (None, "default", "llama3"):  # llama3: a rope_freqs.weight tensor, no keys
        raise NotImplementedError(f"rope_type {rope_type!r}")
    if full.get("rope_theta") is not None:
        w.add_rope_freq_base(full["rope_theta"])
    if (local := rope.get("sliding_attention", {}).get("rope_theta")) is not None:
        w.add_rope_freq_base_swa(local)
    if (n_expert := cfg.get("num_local_experts", cfg.get("num_experts"))) is not None:
        w.add_expert_count(n_expert)
    if (n_used := cfg.get("num_experts_per_tok")) is not None:
        w.add_expert_used_count(n_used)
    if cfg.get("head_dim") is not None:  # whenever the config names it, even if it is hidden / heads
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])

    if arch == "llama":
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(head_dim(cfg))
    elif arch == "gpt-oss":  # the window's pattern (every other layer, from the first) is llama.cpp's own
        w.add_sliding_window(cfg["sliding_window"])
        w.add_expert_feed_forward_length(cfg["intermediate_size"])
    elif arch == "qwen3moe":
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size") is not None:
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    elif arch == "gemma3":
        assert cfg.get("attn_logit_softcapping") is None, "Gemma 3 has no attention soft-capping"
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        if cfg.get("sliding_window_pattern") != 1:
            w.add_sliding_window(cfg["sliding_window"])
        write_gemma_layer_pattern(w, cfg, every=6)


def write_gemma_layer_pattern(w: gguf.GGUFWriter, cfg: dict[str, Any], every: int) -> None:
    """Which layers slide. llama.cpp's converter writes nothing for Gemma 2/3: its loader hard-codes every
    `every`-th layer as full attention (layers every-1, 2*every-1, ... ; the rest slide), unless the file has
    `{arch}.attention.sliding_window_pattern`, read as one flag per layer (true = sliding). Real Gemmas follow
    the hard-coded pattern, so we write the key only for a config whose `layer_types` does not -- as a tiny test
    model's may. Also not carried: `query_pre_attn_scalar`; llama.cpp scales scores by 1/sqrt(head_dim) (by
    1/sqrt(hidden/heads) for the 27B models, which it recognises by their layer count)."""
    n_layer = cfg["num_hidden_layers"]
    default = [il % every < every - 1 for il in range(n_layer)]
    sliding = [t == "sliding_attention" for t in cfg.get("layer_types") or ()] or default
    if sliding != default:
        w.add_sliding_window_pattern(sliding)
    if cfg.get("query_pre_attn_scalar", cfg["head_dim"]) != cfg["head_dim"]:
        warnings.warn(f"query_pre_attn_scalar {cfg['query_pre_attn_scalar']} != head_dim {cfg['head_dim']}: a GGUF "
                      "cannot say so, and llama.cpp will scale attention by 1/sqrt(head_dim)", stacklevel=4)


def llama3_rope_factors(cfg: dict[str, Any]) -> torch.Tensor:
    """Llama 3's frequency-dependent rope scaling as per-frequency divisors (llama.cpp's rope_freqs.weight):
    1 for short wavelengths, `factor` for long ones, a smooth blend between."""
    rope = rope_parameters(cfg)
    dim, base = head_dim(cfg), rope.get("rope_theta", 10000.0)
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_ctx = rope.get("original_max_position_embeddings", 8192)
    factors = []
    for freq in 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            factors.append(1.0)
        elif wavelen > old_ctx / low:
            factors.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def convert_tensors(folder: Path, arch: str, cfg: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """(GGUF name, tensor) for every weight, transformed as llama.cpp transforms it."""
    weights: dict[str, torch.Tensor] = {}
    for part in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(part))
    n_head = cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads", n_head)
    names = LAYER_NAMES[arch]
    if arch == "llama" and rope_parameters(cfg).get("rope_type") == "llama3":
        yield "rope_freqs.weight", llama3_rope_factors(cfg)
    if arch == "phi3" and rope_parameters(cfg).get("long_factor"):
        yield "rope_factors_long.weight", torch.tensor(rope_parameters(cfg)["long_factor"], dtype=torch.float32)
        yield "rope_factors_short.weight", torch.tensor(rope_parameters(cfg)["short_factor"], dtype=torch.float32)

    if arch == "gpt-oss":
        weights = dict(gpt_oss_experts(weights))
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = defaultdict(dict)
    for name, t in weights.items():
        if name.endswith(".rotary_emb.inv_freq") or (arch == "gemma2" and name == "lm_head.weight"):
            continue  # gemma2: llama.cpp always ties the output to token_embd
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            t = t + 1  # Gemma's RMSNorm scales by (1 + w); GGUF stores the factor itself (q/k norms too)
        # (llama.cpp also cuts Gemma 3's token_embd to the tokenizer's own count of tokens; here the token list is
        # padded to vocab_size, as llama.cpp pads it too, so every row is kept and rows == tokens)
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            t = permute_for_llama(t, n_head)
        if arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            t = permute_for_llama(t, n_kv)
        if m := EXPERT.fullmatch(name):
            experts[(int(m[1]), EXPERT_KIND[m[3]])][int(m[2])] = t
            continue
        if name.startswith("blk."):  # already in llama.cpp's names (gpt-oss's experts)
            yield name, t
        elif name in GLOBAL_NAMES:
            yield GLOBAL_NAMES[name], t
        elif (m := re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)) and m[2] in names:
            yield f"blk.{m[1]}.{names[m[2]]}", t
        else:
            raise ValueError(f"no GGUF name for {name!r} in {arch}")
    # (n_expert, n_ff, n_embd) for gate/up, (n_expert, n_embd, n_ff) for down: ggml ne = (cols, rows, n_expert)
    for (layer, kind), per_expert in sorted(experts.items()):
        assert sorted(per_expert) == list(range(len(per_expert))), f"missing experts in layer {layer}"
        yield f"blk.{layer}.ffn_{kind}_exps.weight", torch.stack([per_expert[e] for e in sorted(per_expert)])


def gpt_oss_experts(weights: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """gpt-oss's stacked experts as llama.cpp's converter writes them: gate_up [experts, hidden, 2 * ff] split
    into its interleaved gate and up columns, each transposed to (n_expert, n_ff, n_embd); down transposed to
    (n_expert, n_embd, n_ff); the biases split the same way. Other tensors pass through."""
    for name, t in weights.items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?", name)
        if m is None:
            yield name, t
            continue
        layer, kind, bias = m[1], m[2], m[3] is not None
        if kind == "down_proj":
            yield f"blk.{layer}.ffn_down_exps.{'bias' if bias else 'weight'}", t if bias else t.transpose(1, 2)
            continue
        t = t if bias else t.transpose(1, 2)  # [experts, 2 * ff(, hidden)], gate and up interleaved
        suffix = "bias" if bias else "weight"
        yield f"blk.{layer}.ffn_gate_exps.{suffix}", t[:, 0::2].contiguous()
        yield f"blk.{layer}.ffn_up_exps.{suffix}", t[:, 1::2].contiguous()


def write_vocab(w: gguf.GGUFWriter, folder: Path, cfg: dict[str, Any]) -> None:
    """A byte-level BPE vocabulary as llama.cpp's "gpt2" tokenizer model."""
    tok = json.loads((folder / "tokenizer.json").read_text())
    model = tok["model"]
    if model["type"] != "BPE" or model.get("byte_fallback") or tok["decoder"]["type"] != "ByteLevel":
        raise ValueError("only byte-level BPE tokenizers (tokenizer.ggml.model 'gpt2') are converted")
    text = {i: t for t, i in model["vocab"].items()}
    added = {a["id"]: a for a in tok.get("added_tokens", [])}
    text.update((i, a["content"]) for i, a in added.items())
    tokens: list[str] = []
    types: list[int] = []
    for i in range(cfg.get("vocab_size", len(text))):  # the embedding's rows; ids the tokenizer lacks are padding
        if i not in text:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            content = text[i]
            looks_special = content.startswith("<|") and content.endswith("|>")
            types.append(gguf.TokenType.CONTROL if added[i]["special"] or looks_special
                         else gguf.TokenType.USER_DEFINED)
            tokens.append(content if types[-1] == gguf.TokenType.CONTROL else content.replace("\u2581", " "))
        else:
            tokens.append(text[i])
            types.append(gguf.TokenType.NORMAL)
    w.add_tokenizer_model("gpt2")
    # llama.cpp names the pre-tokenizer by hashing how the tokenizer splits a fixed text and looking the hash up
    # among known models; a tiny test tokenizer matches none (its converter would stop). Ours is ByteLevel with
    # the GPT-2 split regex, which is llama.cpp's "gpt-2".
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    # merges, bos/eos/unk/pad ids, add_bos/add_eos, chat template (chat_template.jinja or tokenizer_config.json):
    # gguf's own reader of these files, the one llama.cpp's converter uses
    gguf.SpecialVocab(folder, load_merges=True, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)
