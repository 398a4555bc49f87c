"""Sampler: one batch of logits [B, V] -> one token per row (+ logprobs), each row with its own params.

Order per row: penalties, logit_bias, min_tokens suppression, the grammar's mask (structured output), then greedy rows take the argmax; the others go through
temperature, top-k / top-p, min-p and an exponential race (argmax of probs / q, q ~ Exp(1)), which draws
a token with exactly the filtered probabilities. Seeded rows draw q from their own generator, so their
tokens do not depend on what else is in the batch. Logprobs are taken from the raw logits given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvflow.layers.logit_filters import apply_min_p, apply_top_k_top_p
from kvflow.layers.penalties import apply_logit_bias, apply_penalties, suppress_tokens
from kvflow.sampling_params import SamplingParams
from kvflow.structured.masks import apply_masks, mask_words, unpack_allowed, wrap_up

# Below this, dividing by the temperature only risks overflow; the distribution is a point mass anyway.
MIN_TEMPERATURE = 1e-5


@dataclass
class SamplingRow:
    """What the sampler needs to know about one request for one step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None = None  # a seeded row's (position_generator), else None
    suppress_token_ids: list[int] = field(default_factory=list)  # masked while below min_tokens
    matcher: Any = None  # the request's grammar state (an llguidance matcher) for structured output
    end_token_ids: list[int] = field(default_factory=list)  # tokens that end it, allowed where its grammar may end
    closing_tokens: np.ndarray | None = None  # near its token budget: compiler.closing_tokens, else None
    in_string: bool = False  # its JSON output stands inside a string (structured/json_state.py)
    mask_words: np.ndarray | None = None  # its grammar's mask, when computed during the forward


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float | None]  # the chosen token's logprob, for rows that asked for logprobs
    # (token id, logprob), best first, k = params.logprobs (or params.logprob_token_ids' tokens, in their order)
    top_logprobs: list[list[tuple[int, float]] | None]


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator for one seeded request; it must live on the device the logits are on."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def position_generator(seed: int, position: int, device: torch.device | str) -> torch.Generator:
    """The generator for a seeded sequence's output token at `position`: its noise depends on the seed
    and the position alone, not on how many draws came before. So a seeded sample is the same whether the
    token is decoded on its own or verified in a speculative step (which also samples positions whose
    drafts are then thrown away), and the same after a preemption."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) % (1 << 64)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % (1 << 64)  # splitmix64's mixing: nearby seeds decorrelate
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % (1 << 64)
    return make_generator(z ^ (z >> 31), device)


def is_greedy(params: SamplingParams) -> bool:
    return params.greedy or params.temperature < MIN_TEMPERATURE


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"Sampler: logits {tuple(logits.shape)} do not match {len(rows)} rows")
        logits = logits.float()
        raw_logprobs, logprob_rows = _raw_logprobs(logits, rows)

        params = [r.params for r in rows]
        if any(p.has_penalties for p in params):
            logits = apply_penalties(
                logits, params, [r.prompt_token_ids for r in rows], [r.output_token_ids for r in rows]
            )
        if any(p.logit_bias for p in params):
            logits = apply_logit_bias(logits, [p.logit_bias for p in params])
        if any(r.suppress_token_ids for r in rows):
            logits = suppress_tokens(logits, [r.suppress_token_ids for r in rows])
        constrained = [i for i, r in enumerate(rows) if r.matcher is not None]
        if constrained:
            with torch.inference_mode():  # masks are written into the runner's logits (inference tensors)
                logits = _apply_grammars(logits, rows, constrained)

        greedy = [is_greedy(p) for p in params]
        sampled_rows = [i for i, g in enumerate(greedy) if not g]
        if not sampled_rows:
            tokens = greedy_tokens(logits)
        elif len(sampled_rows) == len(rows):
            tokens = _sample(logits, rows)
        else:
            tokens = greedy_tokens(logits)
            index = torch.tensor(sampled_rows, device=logits.device)
            tokens[index] = _sample(logits[index], [rows[i] for i in sampled_rows])

        token_ids = tokens.tolist()
        if raw_logprobs is None:
            return SamplerOutput(token_ids, [None] * len(rows), [None] * len(rows))
        return SamplerOutput(token_ids, *_gather_logprobs(raw_logprobs, logprob_rows, tokens, rows))


def _apply_grammars(logits: torch.Tensor, rows: list[SamplingRow], constrained: list[int]) -> torch.Tensor:
    missing = [i for i in constrained if rows[i].mask_words is None]
    computed = dict(zip(missing, mask_words([rows[i].matcher for i in missing], logits.shape[1]))) if missing else {}
    words = [computed[i] if i in computed else rows[i].mask_words for i in constrained]
    masked, allowed_rows = [], []
    for j, i in enumerate(constrained):
        row = rows[i]
        if _takes_its_own_choice(logits[i], row, words[j]):
            continue
        allowed = unpack_allowed(words[j], logits.shape[1], row.matcher, row.end_token_ids)
        if row.suppress_token_ids:  # min_tokens hides the end for now
            allowed[row.suppress_token_ids] = False
        if row.closing_tokens is not None:
            allowed = wrap_up(allowed, row.closing_tokens, row.end_token_ids, row.in_string)
        if not allowed.any():  # the grammar is done, or min_tokens hides its ending: end the request
            ends = row.end_token_ids or [0]
            allowed[ends] = True
            apply_masks(logits, [i], allowed[None])
            logits[i, ends] = 0.0
            continue
        if is_greedy(row.params):  # only its best allowed token matters: make that the row's maximum
            choices = np.flatnonzero(allowed)
            values = logits[i].numpy()[choices] if logits.device.type == "cpu" else logits[i, torch.from_numpy(choices)]
            logits[i, int(choices[int(values.argmax())])] = float("inf")
            continue
        masked.append(i)
        allowed_rows.append(allowed)
    if masked:
        apply_masks(logits, masked, np.stack(allowed_rows))
    return logits


def _takes_its_own_choice(logits: torch.Tensor, row: SamplingRow, words: np.ndarray) -> bool:
    """A greedy row whose grammar allows the token it would pick anyway needs no mask written into its
    logits: the masked argmax is that same token, and reading one bit costs far less than applying a mask."""
    if not is_greedy(row.params) or row.closing_tokens is not None or row.suppress_token_ids:
        return False
    token = int(logits.numpy().argmax()) if logits.device.type == "cpu" else int(logits.argmax())
    if token in row.end_token_ids:
        return row.matcher.is_accepting()
    return bool((int(words[token >> 5]) >> (token & 31)) & 1)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first index on ties, as torch.argmax). On CPU through NumPy, whose argmax
    over a vocabulary-sized row is an order of magnitude quicker than PyTorch's (benchmarks/RESULTS.md)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(np.asarray(logits.detach().numpy().argmax(axis=-1)))
    return logits.argmax(dim=-1)


def _raw_logprobs(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[torch.Tensor | None, list[int]]:
    """log_softmax of the raw logits for the rows that asked for logprobs (None when no row did)."""
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if not wanted:
        return None, wanted
    if len(wanted) == len(rows):
        return torch.log_softmax(logits, dim=-1), wanted
    return torch.log_softmax(logits[torch.tensor(wanted, device=logits.device)], dim=-1), wanted


def _gather_logprobs(
    logprobs: torch.Tensor, wanted: list[int], tokens: torch.Tensor, rows: list[SamplingRow]
) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
    index = torch.tensor(wanted, device=tokens.device)
    chosen = logprobs.gather(1, tokens[index].unsqueeze(1)).squeeze(1).tolist()
    k_max = max(rows[i].params.logprobs or 0 for i in wanted)
    top_values: list[list[float]] = [[] for _ in wanted]
    top_ids: list[list[int]] = [[] for _ in wanted]
    if k_max > 0:
        values, ids = logprobs.topk(k_max, dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()

    out_chosen: list[float | None] = [None] * len(rows)
    out_top: list[list[tuple[int, float]] | None] = [None] * len(rows)
    for j, i in enumerate(wanted):
        k = rows[i].params.logprobs or 0
        out_chosen[i] = chosen[j]
        named = rows[i].params.logprob_token_ids
        if named:  # the tokens asked for by id, in their order, instead of the top k
            values = logprobs[j, torch.tensor(named, device=logprobs.device)].tolist()
            out_top[i] = list(zip(named, values, strict=True))
        else:
            out_top[i] = list(zip(top_ids[j][:k], top_values[j][:k], strict=True))
    return out_chosen, out_top


def _sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Sample one token per row of logits [S, V]; every row here is non-greedy."""
    params = [r.params for r in rows]
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    logits = logits / temperature.unsqueeze(1)
    logits = apply_top_k_top_p(logits, [p.top_k for p in params], [p.top_p for p in params])
    if any(p.min_p > 0.0 for p in params):
        logits = apply_min_p(logits, [p.min_p for p in params])

    # Unnormalised probabilities suffice: the race's argmax does not change when a row is rescaled.
    weights = (logits - logits.amax(dim=-1, keepdim=True)).exp()
    return (weights / _exponential_noise(weights, rows)).argmax(dim=-1)


def _exponential_noise(like: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """q ~ Exp(1) shaped like `like`, as -log(u) with u ~ U[0, 1): seeded rows draw u from their own
    generator, the rest in one draw. u = 0 gives q = inf, which just takes that token out of the race."""
    noise = torch.empty_like(like)
    unseeded = [i for i, r in enumerate(rows) if r.generator is None]
    if len(unseeded) == len(rows):
        noise.uniform_()
    elif unseeded:
        index = torch.tensor(unseeded, device=like.device)
        noise[index] = torch.rand((len(unseeded), like.shape[1]), dtype=like.dtype, device=like.device)
    for i, row in enumerate(rows):
        if row.generator is not None:  # one small draw per seeded row: the price of reproducibility
            noise[i].uniform_(generator=row.generator)
    return noise.log_().neg_()
