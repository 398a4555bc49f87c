"""The rest of the API that OpenAI, vLLM and llama.cpp clients call (issue 24): logit_bias, tokenize and
detokenize, /version, models.retrieve, usage in every chunk, X-Request-Id, JSON-only bodies (415), a seed
that does not fit 64 bits (a 400 for that request alone), --root-path, --uds, and a log line per request
under its id."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from openai import OpenAI

from server.conftest import DEFAULT_NAME
from server.server_process import ServerProcess
from server.test_errors import assert_error, assert_still_serves, post


@pytest.fixture(scope="module")
def client(agent_server) -> OpenAI:
    return OpenAI(base_url=f"{agent_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _token(agent_server, text: str) -> int:
    r = httpx.post(f"{agent_server.base_url}/tokenize", json={"prompt": text, "add_special_tokens": False})
    (token,) = r.json()["tokens"]
    return token


def test_logit_bias_steers_greedy_output(agent_server, client):
    banana = _token(agent_server, " banana")
    bias = {str(banana): 100}
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=DEFAULT_NAME, messages=messages, max_tokens=3, temperature=0,
                                          logit_bias=bias)
    assert chat.choices[0].message.content.startswith(" banana") or chat.choices[0].message.content.startswith("banana")
    done = client.completions.create(model=DEFAULT_NAME, prompt="The capital of France is", max_tokens=2,
                                     temperature=0, logit_bias=bias)
    assert done.choices[0].text.startswith(" banana")
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=DEFAULT_NAME, prompt="The capital of France is", max_tokens=2, temperature=0, logit_bias=bias,
        stream=True) if c.choices)
    assert streamed == done.choices[0].text
    paris = client.completions.create(model=DEFAULT_NAME, prompt="The capital of France is", max_tokens=1,
                                      temperature=0).choices[0].text
    banned = client.completions.create(model=DEFAULT_NAME, prompt="The capital of France is", max_tokens=1,
                                       temperature=0, logit_bias={str(_token(agent_server, paris)): -100})
    assert banned.choices[0].text != paris


@pytest.mark.parametrize("bias, message", [({"not-an-id": 1}, "token ids"), ({"5": 101}, "[-100, 100]"),
                                           ({"99999999": 1}, "outside the vocabulary")])
def test_bad_logit_bias_is_400(agent_server, bias, message):
    r = post(agent_server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "logit_bias": bias})
    assert_error(r, 400, "logit_bias", None, message)
    assert_still_serves(agent_server)


@pytest.mark.parametrize("text", ["The quick brown fox.", "안녕하세요, 세계!", "def f(x):\n    return x ** 2\n",
                                  "Emoji: 🦊🚀 done"])
def test_tokenize_detokenize_round_trip(agent_server, text):
    url = agent_server.base_url
    tokens = httpx.post(f"{url}/tokenize", json={"prompt": text, "add_special_tokens": False,
                                                 "return_token_strs": True}).json()
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"]) and tokens["max_model_len"] > 0
    back = httpx.post(f"{url}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert back["prompt"] == back["content"] == text
    pieces = httpx.post(f"{url}/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == tokens["tokens"]  # llama.cpp's shape


def test_tokenize_messages_is_the_chat_prompt(agent_server, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    counted = httpx.post(f"{agent_server.base_url}/tokenize", json={"messages": messages}).json()["count"]
    used = client.chat.completions.create(model=DEFAULT_NAME, messages=messages, max_tokens=1).usage.prompt_tokens
    assert counted == used
    r = post(agent_server, "/detokenize", {"tokens": [10**9]})
    assert_error(r, 400, "tokens", None, "outside the vocabulary")


def test_version_and_models_retrieve(agent_server, client):
    assert httpx.get(f"{agent_server.base_url}/version").json()["version"]
    assert client.models.retrieve(DEFAULT_NAME).id == DEFAULT_NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_continuous_usage_stats(client):
    chunks = list(client.chat.completions.create(
        model=DEFAULT_NAME, messages=[{"role": "user", "content": "Count: one two"}], max_tokens=6, temperature=0,
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices and c.usage is not None]
    assert counts and counts == sorted(counts) and counts[-1] >= 5
    assert chunks[-1].usage.completion_tokens == 6


def test_request_id_header_comes_back(agent_server):
    r = httpx.post(f"{agent_server.base_url}/v1/completions", headers={"X-Request-Id": "trace-42"},
                   json={"prompt": "hi", "max_tokens": 1})
    assert r.headers["x-request-id"] == "trace-42" and r.json()["id"] == "trace-42"


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_bodies_that_are_not_declared_json_are_415(agent_server, content_type):
    for path in ("/v1/completions", "/api/generate"):
        r = httpx.post(f"{agent_server.base_url}{path}", headers={"Content-Type": content_type},
                       content=json.dumps({"model": DEFAULT_NAME, "prompt": "hi", "max_tokens": 1, "stream": False}))
        assert r.status_code == 415 and "application/json" in r.text
    assert_still_serves(agent_server)


def test_a_seed_that_does_not_fit_fails_only_its_request(agent_server):
    good = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0}
    bad = {**good, "seed": 18446744073709551615, "n": 2}
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda body: post(agent_server, "/v1/completions", body), [good, bad, good]))
    assert [r.status_code for r in answers] == [200, 400, 200]
    assert answers[1].json()["error"]["param"] == "seed" and "64-bit" in answers[1].json()["error"]["message"]


def test_root_path_and_request_log_lines(tiny_model_dir):
    server = ServerProcess("--model", str(tiny_model_dir), "--kv-cache-memory", "32MiB", "--root-path", "/kv",
                           "--log-level", "info")
    try:
        url = server.base_url
        assert httpx.get(f"{url}/kv/v1/models").status_code == 200
        r = httpx.post(f"{url}/kv/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                       headers={"X-Request-Id": "trace-77"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "trace-77"
        deadline = time.monotonic() + 10
        while "request trace-77 finished (length): " not in server.output() and time.monotonic() < deadline:
            time.sleep(0.1)  # the line is written as the engine thread hands the output over
        line = next(x for x in server.output().splitlines() if "request trace-77 finished" in x)
        assert "1 generated" in line and "TTFT" in line
        assert httpx.get(f"{url}/kv/health").status_code == 200 and httpx.get(f"{url}/v1/models").status_code == 200
        r = httpx.post(f"{url}/kv/api/generate", json={"model": "x", "prompt": "hi"})  # an Ollama route's error shape
        assert r.status_code == 404 and isinstance(r.json()["error"], str)
    finally:
        server.stop()


def test_unix_socket(tiny_model_dir, tmp_path):
    socket_path = tmp_path / "kvflow.sock"
    cmd = [sys.executable, "-m", "kvflow", "serve", "--model", str(tiny_model_dir), "--kv-cache-memory", "32MiB",
           "--uds", str(socket_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(socket_path)), base_url="http://kvflow") as unix:
            deadline = time.monotonic() + 120
            while True:
                assert proc.poll() is None, "kvflow serve --uds exited"
                try:
                    if unix.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    assert time.monotonic() < deadline, "not ready over the socket"
                    time.sleep(0.3)
            r = unix.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        proc.terminate()
        proc.wait(30)
