"""Roofline arithmetic for a Llama-style decoder: what the machine's limits allow, from the shape alone.

Decode reads every weight once per step (plus the KV cache of each sequence), so its ceiling is
bandwidth / bytes read.  Prefill is compute-bound, so its ceiling is matmul rate / FLOPs.
Everything here is plain arithmetic; the measured limits come from ``kvflow.machine.probe``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Bytes per parameter of common storage formats.  GGUF block formats store 32 weights per block:
# Q8_0 = 32 int8 + one f16 scale; Q4_0 = 16 bytes of nibbles + f16 scale; Q4_1 adds an f16 minimum.
BYTES_PER_PARAM: dict[str, float] = {
    "f32": 4.0,
    "f16": 2.0,
    "bf16": 2.0,
    "q8_0": 34 / 32,
    "q4_0": 18 / 32,
    "q4_1": 20 / 32,
}

# Tensor groups that a weight format may store differently (GGUF keeps norms in f32, often the
# embedding in Q8_0 and the layers in Q4_x).
GROUPS = ("embedding", "lm_head", "layers", "norms")


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    # A mixture of experts: moe_layers of the layers hold num_experts MLPs of expert_intermediate_size,
    # of which each token runs experts_per_token (decode at batch 1 reads only those).
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    moe_layers: int = 0

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelShape:
        """Build from a Hugging Face ``config.json`` dict (Llama/Qwen/Mistral key names)."""
        heads = config["num_attention_heads"]
        experts = config.get("num_local_experts") or config.get("num_experts") or 0
        layers = config["num_hidden_layers"]
        return cls(
            num_layers=config["num_hidden_layers"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            vocab_size=config["vocab_size"],
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            num_experts=experts,
            experts_per_token=config.get("num_experts_per_tok") or 0 if experts else 0,
            expert_intermediate_size=(config.get("moe_intermediate_size") or config["intermediate_size"]) if experts else 0,
            moe_layers=layers - len(set(config.get("mlp_only_layers") or ())) if experts else 0,
        )

    # --- parameter counts -------------------------------------------------------------------
    @property
    def attention_params_per_layer(self) -> int:
        q_out = self.num_heads * self.head_dim
        kv_out = self.num_kv_heads * self.head_dim
        return self.hidden_size * (q_out + 2 * kv_out) + q_out * self.hidden_size

    @property
    def mlp_params_per_layer(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size  # gate, up, down

    def _mlp_params(self, experts: int) -> int:
        """All layers' MLP weights, counting `experts` experts (and the router) in each MoE layer."""
        dense = (self.num_layers - self.moe_layers) * self.mlp_params_per_layer
        per_expert = 3 * self.hidden_size * self.expert_intermediate_size
        return dense + self.moe_layers * (experts * per_expert + self.num_experts * self.hidden_size)

    @property
    def layer_matmul_params(self) -> int:
        """Weights of all linear layers inside the decoder layers (every expert)."""
        return self.num_layers * self.attention_params_per_layer + self._mlp_params(self.num_experts)

    @property
    def active_layer_matmul_params(self) -> int:
        """The layer weights one token multiplies by: only its routed experts in a MoE layer."""
        return self.num_layers * self.attention_params_per_layer + self._mlp_params(self.experts_per_token)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """Parameters stored for the output projection: none of its own when tied to the embedding."""
        return 0 if self.tied_embeddings else self.vocab_size * self.hidden_size

    @property
    def norm_params(self) -> int:
        return (2 * self.num_layers + 1) * self.hidden_size  # two RMSNorms per layer + final norm

    @property
    def num_params(self) -> int:
        return self.embedding_params + self.lm_head_params + self.layer_matmul_params + self.norm_params

    @property
    def matmul_params(self) -> int:
        """Parameters taking part in a matmul per token: the layers (routed experts only) plus the output
        projection."""
        return self.active_layer_matmul_params + self.vocab_size * self.hidden_size

    # --- bytes ------------------------------------------------------------------------------
    def group_params(self) -> dict[str, int]:
        return {
            "embedding": self.embedding_params,
            "lm_head": self.lm_head_params,
            "layers": self.layer_matmul_params,
            "norms": self.norm_params,
        }

    def weight_bytes(self, bytes_per_param: float | Mapping[str, float]) -> float:
        """Bytes of stored weights.  ``bytes_per_param`` is one figure or a dict per group in GROUPS;
        a missing "lm_head" follows "embedding", missing "norms" default to f32 (as GGUF keeps them)."""
        return sum(self.group_params()[g] * b for g, b in _per_group(bytes_per_param).items())

    def decode_weight_bytes(self, bytes_per_param: float | Mapping[str, float]) -> float:
        """Weight bytes read in one decode step of one sequence: every matmul weight and norm once (of a
        MoE layer, the token's experts only).  An untied embedding table is only indexed (a few rows), so
        it is left out; a tied one is read whole as the output projection."""
        per = _per_group(bytes_per_param)
        groups = {**self.group_params(), "layers": self.active_layer_matmul_params}
        if not self.tied_embeddings:
            groups["embedding"] = 0
        return sum(groups[g] * per[g] for g in GROUPS)

    def kv_bytes_per_token(self, dtype_bytes: float = 2) -> float:
        """K and V of one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    # --- FLOPs ------------------------------------------------------------------------------
    def flops_per_token(self, context: float) -> float:
        """FLOPs for one token attending to ``context`` tokens: 2 per matmul weight, plus
        QK^T and PV (2 FLOPs each per head dim per context token per head per layer)."""
        attention = 4 * self.num_layers * self.num_heads * self.head_dim * context
        return 2 * self.matmul_params + attention

    def prefill_flops(self, n_prompt: int, depth: int = 0, all_logits: bool = True) -> float:
        """FLOPs to prefill ``n_prompt`` tokens after ``depth`` cached tokens (causal: token i
        attends to depth + i tokens).  ``all_logits=False`` computes the output projection for the
        last token only, as a server does."""
        context_sum = n_prompt * depth + n_prompt * (n_prompt + 1) / 2
        attention = 4 * self.num_layers * self.num_heads * self.head_dim * context_sum
        lm_head_rows = n_prompt if all_logits else 1
        return (
            2 * self.active_layer_matmul_params * n_prompt
            + 2 * self.vocab_size * self.hidden_size * lm_head_rows
            + attention
        )


def _per_group(bytes_per_param: float | Mapping[str, float]) -> dict[str, float]:
    if isinstance(bytes_per_param, (int, float)):
        return dict.fromkeys(GROUPS, float(bytes_per_param))
    per = {k: float(_as_bytes(v)) for k, v in bytes_per_param.items()}
    unknown = set(per) - set(GROUPS)
    if unknown:
        raise ValueError(f"unknown tensor groups {sorted(unknown)}; expected some of {GROUPS}")
    per.setdefault("lm_head", per.get("embedding", BYTES_PER_PARAM["f32"]))
    per.setdefault("norms", BYTES_PER_PARAM["f32"])
    missing = set(GROUPS) - set(per)
    if missing:
        raise ValueError(f"bytes per parameter missing for {sorted(missing)}")
    return per


def _as_bytes(v: float | str) -> float:
    return BYTES_PER_PARAM[v.lower()] if isinstance(v, str) else v


def gguf_q4_1_format() -> dict[str, float]:
    """The default SmolLM2 GGUF: embedding Q8_0, layers Q4_1, norms f32."""
    return {"embedding": BYTES_PER_PARAM["q8_0"], "layers": BYTES_PER_PARAM["q4_1"], "norms": 4.0}


def decode_roofline_tokens_per_s(
    shape: ModelShape,
    bandwidth_bytes_per_s: float,
    bytes_per_param: float | Mapping[str, float],
    depth: int = 0,
    batch: int = 1,
    kv_dtype_bytes: float = 2,
) -> float:
    """Ceiling on decode tokens/s: each step reads the weights once and each sequence's KV cache
    (``depth`` tokens), and yields ``batch`` tokens."""
    step_bytes = shape.decode_weight_bytes(bytes_per_param) + shape.kv_bytes_per_token(kv_dtype_bytes) * depth * batch
    return bandwidth_bytes_per_s / step_bytes * batch


def prefill_roofline_tokens_per_s(
    shape: ModelShape,
    matmul_flop_per_s: float,
    n_prompt: int | None = None,
    depth: int = 0,
    all_logits: bool = True,
) -> float:
    """Ceiling on prefill tokens/s at the measured matmul rate.  Without ``n_prompt``, attention is
    ignored (2 FLOPs per matmul weight per token); with it, the exact causal FLOPs are used."""
    if n_prompt is None:
        return matmul_flop_per_s / shape.flops_per_token(context=0)
    return matmul_flop_per_s * n_prompt / shape.prefill_flops(n_prompt, depth, all_logits)


def fraction_of_roofline(measured: float, roofline: float) -> float:
    return measured / roofline if roofline > 0 else float("nan")
