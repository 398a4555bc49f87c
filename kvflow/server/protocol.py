"""OpenAI request bodies (pydantic). Unknown fields are rejected; OpenAI fields that kvflow does not act on
are accepted only when they would change nothing (user, metadata...), and refused otherwise."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from kvflow.sampling_params import SamplingParams
from kvflow.server.errors import bad_request, from_value_error


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingFields(Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # kvflow / vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # OpenAI fields accepted as metadata, or refused unless neutral (see check_common)
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None

    def check_common(self) -> None:
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias", "unsupported_parameter")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of must equal n (kvflow returns every sample)", "best_of",
                              "unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        values: dict[str, Any] = dict(
            n=self.n, max_tokens=max_tokens, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos, logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
        )
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty", "min_tokens"):
            value = getattr(self, name)
            if value is not None:
                values[name] = value
        try:
            return SamplingParams(**values)
        except ValueError as exc:
            raise from_value_error(exc, self.param_names()) from None

    def param_names(self) -> dict[str, str]:
        return {}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            prompts: list = [p]
        elif not p:
            raise bad_request("the prompt is empty", "prompt")
        elif all(isinstance(x, int) for x in p):
            prompts = [list(p)]
        else:
            prompts = list(p)
        if any(len(x) == 0 for x in prompts):
            raise bad_request("the prompt is empty", "prompt")
        return prompts

    def validate_request(self) -> SamplingParams:
        self.check_common()
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix", "unsupported_parameter")
        if self.echo and self.logprobs is not None:
            raise bad_request("echo with logprobs is not supported (kvflow has no prompt logprobs)", "echo",
                              "unsupported_parameter")
        return self.sampling_params(self.max_tokens, self.logprobs)


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    def as_template_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        # Templates written before "developer" existed know it as "system".
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    def param_names(self) -> dict[str, str]:
        return {"logprobs": "top_logprobs", "max_tokens": self._max_tokens_field()}

    def _max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def validate_request(self) -> SamplingParams:
        self.check_common()
        if not self.messages:
            raise bad_request("messages must not be empty", "messages")
        if self.tools:
            raise bad_request("tools are not supported", "tools", "unsupported_parameter")
        if self.tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice is not supported", "tool_choice", "unsupported_parameter")
        if self.response_format is not None and self.response_format.type != "text":
            raise bad_request("only response_format {\"type\": \"text\"} is supported", "response_format",
                              "unsupported_parameter")
        if self.store:
            raise bad_request("store is not supported", "store", "unsupported_parameter")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise bad_request("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling_params(max_tokens, logprobs)
