"""`kvflow serve --tensor-parallel-size 2`: the server starts its second rank itself, answers as the whole model
does, and when a rank dies it says so on /health and in the stream in flight, within seconds."""

from __future__ import annotations

import subprocess
import time

import httpx
import openai
import pytest

from kvflow import LLM, SamplingParams

from .server_process import ServerProcess
from .test_engine_core import descendants


@pytest.fixture
def split_server(tiny_model_dir):
    server = ServerProcess("--model", str(tiny_model_dir), "--tp", "2", "--threads", "1", "--dtype", "float32",
                           "--kv-cache-memory", "8MiB")
    yield server
    server.stop()


def test_split_server_answers_as_the_whole_model_and_reports_a_dead_rank(split_server, tiny_model_dir):
    client = openai.OpenAI(base_url=f"{split_server.base_url}/v1", api_key="none")
    prompt = "The quick brown fox"
    answer = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=12, temperature=0)
    with LLM(str(tiny_model_dir), dtype="float32", device="cpu", kv_cache_memory=8 << 20) as whole:
        expected = whole.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
    assert answer.choices[0].text == expected

    stream = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=3000, temperature=0.8,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    ranks = [pid for pid, cmd in descendants(split_server.proc.pid) if "kvflow.engine.rank_worker" in cmd]
    assert len(ranks) == 1, f"expected one spawned rank, found {ranks}"
    subprocess.run(["kill", "-9", str(ranks[0])], check=True)
    killed = time.monotonic()
    with pytest.raises(openai.APIError, match="rank"):
        for _ in chunks:
            pass
    assert time.monotonic() - killed < 10
    health = httpx.get(f"{split_server.base_url}/health", timeout=5)
    assert health.status_code == 503
    assert "tensor-parallel rank" in health.text
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=2)
    assert refused.value.status_code == 503
    assert "rank" in split_server.output()
