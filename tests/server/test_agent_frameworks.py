"""Real agent frameworks driven against `kvflow serve` unchanged: the OpenAI Agents SDK (two function tools
and a structured final output, over chat completions and over the Responses API), LangChain's ChatOpenAI
(bind_tools, with_structured_output) and the anthropic client (messages.create with tools, messages.stream).
The default model is small: the tests check that each loop runs and every call and output is well formed."""

from __future__ import annotations

import asyncio

import agents
import anthropic
import pytest
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from openai import AsyncOpenAI
from pydantic import BaseModel

from server.conftest import DEFAULT_NAME


class Report(BaseModel):
    city: str
    summary: str


def _agent(model, calls: list[str]):
    # Each tool serves once (is_enabled turns them off after a call): a model this small, shown a tool
    # result, calls the same tool again rather than answer.
    def unused(context, agent) -> bool:
        return not calls

    @agents.function_tool(is_enabled=unused)
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(f"weather:{city}")
        return f"Sunny and 18 degrees in {city}."

    @agents.function_tool(is_enabled=unused)
    def get_local_time(city: str) -> str:
        """The local time in a city."""
        calls.append(f"time:{city}")
        return f"It is 10:00 in {city}."

    settings = agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=160)
    return agents.Agent(name="weather", instructions="Answer questions about cities; use the tools.",
                        tools=[get_weather, get_local_time], output_type=Report, model=model, model_settings=settings)


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_openai_agents_sdk_runs_a_tool_loop_to_a_structured_answer(agent_server, api):
    agents.set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=f"{agent_server.base_url}/v1", api_key="unused", max_retries=0)
    model_class = agents.OpenAIChatCompletionsModel if api == "chat_completions" else agents.OpenAIResponsesModel
    calls: list[str] = []
    agent = _agent(model_class(model=DEFAULT_NAME, openai_client=client), calls)
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris right now?", max_turns=8))
    assert calls, "the first turn must call a tool (tool_choice required)"
    assert isinstance(result.final_output, Report)


def test_langchain_bind_tools_and_structured_output(agent_server):
    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return "sunny"

    llm = ChatOpenAI(base_url=f"{agent_server.base_url}/v1", api_key="unused", model=DEFAULT_NAME,
                                      temperature=0, max_tokens=120, max_retries=0)
    message = llm.bind_tools([get_weather], tool_choice="required").invoke("What is the weather in Paris?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    assert isinstance(message.tool_calls[0]["args"].get("city"), str)
    report = llm.with_structured_output(Report).invoke("Describe the weather in Rome.")
    assert isinstance(report, Report)


def test_anthropic_client_tools_and_stream(agent_server):
    client = anthropic.Anthropic(base_url=agent_server.base_url, api_key="unused", max_retries=0)
    tools = [{"name": "get_weather", "description": "The current weather in a city.",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    question = {"role": "user", "content": "What is the weather in Paris?"}
    first = client.messages.create(model=DEFAULT_NAME, max_tokens=80, tools=tools, messages=[question],
                                   tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"temperature": 0})
    uses = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and uses and isinstance(uses[0].input["city"], str)
    follow = [question, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "Sunny, 18C"}]}]
    answer = client.messages.create(model=DEFAULT_NAME, max_tokens=30, tools=tools, messages=follow,
                                    extra_body={"temperature": 0})
    assert answer.role == "assistant" and answer.content and answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    with client.messages.stream(model=DEFAULT_NAME, max_tokens=20, messages=[{"role": "user", "content": "Say hi."}],
                                extra_body={"temperature": 0}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text and final.usage.output_tokens > 0
    with client.messages.stream(model=DEFAULT_NAME, max_tokens=80, tools=tools, messages=[question],
                                tool_choice={"type": "any"}, extra_body={"temperature": 0}) as stream:
        streamed = stream.get_final_message()
    assert [b.type for b in streamed.content][0] == "tool_use" and streamed.content[0].name == "get_weather"
    with pytest.raises(anthropic.BadRequestError, match="image"):
        client.messages.create(model=DEFAULT_NAME, max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}])
