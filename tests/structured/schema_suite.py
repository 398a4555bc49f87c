"""The committed schema suite (schemas.json: JSON schemas of the kinds agents send, each with a prompt
asking the default model for such an object) and the check that an output meets its schema."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema

CASES: list[dict] = json.loads((Path(__file__).parent / "schemas.json").read_text())


def violation(text: str, schema: dict) -> str | None:
    """Why text is not a JSON value valid against schema (formats checked too), or None when it is."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"not JSON ({exc}): {text!r}"
    try:
        jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())
    except jsonschema.ValidationError as exc:
        return f"{exc.message}: {text!r}"
    return None


def chat_prompt(case: dict) -> list[dict]:
    return [{"role": "user", "content": case["prompt"] + " Answer in JSON."}]
