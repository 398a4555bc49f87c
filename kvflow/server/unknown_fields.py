"""Fields a request body carries that kvflow does not know: accepted and ignored, as vLLM, llama-server and
Ollama do, since the clients of each wire API send the newest (and beta) fields of that API, which a local
server cannot track release by release. A known field of the wrong type or value is still a 400 naming it.

Every request model is built with `extra="allow"`: pydantic keeps the unknown fields aside (model_extra)
and nothing reads them. serving.parse_body walks the validated body with `unknown_fields`, and each
unknown field is logged once per route at debug level and counted in /metrics
(`kvflow:request_ignored_fields_total{route, field}`), its path written with `*` for list positions
(`messages.*.refusal`), so the label stays one per kind of field however long the conversation."""

from __future__ import annotations

from collections.abc import Iterator

from pydantic import BaseModel


def unknown_fields(model: BaseModel) -> list[str]:
    """The paths of the fields in model (and the models inside it) that its classes do not declare, each once."""
    return sorted(set(_walk(model, "")))


def _walk(value: object, prefix: str) -> Iterator[str]:
    if isinstance(value, BaseModel):
        for name in value.model_extra or {}:
            yield prefix + name
        for name in type(value).model_fields:
            yield from _walk(getattr(value, name), f"{prefix}{name}.")
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _walk(item, prefix + "*.")
