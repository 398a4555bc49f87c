"""SamplingParams: how one request picks its tokens. Checked when built, so bad values never reach the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvflow.structured.spec import StructuredOutput

# Every generated token is checked against each stop string, and text that may begin one is held back, so a
# request's stop strings cost each step (of every request in the batch) time in their number and length.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # > 1 discourages tokens seen in prompt or output
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: until EOS or the context is full; 0: compute the prompt only
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: the chosen token's logprob plus the top k alternatives
    # vLLM's: with logprobs, these tokens' logprobs at each position instead of the top k (label scoring)
    logprob_token_ids: list[int] | None = None
    # The same for every prompt token after the first (what the model thought of the prompt: scoring,
    # perplexity). The prompt is then computed in full, never read from the prefix cache.
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_output: StructuredOutput | None = None  # a JSON schema, regex, choice or grammar to match
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI's range: [-100, 100])
    # A prefix-cache key (OpenAI's prompt_cache_key; Anthropic's cache_control): the prompt's cached blocks
    # are evicted after those of requests without one, and data-parallel replicas route by it.
    cache_key: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}: {why}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if not self.temperature >= 0.0:
            raise bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be -1, 0 (off) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "must be > 0")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer")
        if self.seed is not None and not -(2**63) <= self.seed <= 2**63 - self.n:
            # Sample i of n draws from seed + i, which must fit a signed 64-bit integer too.
            raise bad("seed", f"must be a signed 64-bit integer (at most 2**63 - n = {2**63 - self.n})")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 0):
            raise bad("max_tokens", "must be an integer >= 0")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must not exceed max_tokens ({self.max_tokens})")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"SamplingParams.stop: at most {MAX_STOP_STRINGS} stop strings of at most "
                             f"{MAX_STOP_CHARS} characters each, got {len(self.stop)} of up to "
                             f"{max(len(s) for s in self.stop)}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= 20):
                raise bad(name, "must be an integer in [0, 20]")
        if self.logprob_token_ids is not None:
            ids = self.logprob_token_ids
            if not isinstance(ids, list) or not ids or any(not isinstance(t, int) or isinstance(t, bool) or t < 0
                                                           for t in ids):
                raise bad("logprob_token_ids", "must be a non-empty list of token ids")
            if self.logprobs is None:
                raise bad("logprob_token_ids", "needs logprobs")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or any(not isinstance(t, int) or t < 0 for t in self.logit_bias):
                raise bad("logit_bias", "must map non-negative token ids to biases")
            if any(not isinstance(b, (int, float)) or not -100 <= b <= 100 for b in self.logit_bias.values()):
                raise bad("logit_bias", "biases must be numbers in [-100, 100]")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise bad("structured_output", "must be a kvflow.structured.spec.StructuredOutput")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
