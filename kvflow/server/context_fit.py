"""Fitting a request into the served context, as agents expect of a local server.

Coding agents ask for more output than is left once their long prompts are in (Claude Code asks for
max_tokens 32000 on a 20,000-token prompt): like llama-server and Ollama, kvflow then generates what fits,
and the answer ends with finish_reason "length" (Anthropic: stop_reason "max_tokens"). `--strict-max-tokens`
refuses such a request with a 400 instead, as kvflow did before. The room is the context's and the KV
cache's, whichever is less (a cache sized by --kv-cache-memory may hold fewer tokens than max_model_len).
A prompt that leaves no room at all gets the
error each API's clients act on: OpenAI's code "context_length_exceeded", and Anthropic's
"prompt is too long: N tokens > M maximum" (on which Claude Code compacts its history).
"""

from __future__ import annotations

from dataclasses import replace

from kvflow.sampling_params import SamplingParams
from kvflow.server.errors import APIError


class ContextLengthExceeded(APIError):
    """A prompt of n_prompt tokens where at most `limit` fit with one token to generate: the context
    (max_model_len - 1) or, where the KV cache holds fewer tokens, the cache (the pool's tokens + 1: the
    last sampled token takes no slot)."""

    def __init__(self, n_prompt: int, max_model_len: int, pool_tokens: int | None = None) -> None:
        if pool_tokens is not None and pool_tokens < max_model_len - 1:
            message = (f"The KV cache holds {pool_tokens} tokens (set by --kv-cache-memory), fewer than this "
                       f"model's maximum context length of {max_model_len} tokens, and the prompt has {n_prompt} "
                       f"tokens. Please reduce the length of the messages.")
            self.limit = pool_tokens
        else:
            message = (f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
                       f"{n_prompt} tokens (at least one must be left to generate). Please reduce the length of "
                       f"the messages.")
            self.limit = max_model_len - 1
        super().__init__(400, message, None, "context_length_exceeded")
        self.n_prompt = n_prompt
        self.max_model_len = max_model_len

    def anthropic_body(self) -> dict:
        # Anthropic's own wording, which its clients parse: the maximum is the longest prompt that fits.
        message = f"prompt is too long: {self.n_prompt} tokens > {self.limit} maximum"
        return {"type": "error", "error": {"type": "invalid_request_error", "message": message}}


def fit_context(n_prompt: int, params: SamplingParams, max_model_len: int, strict: bool,
                pool_tokens: int | None = None) -> SamplingParams:
    """params for a prompt of n_prompt tokens: max_tokens clamped to the room left in the context and in
    the KV cache (pool_tokens: the most one request can hold; None: no bound past the context), unless
    strict, where the engine's own check then refuses it; ContextLengthExceeded when there is no room."""
    room = max_model_len - n_prompt
    if pool_tokens is not None:
        # Every token but the last sampled one takes a slot: a prompt of the pool's size leaves one.
        room = min(room, pool_tokens + 1 - n_prompt)
    if room < 1:
        raise ContextLengthExceeded(n_prompt, max_model_len, pool_tokens)
    if strict or params.max_tokens is None or params.max_tokens <= room:
        return params
    return replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
