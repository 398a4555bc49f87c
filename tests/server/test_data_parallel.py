"""`kvflow serve --data-parallel-size 2`: two engine cores behind one front end. An agent's turns go to the
replica that holds its prefix (its prefix-cache hits say so); another conversation goes to the idle one; when
a replica dies, the other keeps serving, and /health and /metrics say which one is out."""

from __future__ import annotations

import re
import subprocess
import time

import httpx
import openai
import pytest

from .server_process import ServerProcess
from .test_engine_core import core_pids, descendants

SYSTEM = ("You are a coding agent. Tools: read_file, write_file, run_tests. Answer with one tool call. "
          "The repository holds a parser, a scheduler and a cache; keep changes small. " * 3)


def _replicas(server: ServerProcess) -> dict[str, dict]:
    """Per replica number: its core's pid, whether it is up, its prefix-cache hit tokens and its steps (from
    /metrics)."""
    found: dict[str, dict] = {}
    for line in httpx.get(f"{server.base_url}/metrics", timeout=10).text.splitlines():
        m = re.match(r"^(kvflow:replica_\w+)\{([^}]*)\} (\S+)$", line)
        if m is None:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        entry = found.setdefault(labels["replica"], {})
        if m.group(1) == "kvflow:replica_up":
            entry.update(up=float(m.group(3)), pid=int(labels["pid"]))
        elif m.group(1) == "kvflow:replica_prefix_cache_hits_total":
            entry["hits"] = float(m.group(3))
        elif m.group(1) == "kvflow:replica_engine_steps_total":
            entry["steps"] = float(m.group(3))
    return found


@pytest.fixture
def two_replicas(tiny_model_dir):
    server = ServerProcess("--model", str(tiny_model_dir), "--dp", "2", "--threads", "2", "--kv-cache-memory", "16MiB")
    yield server
    server.stop()


def _turn(client: openai.OpenAI, messages: list[dict]) -> int:
    answer = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=6, temperature=0)
    messages.append({"role": "assistant", "content": answer.choices[0].message.content})
    return answer.usage.prompt_tokens_details.cached_tokens


def test_turns_stay_on_their_replica_and_one_replica_dying_leaves_the_other(two_replicas):
    client = openai.OpenAI(base_url=f"{two_replicas.base_url}/v1", api_key="none", max_retries=0)
    agent = [{"role": "system", "content": SYSTEM}]
    cached = []
    for turn in range(4):
        agent.append({"role": "user", "content": f"Step {turn}: run the tests and report."})
        cached.append(_turn(client, agent))
    assert all(c > 0 for c in cached[1:]), cached
    replicas = _replicas(two_replicas)
    assert sorted(r["hits"] > 0 for r in replicas.values()) == [False, True], replicas
    home = next(i for i, r in replicas.items() if r["hits"] > 0)
    away = next(i for i in replicas if i != home)

    other = [{"role": "user", "content": "A different conversation about the weather, with nothing in common."}]
    _turn(client, other)  # no prefix anywhere: the replica sent fewer requests takes it
    assert _replicas(two_replicas)[away]["hits"] == replicas[away]["hits"]

    subprocess.run(["kill", "-9", str(replicas[home]["pid"])], check=True)
    deadline = time.monotonic() + 10
    while _replicas(two_replicas)[home]["up"] == 1.0 and time.monotonic() < deadline:
        time.sleep(0.1)
    health = httpx.get(f"{two_replicas.base_url}/health", timeout=5)
    assert health.status_code == 200 and f"replica {home}" in health.text, health.text
    for turn in range(4, 7):
        agent.append({"role": "user", "content": f"Step {turn}: run the tests again."})
        _turn(client, agent)
    assert _replicas(two_replicas)[away]["hits"] > replicas[away]["hits"]  # the agent's turns moved there
    assert two_replicas.proc.poll() is None


def test_replicas_of_tensor_parallel_ranks_answer_as_one_engine(tiny_model_dir, tiny_server):
    """--dp 2 --tp 2: two cores, each leading a rank of its own; in float32 each answers as one engine does."""
    server = ServerProcess("--model", str(tiny_model_dir), "--dp", "2", "--tp", "2", "--threads", "1",
                           "--dtype", "float32", "--kv-cache-memory", "16MiB")
    try:
        ranks = [pid for pid, cmd in descendants(server.proc.pid) if "kvflow.engine.rank_worker" in cmd]
        assert len(core_pids(server)) == 2 and len(ranks) == 2, descendants(server.proc.pid)
        prompts = ["Once upon a time", "The capital of France is"]
        for prompt in prompts * 2:  # two conversations: one per replica (the least loaded), then where each is
            got = httpx.post(f"{server.base_url}/v1/completions", timeout=60, json={
                "model": "tiny-llama", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
            want = httpx.post(f"{tiny_server.base_url}/v1/completions", timeout=60, json={
                "model": "tiny-llama", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
            assert got.status_code == 200, got.text
            assert got.json()["choices"][0]["text"] == want.json()["choices"][0]["text"]
        replicas = _replicas(server)
        assert len(replicas) == 2 and all(r["up"] == 1.0 and r["steps"] > 0 for r in replicas.values()), replicas
    finally:
        server.stop()
