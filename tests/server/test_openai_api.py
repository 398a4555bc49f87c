"""The OpenAI API on a tiny random model, through the official client: every field and response shape."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI
from tiny_models import TINY_NAME

GREEDY = dict(temperature=0, max_tokens=8, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def client(tiny_server) -> OpenAI:
    return OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="unused", max_retries=0)


def sse_events(response: httpx.Response) -> list:
    """The data of each SSE event; [DONE] as the string."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == [TINY_NAME]
    assert models[0].object == "model"


def test_completion_shape_usage_and_timings(client, tiny_server):
    raw = client.completions.with_raw_response.create(model=TINY_NAME, prompt="hello world", **GREEDY)
    c = raw.parse()
    assert c.object == "text_completion" and c.id.startswith("cmpl-") and c.model == TINY_NAME
    assert isinstance(c.created, int)
    assert len(c.choices) == 1 and c.choices[0].index == 0 and c.choices[0].finish_reason == "length"
    u = c.usage
    assert u.completion_tokens == 8 and u.total_tokens == u.prompt_tokens + 8
    assert u.prompt_tokens_details.cached_tokens >= 0
    timings = u.model_extra["kvflow_timings"]
    assert set(timings) == {"queue_ms", "ttft_ms", "prefill_ms", "decode_ms", "cached_tokens", "disk_cached_tokens",
                            "spec_draft_tokens", "spec_accepted_tokens"}
    assert timings["ttft_ms"] >= timings["prefill_ms"] >= 0 and timings["decode_ms"] > 0
    for name in ("queue-ms", "ttft-ms", "prefill-ms", "decode-ms", "cached-tokens"):
        assert f"x-kvflow-{name}" in raw.headers
    assert float(raw.headers["x-kvflow-ttft-ms"]) == timings["ttft_ms"]


def test_prompt_forms_give_the_same_text(client, tiny_model_dir):
    from transformers import AutoTokenizer

    text = client.completions.create(model=TINY_NAME, prompt="the quick brown fox", **GREEDY).choices[0].text
    token_ids = AutoTokenizer.from_pretrained(str(tiny_model_dir))("the quick brown fox").input_ids
    by_ids = client.completions.create(model=TINY_NAME, prompt=token_ids, **GREEDY)
    assert by_ids.choices[0].text == text
    many = client.completions.create(model=TINY_NAME, prompt=["the quick brown fox", "hello world"], **GREEDY)
    assert [ch.index for ch in many.choices] == [0, 1] and many.choices[0].text == text
    many_ids = client.completions.create(model=TINY_NAME, prompt=[token_ids, token_ids], **GREEDY)
    assert [ch.text for ch in many_ids.choices] == [text, text]
    assert many_ids.usage.prompt_tokens == 2 * len(token_ids)
    assert many_ids.usage.completion_tokens == 16


def test_echo_n_seed_and_stop(client):
    echo = client.completions.create(model=TINY_NAME, prompt="hello world", echo=True, **GREEDY)
    plain = client.completions.create(model=TINY_NAME, prompt="hello world", **GREEDY)
    assert echo.choices[0].text == "hello world" + plain.choices[0].text
    sampled = dict(model=TINY_NAME, prompt="hello", max_tokens=12, temperature=1.0, n=3, seed=7,
                   extra_body={"ignore_eos": True})
    a = client.completions.create(**sampled)
    b = client.completions.create(**sampled)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # same seed, same samples
    assert a.usage.completion_tokens == 36 and len({c.text for c in a.choices}) > 1
    full = plain.choices[0].text
    stop = full[2:4]
    if stop:
        stopped = client.completions.create(model=TINY_NAME, prompt="hello world", stop=[stop], **GREEDY)
        assert stopped.choices[0].finish_reason == "stop"
        assert stopped.choices[0].text == full[: full.index(stop)]


def test_sampling_fields_are_accepted_and_change_output(client):
    base = dict(model=TINY_NAME, prompt="hello world", max_tokens=16, temperature=0)
    greedy = client.completions.create(**base, extra_body={"ignore_eos": True}).choices[0].text
    penalized = client.completions.create(
        **base, frequency_penalty=2.0, presence_penalty=2.0,
        extra_body={"ignore_eos": True, "repetition_penalty": 3.0},
    ).choices[0].text
    assert penalized != greedy
    knobs = client.completions.create(
        **{**base, "temperature": 0.7}, top_p=0.9, seed=1,
        extra_body={"top_k": 5, "min_p": 0.05, "min_tokens": 4, "stop_token_ids": [2]},
    )
    assert knobs.usage.completion_tokens >= 4


def test_completion_logprobs(client):
    c = client.completions.create(model=TINY_NAME, prompt="hello world", logprobs=3, **GREEDY)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # keys are decoded strings, so byte tokens that all print as U+FFFD share one key
        assert value <= 0 and 1 <= len(top) <= 4 and top[token] == value
        assert value == pytest.approx(max(top.values()))  # greedy picks the most likely token
    assert lp.text_offset[0] == 0


def test_chat_completion_shape_and_logprobs(client):
    r = client.chat.completions.create(
        model=TINY_NAME, messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        max_completion_tokens=6, temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True},
    )
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    content = choice.logprobs.content
    assert len(content) == 6 == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.bytes == list(t.token.encode()) for t in content)
    as_parts = [{"role": "system", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    parts = client.chat.completions.create(model=TINY_NAME, messages=as_parts, max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert parts.choices[0].message.content == choice.message.content


def test_completion_stream_equals_non_stream(client):
    kwargs = dict(model=TINY_NAME, prompt="the lazy dog", **GREEDY)
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert all(ch.object == "text_completion" for ch in chunks)
    assert "".join(c.text for ch in chunks for c in ch.choices) == whole
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert "kvflow_timings" in chunks[-1].usage.model_extra
    assert [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason] == ["length"]


def test_streamed_logprobs_equal_non_streamed(client):
    kwargs = dict(model=TINY_NAME, prompt="the lazy dog", logprobs=2, **GREEDY)
    whole = client.completions.create(**kwargs).choices[0].logprobs
    chunks = [ch.choices[0] for ch in client.completions.create(**kwargs, stream=True)]
    assert [t for c in chunks for t in c.logprobs.tokens] == whole.tokens
    # The second run of a prompt reads its prefix from the prefix cache, a different (equally exact)
    # float32 summation order: values agree to rounding, tokens exactly.
    assert [v for c in chunks for v in c.logprobs.token_logprobs] == pytest.approx(whole.token_logprobs, abs=1e-5)
    assert [o for c in chunks for o in c.logprobs.text_offset] == whole.text_offset
    messages = [{"role": "user", "content": "hi"}]
    chat = dict(model=TINY_NAME, messages=messages, logprobs=True, top_logprobs=1, **GREEDY)
    whole_chat = client.chat.completions.create(**chat).choices[0].logprobs.content
    streamed = [t for ch in client.chat.completions.create(**chat, stream=True)
                if ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in whole_chat]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in whole_chat], abs=1e-5)


def test_stop_as_a_string_and_stop_in_streams(client):
    full = client.completions.create(model=TINY_NAME, prompt="hello world", **GREEDY).choices[0].text
    stop = full[3:5]
    assert len(stop) == 2, f"greedy text too short to cut a stop string from: {full!r}"
    kwargs = dict(model=TINY_NAME, prompt="hello world", stop=stop, **GREEDY)
    assert client.completions.create(**kwargs).choices[0].text == full[: full.index(stop)]
    streamed = [ch.choices[0] for ch in client.completions.create(**kwargs, stream=True)]
    assert "".join(c.text for c in streamed) == full[: full.index(stop)]
    assert streamed[-1].finish_reason == "stop"


def test_chat_stream_shape(client, tiny_server):
    body = {"model": TINY_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
            "temperature": 0, "ignore_eos": True, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{tiny_server.base_url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 10
    chunks = events[:-2]
    assert all(e["object"] == "chat.completion.chunk" and e["usage"] is None for e in chunks)
    for index in (0, 1):
        mine = [e["choices"][0] for e in chunks if e["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["length"]


def test_async_client_streams_and_not(tiny_server):
    asyncio.run(_async_chat(tiny_server))


async def _async_chat(tiny_server):
    client = AsyncOpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "how are you"}]
    whole = await client.chat.completions.create(model=TINY_NAME, messages=messages, **GREEDY)
    stream = await client.chat.completions.create(model=TINY_NAME, messages=messages, stream=True, **GREEDY)
    text = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
    assert text == whole.choices[0].message.content
    await client.close()
