"""Token masks: one row computed alone equals the same row computed in a batch; wrapping up prefers the end,
then closing a string, then closing brackets (never brackets inside a string); the string state follows
escapes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvflow.structured.json_state import JsonStringState
from kvflow.structured.masks import apply_masks, closing_cost, wrap_up
from kvflow.structured.spec import StructuredOutput
from structured.grammar_helpers import allowed_tokens

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "tags"], "additionalProperties": False}


def _walk(compiler, text: str):
    matcher = compiler.matcher(StructuredOutput(json=SCHEMA))
    state = JsonStringState()
    for token in compiler.tokenizer.tokenize_str(text):
        assert matcher.consume_token(token), text
        state.feed(compiler.token_texts[token])
    return matcher, state


def test_batch_masks_are_each_matchers_own_bitmask(compiler):
    prefixes = ['{"name": "Al', '{"name": "Alice", "tags": [', '{"name": "A", "tags": ["x"]', "{"]
    matchers = [_walk(compiler, p)[0] for p in prefixes]
    batch = allowed_tokens(matchers, compiler.vocab_size, [[]] * len(matchers))
    for row, matcher in enumerate(matchers):
        own = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")
        assert (batch[row] == own[:compiler.vocab_size].astype(bool)).all()
    assert batch.any(axis=1).all() and not batch.all(axis=1).any()
    assert batch[0].sum() > 40000 and batch[1].sum() < 100  # inside a string nearly all; at an array's start few


def test_end_tokens_are_allowed_only_where_the_grammar_may_end(compiler):
    done, _ = _walk(compiler, '{"name": "A", "tags": []}')
    open_, _ = _walk(compiler, '{"name": "A"')
    allowed = allowed_tokens([done, open_], compiler.vocab_size, [[7], [7]])
    assert allowed[0, 7] and not allowed[1, 7]


def test_wrap_up_closes_strings_first_and_brackets_only_outside_them(compiler):
    closing = compiler.closing_tokens
    texts = compiler.token_texts
    in_string, state = _walk(compiler, '{"name": "Alice is a')
    assert state.in_string
    row = wrap_up(allowed_tokens([in_string], compiler.vocab_size, [[]])[0], closing, [], state.in_string)
    assert all(texts[int(t)].strip().startswith('"') for t in np.flatnonzero(row))
    in_array, state = _walk(compiler, '{"name": "A", "tags": ["x"')
    assert not state.in_string
    row = wrap_up(allowed_tokens([in_array], compiler.vocab_size, [[]])[0], closing, [], state.in_string)
    assert row.any() and all(set(texts[int(t)].strip()) <= set("]} ") for t in np.flatnonzero(row))
    assert closing_cost(in_array, state, compiler.closing_ids, texts, 50) <= 3


@pytest.mark.parametrize("allowed_ids", [[3, 5], list(range(2, 64))], ids=["few allowed", "few blocked"])
def test_masked_rows_get_minus_infinity_and_other_rows_are_untouched(allowed_ids):
    logits = torch.randn(3, 64)
    before = logits.clone()
    allowed = np.zeros((1, 64), dtype=bool)
    allowed[0, allowed_ids] = True
    out = apply_masks(logits, [1], allowed)
    assert torch.equal(out[0], before[0]) and torch.equal(out[2], before[2])
    assert torch.isinf(out[1]).sum() == 64 - len(allowed_ids)
    assert torch.equal(out[1, allowed_ids], before[1, allowed_ids])


@pytest.mark.parametrize("text, inside", [('"a', True), ('"a"', False), ('"a\\"', True), ('"a\\\\"', False),
                                          ('{"k": "v", "w": "', True)])
def test_string_state_follows_quotes_and_escapes(text, inside):
    state = JsonStringState()
    for ch in text:  # fed a character at a time, as tokens may split anywhere
        state.feed(ch)
    assert state.in_string == inside
