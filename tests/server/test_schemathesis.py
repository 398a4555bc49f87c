"""Property-based fuzzing of every wire API a real `kvflow serve` documents at /openapi.json (schemathesis).

Each operation gets schema-valid bodies (and, for those that take one, schema-violating ones), a bounded
number of each. Every answer must be: no 5xx; a status and content type the description documents; a body
(or each event of a stream) that matches the documented schema; for a 4xx, the error shape of the route's
API (OpenAI, Anthropic or Ollama); and within REQUEST_SECONDS. Afterwards the server still chats, and its
engine holds nothing: no request running or waiting, every KV block free.

KVFLOW_FUZZ_EXAMPLES=N runs N valid bodies per operation instead of the default (and half as many invalid
ones); KVFLOW_FUZZ_SEED=S draws other cases than CI's fixed ones."""

from __future__ import annotations

import os
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from server.fuzz_cases import bound_body, closed_schema, error_shape_problem

EXAMPLES = int(os.environ.get("KVFLOW_FUZZ_EXAMPLES", "6"))
SEED = int(os.environ.get("KVFLOW_FUZZ_SEED", "50"))
REQUEST_SECONDS = 30.0  # the most one fuzzed request may take (each generates at most 4 tokens a choice)
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


def _fuzz_operation(operation, mode: GenerationMode, base_url: str, model: str, failures: list[str]) -> int:
    """Send the operation's generated cases; each problem found is added to failures. Returns the count."""
    sent = [0]

    @seed(SEED)
    @settings(max_examples=EXAMPLES if mode == GenerationMode.POSITIVE else max(1, EXAMPLES // 2),
              deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case) -> None:
        path = operation.path
        case.body = bound_body(path, case.body, model) if case.body is not None else case.body
        sent[0] += 1
        label = f"{operation.method.upper()} {path} ({mode.value})"
        started = time.monotonic()
        try:
            response = case.call(base_url=base_url, timeout=REQUEST_SECONDS * 2)
        except Exception as exc:  # noqa: BLE001 - a refused or dropped connection is a finding too
            failures.append(f"{label}: no answer ({exc!r}) to {_shown(case.body)}")
            return
        took = time.monotonic() - started
        if took > REQUEST_SECONDS:
            failures.append(f"{label}: {took:.1f} s (bound {REQUEST_SECONDS} s) for {_shown(case.body)}")
        if 400 <= response.status_code < 500:
            problem = error_shape_problem(path, response.status_code, response.text)
            if problem:
                failures.append(f"{label}: {problem} for {_shown(case.body)}")
        try:
            case.validate_response(response, checks=CHECKS)
        except FailureGroup as group:
            for exc in group.exceptions:
                failures.append(f"{label}: {type(exc).__name__}: {str(exc)[:400]} ({response.status_code}: "
                                f"{response.text[:300]!r}) for {_shown(case.body)}")

    run()
    return sent[0]


def _shown(body) -> str:
    text = repr(body)
    return text if len(text) < 600 else text[:600] + "..."


def _engine_gauges(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    wanted = ("kvflow:num_requests_running", "kvflow:num_requests_waiting", "kvflow:kv_cache_blocks_used")
    gauges = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in wanted:
            gauges[name] = float(value)
    return gauges


def test_every_wire_api_survives_fuzzing(default_server):
    base_url = default_server.base_url
    doc = httpx.get(f"{base_url}/openapi.json", timeout=10).json()
    model = httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["id"]
    schema = schemathesis.openapi.from_dict(closed_schema(doc))
    failures: list[str] = []
    sent: dict[str, int] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.path == "/metrics":  # Prometheus text, described as such; nothing to generate
            continue
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if operation.body else [])
        for mode in modes:
            key = f"{operation.method.upper()} {operation.path} {mode.value}"
            sent[key] = _fuzz_operation(operation, mode, base_url, model, failures)
    assert sum(sent.values()) >= 10 * EXAMPLES, sent  # the fuzzing did reach the routes
    assert not failures, f"{len(failures)} problems:\n" + "\n".join(dict.fromkeys(failures))

    # The server still chats...
    answer = httpx.post(f"{base_url}/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8})
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"]
    # ...and every request the fuzzing made has left the engine, its KV blocks with it.
    deadline = time.monotonic() + 20
    while (gauges := _engine_gauges(base_url)) and any(gauges.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert gauges == {"kvflow:num_requests_running": 0.0, "kvflow:num_requests_waiting": 0.0,
                      "kvflow:kv_cache_blocks_used": 0.0}, gauges


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses",
                                  "/v1/messages/count_tokens", "/api/chat", "/api/generate", "/tokenize",
                                  "/detokenize"])
def test_openapi_documents_the_real_body_and_errors(default_server, path):
    doc = httpx.get(f"{default_server.base_url}/openapi.json", timeout=10).json()
    operation = doc["paths"][path]["post"]
    ref = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    body = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert len(body["properties"]) >= 2  # the route's pydantic model, not an empty object
    for status in ("200", "400", "404", "413", "415", "503"):
        assert status in operation["responses"], (path, status)
    assert "422" not in operation["responses"]  # FastAPI's own, which kvflow answers with a 400
    error = operation["responses"]["400"]["content"]["application/json"]["schema"]
    assert ("error" in error["required"]) and (("type" in error["required"]) == path.startswith("/v1/messages"))
