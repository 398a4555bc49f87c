"""What one request may cost: asks past the bounds are refused at once with a 400 naming the field (n above
--max-n, too many prompts, logprobs past 20, too many or too long stop strings), never queued; the engine
holds nothing afterwards."""

from __future__ import annotations

import time

import httpx
import pytest

from kvflow.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS
from kvflow.server.serving import DEFAULT_MAX_N, MAX_PROMPTS

REFUSED_WITHIN_S = 5.0
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

# (route, body, the field the 400 names)
TOO_COSTLY = [
    ("/v1/chat/completions", {**CHAT, "n": 1_000_000}, "n"),
    ("/v1/chat/completions", {**CHAT, "n": DEFAULT_MAX_N + 1}, "n"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": 10**9}, "n"),
    ("/v1/completions", {"prompt": [[1]] * (MAX_PROMPTS + 1), "max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "logprobs": 10**6}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]},
     "stop"),
    ("/v1/chat/completions", {**CHAT, "stop": ["x" * (MAX_STOP_CHARS + 1)]}, "stop"),
]


@pytest.mark.parametrize(("path", "body", "param"), TOO_COSTLY,
                         ids=[f"{p}-{f}-{i}" for i, (p, _, f) in enumerate(TOO_COSTLY)])
def test_a_costly_ask_is_refused_at_once_naming_the_field(default_server, path, body, param):
    started = time.monotonic()
    response = httpx.post(default_server.base_url + path, json=body, timeout=60)
    took = time.monotonic() - started
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text
    assert took < REFUSED_WITHIN_S, f"refusing took {took:.1f} s"


def test_anthropic_and_ollama_stop_lists_are_bounded_too(default_server):
    many = [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]
    messages = httpx.post(default_server.base_url + "/v1/messages", timeout=60, json={
        "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "stop_sequences": many})
    assert messages.status_code == 400 and messages.json()["type"] == "error", messages.text
    ollama = httpx.post(default_server.base_url + "/api/chat", timeout=60, json={
        "model": "smollm2-135m", "stream": False, "messages": [{"role": "user", "content": "hi"}],
        "options": {"num_predict": 2, "stop": many}})
    assert ollama.status_code == 400 and "stop" in ollama.json()["error"], ollama.text


def test_the_limits_leave_the_engine_empty(default_server):
    for path, body, _ in TOO_COSTLY[:4]:
        httpx.post(default_server.base_url + path, json=body, timeout=60)
    assert default_server.metric("kvflow:num_requests_waiting") == 0
    assert default_server.metric("kvflow:num_requests_running") == 0


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/api/chat"])
def test_json_nested_past_the_recursion_limit_is_a_400(default_server, path):
    """json.loads raises RecursionError (not a JSONDecodeError) on a few kB of brackets: that was a 500."""
    deep = '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}"
    response = httpx.post(default_server.base_url + path, content=deep, timeout=60,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert "nested too deeply" in response.text
