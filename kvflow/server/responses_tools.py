"""The Responses API's tools, as the chat pipeline takes them, and their calls, as Responses clients expect
them back.

- `function` tools are chat's function tools.
- `custom` (freeform) tools are chat's custom tools (custom_tools.py): their input may be held to a Lark
  grammar or a regex; their calls come back as `custom_tool_call` items.
- A `namespace` groups function and custom tools (Codex sends its MCP servers' tools so). The model sees
  each under the flat name Codex itself uses where a boundary cannot keep the split, `namespace` without
  its trailing underscores, `__`, then `name` (`mcp__docs__` and `search`: `mcp__docs__search`); its calls
  come back split again, with `name` and `namespace` (what Codex routes on).
- Hosted tools, which OpenAI runs on its side (web_search, file_search, computer_use_preview,
  image_generation, code_interpreter, mcp, local_shell...), and any other type: kvflow cannot run them, so
  they are left out of the prompt rather than refused (Codex offers web_search by default).

`tool_choice` follows: a named function (with its namespace) or custom tool, `allowed_tools` (the tools
offered are cut to those), and a hosted tool's choice, which becomes "auto"."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvflow.server.custom_tools import CustomFormat
from kvflow.server.errors import bad_request
from kvflow.server.protocol import Lenient

log = logging.getLogger("kvflow")
_OFFERED = ("function", "custom")


class ResponsesTool(Lenient):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None
    format: CustomFormat | None = None  # a custom tool's
    tools: list[ResponsesTool] | None = None  # a namespace's


@dataclass(frozen=True)
class ToolName:
    name: str
    namespace: str | None = None
    custom: bool = False


def flat_name(namespace: str | None, name: str) -> str:
    """The name the model sees for `name` in `namespace` (Codex's own flattening)."""
    return name if not namespace else f"{namespace.rstrip('_')}__{name.lstrip('_')}"


class ToolBook:
    """The request's tools as chat tools (`chat_tools`), and what each flat name stands for."""

    def __init__(self, tools: list[ResponsesTool] | None) -> None:
        self.chat_tools: list[dict] = []
        self.names: dict[str, ToolName] = {}
        for i, tool in enumerate(tools or []):
            if tool.type == "namespace":
                namespace = _named(tool, f"tools.{i}")
                if tool.tools is None:
                    raise bad_request("a namespace needs its tools", f"tools.{i}.tools")
                for j, inner in enumerate(tool.tools):
                    self._add(inner, f"tools.{i}.tools.{j}", namespace)
            else:
                self._add(tool, f"tools.{i}", None)

    def _add(self, tool: ResponsesTool, path: str, namespace: str | None) -> None:
        if tool.type not in _OFFERED:
            log.debug("leaving out a tool of type %r (kvflow cannot run it)", tool.type)
            return
        name = _named(tool, path)
        flat = flat_name(namespace, name)
        self.names[flat] = ToolName(name, namespace, tool.type == "custom")
        if tool.type == "custom":
            custom = {"name": flat, "description": tool.description,
                      "format": tool.format.model_dump(exclude_none=True) if tool.format else None}
            self.chat_tools.append({"type": "custom", "custom": {k: v for k, v in custom.items() if v is not None}})
        else:
            function = {"name": flat, "description": tool.description, "parameters": tool.parameters,
                        "strict": tool.strict}
            self.chat_tools.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})

    def split(self, flat: str) -> ToolName:
        """What a call of the flat name `flat` calls (a name the model made up: a plain function)."""
        return self.names.get(flat, ToolName(flat))

    def chat_choice(self, choice: str | dict | None) -> tuple[str | dict | None, list[dict]]:
        """The chat request's tool_choice and tools for the Responses tool_choice `choice`."""
        if not isinstance(choice, dict):
            return choice, self.chat_tools
        kind = choice.get("type")
        if kind in _OFFERED:
            if not isinstance(choice.get("name"), str):
                raise bad_request(f'a tool_choice of type "{kind}" needs a name', "tool_choice.name")
            flat = flat_name(choice.get("namespace"), choice["name"])
            return {"type": kind, kind: {"name": flat}}, self.chat_tools
        if kind == "allowed_tools":
            listed = choice.get("tools")
            if choice.get("mode") not in ("auto", "required") or not isinstance(listed, list):
                raise bad_request('allowed_tools needs a mode ("auto" or "required") and a list of tools',
                                  "tool_choice")
            allowed = {flat_name(t.get("namespace"), t.get("name") or "") for t in listed if isinstance(t, dict)}
            tools = [t for t in self.chat_tools if t[t["type"]]["name"] in allowed]
            return choice["mode"] if tools else "none", tools
        if isinstance(kind, str):  # a hosted tool's choice: that tool is not offered
            return "auto", self.chat_tools
        raise bad_request('tool_choice must be "none", "auto", "required" or an object with a type', "tool_choice")


def _named(tool: ResponsesTool, path: str) -> str:
    if not tool.name:
        raise bad_request(f"a tool of type {tool.type!r} needs a name", f"{path}.name")
    return tool.name
