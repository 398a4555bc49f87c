"""What Codex sends and reads on the Responses API, through the official openai client: namespace tools (their
calls come back with name and namespace), custom tools held to their Lark or regex grammar (custom_tool_call
items, and their input events when streamed), hosted tools left out of the prompt, and the input items of a
turn after a tool round trip. Custom tools on chat completions come back in chat's custom shape."""

from __future__ import annotations

import json
import re

import pytest
from openai import OpenAI
from tiny_models import TINY_NAME

from server.agent_bodies import codex
from server.test_errors import assert_still_serves, post

SEARCH = {"type": "function", "name": "search", "description": "Search the docs.",
          "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 12}},
                         "required": ["query"], "additionalProperties": False}}
NAMESPACE = {"type": "namespace", "name": "mcp__docs__", "description": "The docs server.", "tools": [SEARCH]}
DATE = {"type": "custom", "name": "set_date", "description": "Set the date.",
        "format": {"type": "grammar", "syntax": "regex", "definition": "[0-9]{4}-[0-9]{2}-[0-9]{2}"}}
LS = {"type": "custom", "name": "ls", "description": "List a folder.",
      "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "ls " NAME\nNAME: /[a-z]{1,8}/'}}
HOSTED = [{"type": "web_search", "external_web_access": False}, {"type": "file_search", "vector_store_ids": ["v"]},
          {"type": "image_generation"}, {"type": "code_interpreter", "container": {"type": "auto"}},
          {"type": "mcp", "server_label": "x", "server_url": "https://example.invalid"}, {"type": "local_shell"},
          {"type": "computer_use_preview", "display_width": 1, "display_height": 1, "environment": "linux"}]


@pytest.fixture(scope="module")
def client(tiny_server) -> OpenAI:
    return OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def _ask(client, tools, tool_choice, max_output_tokens: int = 200, **kwargs):
    return client.responses.create(model=TINY_NAME, input="Go.", tools=tools, tool_choice=tool_choice,
                                   parallel_tool_calls=False, max_output_tokens=max_output_tokens, temperature=0,
                                   **kwargs)


def test_a_codex_turn_is_served_streamed_and_whole(tiny_server, client):
    body = codex(TINY_NAME)
    known = {k: v for k, v in body.items() if k != "client_metadata"}  # a field the openai client lacks
    events = list(client.responses.create(**known, extra_body={"client_metadata": body["client_metadata"]}))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    r = post(tiny_server, "/v1/responses", {**body, "stream": False})
    assert r.status_code == 200 and r.json()["usage"]["input_tokens"] > 0, r.text


def test_namespace_calls_come_back_with_name_and_namespace(client):
    r = _ask(client, [NAMESPACE, *HOSTED], {"type": "function", "namespace": "mcp__docs__", "name": "search"})
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "search" and call.namespace == "mcp__docs__" and "query" in json.loads(call.arguments)
    events = list(_ask(client, [NAMESPACE], "required", stream=True))
    done = next(e for e in events if e.type == "response.output_item.done" and e.item.type == "function_call")
    assert done.item.name == "search" and done.item.namespace == "mcp__docs__"


@pytest.mark.parametrize("tool, pattern", [(DATE, r"[0-9]{4}-[0-9]{2}-[0-9]{2}"), (LS, r"ls [a-z]{1,8}")])
def test_custom_tools_are_held_to_their_grammar(client, tool, pattern):
    r = _ask(client, [tool, SEARCH], {"type": "custom", "name": tool["name"]})
    (call,) = [item for item in r.output if item.type == "custom_tool_call"]
    assert call.name == tool["name"] and re.fullmatch(pattern, call.input), call.input
    events = list(_ask(client, [tool], "required", stream=True))
    kinds = [e.type for e in events]
    assert "response.custom_tool_call_input.delta" in kinds and "response.custom_tool_call_input.done" in kinds
    done = next(e for e in events if e.type == "response.custom_tool_call_input.done")
    item = next(e.item for e in events if e.type == "response.output_item.done")
    assert item.type == "custom_tool_call" and re.fullmatch(pattern, done.input) and item.input == done.input


def test_hosted_tools_are_left_out_of_the_prompt(client):
    plain = _ask(client, [SEARCH], "auto", max_output_tokens=1)
    hosted = _ask(client, [SEARCH, *HOSTED], {"type": "web_search"}, max_output_tokens=1)
    only_hosted = _ask(client, HOSTED, "required", max_output_tokens=1)
    nothing = client.responses.create(model=TINY_NAME, input="Go.", max_output_tokens=1)
    assert hosted.usage.input_tokens == plain.usage.input_tokens > only_hosted.usage.input_tokens
    assert only_hosted.usage.input_tokens == nothing.usage.input_tokens


def test_a_round_trips_items_reach_the_prompt(tiny_server):
    body = {**codex(TINY_NAME), "stream": False, "max_output_tokens": 1}
    whole = post(tiny_server, "/v1/responses", body).json()["usage"]["input_tokens"]
    kinds = ("function_call", "function_call_output", "custom_tool_call", "custom_tool_call_output")
    bare = {**body, "input": [item for item in body["input"] if item.get("type") not in kinds]}
    assert post(tiny_server, "/v1/responses", bare).json()["usage"]["input_tokens"] < whole
    # reasoning, item references and item types kvflow does not know are left out of the prompt
    extra = [{"type": "computer_call", "id": "c", "call_id": "c", "action": {}, "status": "completed"},
             {"type": "compaction", "encrypted_content": "opaque"}]
    more = {**body, "input": body["input"] + extra}
    assert post(tiny_server, "/v1/responses", more).json()["usage"]["input_tokens"] == whole
    r = post(tiny_server, "/v1/responses", {**body, "tools": [{"type": "function"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools.0.name"
    r = post(tiny_server, "/v1/responses", {**body, "tools": [{"type": "custom", "name": "x",
                                                              "format": {"type": "grammar", "syntax": "lark"}}]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("tools.0.format"), r.text
    assert_still_serves(tiny_server)


def test_custom_tools_on_chat_completions(tiny_server):
    tool = {"type": "custom", "custom": {"name": "set_date", "format": DATE["format"]}}
    r = post(tiny_server, "/v1/chat/completions", {
        "model": TINY_NAME, "messages": [{"role": "user", "content": "Go."}], "max_tokens": 60, "temperature": 0,
        "tools": [tool], "tool_choice": {"type": "custom", "custom": {"name": "set_date"}}})
    assert r.status_code == 200, r.text
    (call,) = r.json()["choices"][0]["message"]["tool_calls"]
    assert call["type"] == "custom" and call["custom"]["name"] == "set_date"
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", call["custom"]["input"])
