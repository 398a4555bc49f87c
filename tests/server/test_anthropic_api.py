"""Anthropic's Messages API (POST /v1/messages) at the HTTP level: the response and stream event shapes,
stop reasons, and errors in Anthropic's own shape (the client-level loop is in test_agent_frameworks.py)."""

from __future__ import annotations

import json

import httpx

from server.conftest import DEFAULT_NAME
from server.test_errors import assert_still_serves


def _post(server, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/messages", json={"model": DEFAULT_NAME, **body},
                      headers={"anthropic-version": "2023-06-01"}, timeout=120, **kwargs)


def test_text_reply_shape(agent_server):
    r = _post(agent_server, {"max_tokens": 12, "temperature": 0, "system": "Be brief.",
                             "messages": [{"role": "user", "content": "Name a colour."}]})
    doc = r.json()
    assert r.status_code == 200 and doc["type"] == "message" and doc["role"] == "assistant"
    assert doc["content"][0]["type"] == "text" and doc["stop_reason"] in ("end_turn", "max_tokens")
    assert doc["usage"]["input_tokens"] > 0 and doc["usage"]["output_tokens"] > 0


def test_stop_sequences_and_max_tokens(agent_server):
    doc = _post(agent_server, {"max_tokens": 3, "messages": [{"role": "user", "content": "Count to ten."}],
                               "temperature": 0}).json()
    assert doc["stop_reason"] == "max_tokens"


def test_stream_events(agent_server):
    with httpx.stream("POST", f"{agent_server.base_url}/v1/messages", timeout=120, json={
            "model": DEFAULT_NAME, "max_tokens": 12, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "Say hi."}]}) as r:
        lines = [line for line in r.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names[1] == "content_block_start" and names[-3] == "content_block_stop"
    assert set(names[2:-3]) == {"content_block_delta"}
    assert [d["type"] for d in data] == names
    assert data[-2]["delta"]["stop_reason"] in ("end_turn", "max_tokens")


def test_errors_have_anthropics_shape(agent_server):
    r = _post(agent_server, {"messages": [{"role": "user", "content": "hi"}]})  # max_tokens is required
    assert r.status_code == 400
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]
    r = _post(agent_server, {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
                             "tool_choice": {"type": "tool", "name": "nope"},
                             "tools": [{"name": "f", "input_schema": {"type": "object"}}]})
    assert r.status_code == 400 and "nope" in r.json()["error"]["message"]
    assert_still_serves(agent_server)
