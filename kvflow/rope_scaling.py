"""The value of --rope-scaling (and LLM(rope_scaling=...)): another rotary scaling than the model's config
states, for longer contexts. Read and checked here, before anything loads; kvflow/models/rope_override.py
puts it in place of the model's own.

One flag, two spellings: vLLM's JSON (`{"rope_type": "yarn", "factor": 4.0,
"original_max_position_embeddings": 32768}`, the dict transformers keeps as `rope_scaling`), or the short
`TYPE:FACTOR[:ORIGINAL]` (`yarn:4`, `yarn:4:32768`, `linear:2`). A third, `auto`, names no factor: YaRN
just far enough to reach --max-model-len where that goes past the model's trained context, nothing where it
does not (`kvflow launch` starts its server so: a small model trained for 8,192 tokens, stretched to an
agent's 32,768, answers in sentences and stops; unstretched, past 8,192 it writes noise until the limit).
"""

from __future__ import annotations

import json
import math
from typing import Any

ROPE_TYPES = ("linear", "yarn")
AUTO = {"rope_type": "auto"}  # resolved against the model and --max-model-len in models/rope_override.py
_NUMBERS = {"factor", "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"}
_KEYS = {"linear": {"rope_type", "factor"},
         "yarn": {"rope_type", "factor", "original_max_position_embeddings", "truncate"} | _NUMBERS}
EXAMPLE = 'e.g. yarn:4:32768, linear:2 or \'{"rope_type": "yarn", "factor": 4.0}\''


def parse_rope_scaling(value: str | dict | None) -> dict | None:
    """The rotary scaling stated on the command line or to LLM(...), checked; None: the model's own.
    Raises ValueError naming what is wrong."""
    if value is None:
        return None
    if isinstance(value, str):
        value = dict(AUTO) if value.strip().lower() == "auto" else _from_text(value.strip())
    if value == AUTO:  # said as text, or as the dict (LLM(rope_scaling=...), a config read again)
        return dict(AUTO)
    if not isinstance(value, dict):
        raise ValueError(f"rope scaling must be a JSON object or TYPE:FACTOR[:ORIGINAL], {EXAMPLE}")
    scaling = dict(value)
    rope_type = scaling.pop("type", None) or scaling.get("rope_type")  # transformers 4 wrote "type"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope scaling type {rope_type!r} is not supported here (supported: "
                         f"{', '.join(ROPE_TYPES)}, or auto); {EXAMPLE}")
    scaling["rope_type"] = rope_type
    unknown = set(scaling) - _KEYS[rope_type]
    if unknown:
        raise ValueError(f"rope scaling {rope_type}: unknown key(s) {', '.join(sorted(unknown))} "
                         f"(known: {', '.join(sorted(_KEYS[rope_type]))})")
    for key in _NUMBERS & set(scaling):
        number = scaling[key]
        if isinstance(number, bool) or not isinstance(number, int | float) or not math.isfinite(number):
            raise ValueError(f"rope scaling {key} must be a number, not {number!r}")
    factor = scaling.get("factor")
    if factor is None or factor < 1:
        raise ValueError(f"rope scaling needs a factor >= 1 (the context is stretched by it), not {factor!r}")
    original = scaling.get("original_max_position_embeddings")
    if original is not None and (isinstance(original, bool) or not isinstance(original, int) or original < 1):
        raise ValueError(f"rope scaling original_max_position_embeddings must be a positive integer, "
                         f"not {original!r}")
    if "truncate" in scaling and not isinstance(scaling["truncate"], bool):
        raise ValueError(f"rope scaling truncate must be true or false, not {scaling['truncate']!r}")
    return scaling


def _from_text(text: str) -> Any:
    if text.startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"rope scaling is not valid JSON ({exc.msg}); {EXAMPLE}") from None
    parts = text.split(":")
    if len(parts) not in (2, 3) or not parts[0]:
        raise ValueError(f"rope scaling {text!r} is neither JSON nor TYPE:FACTOR[:ORIGINAL]; {EXAMPLE}")
    scaling: dict[str, Any] = {"rope_type": parts[0].lower()}
    try:
        scaling["factor"] = float(parts[1])
        if len(parts) == 3:
            scaling["original_max_position_embeddings"] = int(parts[2])
    except ValueError:
        raise ValueError(f"rope scaling {text!r}: the factor must be a number and the original context an "
                         f"integer; {EXAMPLE}") from None
    return scaling
