"""Front-end state of one user request: its sequences (n of them), their text, logprobs and generators."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvflow.engine.detokenizer import IncrementalDetokenizer
from kvflow.engine.request import Request
from kvflow.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvflow.sampling_params import SamplingParams


@dataclass
class SequenceState:
    """One of the n completions of a request, backed by one engine Request."""

    group_id: str
    index: int
    request: Request
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    num_processed: int = 0  # output tokens already detokenized

    def completion(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.detokenizer.output_text,
            token_ids=list(self.request.output_token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.request.stop_reason,
            delta_text=self.delta_text,
            delta_token_ids=list(self.delta_token_ids),
        )


@dataclass
class RequestGroup:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[SequenceState] = field(default_factory=list)
    children_to_fork: int = 0  # n - 1 until the first sequence's prompt is computed

    @property
    def finished(self) -> bool:
        return self.children_to_fork == 0 and all(s.finish_reason is not None for s in self.sequences)

    def metrics(self) -> RequestMetrics:
        first = self.sequences[0].request
        t = first.timings
        finished = [s.request.timings.finished_time for s in self.sequences]
        return RequestMetrics(
            arrival_time=t.arrival_time,
            first_scheduled_time=t.first_scheduled_time,
            first_token_time=t.first_token_time,
            finished_time=max(finished) if all(f is not None for f in finished) else None,
            token_times=list(t.token_times),
            num_prompt_tokens=len(self.prompt_token_ids),
            num_cached_tokens=max(first.num_cached_tokens, 0),
            num_generated_tokens=sum(s.request.num_output_tokens for s in self.sequences),
            num_preemptions=sum(s.request.num_preemptions for s in self.sequences),
        )

    def output(self) -> RequestOutput:
        out = RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[s.completion() for s in self.sequences],
            finished=self.finished,
            metrics=self.metrics(),
        )
        for s in self.sequences:
            s.delta_text, s.delta_token_ids = "", []
        return out
