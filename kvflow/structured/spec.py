"""StructuredOutput: what a request's output must match, as plain data (no grammar engine imported), so that
SamplingParams stays cheap to build and to copy. The engine compiles it (structured/compiler.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one of: a JSON schema (`json`, a dict or its JSON text; `{"type": "object"}` for any object),
    a regular expression, a list of choices, or a Lark grammar (llguidance's dialect, which may embed
    JSON schemas with %json)."""

    json: Any = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    # The output is JSON, perhaps inside tags (a tool-call grammar): near its token budget the engine may
    # steer it to close its strings and brackets. Always so for `json`.
    closes_like_json: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"StructuredOutput takes exactly one of json, regex, choice, grammar; got {given}")
        if self.choice is not None:
            if not self.choice or any(not isinstance(c, str) or not c for c in self.choice):
                raise ValueError("StructuredOutput.choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json is not None and isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json.loads(self.json))
            except json.JSONDecodeError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError("a JSON schema must be an object (or true/false)")
        if self.json is not None:
            object.__setattr__(self, "closes_like_json", True)

    @property
    def kind(self) -> str:
        return next(name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None)

    def cache_key(self) -> str:
        """One text per distinct constraint (JSON key order does not matter)."""
        if self.json is not None:
            return "json:" + json.dumps(self.json, sort_keys=True, separators=(",", ":"))
        if self.choice is not None:
            return "choice:" + json.dumps(list(self.choice))
        return f"{self.kind}:{self.regex if self.regex is not None else self.grammar}"


JSON_OBJECT = StructuredOutput(json={"type": "object"})
