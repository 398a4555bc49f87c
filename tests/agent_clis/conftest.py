"""The agent CLIs (installed by install_clients.sh into .agents-npm/) and the server they run against: the
default model as `kvflow serve` runs it by default, with the context the agents' prompts need."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from server.server_process import ServerProcess

INSTALL = Path(__file__).with_name("install_clients.sh")


@pytest.fixture(scope="session")
def agent_bin() -> Path:
    """The folder with node (24) and the four clients' commands, installed (pinned) on first use. On CI
    (KVFLOW_REQUIRE_AGENTS=1, set by .ci/run, which installs them first) a failed install fails the tests;
    elsewhere they are skipped with the reason."""
    required = os.environ.get("KVFLOW_REQUIRE_AGENTS") == "1"
    if shutil.which("npm") is None:
        message = "npm is needed to install the agent CLIs (apt-get install npm)"
        pytest.fail(message) if required else pytest.skip(message)
    done = subprocess.run([str(INSTALL)], capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        message = f"installing the agent CLIs failed:\n{done.stderr[-3000:]}"
        pytest.fail(message) if required else pytest.skip(message)
    return Path(done.stdout.strip().splitlines()[-1]) / "bin"


@pytest.fixture(scope="session")
def agent_cli_server():
    server = ServerProcess("--max-model-len", "32768", "--kv-cache-memory", "1GiB")
    yield server
    server.stop()
