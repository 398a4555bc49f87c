"""How an attention layer reaches its step's metadata, so the rest of the model can be compiled.

The metadata of a step (per-sequence lengths, block tables) changes every step and drives Python-side
branching in the backends. If it were an argument of the model's forward, torch.compile would guard on
it and recompile every step. Instead the model sets it here once per forward, and attention runs as one
opaque custom op (`kvflow::attention`) that reads it: the compiled graph sees only tensors whose shapes
are the step's token count.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from kvflow.layers.attention.metadata import AttentionMetadata


@dataclass
class ForwardContext:
    meta: AttentionMetadata
    layers: Sequence  # the model's attention layers, indexed by Attention.layer_id
    built: dict = field(default_factory=dict)  # (backend, KV group) -> its metadata for this step

    def metadata_for(self, backend, group: int = 0) -> object:
        """The backend's own metadata for this step and KV group: built by the first layer that asks,
        shared by the rest."""
        built = self.built.get((backend, group))
        if built is None:
            built = self.built[backend, group] = backend.build_metadata(self.meta.for_group(group))
        return built


_current: ForwardContext | None = None


@contextmanager
def forward_context(meta: AttentionMetadata, layers: Sequence) -> Iterator[None]:
    global _current
    previous, _current = _current, ForwardContext(meta, layers)
    try:
        yield
    finally:
        _current = previous


def current() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention ran outside a model forward (no forward_context is set)")
    return _current


def run_attention(layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Store k/v in the layer's cache and attend; the eager path and the custom op's body."""
    meta = current().metadata_for(layer.backend, layer.kv_group)
    if layer.plain_softmax:  # only the other layers pass window, cap and sinks: backends without them serve these
        return layer.backend.forward(q, k, v, layer.k_cache, layer.v_cache, meta, layer.scale)
    return layer.backend.forward(q, k, v, layer.k_cache, layer.v_cache, meta, layer.scale, window=layer.window,
                                 softcap=layer.softcap, sinks=layer.sinks)


@torch.library.custom_op("kvflow::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: torch.Tensor) -> torch.Tensor:
    # Writes the layer's KV cache, which is not an argument: the cache is state the graph never reads.
    # The layer comes as a 0-d tensor, not an int: the compiler specialises on ints, so thirty layers
    # would mean thirty graphs; as a tensor, one compiled decoder layer serves them all.
    return run_attention(current().layers[int(layer_id)], q, k, v)


@attention_op.register_fake
def _attention_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q)
