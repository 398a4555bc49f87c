"""The prefix cache's disk tier through the server: a prompt served before a restart is read back from disk
after it (the response's timings and /metrics say so), with the same answer."""

from __future__ import annotations

import httpx

from server.server_process import ServerProcess

PROMPT = "the quick brown fox jumps over the lazy dog and runs into the forest " * 12


def ask(server: ServerProcess) -> tuple[str, dict]:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()
    return data["choices"][0]["text"], data["usage"]["kvflow_timings"]


def test_a_restarted_server_reads_the_prefix_from_disk(tiny_model_dir, tmp_path):
    args = ("--model", str(tiny_model_dir), "--kv-cache-memory", "64MiB", "--dtype", "float32",
            "--prefix-cache-dir", str(tmp_path), "--prefix-cache-disk", "256MiB")
    first = ServerProcess(*args)
    try:
        text, timings = ask(first)
        assert timings["disk_cached_tokens"] == 0
        assert first.metric("kvflow:prefix_cache_disk_hits_total") == 0
    finally:
        first.stop()  # a clean shutdown: whatever is still queued reaches the disk
    second = ServerProcess(*args)
    try:
        assert second.metric("kvflow:prefix_cache_disk_blocks") > 0
        text2, timings2 = ask(second)
        assert text2 == text
        assert timings2["disk_cached_tokens"] == timings2["cached_tokens"] > 100
        assert second.metric("kvflow:prefix_cache_disk_hits_total") == timings2["disk_cached_tokens"]
        assert second.metric("kvflow:prefix_cache_disk_refused_total") == 0
    finally:
        second.stop()
