"""Where a response's time went: queue, TTFT, prefill, decode (ms) and cached prompt tokens.

Reported as usage.kvflow_timings in bodies and final stream chunks, and as x-kvflow-* headers on
non-streaming responses. A request with several prompts reports the slowest prompt's times and the sum
of their cached tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvflow.outputs import RequestOutput

_PHASES = (("queue_ms", "queue_time"), ("ttft_ms", "ttft"), ("prefill_ms", "prefill_time"),
           ("decode_ms", "decode_time"))


def request_timings(outputs: Sequence[RequestOutput]) -> dict:
    timings: dict = {}
    for key, attr in _PHASES:
        values = [getattr(o.metrics, attr) for o in outputs]
        known = [v for v in values if v is not None]
        timings[key] = round(max(known) * 1000, 3) if known else None
    timings["cached_tokens"] = sum(o.metrics.num_cached_tokens for o in outputs)
    return timings


def timing_headers(timings: dict) -> dict[str, str]:
    headers = {}
    for key, value in timings.items():
        if value is None:
            continue
        name = "x-kvflow-" + key.replace("_ms", "-ms").replace("_", "-")
        headers[name] = str(value)
    return headers


def usage(outputs: Sequence[RequestOutput]) -> dict:
    """OpenAI's usage block (prompt tokens of every prompt, tokens of every choice) plus kvflow_timings."""
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    timings = request_timings(outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": timings["cached_tokens"]},
        "kvflow_timings": timings,
    }
