"""Truncation filters applied after temperature: top-k, top-p (nucleus) and min-p.

Each takes logits [B, V] and per-row settings and returns logits with the excluded tokens at -inf. Rows
whose settings are "off" are not touched at all, so a request's result never depends on its batchmates.
"""

from __future__ import annotations

import torch

# Top-p first looks at this many best tokens: a partial top-k is far cheaper than sorting the vocabulary,
# and language-model nuclei are nearly always smaller. When they are not, we fall back to a full sort.
TOP_P_CANDIDATES = 256


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """top_k: per row, 0 = off. top_p: per row, 1.0 = off. Top-p is taken over the top-k survivors.

    Exactly k tokens survive top-k (ties at the k-th value are broken by the sort). A token survives
    top-p while the probability of the better tokens is still short of p, so the best always stays.
    """
    vocab_size = logits.shape[1]
    # A k of the whole vocabulary or more cuts nothing: treat it as off.
    top_k = [k if 0 < k < vocab_size else 0 for k in top_k]
    active = [i for i, (k, p) in enumerate(zip(top_k, top_p, strict=True)) if k > 0 or p < 1.0]
    if not active:
        return logits
    device = logits.device
    index = torch.tensor(active, device=device)
    sub = logits[index]
    ks = [top_k[i] or vocab_size for i in active]
    ps = [top_p[i] for i in active]
    k = torch.tensor(ks, device=device).unsqueeze(1)
    p = torch.tensor(ps, dtype=sub.dtype, device=device).unsqueeze(1)

    use_top_p = any(x < 1.0 for x in ps)
    # The window must hold every row's top-k (top-p renormalises over it), and the top-p candidates.
    width = max((x for x in ks if x < vocab_size), default=0)
    if use_top_p:
        width = max(width, TOP_P_CANDIDATES)
    filtered = _truncate(sub, k, p if use_top_p else None, min(width, vocab_size))
    if filtered is None:  # some nucleus is wider than the window: sort the whole vocabulary
        filtered = _truncate(sub, k, p, vocab_size)
    out = logits.clone()
    out[index] = filtered
    return out


def _truncate(
    logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor | None, width: int
) -> torch.Tensor | None:
    """Filter using only the `width` best tokens per row; None when that cannot decide some row."""
    values, order = logits.topk(width, dim=-1)
    rank = torch.arange(width, device=logits.device).unsqueeze(0)
    keep = rank < k
    if p is not None:
        values = values.masked_fill(~keep, float("-inf"))
        # Normalise over the top-k survivors; for rows without top-k that is the whole vocabulary.
        norm = torch.where(
            k < logits.shape[1],
            values.logsumexp(dim=-1, keepdim=True),
            logits.logsumexp(dim=-1, keepdim=True),
        )
        probs = (values - norm).exp()
        cumulative = probs.cumsum(dim=-1)
        keep &= (cumulative - probs < p) | (p >= 1.0)
        # Tokens past the window are dropped correctly only if top-k already cut them (k <= width) or the
        # window holds at least p of the mass.
        decided = (k <= width) | (cumulative[:, -1:] >= p) | (p >= 1.0)
        if not bool(decided.all()):
            return None
    kept = values.masked_fill(~keep, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, kept)


def apply_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """min_p: per row, 0 = off. Drop tokens whose probability is below min_p times the top probability.

    In log space: logit < max_logit + log(min_p), which needs no softmax.
    """
    floor = torch.tensor(min_p, dtype=logits.dtype, device=logits.device).log().unsqueeze(1)
    return logits.masked_fill(logits < logits.amax(dim=-1, keepdim=True) + floor, float("-inf"))
