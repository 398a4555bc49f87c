"""Wrapping up near the token budget, on the default model: the schemas whose outputs it would otherwise
cut off (strings it repeats itself in, a recursive schema it nests without end, many required items) still
end as valid JSON at tight budgets, and a tool-call grammar ends between calls rather than inside one."""

from __future__ import annotations

import pytest
from engine_helpers import make_llm

from kvflow import SamplingParams
from kvflow.structured.spec import StructuredOutput
from structured.schema_suite import CASES, chat_prompt, violation

RAMBLING = ["yes_no", "priority", "ref_tree", "plan_steps", "email_send", "git_commit", "code_review",
            "final_answer", "person_email", "nested_order"]


@pytest.fixture(scope="module")
def llm(packed_loaded):
    return make_llm(packed_loaded)


@pytest.mark.parametrize("max_tokens", [48, 96])
def test_tight_budgets_still_end_valid(llm, max_tokens):
    cases = [c for c in CASES if c["name"] in RAMBLING]
    tokenizer = llm.engine.tokenizer
    prompts = [tokenizer.apply_chat_template(chat_prompt(c), tokenize=False, add_generation_prompt=True) for c in cases]
    params = [SamplingParams(temperature=0, max_tokens=max_tokens, structured_output=StructuredOutput(json=c["schema"]))
              for c in cases]
    outs = llm.generate(prompts, params)
    failures = {c["name"]: why for c, o in zip(cases, outs) if (why := violation(o.outputs[0].text, c["schema"]))}
    assert not failures, failures
    assert all(len(o.outputs[0].token_ids) <= max_tokens for o in outs)


def test_repeated_calls_stop_at_a_call_boundary(llm):
    grammar = ('start: call ("\\n" call)*\ncall: "<tool_call>" body "</tool_call>"\n'
               'body: %json {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], '
               '"additionalProperties": false}')
    spec = StructuredOutput(grammar=grammar, closes_like_json=True)
    prompt = llm.engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "List cities as <tool_call>{\"city\": ...}</tool_call> blocks, many of them."}],
        tokenize=False, add_generation_prompt=True)
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=60, structured_output=spec))
    text = out.outputs[0].text
    assert text.endswith("</tool_call>") and text.count("<tool_call>") == text.count("</tool_call>") >= 1
