"""What /openapi.json says each route answers: the success body (JSON, or the events of a stream: SSE on
/v1, NDJSON lines on /api), and every error status with the shape of the route's API (errors.py):
OpenAI's {"error": {...}}, Anthropic's {"type": "error", "error": {...}} on /v1/messages, Ollama's
{"error": "..."} on /api. The schemas name the fields clients rely on; the bodies carry more (kvflow_timings,
vLLM's extensions), which the schemas allow. Stream events follow OpenAPI 3.2's reading of an event stream's
`itemSchema`: each event is an object whose `data` is a string, here JSON (contentSchema) or [DONE]."""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]

_STR: Schema = {"type": "string"}
_INT: Schema = {"type": "integer", "minimum": 0}
_STR_OR_NULL: Schema = {"type": ["string", "null"]}


def _object(required: dict[str, Schema], **optional: Schema) -> Schema:
    return {"type": "object", "required": list(required), "properties": {**required, **optional}}


OPENAI_ERROR = _object({"error": _object({"message": _STR, "type": _STR}, param=_STR_OR_NULL, code=_STR_OR_NULL)})
ANTHROPIC_ERROR = _object({"type": {"const": "error"}, "error": _object({"type": _STR, "message": _STR})})
OLLAMA_ERROR = _object({"error": _STR})

_USAGE = _object({"prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT})
_FINISH: Schema = {"type": ["string", "null"]}
_HEAD = {"id": _STR, "created": _INT, "model": _STR}

CHAT_COMPLETION = _object({
    **_HEAD, "object": {"const": "chat.completion"}, "usage": _USAGE,
    "choices": {"type": "array", "items": _object({
        "index": _INT, "finish_reason": _FINISH,
        "message": _object({"role": _STR}, content=_STR_OR_NULL, tool_calls={"type": "array"}),
    })},
})
CHAT_CHUNK = _object({
    **_HEAD, "object": {"const": "chat.completion.chunk"},
    "choices": {"type": "array", "items": _object({"index": _INT, "delta": {"type": "object"}, "finish_reason": _FINISH})},
}, usage={"anyOf": [_USAGE, {"type": "null"}]})
COMPLETION = _object({
    **_HEAD, "object": {"const": "text_completion"},
    "choices": {"type": "array", "items": _object({"index": _INT, "text": _STR, "finish_reason": _FINISH})},
}, usage={"anyOf": [_USAGE, {"type": "null"}]})

_ANTHROPIC_USAGE = _object({"input_tokens": _INT, "output_tokens": _INT})
ANTHROPIC_MESSAGE = _object({
    "id": _STR, "type": {"const": "message"}, "role": {"const": "assistant"}, "model": _STR,
    "content": {"type": "array", "items": _object({"type": _STR})}, "stop_reason": _STR_OR_NULL,
    "usage": _ANTHROPIC_USAGE,
})
ANTHROPIC_EVENT = _object({"type": _STR})
COUNT_TOKENS = _object({"input_tokens": _INT})

RESPONSE = _object({"id": _STR, "object": {"const": "response"}, "status": _STR, "output": {"type": "array"}})
RESPONSE_EVENT = _object({"type": _STR, "sequence_number": _INT})

_OLLAMA_HEAD = {"model": _STR, "created_at": _STR, "done": {"type": "boolean"}}
OLLAMA_GENERATE = _object({**_OLLAMA_HEAD, "response": _STR})
OLLAMA_CHAT = _object({**_OLLAMA_HEAD, "message": _object({"role": _STR, "content": _STR})})

TOKENIZE = _object({"count": _INT, "max_model_len": _INT, "tokens": {"type": "array"}})
DETOKENIZE = _object({"prompt": _STR})
MODEL = _object({"id": _STR, "object": {"const": "model"}, "max_model_len": _INT})
MODELS = _object({"object": {"const": "list"}, "data": {"type": "array", "items": MODEL}})


def sse_event(data: Schema, done: bool = False) -> Schema:
    """One server-sent event whose data is JSON matching `data` (or, with done, OpenAI's closing [DONE])."""
    payload: Schema = {"type": "string", "contentMediaType": "application/json", "contentSchema": data}
    return _object({"data": {"anyOf": [{"const": "[DONE]"}, payload]} if done else payload}, event=_STR)


# path -> (JSON body, SSE event or None, streams NDJSON lines); the error events a stream may end with are
# allowed in its event schema.
_SUCCESS: dict[str, tuple[Schema, Schema | None, bool]] = {
    "/v1/chat/completions": (CHAT_COMPLETION, sse_event({"anyOf": [CHAT_CHUNK, OPENAI_ERROR]}, done=True), False),
    "/v1/completions": (COMPLETION, sse_event({"anyOf": [COMPLETION, OPENAI_ERROR]}, done=True), False),
    "/v1/messages": (ANTHROPIC_MESSAGE, sse_event(ANTHROPIC_EVENT), False),
    "/v1/messages/count_tokens": (COUNT_TOKENS, None, False),
    "/v1/responses": (RESPONSE, sse_event(RESPONSE_EVENT), False),
    "/api/generate": (OLLAMA_GENERATE, None, True),
    "/api/chat": (OLLAMA_CHAT, None, True),
    "/tokenize": (TOKENIZE, None, False),
    "/detokenize": (DETOKENIZE, None, False),
    "/v1/models": (MODELS, None, False),
    "/v1/models/{model_id}": (MODEL, None, False),
}

_PLAIN_TEXT = {"/health": "The engine's status: 200 while it runs, else 503",
               "/metrics": "Prometheus metrics (text exposition format)"}

_ERRORS = {400: "Bad request: the message names the field at fault (`param`)",
           401: "Missing or wrong API key (--api-key)", 404: "Unknown model or path",
           413: "Body larger than --max-body-size", 415: "Body not sent as application/json",
           500: "Internal error", 503: "Busy (--max-waiting; Retry-After) or the engine is down"}


def error_schema(path: str) -> Schema:
    """The error body of the API the path belongs to (the rule errors.error_response follows)."""
    if path.startswith("/api/"):
        return OLLAMA_ERROR
    if path.startswith("/v1/messages"):
        return ANTHROPIC_ERROR
    return OPENAI_ERROR


def document(doc: dict) -> None:
    """Fill in every operation's responses in the OpenAPI description `doc` (in place)."""
    for path, methods in doc.get("paths", {}).items():
        for method, operation in methods.items():
            if method not in ("get", "post", "head"):
                continue
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)  # FastAPI's own validation error: kvflow answers those with a 400
            success = _SUCCESS.get(path)
            if path in _PLAIN_TEXT:
                responses["200"] = {"description": _PLAIN_TEXT[path], "content": {"text/plain": {"schema": _STR}}}
            elif success is not None:
                body, event, ndjson = success
                content: dict = {"application/json": {"schema": body}}
                if event is not None:
                    content["text/event-stream"] = {"schema": event}
                if ndjson:  # one JSON object a line: the pieces, then the final one with done true
                    content["application/x-ndjson"] = {}
                responses["200"] = {"description": "Successful Response", "content": content}
            statuses = _ERRORS if method == "post" or "{" in path else {401: _ERRORS[401], 500: _ERRORS[500]}
            if path == "/health":
                responses["503"] = {"description": "The engine is not running",
                                    "content": {"text/plain": {"schema": _STR}}}
                continue
            for status, why in statuses.items():
                responses[str(status)] = {"description": why,
                                          "content": {"application/json": {"schema": error_schema(path)}}}
