"""Logprobs in the shapes clients read: chat's `logprobs.content`, the completions `logprobs` block (over the
echoed prompt too: what lm-evaluation-harness and perplexity scripts sum), and vLLM's `prompt_logprobs` list.
vLLM's return_tokens_as_token_ids (as_ids) and logprob_token_ids (every) apply to the first two."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvflow.outputs import Logprob
from kvflow.server.vllm_fields import alternatives, token_id_name, token_name

Scored = Sequence[dict[int, Logprob] | None]


def _entry(token_id: int, lp: Logprob, as_ids: bool) -> dict:
    text = token_name(token_id, lp, as_ids)
    return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(token_ids: Sequence[int], entries: Scored, k: int, as_ids: bool = False,
                  every: bool = False) -> dict:
    """/v1/chat/completions logprobs: {"content": [{token, logprob, bytes, top_logprobs}], "refusal": null}."""
    content = []
    for token, entry in zip(token_ids, entries):
        item = _entry(token, entry[token], as_ids)
        item["top_logprobs"] = [_entry(t, lp, as_ids) for t, lp in alternatives(entry, k, every)]
        content.append(item)
    return {"content": content, "refusal": None}


def completion_logprobs(token_ids: Sequence[int], entries: Scored, k: int, offset: int, as_ids: bool = False,
                        every: bool = False) -> dict:
    """/v1/completions logprobs: tokens, token_logprobs, top_logprobs (top k plus the chosen token),
    text_offset (of each token's text, whatever as_ids writes)."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for token, entry in zip(token_ids, entries):
        chosen = entry[token]
        text = chosen.decoded_token or ""
        name = token_name(token, chosen, as_ids)
        tokens.append(name)
        token_logprobs.append(chosen.logprob)
        top: dict[str, float] = {}
        for tid, lp in alternatives(entry, k, every):  # distinct tokens can decode alike (byte tokens): keep the likeliest
            key = token_name(tid, lp, as_ids)
            top[key] = max(top.get(key, lp.logprob), lp.logprob)
        top[name] = chosen.logprob
        top_logprobs.append(top)
        text_offset.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def echoed_prompt_logprobs(prompt_ids: Sequence[int], scored: Scored, k: int, decode: Callable,
                           as_ids: bool = False) -> dict:
    """The completions logprobs block of an echoed prompt: its first token with null logprobs, then each
    later token's logprob given the ones before it."""
    first = decode([prompt_ids[0]])
    rest = completion_logprobs(prompt_ids[1:], scored[1:], k, len(first), as_ids)
    name = token_id_name(prompt_ids[0]) if as_ids else first
    return joined({"tokens": [name], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]}, rest)


def joined(first: dict, second: dict) -> dict:
    """Two completions logprobs blocks as one (the echoed prompt's, then the completion's)."""
    return {key: first[key] + second[key] for key in first}


def vllm_prompt_logprobs(prompt_ids: Sequence[int], scored: Scored, k: int) -> list[dict[str, dict] | None]:
    """vLLM's prompt_logprobs: per prompt token, None for the first, else {token id: {logprob, rank,
    decoded_token}} for the token itself and the k most likely."""
    out: list[dict[str, dict] | None] = []
    for token, entry in zip(prompt_ids, scored):
        if entry is None:
            out.append(None)
            continue
        kept = {tid: lp for tid, lp in entry.items() if tid == token or lp.rank <= k}
        out.append({str(tid): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                    for tid, lp in kept.items()})
    return out
