"""Custom (freeform) tools, OpenAI's `{"type": "custom", "name", "description", "format"}`: a tool whose input
is free text, perhaps held to a Lark grammar (llguidance's dialect) or a regular expression. Codex declares
its apply_patch tool so.

To the model, a custom tool is a function taking one string, `input` (its grammar or regex written into the
description, the regex also as the string's pattern), so that every template and tool-call format offers
it. In kvflow's own format (hermes, tool_calls.py) a call may also be written raw, its input after a JSON
line that names the tool:

    <tool_call>
    {"name": "apply_patch"}
    *** Begin Patch
    ...
    </tool_call>

which is how a forced call is made (tool_choice required or naming it): the input is then generated under
the tool's grammar, which could not hold it inside a JSON string. Either way, the call's arguments are
`{"input": ...}`, and `custom_input` gives the input back to the APIs that return custom calls."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator

INPUT = "input"


class CustomFormat(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are ignored (serving.unknown_fields)
    type: Literal["text", "grammar"] = "text"
    syntax: Literal["lark", "regex"] | None = None
    definition: str | None = None

    @model_validator(mode="after")
    def _grammar_is_whole(self):
        if self.type == "grammar" and (self.syntax is None or not self.definition):
            raise ValueError('a format of type "grammar" needs its syntax ("lark" or "regex") and definition')
        return self


class CustomDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    format: CustomFormat | None = None

    @property
    def grammar(self) -> CustomFormat | None:
        return self.format if self.format is not None and self.format.type == "grammar" else None

    def function_view(self) -> dict:
        """The tool as a function of one string (FunctionDefinition's fields)."""
        grammar = self.grammar
        text: dict = {"type": "string"}
        note = "Its input is free text."
        if grammar is not None and grammar.syntax == "regex":
            text["pattern"] = f"^(?:{grammar.definition})$"
            note = f"Its input matches this regular expression: {grammar.definition}"
        elif grammar is not None:
            note = f"Its input follows this Lark grammar:\n{grammar.definition}"
        description = "\n\n".join(part for part in (self.description, note) if part)
        return {"name": self.name, "description": description, "parameters": {
            "type": "object", "properties": {INPUT: text}, "required": [INPUT], "additionalProperties": False}}

    def raw_call_rule(self, rule: str, open_tag: str, close_tag: str) -> list[str]:
        """Lark rules (llguidance's) for one raw call of this tool: `rule` is its alternative of a call."""
        head = json.dumps(open_tag + json.dumps({"name": self.name}) + "\n")
        grammar = self.grammar
        if grammar is None:  # free text, up to the closing tag
            return [f"{rule}: {head} {rule}_text", f'{rule}_text[suffix={json.dumps(close_tag)}]: /(.|\\n)*/']
        if grammar.syntax == "regex":
            body = "/" + (grammar.definition or "").replace("/", "\\/") + "/"
        else:
            body = "%lark {\n" + (grammar.definition or "") + "\n}"
        return [f"{rule}: {head} {rule}_input {json.dumps(close_tag)}", f"{rule}_input: {body}"]


def custom_input(arguments: str) -> str:
    """A custom call's input, from its arguments ({"input": ...}; none: empty); arguments of another shape
    as they are."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get(INPUT), str):
        return value[INPUT]
    return "" if value == {} else arguments


def custom_arguments(text: str) -> str:
    """A custom call's arguments, from its input."""
    return json.dumps({INPUT: text}, ensure_ascii=False)
