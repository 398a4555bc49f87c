"""Tools and structured output for a chat request: the tools as the chat template receives them (or, for a
template that ignores tools, described in the system prompt), earlier tool calls and results in the
history, and the grammar that `tool_choice` and `response_format` impose on the answer."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from kvflow.server.errors import bad_request
from kvflow.server.harmony import is_harmony
from kvflow.server.reasoning import think_rule
from kvflow.server.tool_calls import HERMES, LLAMA3, MISTRAL
from kvflow.structured.compiler import lark_json
from kvflow.structured.spec import StructuredOutput


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are ignored (unknown_fields.py)
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: FunctionDefinition

    def template_dict(self) -> dict:
        """The tool as chat templates take it: its known fields only."""
        known = set(FunctionDefinition.model_fields)
        return {"type": "function", "function": self.function.model_dump(exclude_none=True, include=known)}


def named_choice(tool_choice: str | dict | None) -> str | None:
    """The function a tool_choice names ({"type": "function", "function": {"name": ...}}), else None."""
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        if tool_choice.get("type") == "function" and isinstance(function, dict) and isinstance(function.get("name"), str):
            return function["name"]
        raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                          '{"name": ...}}', "tool_choice")
    return None


# ---- the prompt ---------------------------------------------------------------------------------------
def template_knows_tools(chat_template: str | None) -> bool:
    # A harmony template (gpt-oss) writes the tools into its developer message itself.
    return "tools" in (chat_template or "") or is_harmony(chat_template)


def tools_system_text(tools: list[Tool]) -> str:
    """How kvflow tells a model whose template ignores tools which functions it may call, and how."""
    lines = [json.dumps(t.template_dict()["function"], ensure_ascii=False) for t in tools]
    return ("You may call functions to answer. They are described here, one JSON object per line:\n"
            + "\n".join(lines)
            + "\nTo call a function, answer with one block per call, exactly like this:\n"
              '<tool_call>\n{"name": "the function name", "arguments": {the arguments as JSON}}\n</tool_call>\n'
              "Each result comes back in a <tool_response> block. Once you have the results you need, "
              "do not call the function again: give your answer.")


def with_tools_prompt(messages: list[dict], tools: list[Tool]) -> list[dict]:
    """messages with the tools described after the system message's own text (a system message is added
    when there is none)."""
    text = tools_system_text(tools)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def history_tool_calls(calls: list[dict], template_knows: bool) -> tuple[list[dict] | None, str]:
    """An assistant message's earlier tool calls: as transformers' templates take them (arguments as a
    dict), or, for a template that ignores them, as the hermes text that kvflow asked the model to write."""
    parsed = []
    for call in calls:
        function = call.get("function") or {}
        args = function.get("arguments", "{}")
        try:
            args_value = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            args_value = args
        parsed.append({"id": call.get("id"), "type": "function",
                       "function": {"name": function.get("name"), "arguments": args_value}})
    if template_knows:
        return parsed, ""
    text = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                                  ensure_ascii=False) + "\n</tool_call>" for c in parsed)
    return None, text


# ---- the grammar --------------------------------------------------------------------------------------
def closed_objects(schema: Any) -> Any:
    """schema with `additionalProperties: false` on every object that lists its properties and says nothing
    about others: a function takes the parameters it declares, and a small model otherwise invents more."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_objects(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def _call_schema(tool: Tool, args_key: str) -> dict:
    parameters = closed_objects(tool.function.parameters or {"type": "object"})
    return {"type": "object", "properties": {"name": {"const": tool.function.name}, args_key: parameters},
            "required": ["name", args_key], "additionalProperties": False}


def _any_call(tools: list[Tool], args_key: str) -> dict:
    schemas = [_call_schema(t, args_key) for t in tools]
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def tool_call_grammar(tools: list[Tool], fmt: str, parallel: bool, special_ids: dict[str, int],
                      answer_schema: dict | None = None, reasoning: str | None = None) -> StructuredOutput:
    """A Lark grammar (llguidance's dialect) for an answer that is one call (or, with parallel, several) to
    one of `tools` in the template's format; with answer_schema, a JSON answer is allowed instead; with a
    reasoning mode (reasoning.py), after a think block of free text."""
    if fmt == MISTRAL:
        calls_schema = {"type": "array", "items": _any_call(tools, "arguments"), "minItems": 1}
        if not parallel:
            calls_schema["maxItems"] = 1
        tag = special_ids.get("[TOOL_CALLS]")
        lead = f"<[{tag}]>" if tag is not None else json.dumps("[TOOL_CALLS]")
        rules = [f"calls: {lead} call_list", f"call_list: {lark_json(calls_schema)}"]
    elif fmt == LLAMA3:
        rules = ['calls: call ("; " call)*' if parallel else "calls: call", f"call: {lark_json(_any_call(tools, 'parameters'))}"]
    else:
        assert fmt == HERMES
        open_tag, close_tag = json.dumps("<tool_call>\n"), json.dumps("\n</tool_call>")
        rules = ['calls: call ("\\n" call)*' if parallel else "calls: call",
                 f"call: {open_tag} body {close_tag}", f"body: {lark_json(_any_call(tools, 'arguments'))}"]
    answer = "calls"
    if answer_schema is not None:
        answer = "(calls | answer)"
        rules.append(f"answer: {lark_json(answer_schema)}")
    if reasoning is not None:
        rules.append(think_rule(reasoning))
    start = f"start: {'think ' if reasoning is not None else ''}{answer}"
    # Wrapping up near the budget follows JSON strings through the whole text: not with thinking before it.
    return StructuredOutput(grammar="\n".join([start, *rules]), closes_like_json=reasoning is None)

