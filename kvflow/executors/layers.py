"""The PyTorch-layers executor: a step through the model's own modules (eager, or compiled where the
plan says), with the attention backend this executor picks. It runs the exact CPU mode, the CUDA path
(executors/cuda.py adds graphs) and every step the native decoder does not take.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvflow.layers.attention.backend import ReferenceBackend
from kvflow.layers.attention.forward_context import forward_context
from kvflow.layers.attention.sdpa import SDPABackend
from kvflow.layers.attention.triton_backend import TritonBackend, triton_available


def choose_backend(device: torch.device, name: str = "auto", exact: bool = False, windowed: bool = False):
    """The attention backend: Triton on CUDA, SDPA with the C++ paged kernel on CPU (every query row
    through the kernel in the exact mode), or one named ("reference", "sdpa", "triton"). windowed: the
    model has sliding-window, soft-capped or sink layers, which the Triton kernels do not take."""
    backends = {"reference": ReferenceBackend, "sdpa": SDPABackend, "triton": TritonBackend}
    if name == "auto":
        name = "triton" if device.type == "cuda" and triton_available() and not windowed else "sdpa"
    if name not in backends:
        raise ValueError(f"unknown attention backend {name!r}; choose from {', '.join(backends)}")
    # Prefill attention stays float32 even in the fast mode: bf16 moved SmolLM2's answer to "What is the
    # capital of France?" off "The capital of France is Paris." (a near tie).
    return SDPABackend(exact=exact) if name == "sdpa" else backends[name]()


class LayersExecutor:
    def __init__(self, loaded, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], attention_backend: str = "auto") -> None:
        self.model = loaded.model
        self.vocab_size = loaded.arch.vocab_size
        self.kv_caches = kv_caches
        windowed = not all(layer.plain_softmax for layer in self.model.attention_layers)
        self.backend = choose_backend(loaded.device, attention_backend, exact=loaded.plan.batch_invariant,
                                      windowed=windowed)
        self.hidden_states: Callable = loaded.compiled or self.model.hidden_states
        self.bind()

    def bind(self) -> None:
        """Point every attention layer at this executor's cache and backend. Done before each step too, so
        several engines may share one loaded model (tests, benchmarks) as long as they take turns."""
        layers = self.model.attention_layers
        if layers and layers[0].k_cache is self.kv_caches[0][0] and layers[0].backend is self.backend:
            return  # still ours (nn.Module attribute writes cost microseconds each, every step)
        for layer, (k_cache, v_cache) in zip(layers, self.kv_caches):
            layer.k_cache, layer.v_cache, layer.backend = k_cache, v_cache, self.backend

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """Final-norm hidden states [T, hidden] of a flat batch."""
        with forward_context(meta, self.model.attention_layers):
            return self.hidden_states(input_ids, positions)

    def execute(self, inputs) -> torch.Tensor:
        """float32 logits [rows sampled, vocab] of one step (engine/runner.StepInputs)."""
        self.bind()
        hidden = self.forward(inputs.input_ids, inputs.positions, inputs.meta)
        if inputs.logits_indices.numel() == 0:
            return torch.empty(0, self.vocab_size)
        return self.model.compute_logits(hidden[inputs.logits_indices]).float()
