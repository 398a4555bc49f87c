"""The front end's half of an engine core in its own process: token ids in, the caller's outputs out.

The core sends each step's new ids (engine/core_output.py); here they become text, stop strings are
matched, logprob entries get their token texts, and the RequestOutput a caller reads is built as the
in-process engine builds it. Doing that here keeps detokenization off the core, beside its steps, as
vLLM's output processor does.

A stop string is matched here one step after the core sampled its last token: the core hears of it
(`stopped` below) and frees the sequence, and whatever it sampled meanwhile is never shown. The text and
ids the caller gets are the same as in-process: the ids after the one that completed the stop string are
dropped in both.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kvflow.engine.core_output import CoreOutput, SequenceDelta
from kvflow.engine.detokenizer import IncrementalDetokenizer, add_tokens
from kvflow.engine.request import now
from kvflow.outputs import CompletionOutput, Logprob, RequestOutput
from kvflow.sampling_params import SamplingParams


@dataclass
class _SequenceText:
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class RequestAssembler:
    """One request's text, ids and logprobs, built from its core's outputs."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 tokenizer: Any) -> None:
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.params, self.tokenizer = params, tokenizer
        self.sequences: dict[int, _SequenceText] = {}
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    def apply(self, core: CoreOutput) -> tuple[RequestOutput, list[tuple[int, str]]]:
        """The caller's output for one step, and the sequences a stop string ended here, as (index, stop
        string): the core must stop those."""
        stopped: list[tuple[int, str]] = []
        completions = []
        for delta in core.sequences:
            seq = self.sequences.get(delta.index)
            if seq is None:
                seq = self.sequences[delta.index] = _SequenceText(
                    IncrementalDetokenizer(self.tokenizer, self.prompt_token_ids, self.params),
                    logprobs=None if delta.logprobs is None else [])
            text, ids = "", []
            if seq.finish_reason is None:  # a sequence that ended here on a stop string takes no more news
                text, ids = self._advance(seq, delta, stopped)
            completions.append(CompletionOutput(
                index=delta.index, text=seq.detokenizer.output_text, token_ids=list(seq.token_ids),
                cumulative_logprob=seq.cumulative_logprob, logprobs=seq.logprobs, finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason, delta_text=text, delta_token_ids=ids))
        if core.prompt_logprobs:
            self.prompt_logprobs = (self.prompt_logprobs or []) + [self._named(e) for e in core.prompt_logprobs]
        done = all(s.finish_reason is not None for s in self.sequences.values())
        finished = core.finished or (done and len(self.sequences) == self.params.n)
        metrics = core.metrics
        if finished:  # the ids a stop string dropped here do not count, as they do not in-process
            metrics = dataclasses.replace(
                metrics, finished_time=metrics.finished_time if core.finished else now(),
                num_generated_tokens=sum(len(s.token_ids) for s in self.sequences.values()))
        out = RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions, finished, metrics,
                            None if self.prompt_logprobs is None else list(self.prompt_logprobs), core.error)
        return out, stopped

    def _advance(self, seq: _SequenceText, delta: SequenceDelta, stopped: list) -> tuple[str, list[int]]:
        result, keep = add_tokens(seq.detokenizer, delta.token_ids)
        ids = delta.token_ids[:keep]
        seq.token_ids += ids
        if seq.logprobs is not None and delta.logprobs:
            seq.logprobs += [self._named(e) for e in delta.logprobs[:keep]]
        seq.cumulative_logprob = delta.cumulative_logprob
        text = result.text_delta
        if delta.finish_reason is not None:  # the core ended it: EOS, a stop id, length, its grammar, abort
            if not result.finished:
                text += seq.detokenizer.flush()
            seq.finish_reason, seq.stop_reason = delta.finish_reason, delta.stop_reason
        elif result.finished:
            seq.finish_reason, seq.stop_reason = "stop", result.stop_string
            stopped.append((delta.index, result.stop_string))
        return text, ids

    def _named(self, entry: dict[int, Logprob] | None) -> dict[int, Logprob] | None:
        """A logprob entry with each token's text, which the core leaves out."""
        if entry is not None:
            for token, lp in entry.items():
                lp.decoded_token = self.tokenizer.decode([token])
        return entry
