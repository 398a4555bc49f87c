"""Logit adjustments that depend on a request's history: repetition, presence and frequency penalties,
and masking of ids a request may not emit yet (min_tokens).

Everything is batched over the rows that need it; rows without penalties are not touched and no count
tensors are built when no row asks for them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvflow.sampling_params import SamplingParams


def token_counts(token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab_size] counts of each id per row, from one scatter_add over a padded tensor."""
    width = max((len(t) for t in token_lists), default=0)
    # Pad with an extra column index (vocab_size) that is dropped afterwards, so padding counts nowhere.
    padded = torch.full((len(token_lists), max(width, 1)), vocab_size, dtype=torch.long)
    for i, tokens in enumerate(token_lists):
        if tokens:
            padded[i, : len(tokens)] = torch.as_tensor(tokens, dtype=torch.long)
    padded = padded.to(device, non_blocking=True)
    counts = torch.zeros((len(token_lists), vocab_size + 1), dtype=torch.int32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.int32))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Return logits [B, V] with each row's penalties applied (a new tensor when any row changes).

    repetition_penalty (HF/vLLM): ids seen in prompt or output have positive logits divided and negative
    logits multiplied by it. presence/frequency (OpenAI): subtract presence * (count > 0) + frequency *
    count, with counts over the generated output only.
    """
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return logits
    vocab_size = logits.shape[1]
    device = logits.device
    sub = logits[rows]
    out_counts = token_counts([output_token_ids[i] for i in rows], vocab_size, device)

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=sub.dtype, device=device).unsqueeze(1)

    if any(params[i].repetition_penalty != 1.0 for i in rows):
        rep = column([params[i].repetition_penalty for i in rows])
        prompt_seen = token_counts([prompt_token_ids[i] for i in rows], vocab_size, device) > 0
        seen = prompt_seen | (out_counts > 0)
        penalized = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalized, sub)
    if any(params[i].frequency_penalty != 0.0 or params[i].presence_penalty != 0.0 for i in rows):
        freq = column([params[i].frequency_penalty for i in rows])
        presence = column([params[i].presence_penalty for i in rows])
        sub = sub - freq * out_counts.to(sub.dtype) - presence * (out_counts > 0).to(sub.dtype)

    logits = logits.clone()
    logits[rows] = sub
    return logits


def suppress_tokens(logits: torch.Tensor, suppress_token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """Set logits[i, t] = -inf for every t in suppress_token_ids[i] (e.g. EOS before min_tokens)."""
    vocab_size = logits.shape[1]
    row_index: list[int] = []
    col_index: list[int] = []
    for i, ids in enumerate(suppress_token_ids):
        for t in ids:
            if 0 <= t < vocab_size:  # a stop id outside the model's vocabulary can never be sampled anyway
                row_index.append(i)
                col_index.append(t)
    if not row_index:
        return logits
    logits = logits.clone()
    device = logits.device
    logits[torch.tensor(row_index, device=device), torch.tensor(col_index, device=device)] = float("-inf")
    return logits


def apply_logit_bias(logits: torch.Tensor, biases: Sequence[dict[int, float] | None]) -> torch.Tensor:
    """Add biases[i][t] to logits[i, t] (OpenAI's logit_bias; -100 all but bans a token, +100 all but
    forces it)."""
    rows = [i for i, b in enumerate(biases) for _ in (b or {})]
    cols = [t for b in biases for t in (b or {})]
    values = [v for b in biases for v in (b or {}).values()]
    logits = logits.clone()
    logits[torch.tensor(rows), torch.tensor(cols)] += torch.tensor(values, dtype=logits.dtype)
    return logits
