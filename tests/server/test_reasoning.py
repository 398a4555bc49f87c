"""Reasoning models' thinking split from their answer: Qwen3-style answers that open a think block,
DeepSeek-R1-style ones whose prompt opened it, in random chunkings; the mode each template implies; and
structured output held to the answer after the thinking (the thinking itself is free)."""

from __future__ import annotations

import copy
import random

import pytest

from kvflow.server.answer_parser import AnswerParser
from kvflow.server.chat_pipeline import prepare_chat
from kvflow.server.protocol import ChatCompletionRequest
from kvflow.server.reasoning import BEFORE, INSIDE, ReasoningParser, reasoning_mode
from kvflow.server.tool_calls import HERMES

QWEN3_LIKE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
              "not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
R1_LIKE = "{% for m in messages %}{{ m.content }}{% endfor %}<｜Assistant｜><think>\n"

ANSWERS = [
    (BEFORE, "<think>\nThe user wants 2 + 2. That is 4, not <thin>.\n</think>\n\nThe answer is 4.",
     "\nThe user wants 2 + 2. That is 4, not <thin>.\n", "The answer is 4."),
    (INSIDE, "Paris is the capital; check: yes.\n</think>\n\nParis.", "Paris is the capital; check: yes.\n", "Paris."),
    (BEFORE, "No thinking here, just an answer.", "", "No thinking here, just an answer."),
    (INSIDE, "Thinking that runs out of tokens before it clo", "Thinking that runs out of tokens before it clo", ""),
]


@pytest.mark.parametrize("mode, text, reasoning, content", ANSWERS)
def test_thinking_is_split_off_whatever_the_chunking(mode, text, reasoning, content):
    rng = random.Random(text)
    for trial in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 10)))) if trial else []
        parser = ReasoningParser(mode)
        got_reasoning, got_content = "", ""
        for a, b in zip([0, *cuts], [*cuts, len(text)]):
            split = parser.feed(text[a:b])
            got_reasoning, got_content = got_reasoning + split.reasoning, got_content + split.content
        split = parser.finish()
        assert (got_reasoning + split.reasoning, got_content + split.content) == (reasoning, content)


def test_thinking_then_a_tool_call():
    parser = AnswerParser(HERMES, BEFORE)
    answer = parser.whole('<think>I need the weather.</think>\n<tool_call>\n{"name": "w", "arguments": {}}\n</tool_call>')
    assert answer.reasoning == "I need the weather." and answer.content == "" and [c.name for c in answer.calls] == ["w"]


def test_the_mode_follows_template_and_prompt():
    assert reasoning_mode(QWEN3_LIKE, "<|im_start|>assistant\n") == BEFORE
    assert reasoning_mode(QWEN3_LIKE, "<|im_start|>assistant\n<think>\n\n</think>\n\n") is None  # thinking off
    assert reasoning_mode(R1_LIKE, "hi<｜Assistant｜><think>\n") == INSIDE
    assert reasoning_mode("{{ messages }}", "anything") is None


@pytest.fixture(scope="module")
def tokenizers(default_loaded, grammar_compiler):
    qwen, r1 = copy.deepcopy(default_loaded.tokenizer), copy.deepcopy(default_loaded.tokenizer)
    qwen.chat_template, r1.chat_template = QWEN3_LIKE, R1_LIKE
    return {"qwen": qwen, "r1": r1, "compiler": grammar_compiler}


SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
          "additionalProperties": False}


@pytest.mark.parametrize("name, text", [("qwen", '<think>2 + 2 is "4" {not json}</think>{"answer": 4}'),
                                        ("r1", 'It is 4 {"answer": 5}?</think>{"answer": 4}')])
def test_structured_output_applies_after_the_thinking(tokenizers, name, text):
    body = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "2 + 2?"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}})
    chat = prepare_chat(tokenizers[name], body)
    assert chat.reasoning == (BEFORE if name == "qwen" else INSIDE)
    compiler = tokenizers["compiler"]
    for candidate, valid in ((text, True), (text.replace('{"answer": 4}', '{"answer": "4"}'), False)):
        matcher = compiler.matcher(chat.constraint)
        ok = all(matcher.consume_token(t) for t in compiler.tokenizer.tokenize_str(candidate))
        assert (ok and matcher.is_accepting()) == valid, candidate


def test_enable_thinking_false_reaches_the_template(tokenizers):
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                 "chat_template_kwargs": {"enable_thinking": False}})
    chat = prepare_chat(tokenizers["qwen"], body)
    assert chat.prompt.endswith("<think>\n\n</think>\n\n") and chat.reasoning is None
