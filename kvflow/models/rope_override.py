"""--rope-scaling applied: a model run with another rotary scaling than its config states (longer contexts).

The stated dict (read and checked in kvflow/rope_scaling.py) replaces the model's own, as vLLM's override
does; the tables themselves are built in kvflow/layers/rotary.py, the way transformers' ROPE_INIT_FUNCTIONS
build them, and are the ones every executor (the native CPU decoder included) reads.
"""

from __future__ import annotations

import dataclasses

from kvflow.models.arch import ArchConfig


def apply_rope_scaling(arch: ArchConfig, scaling: dict | None) -> ArchConfig:
    """arch with the stated scaling in place of its own, and a context (max_position_embeddings) stretched
    to what the scaling reaches: YaRN's original context times its factor, linear's the model's context
    times its factor (as vLLM derives its default --max-model-len). YaRN's original context, when not
    stated, is the one the model's own scaling names, else the model's context (transformers' default)."""
    if scaling is None:
        return arch
    scaling = dict(scaling)
    own = arch.rope_scaling or {}
    if scaling["rope_type"] == "yarn":
        original = int(scaling.get("original_max_position_embeddings")
                       or own.get("original_max_position_embeddings") or arch.max_position_embeddings)
        scaling["original_max_position_embeddings"] = original
        reach = int(original * scaling["factor"])
    else:
        reach = int(arch.max_position_embeddings * scaling["factor"])
    return dataclasses.replace(arch, rope_scaling=scaling,
                               max_position_embeddings=max(arch.max_position_embeddings, reach))
