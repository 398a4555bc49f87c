"""ArchConfig: the shape of a decoder-only model, read from a Hugging Face config.json dict."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2: bias on q, k, v
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k
    hidden_act: str = "silu"  # the gated MLP's activation
    # gpt-oss's experts: SwiGLU with the gate capped above and the up projection clamped both ways, the
    # sigmoid's gain alpha, and up + 1 (activation "swiglu_oai").
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    o_proj_bias: bool = False  # gpt-oss: bias on the attention's output projection too
    # gpt-oss: one learned logit per query head that joins every softmax's denominator (and takes no value).
    attention_sinks: bool = False
    router_bias: bool = False  # gpt-oss: the MoE router has a bias
    expert_bias: bool = False  # gpt-oss: each expert's gate/up and down have biases
    partial_rotary_factor: float = 1.0  # Phi-3/4: rotary on the first part of each head only
    sliding_window: int | None = None  # attention sees this many positions (itself included); None: all
    # Per layer "sliding_attention" or "full_attention" where they differ (Gemma: interleaved); None: every
    # layer is windowed when sliding_window is set.
    layer_types: tuple[str, ...] | None = None
    # Mixture of experts (Mixtral, Qwen3-MoE): each token's MLP is the weighted sum of its top experts.
    num_experts: int = 0  # 0: a dense MLP in every layer
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # one expert's hidden width
    norm_topk_prob: bool = True  # renormalise the chosen experts' weights to sum to 1
    dense_mlp_layers: tuple[int, ...] = ()  # layers that keep a dense MLP in a MoE model
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Tensor parallelism: the (first row, rows) of the vocabulary this rank's embedding and output head keep;
    # None: the whole vocabulary (kvflow/distributed/sharding.py).
    vocab_shard: tuple[int, int] | None = None
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def vocab_rows(self) -> int:
        """Rows of the embedding and the output head held here: this rank's share, else the vocabulary."""
        return self.vocab_size if self.vocab_shard is None else self.vocab_shard[1]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_window(self, layer_index: int) -> int:
        """The sliding window of this layer's attention, 0 for a layer that sees every position."""
        if self.sliding_window is None:
            return 0
        if self.layer_types and self.layer_types[layer_index] != "sliding_attention":
            return 0
        return self.sliding_window

    @property
    def kv_group_windows(self) -> list[int]:
        """The KV cache groups' windows (engine/kv_cache_groups.py): layers that see the same span share a
        group; the global layers' group (window 0) comes first, where there is one."""
        windows = {self.layer_window(i) for i in range(self.num_layers)}
        return sorted(windows)

    def layer_kv_group(self, layer_index: int) -> int:
        return self.kv_group_windows.index(self.layer_window(layer_index))

    def is_moe_layer(self, layer_index: int) -> bool:
        return self.num_experts > 0 and layer_index not in self.dense_mlp_layers

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ArchConfig:
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else str(cfg.get("model_type", "unknown"))
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rope_theta, rope_scaling = _rope_settings(cfg)
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        layers = int(cfg["num_hidden_layers"])
        experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_context(cfg, rope_scaling),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            hidden_act=str(cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu"),
            swiglu_alpha=float(cfg.get("swiglu_alpha") or 1.702),
            swiglu_limit=float(cfg.get("swiglu_limit") or 7.0),
            partial_rotary_factor=float(cfg.get("partial_rotary_factor") or 1.0),
            sliding_window=_sliding_window(cfg),
            layer_types=_layer_types(cfg, layers),
            num_experts=experts,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]) if experts else 0,
            # Mixtral always renormalises; Qwen3-MoE says so in its config (transformers' default: no).
            norm_topk_prob=bool(cfg.get("norm_topk_prob", cfg.get("model_type") != "qwen3_moe")),
            dense_mlp_layers=_dense_mlp_layers(cfg, layers) if experts else (),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            raw=cfg,
        )


def _sliding_window(cfg: dict[str, Any]) -> int | None:
    # Qwen2/Qwen3 configs name a window and switch it off (use_sliding_window: false).
    if not cfg.get("sliding_window") or cfg.get("use_sliding_window") is False:
        return None
    return int(cfg["sliding_window"])


def _layer_types(cfg: dict[str, Any], layers: int) -> tuple[str, ...] | None:
    if cfg.get("layer_types"):
        return tuple(cfg["layer_types"])
    # Configs written before transformers listed them: Gemma 2 alternates from a sliding layer; Gemma 3
    # has one global layer in every `sliding_window_pattern` (6).
    every = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6}.get(cfg.get("model_type", ""))
    if every is None:
        return None
    every = int(cfg.get("sliding_window_pattern") or every)
    return tuple("sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers))


def _dense_mlp_layers(cfg: dict[str, Any], layers: int) -> tuple[int, ...]:
    """Qwen-MoE configs keep a dense MLP in `mlp_only_layers` and off every `decoder_sparse_step`-th layer."""
    step = int(cfg.get("decoder_sparse_step") or 1)
    only = {int(i) for i in cfg.get("mlp_only_layers") or ()}
    return tuple(i for i in range(layers) if i in only or (i + 1) % step != 0)


def _rope_settings(cfg: dict[str, Any]) -> tuple[float, dict | None]:
    # transformers 5 writes `rope_parameters`; older configs write rope_theta + rope_scaling.
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]  # one set per layer type (Gemma 3): the global layers' here
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = params.get("rope_type", params.get("type", "default"))
        return theta, (None if rope_type == "default" else _with_lengths(dict(params), cfg))
    scaling = cfg.get("rope_scaling")
    return float(cfg.get("rope_theta", 10000.0)), (_with_lengths(dict(scaling), cfg) if scaling else None)


def _context(cfg: dict[str, Any], scaling: dict | None) -> int:
    """The model's context: its config's, or as far as its YaRN scaling reaches if that is further (as vLLM
    derives it: Qwen's long-context recipe adds YaRN over 32768 tokens and leaves max_position_embeddings)."""
    context = int(cfg.get("max_position_embeddings", 4096))
    if scaling and scaling.get("rope_type", scaling.get("type")) == "yarn":
        return max(context, int(scaling["original_max_position_embeddings"] * scaling["factor"]))
    return context


def _with_lengths(scaling: dict, cfg: dict[str, Any]) -> dict:
    """LongRoPE reads the original and the extended context lengths, which configs keep beside it. YaRN
    reads the original one too, and as transformers does: a top-level original_max_position_embeddings
    first, else the scaling's own, else the model's context; and a missing factor is their ratio."""
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type == "longrope":
        scaling.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
        scaling.setdefault("max_position_embeddings", cfg.get("max_position_embeddings"))
    elif rope_type == "yarn":
        context = int(cfg.get("max_position_embeddings", 4096))
        original = cfg.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = int(original or context)
        if scaling.get("factor") is None:
            scaling["factor"] = context / scaling["original_max_position_embeddings"]
    return scaling
