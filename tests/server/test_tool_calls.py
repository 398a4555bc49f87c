"""Tool-call parsers, one per family, on answers written the way each family's models write them: parsed
whole and streamed in random chunkings, the same content and calls come out."""

from __future__ import annotations

import json
import random

import pytest

from kvflow.server.tool_calls import HERMES, LLAMA3, MISTRAL, ToolCallParser, template_format

# (format, the model's text, expected content, expected [(name, arguments)])
ANSWERS = [
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     "", [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    (HERMES, 'I will look both up.\n<tool_call>\n{"name": "search", "arguments": {"query": "a </tool_call> in text?"}}\n'
             '</tool_call>\n<tool_call>\n{"name": "read_file", "arguments": {"path": "src/main.py"}}\n</tool_call>',
     "I will look both up.\n", [("search", {"query": "a </tool_call> in text?"}), ("read_file", {"path": "src/main.py"})]),
    (HERMES, "The capital of France is Paris.", "The capital of France is Paris.", []),
    # a custom tool's raw call (custom_tools.py): its name's JSON line, then its input up to the closing tag
    (HERMES, 'Patching.\n<tool_call>\n{"name": "apply_patch"}\n*** Begin Patch\n*** Add File: a.txt\n+{"x": 1}\n'
             '*** End Patch\n\n</tool_call>',
     "Patching.\n", [("apply_patch", {"input": '*** Begin Patch\n*** Add File: a.txt\n+{"x": 1}\n*** End Patch\n'})]),
    (HERMES, "Use <tool_call> tags like <tool_call>not json</tool_call> to call.",
     "Use <tool_call> tags like <tool_call>not json</tool_call> to call.", []),
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "San Francisco"}}', "",
     [("get_weather", {"city": "San Francisco"})]),
    (LLAMA3, '<|python_tag|>{"name": "search", "parameters": {"query": "x; y"}}; {"name": "add", "parameters": {"a": 1, "b": 2}}',
     "", [("search", {"query": "x; y"}), ("add", {"a": 1, "b": 2})]),
    (LLAMA3, "Paris is the capital of France.", "Paris is the capital of France.", []),
    (LLAMA3, "{not a call at all", "{not a call at all", []),
    (MISTRAL, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]',
     "", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    (MISTRAL, "Bonjour! Paris is sunny.", "Bonjour! Paris is sunny.", []),
]


def _parse(fmt: str, pieces: list[str]):
    parser = ToolCallParser(fmt)
    content, calls = "", []
    for piece in pieces:
        out = parser.feed(piece)
        content, calls = content + out.content, calls + out.calls
    out = parser.finish()
    return content + out.content, calls + out.calls


@pytest.mark.parametrize("fmt, text, content, expected", ANSWERS)
def test_whole_and_in_random_chunks(fmt, text, content, expected):
    rng = random.Random(text)
    for trial in range(40):
        if trial == 0:
            pieces = [text]
        else:
            cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        got_content, calls = _parse(fmt, pieces)
        assert got_content == content
        assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
        assert len({c.id for c in calls}) == len(calls) and all(c.id.startswith("call_") for c in calls)


def test_a_call_cut_short_by_the_budget_is_content():
    content, calls = _parse(HERMES, ['<tool_call>\n{"name": "search", "argu'])
    assert calls == [] and content == '<tool_call>\n{"name": "search", "argu'


def test_a_complete_call_missing_only_its_closing_tag_counts():
    content, calls = _parse(HERMES, ['<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n'])
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("f", '{"x": 1}')]


@pytest.mark.parametrize("template, fmt", [
    ("{% for m in messages %}<|im_start|>{{ m.role }}{% if tools %}<tool_call>{% endif %}{% endfor %}", HERMES),
    ("{{ bos_token }}{% if m.role == 'ipython' %}<|python_tag|>{% endif %}<|eot_id|>", LLAMA3),
    ("[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS][TOOL_CALLS]", MISTRAL),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", HERMES),
])
def test_the_format_follows_the_template(template, fmt):
    assert template_format(template) == fmt
