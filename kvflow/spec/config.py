"""SpeculativeConfig: vLLM's `speculative_config` dict, checked once when the engine is built."""

from __future__ import annotations

import json
from dataclasses import dataclass

# The default: n-gram lookup with the adaptive control, where it was measured not to slow any workload down
# (CPU: benchmarks/RESULTS.md, sessions 16 and 26); elsewhere off until measured there.
AUTO = "auto"

# ngram: lookup in the request's own tokens; suffix: that, and an index over recent requests
# (spec/suffix.py); draft_model: a smaller model with the same tokenizer drafts greedily (spec/draft_model.py).
METHODS = ("ngram", "suffix", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 16  # the most draft tokens one sequence verifies per step
    prompt_lookup_min: int = 2  # the shortest suffix n-gram that may be looked up
    prompt_lookup_max: int = 16  # the longest (a longer match also says how far to trust the draft)
    model: str | None = None  # draft_model: its name, path or alias (anything kvflow loads)
    suffix_decoding_max_cached_requests: int = 1000  # suffix: how many finished requests the index holds
    draft_kv_cache_memory: int = 256 << 20  # draft_model: bytes of its own KV cache
    # False: every sequence drafts num_speculative_tokens each step, whatever it earns (for measurement);
    # True: as many as pay (engine/speculation.py), 0 included.
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method: {self.method!r} is not one of {', '.join(METHODS)}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 64:
            raise ValueError("speculative_config.num_speculative_tokens: must be an integer in [1, 64]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config.model: needed with method 'draft_model', and only there")
        if self.suffix_decoding_max_cached_requests < 1 or self.draft_kv_cache_memory < 1:
            raise ValueError("speculative_config: suffix_decoding_max_cached_requests and draft_kv_cache_memory "
                             "must be positive")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | str | None:
        """None or "off" (no speculation), "auto" (kept as "auto": `resolve` decides), a SpeculativeConfig, a
        dict or its JSON text (the CLI's --speculative-config)."""
        if value is None or value == "off":
            return None
        if value == AUTO or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field {unknown[0]!r} (known: {', '.join(sorted(known))})")
        return cls(**value)


def resolve(value: SpeculativeConfig | dict | str | None, device: str) -> SpeculativeConfig | None:
    """The engine's speculative config: `value` parsed, with "auto" as n-gram lookup (adaptive) on a CPU and
    off on other devices."""
    spec = SpeculativeConfig.parse(value)
    if spec == AUTO:
        return SpeculativeConfig() if device == "cpu" else None
    return spec
