"""Read a GGUF file: its metadata as a Hugging Face style config, and its tensors under Hugging Face names.

Quantized tensors are dequantized to float32 here, by the `gguf` package's dequantizer (every type it
knows loads); `iter_gguf_raw` instead hands the PACKED_TYPES weights over as their block bytes, for the
packed layers of `--quantization gguf` (loader/quantized_loading.py).
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Container, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvflow.errors import ModelLoadError, UnsupportedModelError
from kvflow.layers.quant.packing import PACKED_BITS

GGUF_ARCHITECTURES = {
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
    "llama": "LlamaForCausalLM",  # MixtralForCausalLM when it has experts
    "phi3": "Phi3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
log = logging.getLogger("kvflow")

FLOAT_TENSOR_TYPES = ("F32", "F16", "BF16")
PACKED_TYPES = tuple(PACKED_BITS)  # block formats kvflow.layers.quant runs without dequantizing


def dequantizable_types() -> tuple[str, ...]:
    """Every quantized type the installed `gguf` package can dequantize (K-quants, I-quants, MXFP4...)."""
    from gguf import quants

    return tuple(sorted(t.name for t in getattr(quants, "_type_traits", {})))

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3: stored fused
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a MoE layer's router
}
# Gemma's four norms a layer (llama.cpp's ffn_norm is the norm before the MLP, as in Llama).
_GEMMA_NORMS = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
GEMMA_TYPES = ("gemma2", "gemma3")
# Rotary settings stored as tensors: read into the config, never placed in the model.
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# A MoE layer's experts, stacked in one 3-D tensor each: [experts, out, in].
_EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def open_gguf(path: Path):
    """A GGUFReader, or one clear error for a file that is not a readable GGUF."""
    from kvflow.loader.gguf_reader import MappedGGUFReader

    try:
        return MappedGGUFReader(str(path))
    except Exception as exc:  # truncated files raise ValueError/IndexError/struct errors deep inside
        raise ModelLoadError(f"{path} is not a valid GGUF file (corrupt or truncated): {exc}") from exc


def field_value(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def hf_config_from_gguf(reader, path: Path) -> dict:
    arch = field_value(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path.name}: GGUF architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    _check_tensor_types(reader, path)

    def meta(key: str, default=None):
        return field_value(reader, f"{arch}.{key}", default)

    heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = int(meta("vocab_size", len(tokens.data) if tokens is not None else 0))
    names = {t.name for t in reader.tensors}
    experts = int(meta("expert_count", 0) or 0)
    cfg = {
        "architectures": ["MixtralForCausalLM" if arch == "llama" and experts else GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "head_dim": int(meta("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": field_value(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field_value(reader, "tokenizer.ggml.eos_token_id"),
        "sliding_window": meta("attention.sliding_window") or None,  # Phi-3 files write 0 for none
    }
    rope_dims = meta("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != cfg["head_dim"]:  # Phi-4-mini: rotary on part of a head
        cfg["partial_rotary_factor"] = int(rope_dims) / cfg["head_dim"]
    if experts:
        cfg.update(num_experts=experts, num_experts_per_tok=int(meta("expert_used_count")),
                   moe_intermediate_size=int(meta("expert_feed_forward_length", cfg["intermediate_size"])),
                   norm_topk_prob=True,  # llama.cpp renormalises the chosen experts' weights for both families
                   # A layer without stacked experts keeps a dense MLP.
                   mlp_only_layers=[i for i in range(cfg["num_hidden_layers"])
                                    if f"blk.{i}.ffn_gate_exps.weight" not in names])
    if arch in GEMMA_TYPES:
        cfg.update(_gemma_settings(arch, meta, cfg))
    if arch == "gpt-oss":  # llama.cpp's pattern: the window on every other layer, from the first
        cfg["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                              for i in range(cfg["num_hidden_layers"])]
    scaling = _rope_scaling(reader, meta, names, path, cfg)
    if scaling is not None:
        cfg["rope_scaling"] = scaling
    return cfg


def _rope_scaling(reader, meta, names: set[str], path: Path, cfg: dict) -> dict | None:
    """The rotary scaling a GGUF file states, in the form ArchConfig reads (None: none)."""
    if "rope_factors_long.weight" in names:  # Phi-3.5 / Phi-4-mini's LongRoPE
        factors = {t.name: _dequantize(t).tolist() for t in reader.tensors if t.name in ROPE_TENSORS}
        return {"rope_type": "longrope", "long_factor": factors["rope_factors_long.weight"],
                "short_factor": factors["rope_factors_short.weight"],
                "original_max_position_embeddings": int(meta("rope.scaling.original_context_length")),
                "max_position_embeddings": cfg["max_position_embeddings"],
                "attention_factor": meta("rope.scaling.attn_factor")}
    if "rope_freqs.weight" in names:  # Llama 3.1+ GGUFs store the llama3 scaling as per-frequency factors
        tensor = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        return {"rope_type": "freq_factors", "factors": _dequantize(tensor).tolist()}
    scaling_type = meta("rope.scaling.type")
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}
    if scaling_type == "yarn":
        return _yarn_scaling(meta, path, cfg)
    if scaling_type not in (None, "none"):
        raise UnsupportedModelError(f"{path.name}: rope scaling type {scaling_type!r} is not supported")
    return None


def _yarn_scaling(meta, path: Path, cfg: dict) -> dict:
    """YaRN as transformers reads it. gpt-oss's own config turns off the rounding of the ramp's ends
    (truncate: false), which GGUF has no key for."""
    if float(meta("rope.scaling.yarn_attn_factor", 1.0)) != 1.0 or meta("rope.scaling.yarn_log_multiplier"):
        raise UnsupportedModelError(f"{path.name}: YaRN with an attention factor or log multiplier is not supported")
    scaling = {"rope_type": "yarn", "factor": float(meta("rope.scaling.factor")),
               "original_max_position_embeddings": int(meta("rope.scaling.original_context_length")),
               "beta_fast": float(meta("rope.scaling.yarn_beta_fast", 32.0)),
               "beta_slow": float(meta("rope.scaling.yarn_beta_slow", 1.0))}
    if cfg["model_type"] == "gpt-oss":
        scaling["truncate"] = False
    return scaling


def _gemma_settings(arch: str, meta, cfg: dict) -> dict:
    """Gemma's settings as llama.cpp reads them: the sliding layers from a per-layer flag list where the file
    has one, else its hard-coded pattern (every other layer in Gemma 2, five of six in Gemma 3: ArchConfig
    derives it from the model type); Gemma 3's local rotary base (10000 unless stated); and the query scale,
    which no key states: 1 / sqrt(head_dim), or 1 / sqrt(hidden / heads) for the 27B models (told by depth)."""
    big = cfg["num_hidden_layers"] == {"gemma2": 46, "gemma3": 62}[arch]
    settings = {
        "hidden_act": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": cfg["hidden_size"] // cfg["num_attention_heads"] if big else cfg["head_dim"],
        "attn_logit_softcapping": meta("attn_logit_softcapping"),
        "final_logit_softcapping": meta("final_logit_softcapping"),
    }
    pattern = meta("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        settings["layer_types"] = ["sliding_attention" if s else "full_attention" for s in pattern]
    if arch == "gemma3":
        settings["rope_local_base_freq"] = float(meta("rope.freq_base_swa", 10000.0))
    return settings


def _check_tensor_types(reader, path: Path) -> None:
    known = set(FLOAT_TENSOR_TYPES) | set(dequantizable_types())
    for t in reader.tensors:
        if t.tensor_type.name not in known:
            raise UnsupportedModelError(
                f"{path.name}: tensor {t.name} has type {t.tensor_type.name}, which is not supported; "
                f"supported: {', '.join(sorted(known))}"
            )
    unpacked = Counter(t.tensor_type.name for t in reader.tensors
                       if t.tensor_type.name not in FLOAT_TENSOR_TYPES + PACKED_TYPES)
    if unpacked:
        log.info("%s: %s have no packed kernel; their weights are dequantized to float at load (gguf package)",
                 path.name, ", ".join(f"{n} tensors of {name}" for name, n in sorted(unpacked.items())))


def _dequantize(tensor) -> np.ndarray:
    from gguf import GGMLQuantizationType, quants

    if tensor.tensor_type == GGMLQuantizationType.BF16:
        raw = np.asarray(tensor.data).view(np.uint16).astype(np.uint32) << 16
        return raw.view(np.float32).reshape(tuple(reversed([int(d) for d in tensor.shape])))
    return quants.dequantize(tensor.data, tensor.tensor_type)


def unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp reorders q/k rows of llama models for its interleaved rope; undo it for the half-split layout."""
    shape = w.shape
    return w.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


def iter_gguf_weights(reader, cfg: dict, skip: Container[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float tensor) for every tensor except those whose GGUF names are in skip."""
    for tensor in reader.tensors:
        if tensor.name in ROPE_TENSORS or tensor.name in skip:
            continue
        name = _hf_name(tensor.name, cfg["model_type"])
        if name is None:
            raise ModelLoadError(f"GGUF tensor {tensor.name!r} is not one kvflow knows how to place")
        experts = _expert_names(tensor.name, name, tensor.data.shape, cfg.get("num_experts", 0))
        if experts and all(f"{tensor.name}#{e}" in skip for e in range(len(experts))):
            continue
        try:
            data = torch.from_numpy(np.array(_dequantize(tensor), copy=True))
        except Exception as exc:
            raise ModelLoadError(f"cannot read GGUF tensor {tensor.name}: {exc}") from exc
        if experts:
            yield from ((n, data[e]) for e, n in enumerate(experts) if f"{tensor.name}#{e}" not in skip)
            continue
        if cfg["model_type"] in GEMMA_TYPES and name.endswith("norm.weight"):
            data = data - 1  # llama.cpp stores Gemma's norms as 1 + weight; the model adds the 1 itself
        heads = _rope_heads(tensor.name, cfg)
        yield name, data if heads is None else unpermute_rope(data, heads)


@dataclass
class RawTensor:
    """A GGUF weight kept as block bytes: data is uint8 [out, bytes per row], a view of the mapped file."""

    gguf_name: str
    hf_name: str
    data: np.ndarray
    qtype: str  # one of PACKED_TYPES
    rope_heads: int | None  # llama q/k: rows are permuted for llama.cpp's rope; undo with this many heads


def iter_gguf_raw(reader, cfg: dict, types: Container[str] = PACKED_TYPES) -> Iterator[RawTensor]:
    """The 2-D weights stored in one of `types`, undecoded (no float copy is made)."""
    for tensor in reader.tensors:
        name = _hf_name(tensor.name, cfg["model_type"])
        if name is None or tensor.tensor_type.name not in types:
            continue
        experts = _expert_names(tensor.name, name, tensor.data.shape, cfg.get("num_experts", 0))
        if experts:  # one packed layer per expert, each a view of its slice of the file
            for e, expert_name in enumerate(experts):
                yield RawTensor(f"{tensor.name}#{e}", expert_name, tensor.data[e], tensor.tensor_type.name, None)
        elif len(tensor.data.shape) == 2:
            yield RawTensor(tensor.name, name, tensor.data, tensor.tensor_type.name, _rope_heads(tensor.name, cfg))


def _rope_heads(gguf_name: str, cfg: dict) -> int | None:
    if cfg["model_type"] != "llama":
        return None
    if gguf_name.endswith(("attn_q.weight", "attn_q.bias")):
        return cfg["num_attention_heads"]
    if gguf_name.endswith(("attn_k.weight", "attn_k.bias")):
        return cfg["num_key_value_heads"]
    return None


def _hf_name(gguf_name: str, model_type: str) -> str | None:
    """The Hugging Face name of a GGUF tensor; for stacked experts, the name of expert {e}'s part."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    m = _LAYER_NAME.match(gguf_name)
    if m is None:
        return None
    kind = m.group(2)
    if kind in _EXPERT_TENSORS:
        return f"model.layers.{m.group(1)}.mlp.experts.{{e}}.{_EXPERT_TENSORS[kind]}.{m.group(3)}"
    if kind == "attn_sinks":  # gpt-oss: a parameter of its own, not a layer's weight
        return f"model.layers.{m.group(1)}.self_attn.sinks"
    if kind == "post_attention_norm" and model_type == "gpt-oss":  # the norm before the MLP
        return f"model.layers.{m.group(1)}.post_attention_layernorm.{m.group(3)}"
    if kind == "ffn_up" and model_type == "phi3":  # Phi-3 stores gate and up fused, under ffn_up
        return f"model.layers.{m.group(1)}.mlp.gate_up_proj.{m.group(3)}"
    if kind in _GEMMA_NORMS and model_type in GEMMA_TYPES:
        return f"model.layers.{m.group(1)}.{_GEMMA_NORMS[kind]}.{m.group(3)}"
    if kind not in _LAYER_TENSORS:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[kind]}.{m.group(3)}"


def _expert_names(gguf_name: str, hf_name: str, shape: tuple[int, ...], experts: int) -> list[str] | None:
    """Per-expert names of a stacked expert tensor of this (numpy-order) shape; None for any other tensor."""
    if "{e}" not in hf_name:
        return None
    dims = 2 if hf_name.endswith(".bias") else 3  # gpt-oss's experts have biases: [experts, out]
    if len(shape) != dims:
        raise ModelLoadError(f"GGUF tensor {gguf_name} should stack its experts in {dims} dimensions, not {len(shape)}")
    if shape[0] != experts:
        raise ModelLoadError(f"GGUF tensor {gguf_name} holds {shape[0]} experts, but the file's metadata says "
                             f"{experts} (expert_count)")
    return [hf_name.format(e=e) for e in range(shape[0])]
