"""OpenAI request bodies (pydantic). ChatCompletionRequest is also the chat pipeline's internal chat request
(chat_pipeline.py), which the other wire APIs' adapters build from their own bodies. Unknown fields are
ignored (logged once and counted: serving.py); known OpenAI fields that kvflow does not act on are accepted
only when they would change nothing (user, metadata...), and refused otherwise. vLLM's extensions
(vllm_fields.py) are checked only when sent, so a plain request runs none of their code."""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvflow.sampling_params import SamplingParams
from kvflow.server.chat_tools import Tool, named_choice
from kvflow.server.errors import bad_request, from_value_error
from kvflow.server.vllm_fields import VllmChatFields, VllmFields, check_generation_prompt
from kvflow.structured.spec import StructuredOutput

log = logging.getLogger("kvflow")


class Strict(BaseModel):
    """Known fields are checked; unknown ones are kept aside and ignored (serving.parse_body counts them)."""

    model_config = ConfigDict(extra="allow")


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk


class Lenient(Strict):
    """Parts of a message: clients send `refusal`, `annotations`, `audio` and vendor fields back with the
    history; like every unknown field, they are ignored."""


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict | None = None

    def schema(self) -> dict | None:
        """The JSON schema it asks for (None for text)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "object"}
        if not self.json_schema or "schema" not in self.json_schema:
            return {"type": "object"}  # OpenAI allows a json_schema without a schema: any object
        return self.json_schema["schema"]


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs` (and its older `guided_*` fields): exactly one constraint."""

    json_: dict | str | bool | None = Field(None, alias="json")  # `json` would shadow pydantic's own method
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class SamplingFields(Strict, VllmFields):
    """Fields shared by /v1/completions and /v1/chat/completions (vLLM's extensions: vllm_fields.py)."""

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
    prompt_logprobs: int | None = None  # vLLM's: the top k per prompt token, returned as `prompt_logprobs`
    # SGLang's, which its router (sglang-router, in front of several kvflow servers) adds to what it forwards
    no_stop_trim: bool = False  # SGLang's include_stop_str_in_output
    return_hidden_states: bool = False
    # OpenAI fields accepted as metadata, or refused unless neutral (see check_common)
    user: str | None = None
    # OpenAI's: a name for prompts that share a prefix; their cached blocks outlast unnamed ones (and
    # data-parallel replicas route by it): SamplingParams.cache_key
    prompt_cache_key: str | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    # structured output: OpenAI's response_format, vLLM's structured_outputs and guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_output(self) -> tuple[StructuredOutput | None, str | None]:
        """The request's output constraint and the field it came from (a 400 when it gives several)."""
        found: list[tuple[str, StructuredOutput]] = []
        try:
            if self.response_format is not None and self.response_format.schema() is not None:
                found.append(("response_format", StructuredOutput(json=self.response_format.schema())))
            if self.structured_outputs is not None:
                so = self.structured_outputs
                found.append(("structured_outputs", StructuredOutput(json=so.json_, regex=so.regex,
                                                                     choice=so.choice, grammar=so.grammar)))
            for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                               ("guided_grammar", "grammar")):
                value = getattr(self, name)
                if value is not None:
                    found.append((name, StructuredOutput(**{kind: value})))
        except ValueError as exc:
            raise bad_request(str(exc), found[-1][0] if found else None, "invalid_schema") from None
        if len(found) > 1:
            raise bad_request(f"give one output constraint, not {len(found)} ({', '.join(n for n, _ in found)})",
                              found[1][0])
        return (found[0][1], found[0][0]) if found else (None, None)

    def check_common(self) -> None:
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of must equal n (kvflow returns every sample)", "best_of",
                              "unsupported_parameter")
        if self.return_hidden_states:
            raise bad_request("return_hidden_states is not supported", "return_hidden_states",
                              "unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        values: dict[str, Any] = dict(
            n=self.n, max_tokens=max_tokens, seed=self.seed, stop=self.stop,
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            structured_output=self.structured_output()[0],
            stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos, logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output or self.no_stop_trim,
            skip_special_tokens=self.skip_special_tokens, logit_bias=self._logit_bias(),
            logprob_token_ids=self.logprob_token_ids, cache_key=self.prompt_cache_key,
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

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI sends token ids as JSON object keys, so as strings."""
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not key.strip().isdigit():
                raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
            bias[int(key)] = value
        return bias

    @property
    def vllm_checked_fields_given(self) -> bool:
        """Whether vLLM's fields that have rules between them were sent (VllmFields.check_vllm_fields)."""
        return self.logprob_token_ids is not None or self.truncate_prompt_tokens is not None

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
        if self.vllm_checked_fields_given:
            self.check_vllm_fields(self.logprobs is not None)
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix", "unsupported_parameter")
        return self.sampling_params(self.max_tokens, self.logprobs, self.prompt_logprobs_wanted)

    @property
    def prompt_logprobs_wanted(self) -> int | None:
        """echo with logprobs scores the prompt too (what evaluation harnesses ask for); with vLLM's
        prompt_logprobs as well, the larger k serves both."""
        echoed = self.logprobs if self.echo and self.logprobs is not None else None
        asked = [k for k in (echoed, self.prompt_logprobs) if k is not None]
        return max(asked) if asked else None


class TextPart(Lenient):
    type: Literal["text"]
    text: str


class RefusalPart(Lenient):
    type: Literal["refusal"]
    refusal: str


class ToolCallFunction(Lenient):
    name: str
    arguments: str | dict = "{}"


class ToolCallItem(Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | RefusalPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCallItem] | None = None
    reasoning_content: str | None = None  # the thinking of an answer, sent back (harmony templates use it)

    def text(self) -> str:
        if isinstance(self.content, list):  # a refusal part is what the model declined to say: no text
            return "".join(part.text for part in self.content if isinstance(part, TextPart))
        return self.content or ""

    def as_template_dict(self) -> dict:
        # Templates written before "developer" existed know it as "system".
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(SamplingFields, VllmChatFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: e.g. {"enable_thinking": false}
    # OpenAI's; templates that take it (gpt-oss's) read it as `reasoning_effort`
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    # vLLM's and SGLang's: the answer continues the last (assistant) message instead of starting a new one
    continue_final_message: bool = False
    # SGLang's: thinking comes apart from the answer, streamed as it comes (kvflow always does both)
    separate_reasoning: bool = True
    stream_reasoning: bool = True

    def param_names(self) -> dict[str, str]:
        return {"logprobs": "top_logprobs", "max_tokens": self._max_tokens_field()}

    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template is given besides the messages and tools (chat_template_kwargs wins)."""
        effort = {"reasoning_effort": self.reasoning_effort} if self.reasoning_effort is not None else {}
        return {**effort, **(self.chat_template_kwargs or {})}

    def _max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def validate_request(self) -> SamplingParams:
        self.check_common()
        if self.vllm_checked_fields_given:
            self.check_vllm_fields(self.logprobs)
        if not self.messages:
            raise bad_request("messages must not be empty", "messages")
        if self.continue_final_message:
            check_generation_prompt(self, self.continue_final_message)
        self._check_tools()
        if self.store:
            raise bad_request("store is not supported", "store", "unsupported_parameter")
        for name in ("separate_reasoning", "stream_reasoning"):
            if not getattr(self, name):
                raise bad_request(f"{name} false is not supported (reasoning always comes apart, as it is made)",
                                  name, "unsupported_parameter")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise bad_request("continue_final_message needs the last message to be the assistant's",
                              "continue_final_message")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise bad_request("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling_params(max_tokens, logprobs)

    def _check_tools(self) -> None:
        names = [t.function.name for t in self.tools or []]
        for i, name in enumerate(names):
            if not name:
                raise bad_request("a tool needs a function name", f"tools.{i}.function.name")
        if len(set(names)) != len(names):
            raise bad_request("two tools have the same name", "tools")
        chosen = named_choice(self.tool_choice) if isinstance(self.tool_choice, dict) else None
        if (chosen is not None or self.tool_choice == "required") and not names:
            raise bad_request("tool_choice requires tools", "tool_choice")
        if chosen is not None and chosen not in names:
            raise bad_request(f"tool_choice names the function {chosen!r}, which is not among the tools",
                              "tool_choice")

    @property
    def answer_role(self) -> str:
        """The answer's role: the assistant's, or, with add_generation_prompt false, the last message's (vLLM)."""
        return "assistant" if self.add_generation_prompt or not self.messages else self.messages[-1].role

    def echoed(self) -> str:
        """With echo: the text the answer starts with, the last message's when it has the answer's role."""
        last = self.messages[-1] if self.messages else None
        return last.text() if self.echo and last is not None and last.role == self.answer_role else ""

    @property
    def calls_tools(self) -> bool:
        """Whether the answer may hold tool calls."""
        return bool(self.tools) and self.tool_choice != "none"
