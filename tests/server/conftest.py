"""Servers shared by the tests: a tiny random Llama (fast, for protocol and error tests) and the default
model SmolLM2 (real text, for parity and streaming). Each is one `kvflow serve` subprocess."""

from __future__ import annotations

import json

import pytest

from server.server_process import ServerProcess

DEFAULT_NAME = "smollm2-135m"


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir):
    # float32 is kvflow's bit-stable mode: these tests compare texts across batch compositions, and the
    # default CPU mode runs many-row matmuls in bf16 (AMX), whose rounding depends on the batch.
    server = ServerProcess("--model", str(tiny_model_dir), "--kv-cache-memory", "64MiB", "--dtype", "float32")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def default_server():
    server = ServerProcess("--kv-cache-memory", "256MiB", "--dtype", "float32")
    yield server
    server.stop()


# The machine limits the agent server's page states each answer against (KVFLOW_PROBE): known figures, so the
# page's tests can check its arithmetic.
PROBE_BANDWIDTH_GB_S = 20.0


def write_probe(path) -> None:
    from kvflow.kernels import cpu_features

    path.write_text(json.dumps({
        "kind": "probe", "device": "cpu", "quick": False,
        "machine": {"cpu_model": cpu_features.cpu_name(), "cpu_tier": cpu_features.isa_tier(), "date": "test"},
        "results": [{"threads": t, "copy_dram_gb_s": PROBE_BANDWIDTH_GB_S, "copy_cache_gb_s": 40.0,
                     "matmul_f32_tflop_s": 0.1, "matmul_bf16_tflop_s": None, "matmul_packed_tflop_s": 0.2}
                    for t in (1, 2, 4, 8)],
    }))


@pytest.fixture(scope="session")
def agent_server(tmp_path_factory):
    """The default model as `kvflow serve` runs it by default (the fast mode): for the structured-output,
    tool-calling and agent-framework tests, which check validity rather than bitwise equality, and the chat
    page's tests."""
    probe = tmp_path_factory.mktemp("probe") / "probe.json"
    write_probe(probe)
    server = ServerProcess("--kv-cache-memory", "256MiB", env={"KVFLOW_PROBE": str(probe)})
    yield server
    server.stop()
