"""What the page reads from the server: GET /kvflow/live (the engine's gauges and the steps it ran), the page's
files, --no-ui, the API key around them, and the machine probe behind the roofline figures."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from server.server_process import KeyedServerProcess, ServerProcess

CHUNK = 64  # --max-num-batched-tokens: a long prompt runs in chunks of at most this many tokens


@pytest.fixture(scope="module")
def chunked_server(tiny_model_dir):
    server = ServerProcess("--model", str(tiny_model_dir), "--kv-cache-memory", "64MiB", "--dtype", "float32",
                           "--max-num-batched-tokens", str(CHUNK))
    yield server
    server.stop()


def test_live_reports_a_long_prompts_chunks_between_another_requests_decode_steps(chunked_server):
    base = chunked_server.base_url
    first = httpx.get(base + "/kvflow/live", timeout=10).json()
    assert first["running"] == 0 and first["kv_blocks_total"] > 0 and first["limits"]["model"]["weight_bytes_per_step"] > 0
    decoding = threading.Thread(target=httpx.post, args=(base + "/v1/completions",), kwargs={
        "json": {"prompt": "once upon a time", "max_tokens": 300, "ignore_eos": True, "temperature": 0},
        "timeout": 120})
    decoding.start()
    while httpx.get(base + "/kvflow/live", timeout=10).json()["running"] == 0:
        time.sleep(0.02)
    long_prompt = [(7 * i) % 300 + 50 for i in range(1000)]  # ids within the tiny vocabulary
    r = httpx.post(base + "/v1/completions", json={"prompt": long_prompt, "max_tokens": 2, "temperature": 0},
                   timeout=120)
    assert r.status_code == 200
    decoding.join()
    steps = httpx.get(base + "/kvflow/live", params={"since": first["num_steps"]}, timeout=10).json()["steps"]
    numbers = [s["step"] for s in steps]
    assert numbers == sorted(numbers) and numbers[0] > first["num_steps"]
    assert all(s["prefill_tokens"] + s["decode_tokens"] <= CHUNK for s in steps)
    mixed = [s for s in steps if s["prefill_tokens"] > 0 and s["decode_tokens"] > 0]
    assert len(mixed) >= len(long_prompt) // CHUNK  # each chunk of the long prompt ran beside a decode step
    assert sum(s["decode_tokens"] for s in steps) >= 300  # (fewer than the 400 steps one poll returns)
    last = numbers[-1]
    assert httpx.get(base + "/kvflow/live", params={"since": last}, timeout=10).json()["steps"] == []


def test_the_page_and_its_files(tiny_server):
    base = tiny_server.base_url
    page = httpx.get(base + "/", headers={"Accept": "text/html"}, timeout=10)
    assert page.status_code == 200 and '<base href="/">' in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    script = httpx.get(base + "/ui/app.js", timeout=10)
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
    assert httpx.get(base + "/ui/style.css", timeout=10).headers["content-type"].startswith("text/css")
    assert httpx.get(base + "/ui/../app.py", timeout=10).status_code == 404
    assert httpx.get(base + "/ui/nothing.js", timeout=10).status_code == 404


def test_no_ui_and_the_key(tiny_model_dir):
    server = KeyedServerProcess("k", "--model", str(tiny_model_dir), "--kv-cache-memory", "64MiB", "--no-ui",
                                "--root-path", "/kv")
    try:
        for prefix in ("", "/kv"):
            root = httpx.get(server.base_url + prefix + "/", headers={"Accept": "text/html"}, timeout=10)
            assert root.status_code == 200 and root.text == "kvflow is running"  # open, and no page
            assert httpx.get(server.base_url + prefix + "/ui/app.js", timeout=10).status_code == 404
            assert httpx.get(server.base_url + prefix + "/kvflow/live", timeout=10).status_code == 401
            live = httpx.get(server.base_url + prefix + "/kvflow/live", headers=server.auth_headers(), timeout=10)
            assert live.status_code == 200 and live.json()["running"] == 0
    finally:
        server.stop()


def test_the_machine_probe_runs_once_at_a_time_and_is_kept(default_loaded, monkeypatch, tmp_path):
    from kvflow.kernels import cpu_features
    from kvflow.machine import probe as probes
    from kvflow.server.machine import MachineLimits

    monkeypatch.setenv("KVFLOW_PROBE", str(tmp_path / "probe.json"))
    release = threading.Event()
    calls = []

    def fake_probe(threads=None, device="cpu", quick=False, log=None):  # the real one takes ~20 s of both cores
        calls.append(threads)
        release.wait(10)
        return {"kind": "probe", "device": device, "machine": {"cpu_model": cpu_features.cpu_name(), "date": "now"},
                "results": [{"threads": t, "copy_dram_gb_s": 10.0, "copy_cache_gb_s": 20.0, "matmul_f32_tflop_s": 0.1,
                             "matmul_bf16_tflop_s": None, "matmul_packed_tflop_s": None} for t in threads]}

    monkeypatch.setattr(probes, "run_probe", fake_probe)
    limits = MachineLimits(default_loaded.summary(), kv_dtype_bytes=4)
    assert limits.as_dict()["machine"] is None
    assert limits.start_probe() is True
    assert limits.start_probe() is False  # one at a time
    assert limits.as_dict()["probing"] is True
    release.set()
    deadline = time.monotonic() + 10
    while limits.as_dict()["probing"] and time.monotonic() < deadline:
        time.sleep(0.01)
    machine = limits.as_dict()["machine"]
    assert machine["bandwidth_bytes_per_s"] == 10e9 and machine["matmul_flop_per_s"] == 0.1e12
    assert len(calls) == 1 and probes.load_probe() is not None  # saved where the benchmarks look
    assert MachineLimits(default_loaded.summary(), kv_dtype_bytes=4).as_dict()["machine"] is not None  # kept for restarts
