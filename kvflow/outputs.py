"""What the engine hands back, in vLLM's shape: RequestOutput -> CompletionOutput(s), plus timings."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # per generated token: chosen + top alternatives
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    delta_text: str = ""  # text added by the latest step (for streaming)
    delta_token_ids: list[int] = field(default_factory=list)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Per-request timings (monotonic seconds) and counts, as of the output that carries them; the
    durations are None until their events happen (engine/request.py derives them)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_disk_cached_tokens: int = 0  # of those, read back from the prefix cache's disk tier
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # speculative decoding: guessed tokens verified
    num_accepted_tokens: int = 0  # of those, the ones kept
    queue_time: float | None = None  # arrival to first scheduled
    ttft: float | None = None  # arrival to first token
    prefill_time: float | None = None  # first scheduled to first token
    decode_time: float | None = None  # first token to last token
    tpot: float | None = None  # mean time per output token after the first


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # Per prompt token (None for the first, which nothing predicts), when prompt_logprobs was asked for;
    # filled in as the prompt is computed, complete by the first output token.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error: str | None = None  # set when the engine failed on this request alone (it is then finished)
