"""The Responses API (POST /v1/responses) through the official openai client: text, structured text.format,
function calls and their outputs sent back as input items, the typed stream events in order with
sequence numbers, and the stateless refusals."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from openai import OpenAI

from server.conftest import DEFAULT_NAME
from server.test_errors import assert_still_serves, post

TOOLS = [{"type": "function", "name": "get_weather", "description": "The current weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


@pytest.fixture(scope="module")
def client(agent_server) -> OpenAI:
    return OpenAI(base_url=f"{agent_server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_text_answer_and_usage(client):
    r = client.responses.create(model=DEFAULT_NAME, input="What is the capital of France?", max_output_tokens=20,
                                temperature=0, instructions="Answer briefly.")
    assert r.status in ("completed", "incomplete") and r.output_text and r.id.startswith("resp_")
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0 and r.instructions == "Answer briefly."


def test_structured_text_format(client):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.responses.create(model=DEFAULT_NAME, input="Describe Alice, who is 30.", max_output_tokens=80,
                                temperature=0, text={"format": {"type": "json_schema", "name": "person",
                                                                "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)


def test_function_calls_and_their_outputs(client):
    r = client.responses.create(model=DEFAULT_NAME, input="Weather in Paris?", tools=TOOLS, tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=80, temperature=0)
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), TOOLS[0]["parameters"])
    follow = client.responses.create(model=DEFAULT_NAME, tools=TOOLS, max_output_tokens=20, temperature=0, input=[
        {"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 18C"}])
    assert follow.output_text or any(item.type == "function_call" for item in follow.output)


def test_stream_events_in_order(client):
    events = list(client.responses.create(model=DEFAULT_NAME, input="Say hello.", max_output_tokens=16,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert text and done.text == text and events[-1].response.output[0].content[0].text == text
    calls = list(client.responses.create(model=DEFAULT_NAME, input="Weather in Paris?", tools=TOOLS, stream=True,
                                         tool_choice="required", parallel_tool_calls=False, max_output_tokens=80,
                                         temperature=0))
    kinds = [e.type for e in calls]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    args = next(e for e in calls if e.type == "response.function_call_arguments.done").arguments
    jsonschema.validate(json.loads(args), TOOLS[0]["parameters"])


def test_stateless_refusals(agent_server, client):
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model=DEFAULT_NAME, input="hi", previous_response_id="resp_123")
    # an item kvflow cannot read is left out (test_codex_wire.py), which here leaves nothing to answer
    r = post(agent_server, "/v1/responses", {"input": [{"type": "computer_call", "id": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    assert httpx.get(f"{agent_server.base_url}/openapi.json").json()["paths"]["/v1/responses"]
    assert_still_serves(agent_server)
