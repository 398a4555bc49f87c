"""Prompt logprobs: scoring a request's prompt tokens from the logits of the prompt rows the runner returned
(engine/runner.PromptSpan). Each row at position p predicts the prompt token at p + 1."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvflow.engine.request import Request, RequestGroup
from kvflow.outputs import Logprob


def score_prompt(group: RequestGroup, request: Request, start: int, logprobs: torch.Tensor,
                 decode: Callable[[list[int]], str | None]) -> None:
    """Append to group.prompt_logprobs the entries of positions start + 1 .. start + len(logprobs): the
    token's own logprob and true rank, and the top k. Positions already scored (a span computed again
    after a preemption) are skipped. Then move request.prompt_logits_from past the span, to None when
    the whole prompt is scored (the prefix cache may serve it again)."""
    k = group.params.prompt_logprobs
    scored = group.prompt_logprobs
    targets = torch.tensor(request.prompt_token_ids[start + 1:start + 1 + logprobs.shape[0]])
    chosen = logprobs.gather(1, targets[:, None])
    ranks = (logprobs > chosen).sum(dim=1) + 1
    top_values, top_ids = logprobs.topk(k, dim=1) if k else (None, None)
    for i, (token, value, rank) in enumerate(zip(targets.tolist(), chosen[:, 0].tolist(), ranks.tolist())):
        if start + 1 + i != len(scored):
            continue
        entry = {token: Logprob(value, rank, decode([token]))}
        if k:
            for r, (tid, v) in enumerate(zip(top_ids[i].tolist(), top_values[i].tolist()), start=1):
                entry.setdefault(tid, Logprob(v, r, decode([tid])))
        scored.append(entry)
    request.prompt_logits_from = start + logprobs.shape[0]
    if request.prompt_logits_from >= request.num_prompt_tokens - 1:
        request.prompt_logits_from = None
