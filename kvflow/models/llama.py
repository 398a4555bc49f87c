"""The Llama-family decoder (Llama 2/3/3.x, SmolLM, TinyLlama, Mistral), also the base of Qwen2/Qwen3.

This file is the architecture's one description: its layers and, through the ArchConfig fields they
read (norm eps, activation, q/k/v bias, per-head q/k norms), what each does. The modules below run it
in PyTorch; the native decoder runs the same layers' weights and flags (executors/native_model.py).

forward() takes a flat 1-D batch of tokens from many sequences, their positions and an
AttentionMetadata; it returns hidden states, and compute_logits() projects only the rows asked for.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvflow.layers.activation import gated_activation
from kvflow.layers.attention.backend import AttentionBackend, ReferenceBackend
from kvflow.layers.attention.forward_context import forward_context, run_attention
from kvflow.layers.attention.metadata import AttentionMetadata
from kvflow.layers.linear import Linear
from kvflow.layers.norm import RMSNorm
from kvflow.layers.rotary import RotaryEmbedding, apply_rotary
from kvflow.models.arch import ArchConfig
from kvflow.models.moe import SparseMoE


class Attention(nn.Module):
    def __init__(self, arch: ArchConfig, layer_index: int) -> None:
        super().__init__()
        # Which layer this is, as a 0-d tensor: the compiled graph passes it to the attention op (see
        # layers/attention/forward_context).
        self.register_buffer("layer_id", torch.tensor(layer_index), persistent=False)
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.window = arch.layer_window(layer_index)  # 0: this layer sees every position
        self.kv_group = arch.layer_kv_group(layer_index)  # whose block tables its cache follows
        self.softcap = 0.0  # > 0: scores capped as softcap * tanh(score / softcap) (Gemma 2)
        self.qkv_proj = Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.attention_bias)
        self.o_proj = Linear(self.q_size, arch.hidden_size, bias=arch.o_proj_bias)
        # gpt-oss: a logit per query head in every softmax's denominator (None: no sinks).
        self.sinks = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False) if arch.attention_sinks else None
        self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.backend: AttentionBackend = ReferenceBackend()
        self.k_cache: torch.Tensor | None = None  # bound by the model runner
        self.v_cache: torch.Tensor | None = None

    @property
    def plain_softmax(self) -> bool:
        """Whether every score goes into one causal softmax as it is: no window, cap or sinks (which some
        kernels, Triton's and the AMX tiles', do not take)."""
        return not (self.window or self.softcap or self.sinks is not None)

    def forward(self, x: torch.Tensor, cos_sin: tuple) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, cos_sin)
        if torch.compiler.is_compiling():  # opaque to the compiler: see forward_context
            out = torch.ops.kvflow.attention(q, k, v, self.layer_id)
        else:
            out = run_attention(self, q, k, v)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, arch: ArchConfig, intermediate_size: int | None = None, bias: bool = False) -> None:
        super().__init__()
        width = intermediate_size or arch.intermediate_size  # an expert's width in a MoE layer
        self.gate_up_proj = Linear(arch.hidden_size, 2 * width, bias=bias)
        self.down_proj = Linear(width, arch.hidden_size, bias=bias)
        params = {"alpha": arch.swiglu_alpha, "limit": arch.swiglu_limit} if arch.hidden_act == "swiglu_oai" else {}
        self.act_and_mul = gated_activation(arch.hidden_act, **params)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, layer_index)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = SparseMoE(arch, MLP) if arch.is_moe_layer(layer_index) else MLP(arch)

    def forward(self, x: torch.Tensor, cos_sin: tuple) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin)
        return x + self.mlp(self.post_attention_layernorm(x))

    def norms(self) -> tuple[nn.Module, nn.Module, nn.Module | None, nn.Module | None]:
        """(before attention, before the MLP, on attention's output, on the MLP's output): what the native
        decoder's layer struct is told; None where the layer has no such norm."""
        return self.input_layernorm, self.post_attention_layernorm, None, None


class LlamaForCausalLM(nn.Module):
    # Checkpoint tensors that we store fused: (our parameter, the checkpoint's name, shard index).
    stacked_params = (
        ("qkv_proj", "q_proj", 0),
        ("qkv_proj", "k_proj", 1),
        ("qkv_proj", "v_proj", 2),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )
    # Checkpoint names spelled otherwise by a family (Mixtral's experts), as (theirs, ours) substrings, and
    # prefixes of checkpoint tensors that are not this model's (an image-text checkpoint's vision tower).
    renamed_params: tuple[tuple[str, str], ...] = ()
    skipped_params: tuple[str, ...] = ()
    decoder_layer: type[nn.Module] = DecoderLayer  # a family with other layers (Gemma) names its own
    weight_sharder = None  # set by the loader under tensor parallelism (kvflow/distributed/sharding.py)

    def __init__(self, arch: ArchConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.arch = arch
        self.rotary = RotaryEmbedding(
            arch.rotary_dim, max_positions or arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling
        )
        # No random init: the checkpoint overwrites the table, and pages never written cost no memory when
        # --quantization gguf swaps it for a packed one.
        self.embed_tokens = nn.Embedding(
            arch.vocab_rows, arch.hidden_size, _weight=torch.empty(arch.vocab_rows, arch.hidden_size)
        )
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(self.decoder_layer(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = Linear(arch.hidden_size, arch.vocab_rows)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        with forward_context(meta, self.attention_layers):
            return self.hidden_states(input_ids, positions)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states of a flat batch; attention reads the step's metadata from the forward context."""
        x = self.embed_tokens(input_ids)
        cos_sin = self.rotary.cos_sin(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos_sin)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @property
    def attention_layers(self) -> list[Attention]:
        # Built once: the model runner reads it every step.
        if getattr(self, "_attention_layers", None) is None:
            self._attention_layers = [layer.self_attn for layer in self.layers]
        return self._attention_layers

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into our parameters, fusing q/k/v and gate/up."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name:
                continue
            if self.skipped_params and name.startswith(self.skipped_params):
                continue
            for theirs, ours in self.renamed_params:
                name = name.replace(theirs, ours)
            if name == "lm_head.weight" and self.arch.tie_word_embeddings:
                continue
            if self.weight_sharder is not None:  # tensor parallelism: this rank's heads and columns
                tensor = self.weight_sharder.narrow(name, tensor)
            target, shard = name, None
            for fused, part, index in self.stacked_params:
                if f".{part}." in name:
                    target, shard = name.replace(f".{part}.", f".{fused}."), index
                    break
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in {self.arch.architecture}")
            param = params[target]
            dst = param.data if shard is None else self._shard_view(param.data, target, shard)
            if dst.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            # A fused tensor in the checkpoint (Phi-3's qkv_proj, gate_up_proj) fills every part at once.
            shards = [shard] if shard is not None else _fused_parts(target)
            loaded.update(f"{target}#{s}" for s in shards)
        self._check_all_loaded(loaded, params)

    def _shard_view(self, data: torch.Tensor, target: str, shard: int) -> torch.Tensor:
        a = self.arch
        if ".qkv_proj." in target:
            sizes = [a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim]
        else:  # gate | up, of a dense MLP or an expert
            sizes = [data.shape[0] // 2] * 2
        start = sum(sizes[:shard])
        return data.narrow(0, start, sizes[shard])

    def _check_all_loaded(self, loaded: set[str], params: dict[str, nn.Parameter]) -> None:
        missing = []
        for name in params:
            if name == "lm_head.weight" and self.arch.tie_word_embeddings:
                continue
            missing += [name for p in _fused_parts(name) if f"{name}#{p}" not in loaded]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(set(missing))[:3]}")


def _fused_parts(param_name: str) -> list[int | None]:
    """The checkpoint parts a parameter is made of: q/k/v, gate/up, or itself alone."""
    if ".qkv_proj." in param_name:
        return [0, 1, 2]
    if ".gate_up_proj." in param_name:
        return [0, 1]
    return [None]
