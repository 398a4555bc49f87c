"""What an engine core in its own process sends per request per step: the new token ids, not the text.

The core's engine runs with detokenize off (LLMEngine.detokenize), so a step's output carries ids, their
logprobs (without token texts) and finish reasons; the front end turns them into text and matches stop
strings (engine/output_assembly.py), beside the steps. Only what is new since the request's last output
crosses the pipe, so a step's message does not grow with the prompt or the answer: no prompt ids, no
text, and the per-token times only once the request has finished.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvflow.outputs import Logprob, RequestMetrics, RequestOutput


@dataclass
class SequenceDelta:
    index: int
    token_ids: list[int]  # new since the last output
    logprobs: list[dict[int, Logprob]] | None  # for those ids, where asked for (decoded_token None)
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass
class CoreOutput:
    request_id: str
    sequences: list[SequenceDelta]
    finished: bool
    metrics: RequestMetrics  # token_times left empty until finished
    prompt_logprobs: list[dict[int, Logprob] | None] | None  # entries new since the last output
    error: str | None


def core_output(out: RequestOutput, prompt_logprobs_sent: int) -> CoreOutput:
    """One step's RequestOutput, reduced to what is new. prompt_logprobs_sent: how many prompt-logprob
    entries earlier outputs carried."""
    sequences = []
    for c in out.outputs:
        new = len(c.delta_token_ids)
        logprobs = None if c.logprobs is None else c.logprobs[len(c.logprobs) - new:]  # the core drops none
        sequences.append(SequenceDelta(c.index, list(c.delta_token_ids), logprobs, c.cumulative_logprob,
                                       c.finish_reason, c.stop_reason))
    metrics = out.metrics if out.finished else dataclasses.replace(out.metrics, token_times=[])
    prompt_logprobs = None if out.prompt_logprobs is None else out.prompt_logprobs[prompt_logprobs_sent:]
    return CoreOutput(out.request_id, sequences, out.finished, metrics, prompt_logprobs, out.error)
