"""On the default model (SmolLM2, real text): streamed text equals non-streamed text, concurrent requests
equal the same requests one at a time, and both APIs agree, all greedy."""

from __future__ import annotations

import asyncio

import ollama
import pytest
from openai import AsyncOpenAI, OpenAI

from server.conftest import DEFAULT_NAME

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(default_server) -> OpenAI:
    return OpenAI(base_url=f"{default_server.base_url}/v1", api_key="x", max_retries=0)


def test_chat_gives_real_text_and_stream_equals_non_stream(client):
    whole = client.chat.completions.create(model=DEFAULT_NAME, messages=QUESTION, max_tokens=12, temperature=0)
    text = whole.choices[0].message.content
    assert "Paris" in text
    stream = client.chat.completions.create(model=DEFAULT_NAME, messages=QUESTION, max_tokens=12, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == text


def test_completion_stream_equals_non_stream(client):
    kwargs = dict(model=DEFAULT_NAME, prompt="The three primary colors are", max_tokens=12, temperature=0)
    text = client.completions.create(**kwargs).choices[0].text
    assert len(text.split()) >= 3
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(**kwargs, stream=True))
    assert streamed == text


def test_async_client_chat_parity(default_server):
    async def run() -> tuple[str, str]:
        ac = AsyncOpenAI(base_url=f"{default_server.base_url}/v1", api_key="x", max_retries=0)
        kwargs = dict(model=DEFAULT_NAME, messages=QUESTION, max_tokens=12, temperature=0)
        whole = (await ac.chat.completions.create(**kwargs)).choices[0].message.content
        stream = await ac.chat.completions.create(**kwargs, stream=True)
        streamed = "".join([ch.choices[0].delta.content or "" async for ch in stream])
        await ac.close()
        return whole, streamed

    whole, streamed = asyncio.run(run())
    assert whole == streamed and "Paris" in whole


def test_ollama_chat_equals_openai_chat(client, default_server):
    openai_text = client.chat.completions.create(
        model=DEFAULT_NAME, messages=QUESTION, max_tokens=12, temperature=0).choices[0].message.content
    options = {"temperature": 0, "num_predict": 12, "repeat_penalty": 1.0}
    ollama_client = ollama.Client(host=default_server.base_url)
    reply = ollama_client.chat(model=DEFAULT_NAME, messages=QUESTION, options=options)
    assert reply.message.content == openai_text
    streamed = "".join(p.message.content for p in ollama_client.chat(
        model=DEFAULT_NAME, messages=QUESTION, options=options, stream=True))
    assert streamed == openai_text


def test_32_concurrent_streams_equal_sequential_requests(default_server):
    prompts = [f"Write one sentence about the number {i}." for i in range(32)]

    async def run() -> tuple[list[str], list[str]]:
        ac = AsyncOpenAI(base_url=f"{default_server.base_url}/v1", api_key="x", max_retries=0, timeout=300)

        async def streamed(prompt: str) -> str:
            stream = await ac.completions.create(model=DEFAULT_NAME, prompt=prompt, max_tokens=8, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
            return "".join([ch.choices[0].text async for ch in stream])

        together = await asyncio.gather(*[streamed(p) for p in prompts])
        alone = []
        for p in prompts:
            r = await ac.completions.create(model=DEFAULT_NAME, prompt=p, max_tokens=8, temperature=0,
                                            extra_body={"ignore_eos": True})
            alone.append(r.choices[0].text)
        await ac.close()
        return together, alone

    together, alone = asyncio.run(run())
    assert together == alone
    assert all(t.strip() for t in together), together
