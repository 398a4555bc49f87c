"""OpenAI Responses API request bodies (POST /v1/responses), and their translation into a chat completion
request, so that tools, structured output and sampling behave exactly as on /v1/chat/completions.

Stateless: `previous_response_id` and `store: true` are refused (kvflow keeps no responses); `reasoning`,
`include`, `truncation`, `metadata` and the like are accepted as they change nothing here."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from kvflow.server.errors import bad_request
from kvflow.server.protocol import ChatCompletionRequest, Lenient


class InputContent(Lenient):
    type: str
    text: str | None = None


class InputItem(Lenient):
    """A message, a function call the model made earlier, or that call's output (by call_id)."""

    type: str = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[InputContent] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputContent] | None = None


class FunctionTool(Lenient):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


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
    tools: list[FunctionTool] | None = None
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

    def as_chat(self) -> ChatCompletionRequest:
        if self.previous_response_id:
            raise bad_request("previous_response_id is not supported: kvflow keeps no responses; send the "
                              "whole conversation as input", "previous_response_id", "unsupported_parameter")
        if self.store:
            raise bad_request("store is not supported: kvflow keeps no responses", "store", "unsupported_parameter")
        body: dict[str, Any] = {"messages": self._messages(), "max_tokens": self.max_output_tokens}
        for name in ("temperature", "top_p", "parallel_tool_calls", "seed"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(include={"name", "description", "parameters",
                                                                                  "strict"}, exclude_none=True)}
                             for t in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        effort = (self.reasoning or {}).get("effort")
        if effort in ("low", "medium", "high"):  # gpt-oss's template takes it
            body["reasoning_effort"] = effort
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type != "text":
            schema = fmt.schema_ if fmt.type == "json_schema" else None
            body["response_format"] = ({"type": "json_object"} if schema is None else
                                       {"type": "json_schema", "json_schema": {"name": fmt.name or "output",
                                                                               "schema": schema}})
        return ChatCompletionRequest.model_validate(body)

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
            elif item.type == "function_call":
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name or "", "arguments": item.arguments or "{}"}}
                if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                    messages[-1]["tool_calls"].append(call)  # parallel calls of one turn
                else:
                    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif item.type == "function_call_output":
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
            elif item.type == "reasoning":
                continue  # kvflow's earlier reasoning is not replayed
            else:
                raise bad_request(f"input items of type {item.type!r} are not supported", f"input.{i}.type")
        return messages


def _text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.text or "" for part in content if part.type in ("input_text", "output_text", "text"))


def _chat_tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, dict):
        if choice.get("type") == "function" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
        raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
                          "tool_choice")
    return choice

