"""What the schemathesis fuzzing of the wire APIs (test_schemathesis.py) sends and how it judges each answer.

The description fuzzed is the server's own /openapi.json, with two changes that spend the examples on what
the routes read: request objects closed to unknown fields (which every route ignores: test_unknown_fields.py
covers them), and each generated body bounded in output (max_tokens and its kin set small, the model set to
the served one) so a run's time is the server's answers, not long generations. What a huge ask costs is
checked apart from the fuzzing (test_request_cost.py)."""

from __future__ import annotations

import copy
import json
from typing import Any

# The fields that set how many tokens a request may generate, on every API; the fuzzer's values are cut to
# this many tokens.
FUZZ_MAX_TOKENS = 4
_OUTPUT_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "num_predict")


def closed_schema(doc: dict) -> dict:
    """doc with every request object that lists its properties closed to others (additionalProperties)."""
    doc = copy.deepcopy(doc)

    def close(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("additionalProperties") is True and "properties" in node:
                node["additionalProperties"] = False
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)

    close(doc.get("components", {}).get("schemas", {}))
    return doc


def bound_body(path: str, body: Any, model: str) -> Any:
    """The generated body with its output bounded: every output-length field present and at most
    FUZZ_MAX_TOKENS, and the served model named wherever a model is."""
    if not isinstance(body, dict):
        return body
    _cap(body)
    if "model" in body:
        body["model"] = model
    if path in ("/v1/completions", "/v1/messages", "/v1/responses") or (
            path == "/v1/chat/completions" and "max_completion_tokens" not in body):
        key = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
        body[key] = min(_small(body.get(key)), FUZZ_MAX_TOKENS)
    if path in ("/api/generate", "/api/chat"):
        options = body.get("options") if isinstance(body.get("options"), dict) else {}
        options["num_predict"] = min(_small(options.get("num_predict")), FUZZ_MAX_TOKENS)
        body["options"] = options
    return body


def _small(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and 1 <= value else FUZZ_MAX_TOKENS


def _cap(node: Any) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in _OUTPUT_FIELDS and isinstance(value, int) and not isinstance(value, bool):
                node[key] = min(value, FUZZ_MAX_TOKENS)
            else:
                _cap(value)
    elif isinstance(node, list):
        for value in node:
            _cap(value)


def error_shape_problem(path: str, status: int, text: str) -> str | None:
    """Why a 4xx body is not an error in the shape of the path's API (None when it is)."""
    try:
        body = json.loads(text)
    except ValueError:
        return f"{status} body is not JSON: {text[:200]!r}"
    if path.startswith("/api/"):  # Ollama: {"error": "message"}
        ok = isinstance(body, dict) and isinstance(body.get("error"), str) and body["error"]
    elif path.startswith("/v1/messages"):  # Anthropic: {"type": "error", "error": {"type", "message"}}
        error = body.get("error") if isinstance(body, dict) else None
        ok = body.get("type") == "error" and isinstance(error, dict) and isinstance(error.get("type"), str) \
            and isinstance(error.get("message"), str) and bool(error["message"])
    else:  # OpenAI: {"error": {"message", "type", "param", "code"}}
        error = body.get("error") if isinstance(body, dict) else None
        ok = isinstance(error, dict) and isinstance(error.get("message"), str) and bool(error["message"]) \
            and isinstance(error.get("type"), str) and set(error) >= {"param", "code"}
    return None if ok else f"{status} body is not {path}'s error shape: {text[:300]}"
