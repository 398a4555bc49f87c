"""Tool parameters that refer to their own definitions (`$defs`, or draft-07's `definitions`), as the schemas
Pydantic generates do, under tool_choice "required" or a named function: the call's grammar nests the
parameters inside the call object, so the definitions move to its root, where the references find them.
On the tiny random model, whose output the grammar alone shapes into a valid call."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Berlin", "Paris"]}},
        "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"place": {"$ref": "#/$defs/Place"}}, "required": ["place"],
    "$defs": {"Place": CITY}}}}
# Another tool with a definition of the same name but another schema, and a nested reference.
TRIP = {"type": "function", "function": {"name": "trip", "parameters": {
    "type": "object", "properties": {"legs": {"type": "array", "items": {"$ref": "#/definitions/Place"},
                                              "minItems": 1, "maxItems": 2}},
    "required": ["legs"],
    "definitions": {"Place": {"type": "object", "properties": {"stop": {"$ref": "#/definitions/Stop"}},
                              "required": ["stop"]},
                    "Stop": {"type": "integer", "minimum": 1, "maximum": 9}}}}}


def _chat(server, **body) -> httpx.Response:
    body = {"model": "tiny-llama", "max_tokens": 200, "temperature": 0,
            "messages": [{"role": "user", "content": "Weather in Berlin?"}], **body}
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)


@pytest.mark.parametrize("tool_choice, tools, name", [
    ("required", [WEATHER], "weather"),
    ({"type": "function", "function": {"name": "weather"}}, [WEATHER, TRIP], "weather"),
    ({"type": "function", "function": {"name": "trip"}}, [WEATHER, TRIP], "trip"),
    ("required", [WEATHER, TRIP], None),
])
def test_references_to_definitions_resolve(tiny_server, tool_choice, tools, name):
    r = _chat(tiny_server, tools=tools, tool_choice=tool_choice, parallel_tool_calls=False)
    assert r.status_code == 200, r.text
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert len(calls) == 1
    called = calls[0]["function"]["name"]
    assert name is None or called == name
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == called)
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), schema)


def test_the_issues_request(tiny_server):
    """Issue 51's own body: a reference to an object with no properties."""
    tool = {"type": "function", "function": {"name": "w", "parameters": {
        "type": "object", "properties": {"o": {"$ref": "#/$defs/O"}}, "$defs": {"O": {"type": "object"}}}}}
    r = _chat(tiny_server, max_tokens=60, tools=[tool], tool_choice="required")
    assert r.status_code == 200, r.text  # was: 400 invalid grammar ... Pointer '/$defs/O' does not exist
    (call,) = r.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "w"
    jsonschema.validate(json.loads(call["function"]["arguments"]), tool["function"]["parameters"])
