"""Servers shared by the tests: a tiny random Llama (fast, for protocol and error tests) and the default
model SmolLM2 (real text, for parity and streaming). Each is one `kvflow serve` subprocess."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_models import make_tiny_checkpoint

from server.server_process import ServerProcess

TINY_NAME = "tiny-llama"
# A longer context than the tiny checkpoint's 512, so streams can run long enough (thousands of tiny,
# fast steps) that tests can act on them mid-flight even on a busy machine.
TINY_CONTEXT = 4096
DEFAULT_NAME = "smollm2-135m"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    folder = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("models") / TINY_NAME)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config["max_position_embeddings"] = TINY_CONTEXT
    config_file.write_text(json.dumps(config))
    return folder


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
