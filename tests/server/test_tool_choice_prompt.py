"""tool_choice and the prompt: under "none" the tools stay in the prompt (vLLM's default), so an agent that
alternates "none" and "auto" over the same tools reuses the prefix cache; and a JSON schema for the answer
(response_format, Anthropic output_config.format) holds the final answer, while tool_choice decides whether
calls may come first: auto, a call or that JSON; any/required, a call; none, that JSON."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest
from openai import OpenAI
from tiny_models import TINY_NAME

from server.test_errors import post

TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the repository and return its text.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string", "enum": ["setup.py", "main.py"]}},
                   "required": ["path"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "run_tests", "description": "Run the test suite, report failures.",
                                      "parameters": {"type": "object", "properties": {},
                                                     "additionalProperties": False}}}]
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"].get("parameters", {"type": "object"})} for t in TOOLS]
# Short answers either way (no free strings), so a random tiny model ends them within the budget (the tiny
# tokenizer spends about a token on two characters).
SCHEMA = {"type": "object", "properties": {"done": {"type": "boolean"}}, "required": ["done"],
          "additionalProperties": False}
BLOCK = 16  # the server's block size: the cache hits whole blocks


@pytest.fixture(scope="module")
def client(tiny_server) -> OpenAI:
    return OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def _chat(client, messages: list[dict], choice: str):
    return client.chat.completions.create(model=TINY_NAME, messages=messages, tools=TOOLS, tool_choice=choice,
                                          temperature=0, max_tokens=8)


@pytest.mark.parametrize("choice", ["none", "auto", "required"])
def test_tool_choice_none_renders_the_tools_as_auto_does(tiny_server, choice):
    messages = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "Fix it."}]
    with_tools = post(tiny_server, "/tokenize", {"messages": messages, "tools": TOOLS}).json()["tokens"]
    without = post(tiny_server, "/tokenize", {"messages": messages}).json()["tokens"]
    r = post(tiny_server, "/v1/chat/completions", {"model": TINY_NAME, "messages": messages, "tools": TOOLS,
                                                    "tool_choice": choice, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert len(with_tools) > len(without) + 50
    assert r.json()["usage"]["prompt_tokens"] == len(with_tools)


@pytest.mark.parametrize("first,second", [("none", "auto"), ("auto", "none")])
def test_alternating_none_and_auto_reuses_the_prefix_cache(client, first, second):
    """An agent's turn under one choice, then the next under the other: the second prompt's prefix (all of
    the first prompt but its last, partly filled block) comes from the cache."""
    messages = [{"role": "system", "content": f"You are agent {first}-{second}: the repository is kvflow."},
                {"role": "user", "content": "The build fails; find out why."}]
    one = _chat(client, messages, first)
    answer = one.choices[0].message
    if first == "none":  # no calls read out of the answer, whatever it says
        assert answer.tool_calls is None and one.choices[0].finish_reason in ("stop", "length")
    follow = [*messages, {"role": "assistant", "content": answer.content or ""},
              {"role": "user", "content": "Go on."}]
    two = _chat(client, follow, second)
    cached = two.usage.prompt_tokens_details.cached_tokens
    assert cached >= one.usage.prompt_tokens - 2 * BLOCK, (cached, one.usage.prompt_tokens)


def _claude(tiny_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=tiny_server.base_url, api_key="unused", max_retries=0, timeout=300)


def _messages(tiny_server, choice: dict, seed: int):
    return _claude(tiny_server).messages.create(
        model=TINY_NAME, max_tokens=120, tools=ANTHROPIC_TOOLS,
        tool_choice={**choice, "disable_parallel_tool_use": True},  # one call: a random model would go on
        messages=[{"role": "user", "content": f"Task {seed}: is the build green?"}],
        extra_body={"temperature": 1.0, "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}})


def _kinds(message) -> set[str]:
    """The kinds of answer a message holds, each checked against its schema."""
    kinds = set()
    for block in message.content:
        if block.type == "tool_use":
            tool = next(t for t in ANTHROPIC_TOOLS if t["name"] == block.name)
            jsonschema.validate(block.input, tool["input_schema"])
            kinds.add("tool_use")
        elif block.type == "text" and block.text:
            if message.stop_reason == "end_turn":
                jsonschema.validate(json.loads(block.text), SCHEMA)
            else:
                assert message.stop_reason == "max_tokens" and block.text.startswith("{")
            kinds.add("json")
    return kinds


def test_output_format_with_tools_under_each_tool_choice(tiny_server):
    """output_config.format holds the final answer; tool_choice says whether calls may come instead:
    any, a call (stop_reason tool_use); none, that JSON and never a call; auto, one or the other, never
    text that is neither (as Anthropic's structured outputs beside tools)."""
    for seed in range(2):
        forced = _messages(tiny_server, {"type": "any"}, seed)
        assert forced.stop_reason == "tool_use" and _kinds(forced) == {"tool_use"}
        answered = _messages(tiny_server, {"type": "none"}, seed)
        assert answered.stop_reason in ("end_turn", "max_tokens") and _kinds(answered) == {"json"}
    seen = set()
    for seed in range(4):
        either = _messages(tiny_server, {"type": "auto"}, seed)
        kinds = _kinds(either)
        assert kinds in ({"tool_use"}, {"json"}), kinds
        assert (either.stop_reason == "tool_use") == (kinds == {"tool_use"})
        seen |= kinds
    assert seen, "auto gave neither a call nor the JSON answer"
