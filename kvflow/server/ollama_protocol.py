"""Ollama request bodies (pydantic) and their mapping to SamplingParams.

Sampling defaults are Ollama's (temperature 0.8, top_k 40, top_p 0.9, repeat_penalty 1.1, unlimited
num_predict). Options that only tune resources (threads, GPUs, batch, mmap...) are accepted and have no
effect, since kvflow sizes those at start; options that would change the output and are not implemented
(mirostat, typical_p, tfs_z) are refused unless at their neutral value, as are images, templates and
context. Fields and options kvflow does not know are ignored, as Ollama does (serving.unknown_fields). `format` ("json" or a JSON
schema) and `tools` map onto the OpenAI request's response_format and tools (ChatRequest.as_openai)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from pydantic import BaseModel, ConfigDict

from kvflow.sampling_params import SamplingParams
from kvflow.server.errors import bad_request, from_value_error
from kvflow.structured.spec import StructuredOutput

_OPTION_NAMES = {  # SamplingParams field -> Ollama option
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
    "max_tokens": "num_predict", "stop": "stop", "repetition_penalty": "repeat_penalty",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
}


class Strict(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are ignored (serving.unknown_fields)


# Ollama's sampling options that kvflow does not implement, with the value at which they change nothing.
_NEUTRAL_OPTIONS = {"mirostat": 0, "typical_p": 1.0, "tfs_z": 1.0}


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
    # would change the output; refused unless neutral
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    typical_p: float | None = None
    tfs_z: float | None = None

    def sampling_params(self) -> SamplingParams:
        for name, neutral in _NEUTRAL_OPTIONS.items():
            value = getattr(self, name)
            if value is not None and value != neutral:
                raise bad_request(f"options.{name} is not supported (only {neutral}, which changes nothing)",
                                  f"options.{name}")
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
        if self.format is not None and self.format != "json" and not isinstance(self.format, dict):
            raise bad_request('format must be "json" or a JSON schema', "format")
        if self.logprobs or self.top_logprobs:
            raise bad_request("logprobs are not supported on the Ollama API; use /v1", "logprobs")

    def sampling_params(self) -> SamplingParams:
        self.check_common()
        params = (self.options or Options()).sampling_params()
        schema = self.format_schema()
        if schema is None:
            return params
        try:
            return replace(params, structured_output=StructuredOutput(json=schema))
        except ValueError as exc:
            raise bad_request(str(exc), "format", "invalid_schema") from None

    def format_schema(self) -> dict | None:
        if self.format == "json":
            return {"type": "object"}
        return self.format if isinstance(self.format, dict) else None


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


class Message(Strict):  # clients send back fields of their own; none changes the output
    role: str
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[dict] | None = None
    tool_name: str | None = None
    thinking: str | None = None

    def as_openai(self) -> dict:
        if self.images:
            raise bad_request("images are not supported", "messages")
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:  # Ollama gives arguments as an object; OpenAI as JSON text
            message["tool_calls"] = [{"type": "function", "function": {
                "name": (c.get("function") or {}).get("name", ""),
                "arguments": json.dumps((c.get("function") or {}).get("arguments", {}), ensure_ascii=False),
            }} for c in self.tool_calls]
        if self.tool_name:
            message["name"] = self.tool_name
        if self.thinking:  # a harmony template (gpt-oss) keeps the thinking before a tool call
            message["reasoning_content"] = self.thinking
        return message


class ChatRequest(_OllamaRequest):
    messages: list[Message] = []
    tools: list[dict] | None = None

    def check(self) -> None:
        pass

    def as_openai(self):
        """The same chat as an OpenAI request, so one path renders tools and builds the answer's grammar."""
        from kvflow.server.protocol import ChatCompletionRequest
        from kvflow.server.serving import validate_as

        body: dict[str, Any] = {"messages": [m.as_openai() for m in self.messages]}
        if self.think is False:  # Ollama's switch for thinking models; templates read enable_thinking
            body["chat_template_kwargs"] = {"enable_thinking": False}
        elif isinstance(self.think, str):  # "low", "medium" or "high": gpt-oss's reasoning effort
            body["reasoning_effort"] = self.think
        if self.tools:
            body["tools"] = self.tools
        schema = self.format_schema()
        if schema is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": schema}}
        return validate_as(ChatCompletionRequest, body)


class ShowRequest(Strict):
    model: str | None = None
    name: str | None = None  # the older spelling
    verbose: bool | None = None
