"""Ollama request bodies (pydantic) and their mapping to SamplingParams.

Sampling defaults are Ollama's (temperature 0.8, top_k 40, top_p 0.9, repeat_penalty 1.1, unlimited
num_predict). Options that only tune resources (threads, GPUs, batch, mmap...) are accepted and have no
effect, since kvflow sizes those at start; options that would change the output and are not implemented
(mirostat, typical_p...) are refused, as are images, tools, templates, formats and context."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from kvflow.sampling_params import SamplingParams
from kvflow.server.errors import bad_request, from_value_error

_OPTION_NAMES = {  # SamplingParams field -> Ollama option
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
    "max_tokens": "num_predict", "stop": "stop", "repetition_penalty": "repeat_penalty",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Options(Strict):
    temperature: float = 0.8
    top_p: float = 0.9
    top_k: int = 40
    min_p: float = 0.0
    seed: int | None = None
    num_predict: int = -1  # -1: until EOS; -2: until the context is full
    stop: list[str] | str | None = None
    repeat_penalty: float = 1.1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # resource hints, accepted without effect
    num_ctx: int | None = None
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    num_thread: int | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    numa: bool | None = None
    low_vram: bool | None = None

    def sampling_params(self) -> SamplingParams:
        if self.num_predict in (-1, -2):
            max_tokens = None
        elif self.num_predict >= 1:
            max_tokens = self.num_predict
        else:
            raise bad_request(f"options.num_predict must be -1, -2 or >= 1, got {self.num_predict}",
                              "options.num_predict")
        try:
            return SamplingParams(
                temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                seed=self.seed, max_tokens=max_tokens, stop=self.stop, repetition_penalty=self.repeat_penalty,
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            )
        except ValueError as exc:
            raise from_value_error(exc, {k: f"options.{v}" for k, v in _OPTION_NAMES.items()}) from None


class _OllamaRequest(Strict):
    model: str
    stream: bool = True
    options: Options | None = None
    format: str | dict | None = None
    keep_alive: float | str | None = None  # the model stays loaded anyway
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def check_common(self) -> None:
        if self.format:
            raise bad_request("format is not supported", "format")
        if self.think:
            raise bad_request("think is not supported", "think")
        if self.logprobs or self.top_logprobs:
            raise bad_request("logprobs are not supported on the Ollama API; use /v1", "logprobs")

    def sampling_params(self) -> SamplingParams:
        self.check_common()
        return (self.options or Options()).sampling_params()


class GenerateRequest(_OllamaRequest):
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None

    def check(self) -> None:
        for name in ("suffix", "template", "context", "images"):
            if getattr(self, name):
                raise bad_request(f"{name} is not supported", name)
        if self.raw and self.system:
            raise bad_request("system cannot be used with raw", "system")


class Message(Strict):
    role: str
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[Any] | None = None
    tool_name: str | None = None
    thinking: str | None = None

    def as_template_dict(self) -> dict:
        if self.images or self.tool_calls:
            raise bad_request("images and tool calls are not supported", "messages")
        return {"role": self.role, "content": self.content}


class ChatRequest(_OllamaRequest):
    messages: list[Message] = []
    tools: list[Any] | None = None

    def check(self) -> None:
        if self.tools:
            raise bad_request("tools are not supported", "tools")


class ShowRequest(Strict):
    model: str | None = None
    name: str | None = None  # the older spelling
    verbose: bool | None = None
