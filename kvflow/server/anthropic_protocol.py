"""Anthropic Messages API request bodies (POST /v1/messages), translated into a chat completion request so
that tools and sampling behave as on /v1/chat/completions. Content blocks: text, tool_use and
tool_result (images are refused); `cache_control`, `metadata`, `thinking` and the like change nothing here
and are accepted."""

from __future__ import annotations

import json
from typing import Any, Literal

from kvflow.server.errors import bad_request
from kvflow.server.protocol import ChatCompletionRequest, Lenient


class Block(Lenient):
    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool | None = None


class AnthropicMessage(Lenient):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(Lenient):
    name: str
    description: str | None = None
    input_schema: dict | None = None


class AnthropicToolChoice(Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(Lenient):

    model: str | None = None
    max_tokens: int
    messages: list[AnthropicMessage]
    system: str | list[Block] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    metadata: dict | None = None
    thinking: dict | None = None
    service_tier: str | None = None

    def as_chat(self) -> ChatCompletionRequest:
        body: dict[str, Any] = {"messages": self._messages(), "max_tokens": self.max_tokens}
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.stop_sequences:
            body["stop"] = self.stop_sequences
        if self.tools:
            body["tools"] = [{"type": "function", "function": {
                "name": t.name, **({"description": t.description} if t.description else {}),
                "parameters": t.input_schema or {"type": "object"}}} for t in self.tools]
        choice = self.tool_choice
        if choice is not None:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type)
            if choice.type == "tool":
                if not choice.name:
                    raise bad_request("tool_choice of type tool needs a name", "tool_choice.name")
                body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
            if choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
        return ChatCompletionRequest.model_validate(body)

    def _messages(self) -> list[dict]:
        messages: list[dict] = []
        if self.system:
            messages.append({"role": "system", "content": _text(self.system)})
        for i, m in enumerate(self.messages):
            if isinstance(m.content, str):
                messages.append({"role": m.role, "content": m.content})
                continue
            text, calls = [], []
            for j, block in enumerate(m.content):
                if block.type == "text":
                    text.append(block.text or "")
                elif block.type == "tool_use" and m.role == "assistant":
                    calls.append({"id": block.id, "type": "function", "function": {
                        "name": block.name or "", "arguments": json.dumps(block.input or {}, ensure_ascii=False)}})
                elif block.type == "tool_result" and m.role == "user":
                    messages.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                     "content": _text(block.content)})
                elif block.type in ("thinking", "redacted_thinking"):
                    continue  # earlier thinking is not replayed
                else:
                    raise bad_request(f"content blocks of type {block.type!r} are not supported here",
                                      f"messages.{i}.content.{j}.type")
            if text or calls or m.role == "assistant":
                message: dict[str, Any] = {"role": m.role, "content": "".join(text)}
                if calls:
                    message["tool_calls"] = calls
                messages.append(message)
        return messages


def _text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(block.text or "" for block in content if block.type == "text")
