"""Prompt logprobs in the two shapes clients read: OpenAI's completions `logprobs` block over the echoed
prompt (what lm-evaluation-harness and perplexity scripts sum), and vLLM's `prompt_logprobs` list."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvflow.outputs import Logprob

Scored = Sequence[dict[int, Logprob] | None]


def top_alternatives(entry: dict[int, Logprob], k: int) -> list[Logprob]:
    """The k most likely alternatives, best first."""
    return sorted((lp for lp in entry.values() if 1 <= lp.rank <= k), key=lambda lp: lp.rank)


def completion_logprobs(token_ids: Sequence[int], entries: Scored, k: int, offset: int) -> dict:
    """/v1/completions logprobs: tokens, token_logprobs, top_logprobs (top k plus the chosen token),
    text_offset."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for token, entry in zip(token_ids, entries):
        chosen = entry[token]
        text = chosen.decoded_token or ""
        tokens.append(text)
        token_logprobs.append(chosen.logprob)
        top: dict[str, float] = {}
        for lp in top_alternatives(entry, k):  # distinct tokens can decode alike (byte tokens): keep the likeliest
            key = lp.decoded_token or ""
            top[key] = max(top.get(key, lp.logprob), lp.logprob)
        top[text] = chosen.logprob
        top_logprobs.append(top)
        text_offset.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def echoed_prompt_logprobs(prompt_ids: Sequence[int], scored: Scored, k: int, decode: Callable) -> dict:
    """The completions logprobs block of an echoed prompt: its first token with null logprobs, then each
    later token's logprob given the ones before it."""
    first = decode([prompt_ids[0]])
    rest = completion_logprobs(prompt_ids[1:], scored[1:], k, len(first))
    return joined({"tokens": [first], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]}, rest)


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
