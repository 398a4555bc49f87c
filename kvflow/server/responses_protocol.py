"""OpenAI Responses API request bodies (POST /v1/responses), and their translation into a chat completion
request, so that tools, structured output and sampling behave exactly as on /v1/chat/completions.

Stateless: `previous_response_id` and `store: true` are refused (kvflow keeps no responses); `reasoning`,
`include`, `truncation`, `metadata`, `client_metadata` and the like are accepted as they change nothing
here. Input items: messages; function and custom tool calls and their outputs (by call_id); earlier
reasoning and item references (kvflow keeps no items to resolve them) and item types it does not know are
left out. Tools: responses_tools.py."""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import ConfigDict, Field

from kvflow.server.custom_tools import custom_arguments
from kvflow.server.errors import bad_request
from kvflow.server.protocol import ChatCompletionRequest, Lenient
from kvflow.server.responses_tools import ResponsesTool, ToolBook, flat_name
from kvflow.server.serving import validate_as

log = logging.getLogger("kvflow")


class InputContent(Lenient):
    type: str
    text: str | None = None


class InputItem(Lenient):
    """A message, a function or custom tool call the model made earlier, or that call's output (by call_id)."""

    type: str = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[InputContent] | None = None
    call_id: str | None = None
    name: str | None = None
    namespace: str | None = None
    arguments: str | None = None  # a function call's
    input: str | None = None  # a custom tool call's
    output: str | list[InputContent] | None = None


class TextFormat(Lenient):
    model_config = ConfigDict(extra="allow", populate_by_name=True)  # Lenient's, and the alias below by name
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict | None = Field(None, alias="schema")  # `schema` would shadow pydantic's own method
    strict: bool | None = None


class TextOptions(Lenient):
    format: TextFormat | None = None


class ResponsesRequest(Lenient):

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict | None = None
    user: str | None = None
    reasoning: dict | None = None
    include: list[str] | None = None
    truncation: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    top_logprobs: int | None = None
    seed: int | None = None  # kvflow extension

    def as_chat(self) -> tuple[ChatCompletionRequest, ToolBook]:
        """The chat request, and the book of tools its calls are read back with."""
        if self.previous_response_id:
            raise bad_request("previous_response_id is not supported: kvflow keeps no responses; send the "
                              "whole conversation as input", "previous_response_id", "unsupported_parameter")
        if self.store:
            raise bad_request("store is not supported: kvflow keeps no responses", "store", "unsupported_parameter")
        messages = self._messages()
        if not messages:
            raise bad_request("the input holds no message kvflow can read", "input")
        body: dict[str, Any] = {"messages": messages, "max_tokens": self.max_output_tokens}
        for name in ("temperature", "top_p", "parallel_tool_calls", "seed"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        book = ToolBook(self.tools)
        choice, tools = book.chat_choice(self.tool_choice)
        if tools:
            body["tools"] = tools
        if choice is not None and (tools or not self.tools or choice in ("none", "auto")):
            body["tool_choice"] = choice  # (a choice that would force hosted tools only: left to "auto")
        effort = (self.reasoning or {}).get("effort")
        if effort in ("low", "medium", "high"):  # gpt-oss's template takes it
            body["reasoning_effort"] = effort
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type != "text":
            schema = fmt.schema_ if fmt.type == "json_schema" else None
            body["response_format"] = ({"type": "json_object"} if schema is None else
                                       {"type": "json_schema", "json_schema": {"name": fmt.name or "output",
                                                                               "schema": schema}})
        return validate_as(ChatCompletionRequest, body), book

    def _messages(self) -> list[dict]:
        messages: list[dict] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return messages + [{"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            if item.type == "message":
                if item.role is None:
                    raise bad_request("a message needs a role", f"input.{i}.role")
                messages.append({"role": item.role, "content": _text(item.content)})
            elif item.type in ("function_call", "custom_tool_call"):
                custom = item.type == "custom_tool_call"
                arguments = custom_arguments(item.input or "") if custom else item.arguments or "{}"
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": flat_name(item.namespace, item.name or ""), "arguments": arguments}}
                if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                    messages[-1]["tool_calls"].append(call)  # parallel calls of one turn
                else:
                    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif item.type in ("function_call_output", "custom_tool_call_output"):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
            elif item.type not in ("reasoning", "item_reference"):  # earlier reasoning is not replayed
                log.debug("leaving out an input item of type %r", item.type)
        return messages


def _text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.text or "" for part in content if part.type in ("input_text", "output_text", "text"))

