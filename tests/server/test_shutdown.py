"""SIGTERM/SIGINT: new connections are refused, the stream in flight runs to its end, the process exits 0."""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest

from server.server_process import ServerProcess


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_lets_the_stream_in_flight_finish_then_exits_0(tiny_model_dir, sig):
    server = ServerProcess("--model", str(tiny_model_dir), "--kv-cache-memory", "64MiB", "--shutdown-grace", "30")
    try:
        body = {"prompt": "hello", "max_tokens": 2000, "ignore_eos": True, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        events = []
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 2:
                        break
            server.proc.send_signal(sig)
            time.sleep(0.5)
            with pytest.raises(httpx.TransportError):  # no longer accepting
                httpx.get(f"{server.base_url}/health", timeout=5)
            events += [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        usage = json.loads(events[-2])["usage"]
        assert usage["completion_tokens"] == 2000
        finishes = [c["finish_reason"] for e in events[:-2] for c in json.loads(e)["choices"] if c["finish_reason"]]
        assert finishes == ["length"]
        assert server.proc.wait(30) == 0
    finally:
        server.stop()
