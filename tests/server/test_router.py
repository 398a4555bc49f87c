"""Data-parallel replicas across machines: plain `kvflow serve` processes behind SGLang's cache-aware router
(sglang-router, from PyPI). An agent's turns land on one replica, whose prefix cache then serves them; when
that replica dies, the router sends the conversation to the other, which keeps answering."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time

import httpx
import openai
import pytest

from .server_process import ServerProcess, free_port, wait_until_answering

AGENT_SYSTEM = ("You are a coding agent. Tools: read_file, write_file, run_tests. Answer with one tool call. "
                "The repository holds a parser, a scheduler and a cache; keep changes small. " * 3)


class Router:
    """sglang-router's launcher on a free port, in front of `workers`."""

    def __init__(self, workers: list[str]) -> None:
        # A free port is only free until someone takes it: with two test processes starting servers, the
        # router once lost that race ("Address already in use"); it then starts again on other ports.
        for attempt in range(3):
            self.port = free_port()
            self.base_url = f"http://127.0.0.1:{self.port}"
            self.log = tempfile.NamedTemporaryFile("w+", prefix="sglang-router-", suffix=".log")  # noqa: SIM115
            cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
                   str(self.port), "--worker-urls", *workers, "--policy", "cache_aware", "--prometheus-port",
                   str(free_port()), "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                   "--log-level", "warn"]
            self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
            try:
                wait_until_answering(self.proc, f"{self.base_url}/v1/models", 60, self.output, "sglang-router")
                return
            except RuntimeError as exc:
                self.log.close()
                if "Address already in use" not in str(exc) or attempt == 2:
                    raise

    def healthy(self) -> dict[str, bool]:
        workers = httpx.get(f"{self.base_url}/workers", timeout=5).json()["workers"]
        return {w["url"]: w["is_healthy"] for w in workers}

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture
def replicas(tiny_model_dir):
    servers = [ServerProcess("--model", str(tiny_model_dir), "--threads", "1", "--kv-cache-memory", "16MiB",
                             "--engine-process", "off") for _ in range(2)]
    router = Router([s.base_url for s in servers])
    yield router, servers
    router.stop()
    for server in servers:
        server.stop()


def _served(server: ServerProcess) -> float:
    return server.metric("kvflow:request_success_total", 'finished_reason="length"')


def test_an_agent_stays_on_one_replica_and_survives_its_death(replicas):
    router, servers = replicas
    client = openai.OpenAI(base_url=f"{router.base_url}/v1", api_key="none", max_retries=0)
    messages = [{"role": "system", "content": AGENT_SYSTEM}]
    cached = []
    for turn in range(4):
        messages.append({"role": "user", "content": f"Step {turn}: run the tests and report."})
        answer = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=6, temperature=0)
        cached.append(answer.usage.prompt_tokens_details.cached_tokens)
        messages.append({"role": "assistant", "content": answer.choices[0].message.content})
    counts = [_served(s) for s in servers]
    assert sorted(counts) == [0, 4], f"the turns were spread over the replicas: {counts}"
    assert all(c > 0 for c in cached[1:]), f"later turns missed the prefix cache: {cached}"

    home = servers[counts.index(4)]
    other = servers[1 - counts.index(4)]
    home.proc.kill()
    home.proc.wait()
    deadline = time.monotonic() + 15  # the router's health check (every second) takes it out
    while router.healthy()[home.base_url] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert router.healthy() == {home.base_url: False, other.base_url: True}
    for turn in range(4, 7):
        messages.append({"role": "user", "content": f"Step {turn}: run the tests again."})
        answer = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=6, temperature=0)
        assert answer.choices[0].finish_reason == "length"
        messages.append({"role": "assistant", "content": answer.choices[0].message.content})
    assert _served(other) == 3
