"""Tools and structured output for a chat request: the tools as the chat template receives them (or, for a
template that ignores tools, described in the system prompt), earlier tool calls and results in the
history, and the grammar that `tool_choice` and `response_format` impose on the answer."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator

from kvflow.server.custom_tools import CustomDefinition
from kvflow.server.errors import bad_request
from kvflow.server.harmony import is_harmony
from kvflow.server.reasoning import think_rule
from kvflow.server.tool_calls import HERMES, LLAMA3, MISTRAL
from kvflow.structured.compiler import lark_json
from kvflow.structured.spec import StructuredOutput


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are ignored (serving.unknown_fields)
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    """A function tool, or a custom (freeform) one (custom_tools.py), which `function` then describes as the
    function of one string that the model is offered."""

    model_config = ConfigDict(extra="allow")
    type: Literal["function", "custom"]
    function: FunctionDefinition = None  # type: ignore[assignment]  # always set once validated
    custom: CustomDefinition | None = None

    @model_validator(mode="after")
    def _one_definition(self):
        if self.type == "custom":
            if self.custom is None:
                raise ValueError('a tool of type "custom" needs its "custom" definition')
            self.function = FunctionDefinition(**self.custom.function_view())
        elif self.function is None:
            raise ValueError('a tool of type "function" needs its "function" definition')
        return self

    def template_dict(self) -> dict:
        """The tool as chat templates take it: its known fields only."""
        known = set(FunctionDefinition.model_fields)
        return {"type": "function", "function": self.function.model_dump(exclude_none=True, include=known)}


def named_choice(tool_choice: str | dict | None) -> str | None:
    """The tool a tool_choice names ({"type": "function", "function": {"name": ...}}, or "custom" and
    "custom" for a custom tool), else None."""
    if isinstance(tool_choice, dict):
        kind = tool_choice.get("type")
        named = tool_choice.get(kind) if kind in ("function", "custom") else None
        if isinstance(named, dict) and isinstance(named.get("name"), str):
            return named["name"]
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


_DEFS_KEYS = ("$defs", "definitions")


def _call_schema(tool: Tool, args_key: str, defs: dict[str, Any]) -> dict:
    """One call's schema; the definitions its parameters refer to move into `defs` (see hoist_defs)."""
    parameters = hoist_defs(closed_objects(tool.function.parameters or {"type": "object"}), tool.function.name, defs)
    return {"type": "object", "properties": {"name": {"const": tool.function.name}, args_key: parameters},
            "required": ["name", args_key], "additionalProperties": False}


def _any_call(tools: list[Tool], args_key: str, defs: dict[str, Any]) -> dict:
    schemas = [_call_schema(t, args_key, defs) for t in tools]
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def with_defs(schema: dict, defs: dict[str, Any]) -> dict:
    """schema as the root of a JSON schema, holding the definitions its parts refer to."""
    return {**schema, "$defs": defs} if defs else schema


def hoist_defs(parameters: Any, tool_name: str, defs: dict[str, Any]) -> Any:
    """parameters without their `$defs`/`definitions`, which move into `defs` (the root's, where a call's
    schema nests the parameters under properties.arguments and `#/$defs/X` would point at nothing), and with
    every reference to them rewritten to where they now are. A name another tool already used for another
    schema is prefixed with this tool's name."""
    if not isinstance(parameters, dict) or not any(isinstance(parameters.get(k), dict) for k in _DEFS_KEYS):
        return parameters
    moved: dict[str, str] = {}  # "#/$defs/X" or "#/definitions/X" -> the new pointer
    found: dict[str, Any] = {}
    for key in _DEFS_KEYS:
        for name, schema in (parameters.get(key) or {}).items():
            new = name if name not in defs and name not in found else f"{tool_name}.{name}"
            while new in defs or new in found:
                new += "_"
            moved[f"#/{key}/{name}"] = f"#/$defs/{_escape(new)}"
            found[new] = schema
    rest = {k: v for k, v in parameters.items() if k not in _DEFS_KEYS}
    defs.update({name: _rewrite_refs(schema, moved) for name, schema in found.items()})
    return _rewrite_refs(rest, moved)


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")  # a JSON pointer's escapes


def _rewrite_refs(schema: Any, moved: dict[str, str]) -> Any:
    if isinstance(schema, list):
        return [_rewrite_refs(s, moved) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _rewrite_refs(v, moved) for k, v in schema.items()}
    ref = out.get("$ref")
    if isinstance(ref, str):
        for old, new in moved.items():
            if ref == old or ref.startswith(old + "/"):
                out["$ref"] = new + ref[len(old):]
                break
    return out


def tool_call_grammar(tools: list[Tool], fmt: str, parallel: bool, special_ids: dict[str, int],
                      answer_schema: dict | None = None, reasoning: str | None = None) -> StructuredOutput:
    """A Lark grammar (llguidance's dialect) for an answer that is one call (or, with parallel, several) to
    one of `tools` in the template's format; with answer_schema, a JSON answer is allowed instead; with a
    reasoning mode (reasoning.py), after a think block of free text."""
    defs: dict[str, Any] = {}
    if fmt == MISTRAL:
        calls_schema = {"type": "array", "items": _any_call(tools, "arguments", defs), "minItems": 1}
        if not parallel:
            calls_schema["maxItems"] = 1
        tag = special_ids.get("[TOOL_CALLS]")
        lead = f"<[{tag}]>" if tag is not None else json.dumps("[TOOL_CALLS]")
        rules = [f"calls: {lead} call_list", f"call_list: {lark_json(with_defs(calls_schema, defs))}"]
    elif fmt == LLAMA3:
        call = with_defs(_any_call(tools, "parameters", defs), defs)
        rules = ['calls: call ("; " call)*' if parallel else "calls: call", f"call: {lark_json(call)}"]
    else:
        assert fmt == HERMES
        rules = ['calls: call ("\\n" call)*' if parallel else "calls: call", *_hermes_call_rules(tools, defs)]
    answer = "calls"
    if answer_schema is not None:
        answer = "(calls | answer)"
        rules.append(f"answer: {lark_json(answer_schema)}")
    if reasoning is not None:
        rules.append(think_rule(reasoning))
    start = f"start: {'think ' if reasoning is not None else ''}{answer}"
    # Wrapping up near the budget follows JSON strings through the whole text: not with thinking before it,
    # nor with a custom tool's raw input.
    raw = fmt == HERMES and any(t.custom is not None for t in tools)
    return StructuredOutput(grammar="\n".join([start, *rules]), closes_like_json=reasoning is None and not raw)


def _hermes_call_rules(tools: list[Tool], defs: dict[str, Any]) -> list[str]:
    """A hermes call: a function's JSON, or a custom tool's raw input (custom_tools.py)."""
    open_tag, close_tag = "<tool_call>\n", "\n</tool_call>"
    functions = [t for t in tools if t.custom is None]
    choices, rules = [], []
    if functions:
        choices.append("function_call")
        rules += [f"function_call: {json.dumps(open_tag)} body {json.dumps(close_tag)}",
                  f"body: {lark_json(with_defs(_any_call(functions, 'arguments', defs), defs))}"]
    for i, tool in enumerate(t for t in tools if t.custom is not None):
        choices.append(f"custom{i}")
        rules += tool.custom.raw_call_rule(f"custom{i}", open_tag, close_tag)
    return [f"call: {' | '.join(choices)}", *rules]



def tool_constraint(tokenizer, tools: list[Tool], fmt: str, tool_choice: str | dict | None,
                    parallel_tool_calls: bool | None, answer: StructuredOutput | None, answer_field: str | None,
                    reasoning: str | None) -> tuple[StructuredOutput, str | None] | None:
    """The grammar an answer that may call `tools` is held to, with the request field it is reported
    against: one of the tools' calls when tool_choice names one or is "required"; under "auto" with a JSON
    answer asked for (answer), either calls or that JSON. None where the answer stays free."""
    chosen = named_choice(tool_choice)
    parallel = parallel_tool_calls is not False and chosen is None
    special = _special_ids(tokenizer, ["[TOOL_CALLS]"]) if fmt == MISTRAL else {}
    if chosen is not None or tool_choice == "required":
        picked = [t for t in tools if chosen is None or t.function.name == chosen]
        return tool_call_grammar(picked, fmt, parallel, special, reasoning=reasoning), "tools"
    if answer is not None and answer.json is not None:
        return tool_call_grammar(tools, fmt, parallel, special, answer.json, reasoning=reasoning), answer_field
    return None


def _special_ids(tokenizer, names: list[str]) -> dict[str, int]:
    """The ids of those names that are special tokens of this vocabulary (Mistral's [TOOL_CALLS])."""
    vocab = tokenizer.get_vocab()
    special = set(getattr(tokenizer, "all_special_tokens", [])) | {
        t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if getattr(t, "special", False)}
    return {name: vocab[name] for name in names if name in vocab and name in special}
