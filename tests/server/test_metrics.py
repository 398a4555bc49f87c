"""/metrics: Prometheus text with vLLM-like names under kvflow:, counting what requests did."""

from __future__ import annotations

import httpx

HISTOGRAMS = ["time_to_first_token_seconds", "time_per_output_token_seconds", "inter_token_latency_seconds",
              "e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds"]
GAUGES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hit_rate",
          "kv_cache_blocks_used", "kv_cache_blocks_total"]
COUNTERS = ["prompt_tokens_total", "prompt_tokens_cached_total", "generation_tokens_total",
            "num_preemptions_total"]


def test_metrics_names_and_types(tiny_server):
    r = httpx.get(f"{tiny_server.base_url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in HISTOGRAMS:
        assert f"# TYPE kvflow:{name} histogram" in text
    for name in GAUGES:
        assert f"# TYPE kvflow:{name} gauge" in text
    for name in COUNTERS + ["request_success_total", "request_errors_total"]:
        # prometheus_client writes a counter's TYPE line with or without _total, by version
        assert f"# TYPE kvflow:{name} counter" in text or f"# TYPE kvflow:{name[:-6]} counter" in text
    assert "kvflow:num_preemptions_total 0.0" in text


def test_a_request_moves_the_counters(tiny_server):
    m = tiny_server.metric
    before = {name: m(f"kvflow:{name}") for name in ("prompt_tokens_total", "generation_tokens_total",
                                                     "time_to_first_token_seconds_count",
                                                     "inter_token_latency_seconds_count",
                                                     "e2e_request_latency_seconds_count", "prefix_cache_hit_rate")}
    length_before = m("kvflow:request_success_total", 'finished_reason="length"')
    prompt = "the quick brown fox jumps over the lazy dog " * 3  # long enough to fill prefix-cache blocks
    body = {"prompt": prompt, "max_tokens": 5, "ignore_eos": True}
    for _ in range(2):  # the second is a prefix-cache hit
        r = httpx.post(f"{tiny_server.base_url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200
    usage = r.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0
    assert m("kvflow:prompt_tokens_total") == before["prompt_tokens_total"] + 2 * usage["prompt_tokens"]
    assert m("kvflow:generation_tokens_total") == before["generation_tokens_total"] + 10
    assert m("kvflow:time_to_first_token_seconds_count") == before["time_to_first_token_seconds_count"] + 2
    assert m("kvflow:inter_token_latency_seconds_count") == before["inter_token_latency_seconds_count"] + 8
    assert m("kvflow:e2e_request_latency_seconds_count") == before["e2e_request_latency_seconds_count"] + 2
    assert m("kvflow:request_success_total", 'finished_reason="length"') == length_before + 2
    assert m("kvflow:prompt_tokens_cached_total") >= usage["prompt_tokens_details"]["cached_tokens"]
    assert 0 < m("kvflow:prefix_cache_hit_rate") <= 1
    assert m("kvflow:kv_cache_blocks_total") > 0 and m("kvflow:num_requests_running") == 0


def test_refused_requests_are_counted_by_kind(tiny_server):
    before = tiny_server.metric("kvflow:request_errors_total", 'kind="not_found"')
    httpx.post(f"{tiny_server.base_url}/v1/completions", json={"prompt": "x", "model": "nope"})
    assert tiny_server.metric("kvflow:request_errors_total", 'kind="not_found"') == before + 1
