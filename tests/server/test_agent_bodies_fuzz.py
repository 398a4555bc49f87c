"""Bad input, as a property: the agents' own request bodies (agent_bodies.py) on each of the four wire APIs,
with one field dropped, duplicated, mistyped or oversized anywhere in them, never get a 5xx; a refusal of a
dropped or mistyped field names it (a key on its path); and the server keeps serving."""

from __future__ import annotations

import json
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import TINY_NAME

from server.agent_bodies import AGENT_BODIES
from server.test_errors import assert_still_serves

Path = tuple[str | int, ...]
# Values of every JSON type: a mistyped field gets one of another type.
VALUES: list[Any] = [None, True, 7, -1, 2.5, "x", [], {}, [1, "a"], {"a": 1}]
BUDGETS = {"max_tokens", "max_output_tokens", "max_completion_tokens", "num_predict"}  # not made huge
HEADERS = {"Content-Type": "application/json", "anthropic-version": "2023-06-01"}


def _paths(value: Any, prefix: Path = ()) -> list[Path]:
    found: list[Path] = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else []
    for key, child in items:
        found.append((*prefix, key))
        found += _paths(child, (*prefix, key))
    return found


def _parent(body: Any, path: Path) -> Any:
    for key in path[:-1]:
        body = body[key]
    return body


def _same_type(a: Any, b: Any) -> bool:
    kinds = (bool, (int, float), str, list, dict, type(None))
    return any(isinstance(a, k) and isinstance(b, k) for k in kinds)


def _encode(value: Any, duplicate: Path | None, at: Path = ()) -> str:
    """JSON text; the key at `duplicate` written twice."""
    if isinstance(value, dict):
        pairs = [(k, v) for k, v in value.items()]
        if duplicate is not None and duplicate[:-1] == at and duplicate[-1] in value:
            pairs.append((duplicate[-1], value[duplicate[-1]]))
        return "{" + ", ".join(f"{json.dumps(k)}: {_encode(v, duplicate, (*at, k))}" for k, v in pairs) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_encode(v, duplicate, (*at, i)) for i, v in enumerate(value)) + "]"
    return json.dumps(value)


@st.composite
def mutated(draw, route: str) -> tuple[str, Path, str]:
    body = AGENT_BODIES[route](TINY_NAME)
    path = draw(st.sampled_from(_paths(body)))
    kind = draw(st.sampled_from(["drop", "duplicate", "mistype", "oversize"]))
    parent, key = _parent(body, path), path[-1]
    if kind == "drop":
        del parent[key]
    elif kind == "mistype":
        parent[key] = draw(st.sampled_from([v for v in VALUES if not _same_type(v, parent[key])]))
    elif kind == "oversize":
        value = parent[key]
        if isinstance(value, str):
            parent[key] = value + "x" * 40_000
        elif isinstance(value, list) and value:
            parent[key] = value * 200
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and key not in BUDGETS:
            parent[key] = 2**70
        else:
            parent[key] = {"deep": [[[[[[[[[[{"a": "b" * 1000}]]]]]]]]]] * 50}
    duplicate = path if kind == "duplicate" and isinstance(parent, dict) else None
    if kind == "duplicate" and isinstance(parent, list):
        parent.insert(key, parent[key])
    return kind, path, _encode(body, duplicate)


def _check(server, route: str, case: tuple[str, Path, str]) -> None:
    kind, path, text = case
    url = f"{server.base_url}{route.split('#')[0]}"
    with httpx.stream("POST", url, content=text, headers=HEADERS, timeout=60) as r:
        body = r.read().decode()
    assert r.status_code < 500, (kind, path, r.status_code, body)
    if r.status_code >= 400 and kind in ("drop", "mistype"):
        keys = [str(k) for k in path if isinstance(k, str)]
        assert any(k in body for k in keys), (kind, path, body)


SETTINGS = settings(max_examples=10, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@SETTINGS
@given(st.data())
def test_codex_bodies(tiny_server, data):
    _check(tiny_server, "/v1/responses", data.draw(mutated("/v1/responses")))


@SETTINGS
@given(st.data())
def test_claude_code_bodies(tiny_server, data):
    _check(tiny_server, "/v1/messages", data.draw(mutated("/v1/messages")))


@SETTINGS
@given(st.data())
def test_qwen_code_and_openclaw_bodies(tiny_server, data):
    route = data.draw(st.sampled_from(["/v1/chat/completions", "/v1/chat/completions#openclaw"]))
    _check(tiny_server, route, data.draw(mutated(route)))


@SETTINGS
@given(st.data())
def test_ollama_bodies(tiny_server, data):
    _check(tiny_server, "/api/chat", data.draw(mutated("/api/chat")))


def test_the_server_still_serves(tiny_server):
    assert_still_serves(tiny_server)
