"""vLLM's request extensions (issue 51), each done as vLLM does it, on the tiny random model through the
official client: return_token_ids, return_tokens_as_token_ids, logprob_token_ids, truncate_prompt_tokens,
add_generation_prompt and echo on chat; /tokenize's chat options and its vocabulary pieces; usage in every
chunk by vLLM's rule; wrong values are 400s naming the field, and so is a malformed message /tokenize reads."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from server.test_errors import assert_error, assert_still_serves, post

MODEL = "tiny-llama"
MESSAGES = [{"role": "user", "content": "hello world"}]
GREEDY = {"model": MODEL, "temperature": 0, "max_tokens": 6}


@pytest.fixture(scope="module")
def client(tiny_server) -> OpenAI:
    return OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _tokenize(server, **body) -> httpx.Response:
    return httpx.post(f"{server.base_url}/tokenize", json=body, timeout=60)


def _stream(client, **kwargs) -> list:
    return list(client.chat.completions.create(messages=MESSAGES, stream=True, **GREEDY, **kwargs))


def test_usage_in_every_chunk_follows_vllms_rule(client):
    """include_usage and continuous_usage_stats: usage in every chunk, the role's first; continuous_usage_stats
    alone: none anywhere; include_usage alone: only the closing chunk."""
    chunks = _stream(client, stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert all(c.usage is not None for c in chunks)
    prompt_tokens = chunks[-1].usage.prompt_tokens
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (chunks[0].usage.prompt_tokens, chunks[0].usage.completion_tokens) == (prompt_tokens, 0)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 6
    assert all(c.usage is None for c in _stream(client, stream_options={"continuous_usage_stats": True}))
    plain = _stream(client, stream_options={"include_usage": True})
    assert [c.usage is not None for c in plain] == [False] * (len(plain) - 1) + [True]


def test_return_token_ids(tiny_server, client):
    done = client.chat.completions.create(messages=MESSAGES, **GREEDY, extra_body={"return_token_ids": True})
    prompt = _tokenize(tiny_server, messages=MESSAGES).json()["tokens"]
    assert done.prompt_token_ids == prompt and len(prompt) == done.usage.prompt_tokens
    ids = done.choices[0].token_ids
    assert len(ids) == done.usage.completion_tokens == 6
    chunks = _stream(client, extra_body={"return_token_ids": True})
    assert chunks[0].prompt_token_ids == prompt  # vLLM: in the first chunk
    assert [t for c in chunks if c.choices for t in getattr(c.choices[0], "token_ids", [])] == ids
    plain = client.chat.completions.create(messages=MESSAGES, **GREEDY)
    assert not hasattr(plain, "prompt_token_ids") and not hasattr(plain.choices[0], "token_ids")

    text = client.completions.create(model=MODEL, prompt=["hello world", "the quick"], max_tokens=4,
                                     temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True})
    for choice, words in zip(text.choices, ["hello world", "the quick"]):
        assert choice.prompt_token_ids == _tokenize(tiny_server, prompt=words).json()["tokens"]
        assert len(choice.token_ids) == 4
    streamed = list(client.completions.create(model=MODEL, prompt="hello world", max_tokens=4, temperature=0,
                                              stream=True, extra_body={"return_token_ids": True, "ignore_eos": True}))
    assert streamed[0].choices[0].prompt_token_ids == text.choices[0].prompt_token_ids
    assert [t for c in streamed if c.choices for t in getattr(c.choices[0], "token_ids", [])] == text.choices[0].token_ids


def test_tokens_as_token_ids_and_chosen_logprob_tokens(client):
    extra = {"return_token_ids": True, "return_tokens_as_token_ids": True}
    done = client.chat.completions.create(messages=MESSAGES, **GREEDY, logprobs=True, top_logprobs=20,
                                          extra_body=extra)
    content = done.choices[0].logprobs.content
    assert [e.token for e in content] == [f"token_id:{t}" for t in done.choices[0].token_ids]
    assert content[0].bytes == list(content[0].token.encode())
    # logprob_token_ids: these tokens' logprobs at each position, in the order asked, after the sampled one
    top = {e.token: e.logprob for e in content[0].top_logprobs}
    asked = [int(t.split(":")[1]) for t in list(top)[1:6]][::-1]
    named = client.chat.completions.create(messages=MESSAGES, **GREEDY, logprobs=True,
                                           extra_body={**extra, "logprob_token_ids": asked})
    first = named.choices[0].logprobs.content[0]
    assert first.token == list(top)[0]  # greedy: the likeliest, which is not among those asked for
    assert [e.token for e in first.top_logprobs] == [first.token] + [f"token_id:{t}" for t in asked]
    for e in first.top_logprobs:
        assert e.logprob == pytest.approx(top[e.token], abs=1e-4)
    text = client.completions.create(model=MODEL, prompt="hello world", max_tokens=3, temperature=0, logprobs=2,
                                     extra_body={**extra, "logprob_token_ids": [5, 7]})
    lp = text.choices[0].logprobs
    assert lp.tokens == [f"token_id:{t}" for t in text.choices[0].token_ids]
    assert all({"token_id:5", "token_id:7"} <= set(alternatives) for alternatives in lp.top_logprobs)


def test_truncate_prompt_tokens_keeps_the_last_tokens(tiny_server, client):
    prompt = _tokenize(tiny_server, messages=MESSAGES).json()["tokens"]
    done = client.chat.completions.create(messages=MESSAGES, **GREEDY,
                                          extra_body={"truncate_prompt_tokens": 5, "return_token_ids": True})
    assert done.usage.prompt_tokens == 5 and done.prompt_token_ids == prompt[-5:]
    cut = client.completions.create(model=MODEL, prompt="the quick brown fox jumps over the lazy dog", max_tokens=4,
                                    temperature=0, extra_body={"truncate_prompt_tokens": 3})
    ids = _tokenize(tiny_server, prompt="the quick brown fox jumps over the lazy dog").json()["tokens"]
    same = client.completions.create(model=MODEL, prompt=ids[-3:], max_tokens=4, temperature=0)
    assert cut.usage.prompt_tokens == 3 and cut.choices[0].text == same.choices[0].text
    whole = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0,
                                      extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == len(ids)


def test_add_generation_prompt_false_and_echo(tiny_server, client, tokenizer):
    history = [*MESSAGES, {"role": "assistant", "content": "Hi"}]
    prompt = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=False)
    ids = _tokenize(tiny_server, messages=history, add_generation_prompt=False).json()["tokens"]
    assert ids == _tokenize(tiny_server, prompt=prompt, add_special_tokens=False).json()["tokens"]
    extra = {"add_generation_prompt": False, "echo": True, "return_token_ids": True}
    done = client.chat.completions.create(messages=history, **GREEDY, extra_body=extra)
    assert done.prompt_token_ids == ids
    message = done.choices[0].message
    assert message.role == "assistant" and message.content.startswith("Hi") and len(message.content) > 2
    chunks = list(client.chat.completions.create(messages=history, stream=True, **GREEDY, extra_body=extra))
    assert chunks[1].choices[0].delta.content == "Hi"  # vLLM: the echo follows the role's chunk
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == message.content
    # With the generation prompt, the answer is the assistant's: a user message last is not echoed.
    echoed = client.chat.completions.create(messages=MESSAGES, **GREEDY, extra_body={"echo": True})
    plain = client.chat.completions.create(messages=MESSAGES, **GREEDY)
    assert echoed.choices[0].message.content == plain.choices[0].message.content


def test_tokenize_chat_options_and_vocabulary_pieces(tiny_server, tokenizer):
    history = [*MESSAGES, {"role": "assistant", "content": "Hel"}]
    prompt = tokenizer.apply_chat_template(history, tokenize=False, continue_final_message=True)
    r = _tokenize(tiny_server, messages=history, continue_final_message=True, return_token_strs=True).json()
    assert r["tokens"] == _tokenize(tiny_server, prompt=prompt, add_special_tokens=False).json()["tokens"]
    assert r["token_strs"] == tokenizer.convert_ids_to_tokens(r["tokens"])  # vLLM's: pieces, not text
    assert "Ġ" in r["token_strs"]
    both = _tokenize(tiny_server, messages=history, continue_final_message=True, add_generation_prompt=True)
    assert_error(both, 400, "add_generation_prompt", None, "not both")
    user_last = _tokenize(tiny_server, messages=MESSAGES, continue_final_message=True)
    assert_error(user_last, 400, "continue_final_message", None, "assistant")


@pytest.mark.parametrize("messages, param, code", [
    ([{}], "messages.0.role", "missing_parameter"),
    ([{"role": "user", "content": 5}], "messages.0.content", "invalid_value"),
    (["hi"], "messages.0", "invalid_value"),
])
def test_tokenize_bad_messages_are_400(tiny_server, messages, param, code):
    assert_error(_tokenize(tiny_server, messages=messages), 400, param, code)
    assert_still_serves(tiny_server)


@pytest.mark.parametrize("field, value, extra", [
    ("return_token_ids", "sometimes", {}),
    ("return_tokens_as_token_ids", [1], {}),
    ("logprob_token_ids", [5], {}),  # without logprobs
    ("logprob_token_ids", [], {"logprobs": True}),
    ("logprob_token_ids", ["a"], {"logprobs": True}),
    ("logprob_token_ids", [10**6], {"logprobs": True}),
    ("truncate_prompt_tokens", 0, {}),
    ("truncate_prompt_tokens", -2, {}),
    ("truncate_prompt_tokens", "all", {}),
    ("include_reasoning", "maybe", {}),
    ("add_generation_prompt", {}, {}),
    ("echo", "maybe", {}),
])
def test_bad_values_are_400_naming_the_field(tiny_server, field, value, extra):
    r = post(tiny_server, "/v1/chat/completions", {**GREEDY, "messages": MESSAGES, field: value, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].split(".")[0] == field
    assert_still_serves(tiny_server)
