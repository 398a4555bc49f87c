"""LLM: the offline Python API, in vLLM's shape.

    from kvflow import LLM, SamplingParams
    llm = LLM()                                   # the default model
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from kvflow.config import engine_config
from kvflow.engine.engine import LLMEngine
from kvflow.executors.model_setup import LoadedModel
from kvflow.outputs import RequestOutput
from kvflow.sampling_params import SamplingParams

Prompt = str | Sequence[int] | dict


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        attention_backend: str = "auto",
        loaded_model: LoadedModel | None = None,
        **engine_options: Any,
    ):
        config = engine_config(model=model, **engine_options)
        self.engine = LLMEngine(config, attention_backend, loaded_model)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def close(self) -> None:
        """Write what the prefix cache's disk tier still has queued (also done at interpreter exit)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched together; one RequestOutput per prompt, in input order."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        ids = [self.engine.add_request(None, _prompt_input(p), sp) for p, sp in zip(prompts, params)]
        finished: dict[str, RequestOutput] = {}
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return [finished[rid] for rid in ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        tokenizer = self.engine.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template")
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield a RequestOutput after every step that changed this request (delta_text holds the new text)."""
        rid = self.engine.add_request(None, _prompt_input(prompt), sampling_params)
        done = False
        try:
            while not done:
                for out in self.engine.step():
                    if out.request_id == rid:
                        done = out.finished
                        yield out
        finally:
            if not done:
                self.engine.abort_request(rid)


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if prompts and isinstance(prompts[0], int):
        return [prompts]  # one prompt given as token ids
    return list(prompts)


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params


def _prompt_input(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        return prompt["prompt"]
    return prompt if isinstance(prompt, str) else list(prompt)
