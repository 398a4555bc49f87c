"""What Claude Code sends and reads on Anthropic's Messages API: HEAD /, the `?beta=true` query, system-role
messages, context_management, output_config, adaptive thinking, cache_control and tool_result blocks;
message_start's usage; /v1/messages/count_tokens; and image blocks refused by name."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from tiny_models import TINY_NAME

from server.agent_bodies import claude_code
from server.test_errors import assert_still_serves

HEADERS = {"anthropic-version": "2023-06-01", "anthropic-beta": "context-management-2025-06-27"}


@pytest.fixture(scope="module")
def client(tiny_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=tiny_server.base_url, api_key="unused", max_retries=0, timeout=60)


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, headers=HEADERS, timeout=60)


def _stream_events(server, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.base_url}/v1/messages?beta=true", json=body, headers=HEADERS,
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]


def test_head_root_answers_like_get(tiny_server):
    for accept in ("*/*", "text/html,*/*"):
        head = httpx.head(f"{tiny_server.base_url}/", headers={"Accept": accept})
        get = httpx.get(f"{tiny_server.base_url}/", headers={"Accept": accept})
        assert head.status_code == get.status_code == 200 and head.content == b""
        assert head.headers["content-type"] == get.headers["content-type"]


def test_claude_code_turn_streams_with_the_prompt_count_in_message_start(tiny_server, client):
    body = claude_code(TINY_NAME)
    events = _stream_events(tiny_server, body)
    assert [e["type"] for e in events][0] == "message_start" and events[-1]["type"] == "message_stop"
    start = events[0]["message"]["usage"]
    counted = client.messages.count_tokens(**{k: body[k] for k in ("model", "messages", "system", "tools")})
    assert start["input_tokens"] == counted.input_tokens > 0
    delta = next(e for e in events if e["type"] == "message_delta")["usage"]
    assert delta["input_tokens"] + delta["cache_read_input_tokens"] == start["input_tokens"]


def test_count_tokens_builds_the_prompt_messages_would(tiny_server, client):
    body = claude_code(TINY_NAME)

    def count(**changes) -> int:
        fields = {k: body[k] for k in ("model", "messages", "system", "tools")} | changes
        r = _post(tiny_server, "/v1/messages/count_tokens?beta=true", fields)
        assert r.status_code == 200, r.text
        assert set(r.json()) == {"input_tokens"}
        return r.json()["input_tokens"]

    whole = count()
    # The system-role message joins the system prompt: the same prompt as one system text.
    system_text = "".join(b["text"] for b in body["system"]) + "\n\nThe working directory is /repo."
    others = [m for m in body["messages"] if m["role"] != "system"]
    assert count(system=system_text, messages=others) == whole
    # Anthropic's own tools (web_search_20250305) are left out of the prompt; the client's are in it.
    assert count(tools=body["tools"][:2]) == whole and count(tools=body["tools"][:1]) < whole
    assert client.messages.count_tokens(model=TINY_NAME, messages=others).input_tokens < whole


def test_output_config_format_holds_the_answer_to_its_schema(tiny_server):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    r = _post(tiny_server, "/v1/messages", {
        "model": TINY_NAME, "max_tokens": 40, "messages": [{"role": "user", "content": "A number?"}],
        "output_config": {"effort": "low", "format": {"type": "json_schema", "schema": schema}}})
    assert r.status_code == 200, r.text
    doc = r.json()
    if doc["stop_reason"] == "end_turn":
        assert isinstance(json.loads(doc["content"][0]["text"])["n"], int)
    else:  # the budget ran out first: the text so far is still the start of such an object
        assert doc["content"][0]["text"].startswith('{"n": ')


@pytest.mark.parametrize("where, param", [
    ("message", "messages.0.content.1"), ("tool_result", "messages.2.content.0.content.1"),
    ("system_message", "messages.1.content.0"),
])
def test_image_and_document_blocks_are_refused_by_name(tiny_server, where, param):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}]},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Read", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                              "content": [{"type": "text", "text": "a picture"}]}]}]
    if where == "message":
        messages[0]["content"].append(image)
    elif where == "tool_result":
        messages[2]["content"][0]["content"].append(image)
    else:
        messages.insert(1, {"role": "system", "content": [{"type": "document", "source": {}}]})
    r = _post(tiny_server, "/v1/messages", {"model": TINY_NAME, "max_tokens": 2, "messages": messages})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"].startswith(param + ":")
    assert ("'document'" if where == "system_message" else "'image'") in error["message"]
    assert_still_serves(tiny_server)
