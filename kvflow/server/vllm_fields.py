"""vLLM's request extensions to the OpenAI APIs, which users moving from vLLM send, each done as vLLM does it:

    return_token_ids            the prompt's token ids (chat: on the response, or its first chunk; completions:
                                on each choice) and each choice's generated ids (streamed: each chunk's own)
    return_tokens_as_token_ids  logprob tokens written "token_id:N", for tokens whose text is not valid UTF-8
    logprob_token_ids           with logprobs: these tokens' logprobs at each position, instead of the top k
    truncate_prompt_tokens      keep the prompt's last N tokens (-1: as many as the context holds)
  chat only:
    include_reasoning           false: the answer's thinking is left out (and, as vLLM, its logprobs and ids)
    add_generation_prompt       false: the prompt ends after the last message; the answer's role is that
                                message's role
    echo                        the answer starts with the last message's content, when that message has the
                                answer's role
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, Field

from kvflow.outputs import Logprob
from kvflow.server.errors import bad_request


class VllmFields(BaseModel):
    """Fields of /v1/completions and /v1/chat/completions."""

    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    logprob_token_ids: list[int] | None = Field(None, min_length=1)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)

    def check_vllm_fields(self, logprobs_asked: bool) -> None:
        if self.logprob_token_ids is not None and not logprobs_asked:
            raise bad_request("logprob_token_ids needs logprobs", "logprob_token_ids")
        if self.truncate_prompt_tokens == 0:
            raise bad_request("truncate_prompt_tokens must be -1 (the whole context) or a positive number of "
                              "tokens", "truncate_prompt_tokens")

    def truncated(self, token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's last truncate_prompt_tokens tokens (vLLM truncates on the left)."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return token_ids
        keep = max_model_len if keep == -1 else keep
        return token_ids[-keep:]


class VllmChatFields(BaseModel):
    """Fields of /v1/chat/completions (and of /tokenize's chat form, add_generation_prompt)."""

    include_reasoning: bool = True
    add_generation_prompt: bool = True
    echo: bool = False


def prompt_inputs(engine, body: VllmFields, prompts: list) -> tuple[list, list[list[int]] | None]:
    """The prompts to submit, and their token ids where the response needs them before the engine's first
    output (return_token_ids, usage in every chunk) or the prompt is cut (truncate_prompt_tokens): the
    prompts are then submitted as those ids."""
    if not (body.return_token_ids or body.truncate_prompt_tokens is not None
            or running_usage_wanted(getattr(body, "stream_options", None))):
        return prompts, None
    ids = [body.truncated(engine.tokenize(p) if isinstance(p, str) else list(p), engine.max_model_len)
           for p in prompts]
    return ids, ids


def token_options(body: VllmFields) -> dict:
    """How logprobs blocks write tokens (return_tokens_as_token_ids) and which they list (logprob_token_ids)."""
    return {"as_ids": bool(body.return_tokens_as_token_ids), "every": body.logprob_token_ids is not None}


def check_generation_prompt(body: BaseModel, continue_final_message: bool) -> None:
    """vLLM refuses both asked for: the answer either continues the last message or starts a new one."""
    if continue_final_message and getattr(body, "add_generation_prompt", False) \
            and "add_generation_prompt" in body.model_fields_set:
        raise bad_request("give continue_final_message or add_generation_prompt, not both",
                          "add_generation_prompt")


def token_id_name(token_id: int) -> str:
    """How return_tokens_as_token_ids writes a token."""
    return f"token_id:{token_id}"


def alternatives(entry: dict[int, Logprob], k: int, every: bool) -> list[tuple[int, Logprob]]:
    """A position's alternatives as (token id, logprob): the top k, best first; with logprob_token_ids
    (every), all the entry holds, as vLLM lists them: the sampled token, then the tokens asked for."""
    if every:
        return list(entry.items())
    return sorted(((t, lp) for t, lp in entry.items() if 1 <= lp.rank <= k), key=lambda item: item[1].rank)


def token_name(token_id: int, lp: Logprob, as_ids: bool) -> str:
    return token_id_name(token_id) if as_ids else (lp.decoded_token or "")


def running_usage_wanted(stream_options) -> bool:
    """vLLM's rule: usage in every chunk needs both include_usage and continuous_usage_stats."""
    return bool(stream_options and stream_options.include_usage and stream_options.continuous_usage_stats)


def opening_usage(prompt_token_ids: Sequence[Sequence[int]]) -> dict:
    """The usage of a chunk sent before any token (the role chunk, an echo): the prompt alone."""
    prompt_tokens = sum(len(ids) for ids in prompt_token_ids)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens}
