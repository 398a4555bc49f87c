"""OpenAI response pieces: logprobs blocks, choices and SSE framing."""

from __future__ import annotations

import json
from collections.abc import Sequence

from kvflow.outputs import Logprob


def sse(obj: dict | str) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n"


def _top(entry: dict[int, Logprob], k: int) -> list[Logprob]:
    """The k most likely alternatives, best first."""
    return sorted((lp for lp in entry.values() if 1 <= lp.rank <= k), key=lambda lp: lp.rank)


def completion_logprobs(
    token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]], k: int, offset: int
) -> dict:
    """/v1/completions logprobs: tokens, token_logprobs, top_logprobs (top k plus the chosen token), text_offset."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for token, entry in zip(token_ids, entries):
        chosen = entry[token]
        text = chosen.decoded_token or ""
        tokens.append(text)
        token_logprobs.append(chosen.logprob)
        top: dict[str, float] = {}
        for lp in _top(entry, k):  # distinct tokens can decode alike (byte tokens): keep the likeliest
            key = lp.decoded_token or ""
            top[key] = max(top.get(key, lp.logprob), lp.logprob)
        top[text] = chosen.logprob
        top_logprobs.append(top)
        text_offset.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def _token_entry(lp: Logprob) -> dict:
    text = lp.decoded_token or ""
    return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]], k: int) -> dict:
    """/v1/chat/completions logprobs: {"content": [{token, logprob, bytes, top_logprobs}], "refusal": null}."""
    content = []
    for token, entry in zip(token_ids, entries):
        item = _token_entry(entry[token])
        item["top_logprobs"] = [_token_entry(lp) for lp in _top(entry, k)]
        content.append(item)
    return {"content": content, "refusal": None}
