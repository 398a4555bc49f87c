"""SpeculativeConfig: vLLM's `speculative_config` dict, checked once when the engine is built."""

from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 16  # the most draft tokens one sequence verifies per step
    prompt_lookup_min: int = 2  # the shortest suffix n-gram that may be looked up
    prompt_lookup_max: int = 16  # the longest (a longer match also says how far to trust the draft)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method: {self.method!r} is not one of {', '.join(METHODS)}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 64:
            raise ValueError("speculative_config.num_speculative_tokens: must be an integer in [1, 64]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """None, a SpeculativeConfig, a dict or its JSON text (the CLI's --speculative-config)."""
        if value is None or isinstance(value, SpeculativeConfig):
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
