"""`kvflow bench latency` on a tiny model: runs, writes well-formed JSON, and its roofline arithmetic holds."""

from __future__ import annotations

import json
import subprocess
import sys

from kvflow.bench.latency import weight_bytes_read_per_step
from kvflow.machine.probe import save_probe

PROBE = {
    "kind": "probe", "device": "cpu", "quick": True, "machine": {},
    "results": [{"threads": t, "copy_dram_gb_s": 10.0, "copy_cache_gb_s": 40.0,
                 "matmul_f32_tflop_s": 0.25, "matmul_bf16_tflop_s": 1.5} for t in (1, 2)],
}


def test_latency_command_writes_json_with_rooflines(tmp_path, tiny_checkpoints):
    probe_path = save_probe(PROBE, tmp_path / "probe.json")
    out = tmp_path / "latency.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvflow", "bench", "latency", "--model", str(tiny_checkpoints["llama"]),
         "-p", "16,32", "-n", "8", "-d", "0,32", "-b", "1,2", "-r", "1", "--threads", "1",
         "--probe", str(probe_path), "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "| pp16 | 0 | 1 |" in proc.stdout and "| tg8 | 32 | 2 |" in proc.stdout
    report = json.loads(out.read_text())
    assert report["kind"] == "latency"
    tests = {(r["test"], r["depth"], r["batch"]) for r in report["results"]}
    assert tests == {("pp16", d, 1) for d in (0, 32)} | {("pp32", d, 1) for d in (0, 32)} | {
        ("tg8", d, b) for d in (0, 32) for b in (1, 2)}
    bandwidth = 10.0e9
    assert report["bandwidth_bytes_per_s"] == bandwidth
    for r in report["results"]:
        assert r["tokens_per_s"] > 0
        assert abs(r["fraction_of_roofline"] - r["tokens_per_s"] / r["roofline_tokens_per_s"]) < 1e-9
        if r["n_gen"]:  # decode: read rate / bytes per step * batch, bytes = weights + KV read
            per_step = report["weight_bytes_per_step"] + report["kv_bytes_per_token"] * r["batch"] * (
                r["depth"] + r["n_gen"] / 2)
            # The rate read around its runs (this machine's, not the saved probe's 10 GB/s)
            assert 1e8 < r["read_bytes_per_s"] < 1e13 and r["read_bytes_per_s"] != bandwidth
            assert abs(r["roofline_tokens_per_s"] - r["read_bytes_per_s"] / per_step * r["batch"]) < 1e-6


def test_zero_prompt_or_generation_length_skips_that_test(tmp_path, tiny_checkpoints):
    # As in llama-bench: -p 0 runs only the decode tests, -n 0 only the prefill ones (the first with
    # speculation on, which the report then names).
    probe_path = save_probe(PROBE, tmp_path / "probe.json")
    from kvflow.cli import main

    spec = ["--speculative-config", '{"method": "ngram", "prompt_lookup_min": 1}']
    off = ["--speculative-config", "off"]
    for flags, expected in ((["-p", "0", "-n", "16", *spec], {"tg16"}), (["-p", "8", "-n", "0", *off], {"pp8"})):
        out = tmp_path / "latency.json"
        # In this process (the command's own entry point): two interpreters and torch imports cost seconds.
        assert main(["bench", "latency", "--model", str(tiny_checkpoints["llama"]), *flags, "-d", "16", "-r", "1",
                     "--probe", str(probe_path), "--out", str(out)]) == 0
        report = json.loads(out.read_text())
        assert {r["test"] for r in report["results"]} == expected
        if spec[1] in flags:  # the run's speculation is reported beside the figures it changed
            assert report["speculative"]["method"] == "ngram"
            assert 0 <= report["speculative"]["accepted_tokens"] <= report["speculative"]["draft_tokens"]
        else:
            assert report["speculative"] is None


def test_weight_bytes_counts_each_read_weight_once(default_loaded):
    # SmolLM2 in float32: 134.5 M parameters, the tied embedding read once as the output projection.
    assert weight_bytes_read_per_step(default_loaded.model) == 134_515_008 * 4


def test_an_untied_packed_embedding_is_not_read_per_step(tiny_checkpoints, tmp_path):
    """A GGUF file's own token_embd (packed, not tied to the output) is only indexed: a decode step reads
    every packed byte but its table's."""
    from gguf_files import requantize
    from hf_to_gguf import hf_to_gguf

    from kvflow.config import ModelConfig
    from kvflow.executors.model_setup import load_model
    from kvflow.loader.quantized_loading import weight_nbytes

    f32 = hf_to_gguf(tiny_checkpoints["llama"], tmp_path / "f32.gguf")
    q8 = requantize(f32, tmp_path / "q8.gguf", lambda name: "Q8_0" if name.endswith(".weight") else None)
    model = load_model(ModelConfig(model=str(q8), device="cpu")).model
    assert not model.arch.tie_word_embeddings
    table = model.embed_tokens.source.nbytes()
    assert table > 0 and weight_bytes_read_per_step(model) == weight_nbytes(model) - table
