"""Fitting a request into the served context, as agents expect of a local server.

Coding agents ask for more output than is left once their long prompts are in (Claude Code asks for
max_tokens 32000 on a 20,000-token prompt): like llama-server and Ollama, kvflow then generates what fits,
and the answer ends with finish_reason "length" (Anthropic: stop_reason "max_tokens"). `--strict-max-tokens`
refuses such a request with a 400 instead, as kvflow did before. A prompt that leaves no room at all gets the
error each API's clients act on: OpenAI's code "context_length_exceeded", and Anthropic's
"prompt is too long: N tokens > M maximum" (on which Claude Code compacts its history).
"""

from __future__ import annotations

from dataclasses import replace

from kvflow.sampling_params import SamplingParams
from kvflow.server.errors import APIError


class ContextLengthExceeded(APIError):
    """A prompt of n_prompt tokens in a context of max_model_len, which must leave one token to generate."""

    def __init__(self, n_prompt: int, max_model_len: int) -> None:
        super().__init__(
            400,
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has {n_prompt} "
            f"tokens (at least one must be left to generate). Please reduce the length of the messages.",
            None,
            "context_length_exceeded",
        )
        self.n_prompt = n_prompt
        self.max_model_len = max_model_len

    def anthropic_body(self) -> dict:
        # Anthropic's own wording, which its clients parse: the maximum is the longest prompt that fits.
        message = f"prompt is too long: {self.n_prompt} tokens > {self.max_model_len - 1} maximum"
        return {"type": "error", "error": {"type": "invalid_request_error", "message": message}}


def fit_context(n_prompt: int, params: SamplingParams, max_model_len: int, strict: bool) -> SamplingParams:
    """params for a prompt of n_prompt tokens: max_tokens clamped to the room left in the context (unless
    strict, where the engine's own check then refuses it); ContextLengthExceeded when there is no room."""
    if n_prompt >= max_model_len:
        raise ContextLengthExceeded(n_prompt, max_model_len)
    room = max_model_len - n_prompt
    if strict or params.max_tokens is None or params.max_tokens <= room:
        return params
    return replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
