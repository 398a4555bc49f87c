"""The sampler under a grammar: a greedy row picks the best token its grammar allows (whether or not that
is its unmasked choice), sampled rows only ever draw allowed tokens, and free rows in the same batch are
untouched."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvflow import SamplingParams
from kvflow.layers.sampler import Sampler, SamplingRow
from kvflow.structured.spec import StructuredOutput
from structured.grammar_helpers import allowed_tokens

SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["alpha", "beta"]}, "n": {"type": "integer"}},
          "required": ["kind", "n"], "additionalProperties": False}


def _matcher(compiler, prefix: str):
    matcher = compiler.matcher(StructuredOutput(json=SCHEMA))
    for token in compiler.tokenizer.tokenize_str(prefix):
        assert matcher.consume_token(token)
    return matcher


@pytest.mark.parametrize("prefix", ["", '{"kind": "', '{"kind": "alpha", "n": 1'])
def test_greedy_takes_the_best_allowed_token(compiler, prefix):
    gen = torch.Generator().manual_seed(len(prefix))
    greedy = SamplingParams(temperature=0)
    for trial in range(8):
        logits = torch.randn(2, compiler.vocab_size, generator=gen)
        matcher = _matcher(compiler, prefix)
        allowed = allowed_tokens([matcher], compiler.vocab_size, [[]])[0]
        if trial % 2:  # make the unmasked choice an allowed token, so the no-mask shortcut is taken
            logits[0, int(np.flatnonzero(allowed)[0])] = 100.0
        expected = int(np.flatnonzero(allowed)[logits[0].numpy()[allowed].argmax()])
        free_expected = int(logits[1].argmax())
        rows = [SamplingRow(greedy, [1], [], matcher=matcher), SamplingRow(greedy, [1], [])]
        out = Sampler()(logits, rows)
        assert out.token_ids == [expected, free_expected]


def test_sampled_rows_draw_only_allowed_tokens(compiler):
    gen = torch.Generator().manual_seed(0)
    for seed in range(20):
        matcher = _matcher(compiler, '{"kind": "')
        allowed = allowed_tokens([matcher], compiler.vocab_size, [[]])[0]
        row = SamplingRow(SamplingParams(temperature=1.0, seed=seed), [1], [], generator=torch.Generator().manual_seed(seed),
                          matcher=matcher)
        (token,) = Sampler()(torch.randn(1, compiler.vocab_size, generator=gen), [row]).token_ids
        assert allowed[token]
