"""`kvflow serve --speculative-config` (issue 20): through the openai client, greedy answers equal a plain
server's on the same weights, streamed or not, and the kept drafts show in kvflow_timings and /metrics."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI

from server.conftest import DEFAULT_NAME
from server.server_process import ServerProcess

CODE = "\n".join(f"def scale_{i}(value):\n    return value * {i} + 1\n" for i in range(10))
PROMPT = (f"<|im_start|>user\nRepeat this file exactly:\n```python\n{CODE}```<|im_end|>\n"
          "<|im_start|>assistant\n```python\n")


@pytest.fixture(scope="module")
def speculative_server():
    config = json.dumps({"method": "ngram", "num_speculative_tokens": 12})
    server = ServerProcess("--kv-cache-memory", "128MiB", "--dtype", "float32", "--speculative-config", config)
    yield server
    server.stop()


def test_answers_equal_a_plain_servers(speculative_server, default_server):
    def client(server):
        return OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120)

    kwargs = dict(model=DEFAULT_NAME, prompt=PROMPT, max_tokens=80, temperature=0)
    plain = client(default_server).completions.create(**kwargs)
    spec = client(speculative_server).completions.create(**kwargs)
    assert spec.choices[0].text == plain.choices[0].text and spec.usage.completion_tokens == 80
    streamed = "".join(c.choices[0].text for c in client(speculative_server).completions.create(**kwargs, stream=True))
    assert streamed == plain.choices[0].text
    timings = spec.usage.model_extra["kvflow_timings"]
    assert 0 < timings["spec_accepted_tokens"] <= timings["spec_draft_tokens"]
    assert speculative_server.metric("kvflow:spec_decode_num_accepted_tokens_total") >= timings["spec_accepted_tokens"]
    chat = client(speculative_server).chat.completions.create(
        model=DEFAULT_NAME, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=12,
        temperature=0)
    assert "Paris" in chat.choices[0].message.content


def test_a_bad_speculative_config_stops_the_command_at_once():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "kvflow", "serve", "--speculative-config", '{"method": "x"}'],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "speculative_config.method" in done.stderr
