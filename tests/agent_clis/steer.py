"""Steering, done by the test proxy only: the default model never chooses a tool under tool_choice "auto", so
the first request that offers the client's tool is rewritten to name that tool (tool_choice) and to pin
its arguments (the tool's schema shown to the model allows only the given values; kvflow's structured
output holds the call to it). The client then runs its own tool for real and sends the result back.

The three wire APIs' shapes: chat completions (`{"type": "function", "function": {name, parameters}}`),
Responses (`{"type": "function", name, parameters}`, possibly inside a `namespace` entry's `tools`) and
Anthropic Messages (`{name, input_schema}`)."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable

from agent_clis.proxy import Exchange


def pinned_schema(schema: dict, arguments: dict[str, str]) -> dict:
    properties = schema.get("properties") or {}
    missing = [name for name in arguments if name not in properties]
    assert not missing, f"the tool has no argument {missing}: its arguments are {sorted(properties)}"
    return {"type": "object", "additionalProperties": False, "required": sorted(arguments),
            "properties": {name: {**properties[name], "type": "string", "enum": [value]}
                           for name, value in arguments.items()}}


def _tools(body: dict, api: str) -> list[dict]:
    """Every tool definition in the body (Responses: namespace entries opened)."""
    found = []
    for tool in body.get("tools") or []:
        if api == "responses" and tool.get("type") == "namespace":
            found += [t for t in tool.get("tools") or [] if isinstance(t, dict)]
        elif isinstance(tool, dict):
            found.append(tool)
    return found


def _name(tool: dict, api: str) -> str | None:
    return (tool.get("function") or {}).get("name") if api == "chat" else tool.get("name")


def steer_to(tool_name: str, arguments: dict[str, str]) -> Callable[[Exchange], tuple[dict, bool] | None]:
    """A steer function for AgentProxy: the first request offering `tool_name` is made to call it with
    `arguments` (returned with True: forced); later requests offering it get the same pinned definition,
    and no forced choice (False), so that their prompts start as the forced one's did and the prefix cache
    serves them as it would the client's own (the definitions are part of the prompt)."""
    forced: list[str] = []

    def steer(exchange: Exchange) -> tuple[dict, bool] | None:
        if exchange.body is None:
            return None
        body = copy.deepcopy(exchange.body)
        api = exchange.api
        matches = [t for t in _tools(body, api) if _name(t, api) == tool_name]
        if not matches:
            return None
        tool = matches[0]
        if api == "chat":
            tool["function"]["parameters"] = pinned_schema(tool["function"].get("parameters") or {}, arguments)
        elif api == "responses":
            tool["parameters"] = pinned_schema(tool.get("parameters") or {}, arguments)
        else:
            tool["input_schema"] = pinned_schema(tool.get("input_schema") or {}, arguments)
        if forced:
            return body, False
        body["tool_choice"] = ({"type": "function", "function": {"name": tool_name}} if api == "chat" else
                               {"type": "function", "name": tool_name} if api == "responses" else
                               {"type": "tool", "name": tool_name})
        forced.append(exchange.request_id)
        return body, True

    return steer


def tool_results(exchange: Exchange) -> list[str]:
    """The tool results a request sends back to the model, as text: chat `tool` messages, Responses
    `function_call_output` items, Anthropic `tool_result` blocks."""
    body = exchange.body or {}
    results: list = []
    if exchange.api == "chat":
        results = [m.get("content") for m in body.get("messages") or [] if m.get("role") == "tool"]
    elif exchange.api == "responses":
        items = body.get("input") if isinstance(body.get("input"), list) else []
        results = [i.get("output") for i in items if isinstance(i, dict) and i.get("type") == "function_call_output"]
    else:
        for message in body.get("messages") or []:
            content = message.get("content")
            if isinstance(content, list):
                results += [b.get("content") for b in content if isinstance(b, dict) and b.get("type") == "tool_result"]
    return [r if isinstance(r, str) else json.dumps(r) for r in results]
