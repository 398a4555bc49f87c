"""Anthropic Messages API request bodies (POST /v1/messages and /v1/messages/count_tokens), translated into a
chat completion request so that tools and sampling behave as on /v1/chat/completions.

What Claude Code sends is accepted: `system`-role messages inside `messages` (they join the system prompt),
`cache_control` on any block, `metadata`, `thinking` of any type, `context_management`, and `output_config`
(its `format` holds the answer to a JSON schema, as response_format does; its `effort` is gpt-oss's reasoning
effort). Content blocks: text, tool_use and tool_result (string or list content); earlier thinking is not
replayed; images and documents are refused by name (the models are text-only); block types kvflow does not
know are left out. Tools of Anthropic's own (web search, code execution, bash_..., text_editor_...: any
`type` but "custom") have no schema to offer the model and are left out of the prompt."""

from __future__ import annotations

import json
import logging
from typing import Any, Literal

from pydantic import ConfigDict, Field

from kvflow.server.errors import bad_request
from kvflow.server.protocol import ChatCompletionRequest, Lenient
from kvflow.server.serving import validate_as

log = logging.getLogger("kvflow")
_TEXT_ONLY = ("image", "document")  # blocks a text-only model cannot read: refused by name


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
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class AnthropicTool(Lenient):
    type: str | None = None  # None or "custom": a tool of the client's, described by its input_schema
    name: str
    description: str | None = None
    input_schema: dict | None = None

    @property
    def is_custom(self) -> bool:
        return self.type in (None, "custom")


class AnthropicToolChoice(Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class OutputFormat(Lenient):
    model_config = ConfigDict(extra="allow", populate_by_name=True)  # Lenient's, and the alias below by name
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")  # `schema` would shadow pydantic's own method


class OutputConfig(Lenient):
    effort: str | None = None
    format: OutputFormat | None = None


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
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # the structured-outputs beta's spelling of output_config.format

    def as_chat(self) -> ChatCompletionRequest:
        body: dict[str, Any] = {"messages": self._messages(), "max_tokens": self.max_tokens}
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.stop_sequences:
            body["stop"] = self.stop_sequences
        tools = [t for t in self.tools or [] if t.is_custom]
        if len(tools) < len(self.tools or []):
            log.debug("leaving out tools of Anthropic's own: %s", [t.type for t in self.tools or [] if not t.is_custom])
        if tools:
            body["tools"] = [{"type": "function", "function": {
                "name": t.name, **({"description": t.description} if t.description else {}),
                "parameters": t.input_schema or {"type": "object"}}} for t in tools]
        choice = self.tool_choice
        if choice is not None:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type)
            if choice.type == "tool":
                if not choice.name:
                    raise bad_request("tool_choice of type tool needs a name", "tool_choice.name")
                body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
            if choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
        config = self.output_config or OutputConfig()
        fmt = config.format or self.output_format
        if fmt is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}
        if config.effort in ("low", "medium", "high"):  # gpt-oss's template takes it
            body["reasoning_effort"] = config.effort
        return validate_as(ChatCompletionRequest, body)

    def _messages(self) -> list[dict]:
        system = [_text(self.system, "system")] if self.system else []
        messages: list[dict] = []
        for i, m in enumerate(self.messages):
            if m.role == "system":  # Claude Code sends some of its instructions so: they join the system prompt
                system.append(_text(m.content, f"messages.{i}.content"))
                continue
            if isinstance(m.content, str):
                messages.append({"role": m.role, "content": m.content})
                continue
            text, calls = [], []
            for j, block in enumerate(m.content):
                path = f"messages.{i}.content.{j}"
                if block.type == "text":
                    text.append(block.text or "")
                elif block.type == "tool_use" and m.role == "assistant":
                    calls.append({"id": block.id, "type": "function", "function": {
                        "name": block.name or "", "arguments": json.dumps(block.input or {}, ensure_ascii=False)}})
                elif block.type == "tool_result" and m.role == "user":
                    messages.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                     "content": _text(block.content, f"{path}.content")})
                elif block.type in ("tool_use", "tool_result"):
                    raise bad_request(f"a {block.type} block cannot be in a message of the {m.role}", f"{path}.type")
                else:
                    _check_readable(block, path)  # earlier thinking is not replayed; unknown blocks left out
            if text or calls or m.role == "assistant":
                message: dict[str, Any] = {"role": m.role, "content": "".join(text)}
                if calls:
                    message["tool_calls"] = calls
                messages.append(message)
        if system:
            messages.insert(0, {"role": "system", "content": "\n\n".join(s for s in system if s)})
        return messages


class CountTokensRequest(MessagesRequest):
    """POST /v1/messages/count_tokens: a Messages request without max_tokens."""

    max_tokens: int | None = None  # type: ignore[assignment]


def _check_readable(block: Block, path: str) -> None:
    """A 400 naming a block a text-only model cannot read; other blocks that carry no text are left out."""
    if block.type in _TEXT_ONLY:
        raise bad_request(f"content blocks of type {block.type!r} are not supported: this model reads text only",
                          path, "unsupported_content")
    if block.type not in ("thinking", "redacted_thinking"):
        log.debug("leaving out a content block of type %r", block.type)


def _text(content: str | list[Block] | None, path: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for k, block in enumerate(content):
        if block.type == "text":
            parts.append(block.text or "")
        else:
            _check_readable(block, f"{path}.{k}")
    return "".join(parts)
