"""Fitting requests into the served context (chat_pipeline.fit_context), through the official clients:
max_tokens past the room left is cut to it (finish_reason "length", Anthropic stop_reason "max_tokens"), a
prompt that does not fit gets each API's own error (OpenAI code "context_length_exceeded", Anthropic's
"prompt is too long: N tokens > M maximum"), --strict-max-tokens refuses instead of cutting, a context past
the model's trained length is warned about, and the served context is reported where clients look for it."""

from __future__ import annotations

import re

import anthropic
import httpx
import ollama
import openai
import pytest
from tiny_models import TINY_CONTEXT, TINY_NAME

from server.server_process import ServerProcess
from server.test_errors import assert_still_serves


def _openai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _anthropic(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


def _message_of(server, tokens_left: int) -> list[dict]:
    """One user message whose chat prompt leaves about tokens_left tokens of the context."""
    def count(words: int) -> int:
        r = httpx.post(f"{server.base_url}/tokenize", timeout=60,
                       json={"messages": [{"role": "user", "content": "a " * words}]})
        return r.json()["count"]

    per_word = (count(1000) - count(0)) / 1000
    words = int((TINY_CONTEXT - tokens_left - count(0)) / per_word)
    return [{"role": "user", "content": "a " * words}]


def test_max_tokens_past_the_context_is_cut_to_the_room_left(tiny_server):
    client = _openai(tiny_server)
    prompt = [5] * (TINY_CONTEXT - 12)
    done = client.completions.create(model=TINY_NAME, prompt=prompt, max_tokens=32000,
                                      extra_body={"ignore_eos": True})
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 12
    chunks = list(client.completions.create(model=TINY_NAME, prompt=prompt, max_tokens=32000, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert chunks[-1].choices[0].finish_reason == "length"
    messages = _message_of(tiny_server, 20)
    # Claude Code's request: max_tokens 32000, streamed (the client refuses so large a non-streamed one)
    with _anthropic(tiny_server).messages.stream(model=TINY_NAME, max_tokens=32000, messages=messages) as stream:
        answer = stream.get_final_message()
    usage = answer.usage
    assert answer.stop_reason in ("max_tokens", "end_turn")  # the tiny random model may end on its own
    if answer.stop_reason == "max_tokens":
        assert usage.input_tokens + (usage.cache_read_input_tokens or 0) + usage.output_tokens == TINY_CONTEXT
    assert_still_serves(tiny_server)


def test_a_prompt_that_does_not_fit_gets_each_apis_error(tiny_server):
    too_long = _message_of(tiny_server, -100)
    with pytest.raises(openai.BadRequestError) as info:
        _openai(tiny_server).chat.completions.create(model=TINY_NAME, messages=too_long, max_tokens=8)
    assert info.value.code == "context_length_exceeded"
    assert f"maximum context length is {TINY_CONTEXT} tokens" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        _openai(tiny_server).completions.create(model=TINY_NAME, prompt=[5] * TINY_CONTEXT, max_tokens=1)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(anthropic.BadRequestError) as caught:
        _anthropic(tiny_server).messages.create(model=TINY_NAME, max_tokens=8, messages=too_long)
    error = caught.value.body["error"]
    assert error["type"] == "invalid_request_error"
    m = re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum", error["message"])
    assert m is not None, error["message"]
    assert int(m.group(1)) > TINY_CONTEXT and int(m.group(2)) == TINY_CONTEXT - 1
    with pytest.raises(ollama.ResponseError) as refused:
        ollama.Client(host=tiny_server.base_url).chat(model=TINY_NAME, messages=too_long)
    assert refused.value.status_code == 400 and f"{TINY_CONTEXT} tokens" in refused.value.error
    assert_still_serves(tiny_server)


def test_strict_max_tokens_and_a_context_past_the_trained_length(tiny_model_dir):
    served = 2 * TINY_CONTEXT
    server = ServerProcess("--model", str(tiny_model_dir), "--kv-cache-memory", "64MiB", "--dtype", "float32",
                           "--max-model-len", str(served), "--strict-max-tokens")
    try:
        assert f"--max-model-len {served} is above the {TINY_CONTEXT} tokens" in server.output()
        with pytest.raises(openai.BadRequestError) as info:
            _openai(server).completions.create(model=TINY_NAME, prompt=[5] * 10, max_tokens=served)
        assert "max_tokens" in info.value.message and str(served) in info.value.message
        listed = httpx.get(f"{server.base_url}/v1/models", timeout=30).json()["data"][0]
        assert listed["max_model_len"] == served
        shown = ollama.Client(host=server.base_url).show(TINY_NAME)
        assert shown.modelinfo["llama.context_length"] == served
        assert_still_serves(server)
    finally:
        server.stop()


# The tiny Llama's KV cache in float32: 2 layers x (K, V) x 2 heads x 16 dims x 4 bytes = 512 bytes a token.
POOL_TOKENS = 1024


def test_the_kv_cache_bounds_the_room_too_and_rope_scaling_stretches_the_context(tiny_model_dir):
    """A cache smaller than the context (--kv-cache-memory): max_tokens is cut to what the cache holds past
    the prompt, and a prompt the cache cannot hold gets each API's context error naming the cache, not a
    generic 400 from the scheduler. The same server runs --rope-scaling yarn:2: a context twice the
    trained one, served without the past-the-trained-length warning."""
    server = ServerProcess("--model", str(tiny_model_dir), "--kv-cache-memory", f"{POOL_TOKENS * 512}B",
                           "--dtype", "float32", "--rope-scaling", "yarn:2")
    try:
        assert "is above the" not in server.output()
        listed = httpx.get(f"{server.base_url}/v1/models", timeout=30).json()["data"][0]
        assert listed["max_model_len"] == 2 * TINY_CONTEXT > POOL_TOKENS
        client = _openai(server)
        done = client.completions.create(model=TINY_NAME, prompt=[5] * (POOL_TOKENS - 24), max_tokens=32000,
                                          extra_body={"ignore_eos": True})
        # The last sampled token takes no slot: 25 tokens after a prompt 24 short of the pool.
        assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 25
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=TINY_NAME, prompt=[5] * (POOL_TOKENS + 1), max_tokens=4)
        assert info.value.code == "context_length_exceeded"
        assert f"KV cache holds {POOL_TOKENS} tokens" in info.value.message and "--kv-cache-memory" in info.value.message
        with pytest.raises(anthropic.BadRequestError) as caught:
            _anthropic(server).messages.create(model=TINY_NAME, max_tokens=8,
                                               messages=[{"role": "user", "content": "a " * 3000}])
        m = re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum", caught.value.body["error"]["message"])
        assert m is not None and int(m.group(1)) > POOL_TOKENS and int(m.group(2)) == POOL_TOKENS
        assert_still_serves(server)
    finally:
        server.stop()
