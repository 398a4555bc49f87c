"""Servers shared by the tests: a tiny random Llama (fast, for protocol and error tests) and the default
model SmolLM2 (real text, for parity and streaming). Each is one `kvflow serve` subprocess."""

from __future__ import annotations

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


@pytest.fixture(scope="session")
def agent_server():
    """The default model as `kvflow serve` runs it by default (the fast mode): for the structured-output,
    tool-calling and agent-framework tests, which check validity rather than bitwise equality."""
    server = ServerProcess("--kv-cache-memory", "256MiB")
    yield server
    server.stop()
