"""Each class of bad input gets its exact status and error body, and the server serves the next request."""

from __future__ import annotations

import threading
import time

import httpx
import ollama
import openai
import pytest
from tiny_models import TINY_CONTEXT, TINY_NAME

from server.server_process import KeyedServerProcess

GOOD = {"prompt": "hello", "max_tokens": 2, "ignore_eos": True}


def post(server, path: str, body=None, **kwargs) -> httpx.Response:
    headers = {**server.auth_headers(), **kwargs.pop("headers", {})}
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=60, **kwargs)


def assert_error(r: httpx.Response, status: int, param, code, message_has: str | tuple = ()) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["code"] == code
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    for part in (message_has,) if isinstance(message_has, str) else message_has:
        assert part in error["message"], error["message"]
    return error


def assert_still_serves(server) -> None:
    r = post(server, "/v1/completions", GOOD)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("body, param, code, message", [
    ({**GOOD, "temperature": -1}, "temperature", None, "temperature: must be >= 0, got -1"),
    ({**GOOD, "top_p": 1.5}, "top_p", None, "top_p: must be in (0, 1]"),
    ({**GOOD, "n": 0}, "n", None, "n: must be an integer >= 1"),
    ({**GOOD, "logprobs": 50}, "logprobs", None, "logprobs: must be an integer in [0, 20]"),
    ({**GOOD, "max_tokens": "many"}, "max_tokens", "invalid_value", "invalid value for max_tokens"),
    ({**GOOD, "logit_bias": {"5": 500}}, "logit_bias", None, "biases must be numbers in [-100, 100]"),
    ({**GOOD, "seed": 2**64 - 1}, "seed", None, "seed: must be a signed 64-bit integer"),
    ({"max_tokens": 2}, "prompt", "missing_parameter", "missing required field: prompt"),
    ({**GOOD, "prompt": []}, "prompt", None, "the prompt is empty"),
    ({**GOOD, "prompt": [1, 99999]}, "prompt", None, "prompt token ids must be in [0, 384)"),
    ({**GOOD, "prompt": [[1, 2], []]}, "prompt", None, "the prompt is empty"),
    ({**GOOD, "suffix": "x"}, "suffix", "unsupported_parameter", "suffix is not supported"),
    ({**GOOD, "echo": True, "logprobs": 21}, "logprobs", None, "logprobs: must be an integer in [0, 20]"),
])
def test_bad_completion_fields_are_400(tiny_server, body, param, code, message):
    assert_error(post(tiny_server, "/v1/completions", body), 400, param, code, message)
    assert_still_serves(tiny_server)


def test_bad_chat_fields_are_400(tiny_server):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = post(tiny_server, "/v1/chat/completions", {**chat, "top_logprobs": 2})
    assert_error(r, 400, "top_logprobs", None, "top_logprobs requires logprobs")
    r = post(tiny_server, "/v1/chat/completions", {**chat, "messages": [{"role": "wizard", "content": "x"}]})
    assert_error(r, 400, "messages.0.role", "invalid_value", "invalid value for messages.0.role")
    r = post(tiny_server, "/v1/chat/completions", {**chat, "tools": [{"type": "function"}]})
    assert_error(r, 400, "tools.0", "invalid_value", "tools.0")  # no function: not a tool of any known type
    r = post(tiny_server, "/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]})
    assert_error(r, 400, "messages.0.content", "invalid_value", "invalid value for messages.0.content")
    assert_still_serves(tiny_server)


def test_prompt_longer_than_the_context_states_both_lengths(tiny_server):
    # max_tokens past the room left is cut to it (--strict-max-tokens: a 400): test_context_fit.py
    r = post(tiny_server, "/v1/completions", {"prompt": [5] * 5000, "max_tokens": 1})
    assert_error(r, 400, None, "context_length_exceeded", ("5000 tokens", f"{TINY_CONTEXT} tokens"))
    assert_still_serves(tiny_server)


def test_unknown_model_is_404(tiny_server):
    r = post(tiny_server, "/v1/completions", {**GOOD, "model": "gpt-17"})
    assert_error(r, 404, "model", "model_not_found", "The model `gpt-17` does not exist")
    r = post(tiny_server, "/v1/chat/completions", {"model": "/no/such/path", "messages": []})
    assert_error(r, 404, "model", "model_not_found", "/no/such/path")
    for accepted in (TINY_NAME, f"{TINY_NAME}:latest"):
        assert post(tiny_server, "/v1/completions", {**GOOD, "model": accepted}).status_code == 200
    with pytest.raises(ollama.ResponseError) as info:
        ollama.Client(host=tiny_server.base_url).generate(model="gpt-17", prompt="hi")
    assert info.value.status_code == 404 and "gpt-17" in info.value.error
    assert_still_serves(tiny_server)


def test_malformed_json_is_400(tiny_server):
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        r = post(tiny_server, "/v1/completions", content=raw, headers={"Content-Type": "application/json"})
        assert_error(r, 400, None, "invalid_json", "body")
    r = post(tiny_server, "/api/generate", content=b"{oops")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]  # Ollama's error shape
    assert_still_serves(tiny_server)


def test_body_over_the_limit_is_413(tiny_server):
    big = {"prompt": "x" * (5 * 2**20), "max_tokens": 1}
    assert_error(post(tiny_server, "/v1/completions", big), 413, None, "request_too_large", "4194304 bytes")

    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(6):
            yield b" " * 2**20

    r = post(tiny_server, "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert_error(r, 413, None, "request_too_large")
    assert_still_serves(tiny_server)


def test_unknown_route_is_404_in_openai_shape(tiny_server):
    r = httpx.get(f"{tiny_server.base_url}/v1/nothing-here")
    assert_error(r, 404, None, None, "Not Found")


@pytest.fixture(scope="module")
def guarded_server(tiny_model_dir):
    """An API key, one running request at a time and at most one waiting."""
    # A long context, so the "long" request below outlasts the test even when the tiny model decodes at
    # thousands of tokens per second on a quiet machine.
    server = KeyedServerProcess("sekret", "--model", str(tiny_model_dir), "--kv-cache-memory", "64MiB",
                                "--max-num-seqs", "1", "--max-waiting", "1", "--served-model-name", "house-model",
                                "--max-model-len", "65536")
    yield server
    server.stop()


def test_api_key_is_required_except_for_health(guarded_server):
    url = guarded_server.base_url
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(f"{url}/v1/completions", json=GOOD, headers=headers)
        assert_error(r, 401, None, "invalid_api_key", "API key")
    assert httpx.get(f"{url}/v1/models").status_code == 401
    assert httpx.get(f"{url}/metrics").status_code == 401
    assert httpx.get(f"{url}/openapi.json").status_code == 401 and httpx.get(f"{url}/docs").status_code == 401
    described = httpx.get(f"{url}/openapi.json", headers={"Authorization": "Bearer sekret"}).json()
    assert {"/v1/chat/completions", "/v1/responses", "/v1/messages", "/api/chat"} <= set(described["paths"])
    assert "ChatCompletionRequest" in described["components"]["schemas"]
    anthropic_style = httpx.get(f"{url}/v1/models", headers={"x-api-key": "sekret"})
    assert anthropic_style.status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=f"{url}/v1", api_key="sekret", max_retries=0)
    assert [m.id for m in good.models.list().data] == ["house-model"]  # --served-model-name
    assert "KV cache" in guarded_server.output() and url in guarded_server.output()  # the start banner
    for name in ("house-model", TINY_NAME):  # the served name, and the model's own name as an alias
        done = good.completions.create(model=name, prompt="hi", max_tokens=2, extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 2 and done.model == "house-model"
    assert guarded_server.metric("kvflow:request_errors_total", 'kind="unauthorized"') >= 3


def _drain(lines) -> None:
    try:
        for _ in lines:
            pass
    except (httpx.HTTPError, RuntimeError):  # closed under us when the test leaves the stream
        pass


def test_full_waiting_queue_is_503_with_retry_after(guarded_server):
    url, headers = guarded_server.base_url, guarded_server.auth_headers()
    long = {"prompt": "hello", "max_tokens": 60000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=long) as running:
            lines = running.iter_lines()
            next(lines)  # the first is running...
            # ...and keeps being read, so the server never stalls on a full socket buffer meanwhile.
            drain = threading.Thread(target=_drain, args=(lines,), daemon=True)
            drain.start()
            with client.stream("POST", "/v1/completions", json=long) as waiting:
                assert waiting.status_code == 200  # ...the second is admitted and waits...
                r = client.post("/v1/completions", json=GOOD)  # ...and a third would be over the limit
                error = assert_error(r, 503, None, "server_overloaded", "1 requests are waiting")
                assert r.headers["Retry-After"] == "1" and error["type"] == "server_error"
        # Hanging up aborts both; once the server has noticed (it polls), new requests are welcome again.
        deadline = time.monotonic() + 10
        while guarded_server.metric("kvflow:num_requests_waiting") > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.post("/v1/completions", json=GOOD).status_code == 200
