"""The logprobs a request asks for: of each sampled token (`logprobs`, with the top k), and of its prompt's
tokens (`prompt_logprobs`), scored from the logits of the prompt rows the runner returned
(engine/runner.PromptSpan), where each row at position p predicts the prompt token at p + 1.

LogprobRecording is a mixin of LLMEngine (engine.py), which holds the state named there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvflow.engine.request import Request, RequestGroup, SequenceState
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


class LogprobRecording:
    # Set by LLMEngine.__init__ (which also has _fail_group: a request that failed ends alone).
    tokenizer: object
    detokenize: bool
    groups: dict[str, RequestGroup]
    sequences: dict[str, SequenceState]

    def _record_prompt_logprobs(self, logits: torch.Tensor, spans: list, touched: set[str]) -> None:
        """Score the prompt tokens of this step's spans (engine/runner.PromptSpan): each logits row
        predicts the token one position after its own. A span recomputed after a preemption adds nothing."""
        logprobs = torch.log_softmax(logits, dim=-1)
        row = 0
        for span in spans:
            rows, row = logprobs[row:row + span.count], row + span.count
            seq = self.sequences.get(span.request_id)
            if seq is None or seq.group_id not in self.groups:
                continue
            try:
                score_prompt(self.groups[seq.group_id], seq.request, span.start, rows, self._token_text)
            except Exception as exc:  # noqa: BLE001 - one request's failure must not end the others'
                self._fail_group(seq, exc, touched)

    def _record_logprobs(self, seq: SequenceState, token: int, lp: float | None, top) -> None:
        entry: dict[int, Logprob] = {}
        for rank, (tid, value) in enumerate(top or [], start=1):
            entry[tid] = Logprob(value, rank, self._token_text([tid]))
        if token not in entry:
            entry = {token: Logprob(float(lp), 0, self._token_text([token])), **entry}  # rank 0: outside top-k
        seq.logprobs.append(entry)
        seq.cumulative_logprob += float(lp)

    def _token_text(self, ids: list[int]) -> str | None:
        """A logprob entry's text, where this engine makes text."""
        return self.tokenizer.decode(ids) if self.detokenize else None
