"""`kvflow serve --speculative-config` (issue 20): through the openai client, greedy answers equal a plain
server's on the same weights (a tiny random Llama in float32, whose greedy text loops: drafts are found
and kept), streamed or not, and the checked drafts show in kvflow_timings and /metrics."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI
from tiny_models import TINY_NAME

from server.server_process import ServerProcess

PROMPT = "The history of the Roman Empire began"


@pytest.fixture(scope="module")
def speculative_server(tiny_model_dir):
    config = json.dumps({"method": "ngram", "num_speculative_tokens": 12, "prompt_lookup_min": 1})
    server = ServerProcess("--model", str(tiny_model_dir), "--kv-cache-memory", "64MiB", "--dtype", "float32",
                           "--speculative-config", config)
    yield server
    server.stop()


def test_answers_equal_a_plain_servers(speculative_server, tiny_server):
    def client(server):
        return OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120)

    kwargs = dict(model=TINY_NAME, prompt=PROMPT, max_tokens=80, temperature=0, extra_body={"ignore_eos": True})
    plain = client(tiny_server).completions.create(**kwargs)
    spec = client(speculative_server).completions.create(**kwargs)
    assert spec.choices[0].text == plain.choices[0].text and spec.usage.completion_tokens == 80
    streamed = "".join(c.choices[0].text for c in client(speculative_server).completions.create(**kwargs, stream=True))
    assert streamed == plain.choices[0].text
    # Drafts were checked (how many were kept depends on what the control chose on this machine; the
    # engine tests pin kept drafts down).
    timings = spec.usage.model_extra["kvflow_timings"]
    assert 0 <= timings["spec_accepted_tokens"] <= timings["spec_draft_tokens"] and timings["spec_draft_tokens"] > 0
    assert speculative_server.metric("kvflow:spec_decode_num_draft_tokens_total") >= timings["spec_draft_tokens"]
    messages = [{"role": "user", "content": "Say something."}]
    chats = [client(server).chat.completions.create(model=TINY_NAME, messages=messages, max_tokens=40, temperature=0.8,
                                                    seed=5) for server in (tiny_server, speculative_server)]
    assert chats[0].choices[0].message.content == chats[1].choices[0].message.content  # seeded: the same sample


def test_a_bad_speculative_config_stops_the_command_at_once():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "kvflow", "serve", "--speculative-config", '{"method": "x"}'],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "speculative_config.method" in done.stderr
