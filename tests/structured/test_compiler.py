"""GrammarCompiler on the default model's tokenizer: every schema of the suite compiles, bad constraints
are refused with the reason, and compiled grammars are kept by schema."""

from __future__ import annotations

import numpy as np
import pytest

from kvflow.structured.compiler import GrammarError
from kvflow.structured.spec import StructuredOutput
from structured.schema_suite import CASES


def test_the_whole_schema_suite_compiles(compiler):
    assert len(CASES) >= 40
    for case in CASES:
        compiler.compile(StructuredOutput(json=case["schema"]))


@pytest.mark.parametrize("spec, reason", [
    (StructuredOutput(json={"type": "strin"}), "Invalid type"),
    (StructuredOutput(json={"type": "string", "format": "no-such-format"}), "Unknown format"),
    (StructuredOutput(json={"$ref": "#/$defs/missing"}), "does not exist"),
    (StructuredOutput(regex="a(b"), "unclosed group"),
    (StructuredOutput(grammar="start: undefined_rule"), "unknown name"),
])
def test_bad_constraints_name_the_problem(compiler, spec, reason):
    with pytest.raises(GrammarError, match=reason) as info:
        compiler.compile(spec)
    assert "\n" not in str(info.value)  # one line for an API error message


def test_bad_specs_are_refused_when_built():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutput(json={}, regex="a")
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutput(json="{oops")
    with pytest.raises(ValueError, match="non-empty"):
        StructuredOutput(choice=[])


def test_compiled_grammars_are_cached_by_schema_not_key_order(compiler):
    a = compiler.compile(StructuredOutput(json={"type": "object", "properties": {"x": {"type": "integer"}}}))
    b = compiler.compile(StructuredOutput(json={"properties": {"x": {"type": "integer"}}, "type": "object"}))
    assert a is b


def test_choice_and_regex_accept_exactly_their_language(compiler):
    tokenizer = compiler.tokenizer
    for spec, good, bad in [
        (StructuredOutput(choice=["yes", "no"]), "no", "maybe"),
        (StructuredOutput(regex=r"[0-9]{3}-[a-z]+"), "123-abc", "12-abc"),
    ]:
        for text, accepted in ((good, True), (bad, False)):
            matcher = compiler.matcher(spec)
            tokens = tokenizer.tokenize_str(text)
            ok = all(matcher.consume_token(t) for t in tokens) and matcher.is_accepting()
            assert ok == accepted, (spec, text)


def test_closing_tokens_close_strings_or_brackets_only(compiler, default_loaded):
    closing = compiler.closing_tokens
    tokenizer = default_loaded.tokenizer
    quote_led = [tokenizer.decode([int(t)]).strip() for t in np.flatnonzero(closing[0])]
    brackets = [tokenizer.decode([int(t)]).strip() for t in np.flatnonzero(closing[1])]
    assert '"' in quote_led and "}" in brackets and "]" in brackets
    assert all(t.startswith('"') and set(t) <= set('"]} ') for t in quote_led)
    assert all(set(t) <= set("]} ") for t in brackets)
