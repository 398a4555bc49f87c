"""The machine probe: quick sizes, real measurements, JSON round trip."""

import json

import pytest
import torch

from kvflow.kernels import cpu_features, packed_matmul
from kvflow.machine import probe


def test_quick_probe_measures_positive_rates_and_restores_threads(tmp_path):
    before = torch.get_num_threads()
    result = probe.run_probe(threads=[1], quick=True)
    assert torch.get_num_threads() == before
    assert result["kind"] == "probe" and result["quick"] is True
    info = result["machine"]
    assert info["torch_version"] == torch.__version__
    assert info["cpu_model"] and info["logical_cores"] >= 1 and "T" in info["date"]
    (row,) = result["results"]
    assert row["threads"] == 1
    # Loose sanity bounds: any machine moves more than 0.1 GB/s and less than 10 TB/s.
    for key in ("read_dram_gb_s", "copy_dram_gb_s", "copy_cache_gb_s"):
        assert 0.1 < row[key] < 10_000
    assert info["cpu_tier"] == cpu_features.isa_tier()
    assert 1e-5 < row["matmul_f32_tflop_s"] < 10_000
    for key in ("matmul_bf16_tflop_s", "matmul_packed_tflop_s"):  # timed only where the engine uses them
        assert row[key] is None or 1e-5 < row[key] < 10_000
    assert (row["matmul_bf16_tflop_s"] is None) == (not cpu_features.has_native_bf16_matmul())
    assert (row["matmul_packed_tflop_s"] is None) == (not packed_matmul.available())


def test_probe_times_no_emulated_bfloat16(monkeypatch):
    """The quick path on a CPU without native bfloat16 (forced here): no bfloat16 matmul is timed at all,
    which on such a CPU would take a minute per 2048^3 product."""
    monkeypatch.setattr(cpu_features, "has_native_bf16_matmul", lambda: False)
    timed = []
    real = probe.matmul_rate
    monkeypatch.setattr(probe, "matmul_rate", lambda n, dtype, *a, **k: timed.append(dtype) or real(n, dtype, *a, **k))
    (row,) = probe.run_probe(threads=[1], quick=True)["results"]
    assert timed == [torch.float32] and row["matmul_bf16_tflop_s"] is None


def test_copy_bandwidth_counts_read_and_write(monkeypatch):
    # With a fixed fake duration the rate is exactly (read + write bytes) / time.
    monkeypatch.setattr(probe, "_median_seconds", lambda fn, dev, reps, warmup: 0.5)
    assert probe.copy_bandwidth(4 * 1024, reps=1, warmup=0) == 2 * 4 * 1024 / 0.5
    assert probe.matmul_rate(64, torch.float32, reps=1, warmup=0) == 2 * 64**3 / 0.5


def test_save_and_load_round_trip(tmp_path, monkeypatch):
    data = {
        "kind": "probe",
        "results": [
            {"threads": 1, "copy_dram_gb_s": 10.0, "copy_cache_gb_s": 40.0,
             "matmul_f32_tflop_s": 0.15, "matmul_bf16_tflop_s": 0.85},
            {"threads": 2, "copy_dram_gb_s": 17.0, "copy_cache_gb_s": 50.0,
             "matmul_f32_tflop_s": 0.3, "matmul_bf16_tflop_s": 1.88},
        ],
    }
    out = probe.save_probe(data, tmp_path / "sub" / "p.json")
    assert json.loads(out.read_text()) == data
    assert probe.load_probe(out) == data
    # The environment variable moves the default location.
    monkeypatch.setenv("KVFLOW_PROBE", str(tmp_path / "env.json"))
    assert probe.default_probe_path() == tmp_path / "env.json"
    assert probe.load_probe() is None
    probe.save_probe(data)
    assert probe.load_probe() == data
    # Accessors pick the largest thread count unless told otherwise.
    assert probe.bandwidth_bytes_per_s(data) == 17e9
    assert probe.bandwidth_bytes_per_s(data, threads=1, cache=True) == 40e9
    assert probe.matmul_flop_per_s(data, "bf16") == pytest.approx(1.88e12)
    assert probe.matmul_flop_per_s(data, "f32", threads=1) == pytest.approx(0.15e12)
    with pytest.raises(KeyError):
        probe.bandwidth_bytes_per_s(data, threads=4)
    # A probe that measured DRAM's read rate: the decode roofline takes it (a copy's rate under-reads it).
    data["results"][1]["read_dram_gb_s"] = 21.0
    assert probe.bandwidth_bytes_per_s(data) == 21e9
    assert probe.bandwidth_bytes_per_s(data, cache=True) == 50e9


# Runs on the GPU machine (benchmarks/gpu_check.sh); CPU-only CI has nothing to measure here.
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_quick_probe_on_cuda():
    result = probe.run_probe(device="cuda", quick=True)
    assert result["machine"]["gpu"]
    assert result["results"][0]["copy_dram_gb_s"] > 1


def test_cli_probe_writes_json_to_env_path(tmp_path, monkeypatch, capsys):
    from kvflow.bench.cli import main

    monkeypatch.setenv("KVFLOW_PROBE", str(tmp_path / "probe.json"))
    assert main(["probe", "--quick", "--threads", "1"]) == 0
    saved = probe.load_probe()
    assert saved["quick"] and [r["threads"] for r in saved["results"]] == [1]
    assert "saved" in capsys.readouterr().out
