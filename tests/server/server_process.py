"""Run `kvflow serve` in a subprocess on 127.0.0.1 and a free port, and wait until /health says ready."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *args: str, startup_timeout: float = 300.0, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvflow-serve-", suffix=".log")  # noqa: SIM115
        cmd = [sys.executable, "-m", "kvflow", "serve", "--host", "127.0.0.1", "--port", str(self.port), *args]
        environ = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=environ)
        self._wait_ready(startup_timeout)

    def _wait_ready(self, timeout: float) -> None:
        try:
            wait_until_answering(self.proc, f"{self.base_url}/health", timeout, self.output, "kvflow serve")
        except TimeoutError:
            self.stop()
            raise

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def metric(self, name: str, labels: str = "") -> float:
        """One sample from /metrics, e.g. metric("kvflow:request_success_total", 'finished_reason="abort"')."""
        text = httpx.get(f"{self.base_url}/metrics", headers=self.auth_headers(), timeout=10).text
        pattern = re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else "") + r" (\S+)"
        m = re.search(r"^" + pattern + r"$", text, re.MULTILINE)
        return float(m.group(1)) if m else 0.0

    def auth_headers(self) -> dict[str, str]:
        return {}

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class KeyedServerProcess(ServerProcess):
    def __init__(self, api_key: str, *args: str, **kwargs) -> None:
        self.api_key = api_key
        super().__init__("--api-key", api_key, *args, **kwargs)

    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}


def wait_until_answering(proc: subprocess.Popen, url: str, timeout: float, output, name: str) -> None:
    """Until GET url answers 200; RuntimeError if proc exits first, TimeoutError after timeout (both with
    output(), the process's log)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{output()}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{name} not ready after {timeout} s:\n{output()}")
