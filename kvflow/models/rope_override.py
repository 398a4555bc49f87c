"""--rope-scaling applied: a model run with another rotary scaling than its config states (longer contexts).

The stated dict (read and checked in kvflow/rope_scaling.py) replaces the model's own, as vLLM's override
does; the tables themselves are built in kvflow/layers/rotary.py, the way transformers' ROPE_INIT_FUNCTIONS
build them, and are the ones every executor (the native CPU decoder included) reads.
"""

from __future__ import annotations

import dataclasses

from kvflow.models.arch import ArchConfig


def apply_rope_scaling(arch: ArchConfig, scaling: dict | None, max_model_len: int | None = None) -> ArchConfig:
    """arch with the stated scaling in place of its own, and a context (max_position_embeddings) stretched
    to what the scaling reaches: YaRN's original context times its factor, linear's the model's context
    times its factor (as vLLM derives its default --max-model-len; YaRN's original: yarn_original).
    `auto` (kvflow/rope_scaling.py) is YaRN with the factor that reaches max_model_len, or nothing."""
    if scaling is None:
        return arch
    scaling = dict(scaling)
    if scaling["rope_type"] == "auto":
        scaling = auto_scaling(arch, max_model_len)
        if scaling is None:
            return arch
    if scaling["rope_type"] == "yarn":
        original = scaling["original_max_position_embeddings"] = yarn_original(arch, scaling)
        reach = int(original * scaling["factor"])
    else:
        reach = int(arch.max_position_embeddings * scaling["factor"])
    return dataclasses.replace(arch, rope_scaling=scaling,
                               max_position_embeddings=max(arch.max_position_embeddings, reach))


def auto_scaling(arch: ArchConfig, max_model_len: int | None) -> dict | None:
    """The YaRN that stretches the model's trained context to max_model_len, or None where it needs none
    (the context fits) or has a scaling of another kind of its own (Llama 3's, LongRoPE), left as it is."""
    own = arch.rope_scaling or {}
    own_type = own.get("rope_type", own.get("type"))  # transformers 4 configs wrote "type"
    if not max_model_len or max_model_len <= arch.max_position_embeddings or own_type not in (None, "yarn"):
        return None
    original = yarn_original(arch, {})
    return {"rope_type": "yarn", "factor": max_model_len / original, "original_max_position_embeddings": original}


def yarn_original(arch: ArchConfig, scaling: dict) -> int:
    """YaRN's original context: the one stated, else the one the model's own scaling names, else the model's
    context (transformers' default)."""
    own = arch.rope_scaling or {}
    return int(scaling.get("original_max_position_embeddings") or own.get("original_max_position_embeddings")
               or arch.max_position_embeddings)
