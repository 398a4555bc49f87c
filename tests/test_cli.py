"""The kvflow command on the default model, as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys

ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}


def kvflow(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvflow", *args], input=stdin, capture_output=True, text=True, timeout=300, env=ENV
    )


def test_generate_chat_answers_paris():
    proc = kvflow("generate", "--chat", "--temperature", "0", "--max-tokens", "24", "--kv-cache-memory", "64MiB",
                  "What is the capital of France?")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_interactive_chat_streams_and_reports_speed():
    proc = kvflow("chat", "--temperature", "0", "--max-tokens", "16", "--kv-cache-memory", "64MiB",
                  stdin="What is the capital of France?\nAnd of Italy?\n")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "Rome" in proc.stdout
    stats = [line for line in proc.stderr.splitlines() if line.startswith("[TTFT")]
    assert len(stats) == 2 and all("tok/s" in line for line in stats), proc.stderr
