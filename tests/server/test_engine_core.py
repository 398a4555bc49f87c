"""The engine core in its own process (`kvflow serve --engine-process on`, and auto where the front end has a
core of its own): a core that dies is reported in every open stream, and the server exits non-zero instead of
serving without an engine. (`--engine-process off` is what every server test without --threads runs.)"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest

from .server_process import ServerProcess


def descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every process under pid."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        children = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout.split()
        for child in map(int, children):
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            found.append((child, cmdline))
            todo.append(child)
    return found


def core_pids(server: ServerProcess) -> list[int]:
    """The engine core processes under a server (multiprocessing's spawn runs them)."""
    return [pid for pid, cmd in descendants(server.proc.pid) if "spawn_main" in cmd]


def test_a_dead_core_fails_the_open_stream_and_the_server_exits_non_zero(tiny_model_dir):
    server = ServerProcess("--model", str(tiny_model_dir), "--threads", "1", "--kv-cache-memory", "16MiB",
                           "--engine-process", "on")
    try:
        cores = core_pids(server)
        assert len(cores) == 1, descendants(server.proc.pid)
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
        stream = iter(client.completions.create(model="tiny-llama", prompt="Once upon", max_tokens=3000,
                                                stream=True, extra_body={"ignore_eos": True}))
        next(stream)
        subprocess.run(["kill", "-9", str(cores[0])], check=True)
        killed = time.monotonic()
        with pytest.raises(openai.APIError, match="engine core process died"):
            for _ in stream:
                pass
        assert server.proc.wait(10) == 1
        assert time.monotonic() - killed < 10
        assert "the engine core process died (exit code -9)" in server.output()
    finally:
        server.stop()


def test_with_engine_restarts_a_dead_core_is_replaced_until_they_are_spent(tiny_model_dir):
    server = ServerProcess("--model", str(tiny_model_dir), "--threads", "1", "--kv-cache-memory", "16MiB",
                           "--engine-process", "on", "--engine-restarts", "1")
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
        first = core_pids(server)
        stream = iter(client.completions.create(model="tiny-llama", prompt="Once upon", max_tokens=3000,
                                                stream=True, extra_body={"ignore_eos": True}))
        next(stream)
        subprocess.run(["kill", "-9", str(first[0])], check=True)
        with pytest.raises(openai.APIError, match="engine core process died"):
            for _ in stream:
                pass
        # A new core loads (503 meanwhile, saying why), then the same server answers again.
        deadline = time.monotonic() + 120
        while (health := httpx.get(f"{server.base_url}/health")).status_code != 200:
            assert "engine core process died" in health.text
            assert server.proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        second = core_pids(server)
        assert len(second) == 1 and second != first
        last_step = max(r["step"] for r in httpx.get(f"{server.base_url}/kvflow/live").json()["steps"])
        answer = client.completions.create(model="tiny-llama", prompt="Once upon", max_tokens=5,
                                           extra_body={"ignore_eos": True})
        assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 5
        # The page's step numbers go on from the first core's: a page polling "since" its last step sees the new ones.
        new_steps = httpx.get(f"{server.base_url}/kvflow/live", params={"since": last_step}).json()["steps"]
        assert new_steps and min(r["step"] for r in new_steps) > last_step
        # The one restart is spent: the next death ends the server, non-zero.
        subprocess.run(["kill", "-9", str(second[0])], check=True)
        assert server.proc.wait(30) == 1
        assert "starting a new engine core" in server.output()
    finally:
        server.stop()
