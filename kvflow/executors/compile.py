"""torch.compile for CPU steps run through the PyTorch layers: the model's Python and small-op overhead, removed.

An eager decode step of a 30-layer model launches about 1,500 small ops (norms, rotary, residual adds,
dtype casts), each costing microseconds of dispatch, which at batch 1 is as much time as the matmuls
themselves. Inductor fuses them into a few C++ loops per layer and calls the matmul kernels directly.
Attention stays an opaque custom op (see layers/attention/forward_context), so a step's changing
sequence lengths never cause a recompile: only the token count is a graph input.

Graphs are built at start-up for the three shape classes a run meets (one token, a few decode rows,
prefill-sized chunks), and Inductor's on-disk cache makes later starts of the same model quick.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from kvflow.kernels import build
from kvflow.layers.attention.forward_context import forward_context
from kvflow.layers.attention.metadata import AttentionMetadata

log = logging.getLogger("kvflow")

COMPILE_MODES = ("auto", "on", "off")
# Token counts that build every graph a run needs: 1 (specialised), a small dynamic batch, a large one.
WARMUP_TOKEN_COUNTS = (1, 2, 64)


def should_compile(mode: str, native_decoder: bool, experts: bool = False) -> bool:
    """auto: compile in the fast CPU mode where the native decoder does not run the model (it has no
    PyTorch ops left to fuse). The exact mode never gets here: compiled reductions may round differently.
    A mixture of experts that the native decoder cannot run runs eager: which experts a step runs depends
    on the data, which a full graph cannot hold."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    if mode == "off" or experts:
        return False
    if mode == "on":
        return True
    return not native_decoder and compiler_available()


def compiler_available() -> bool:
    """Inductor's CPU code needs a C++ compiler; without one we run eager rather than fail."""
    return build.compiler() is not None


def compile_hidden_states(model: torch.nn.Module) -> Callable:
    """A compiled version of model.hidden_states (the eager one stays for anything compile cannot take)."""
    import torch._inductor.config as inductor_config  # here, not at the top: it imports triton

    model.requires_grad_(False)  # inference only: lets Inductor skip building a backward graph
    # The generated wrapper checks every input's sizes and strides on each call (600 checks a step for
    # this model); ours are parameters and fresh activations whose layout never changes.
    inductor_config.size_asserts = False
    inductor_config.alignment_asserts = False
    return torch.compile(model.hidden_states, dynamic=None, fullgraph=True)


@torch.inference_mode()
def warm_up(model: torch.nn.Module, compiled: Callable, device: torch.device) -> float:
    """Run each shape class once (no KV cache is touched) so no request waits on a compile; returns seconds."""
    start = time.perf_counter()
    for n in WARMUP_TOKEN_COUNTS:
        ids = torch.zeros(n, dtype=torch.long, device=device)
        positions = torch.arange(n, device=device)
        with forward_context(AttentionMetadata.for_prompts([n], device), model.attention_layers):
            compiled(ids, positions)
    seconds = time.perf_counter() - start
    log.info("compiled the model for CPU in %.1f s (cached on disk for later starts)", seconds)
    return seconds
