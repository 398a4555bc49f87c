"""The prefix cache's disk tier through the server: a server started on a store that an earlier engine wrote
(here an in-process one, with the server's own settings) reads the prompt's blocks back from disk, says so in
the response's timings and in /metrics, and answers as that engine did."""

from __future__ import annotations

import httpx

from kvflow import LLM, SamplingParams
from server.server_process import ServerProcess

PROMPT = "the quick brown fox jumps over the lazy dog and runs into the forest " * 12


def test_a_server_reads_an_earlier_engines_prefix_from_disk(tiny_model_dir, tmp_path):
    with LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=64 << 20, prefix_cache_dir=str(tmp_path)) as first:
        before = first.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert len(first.engine.prefix_store) > 0
    server = ServerProcess("--model", str(tiny_model_dir), "--kv-cache-memory", "64MiB", "--dtype", "float32",
                           "--prefix-cache-dir", str(tmp_path), "--prefix-cache-disk", "256MiB")
    try:
        assert server.metric("kvflow:prefix_cache_disk_blocks") == len(first.engine.prefix_store)
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        data = r.json()
        timings = data["usage"]["kvflow_timings"]
        assert data["choices"][0]["text"] == before.outputs[0].text
        assert timings["disk_cached_tokens"] == timings["cached_tokens"] > 100
        assert server.metric("kvflow:prefix_cache_disk_hits_total") == timings["disk_cached_tokens"]
        assert server.metric("kvflow:prefix_cache_disk_refused_total") == 0
    finally:
        server.stop()
