"""Clients that go away abort their requests: the engine frees their blocks and keeps serving."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
from tiny_models import TINY_NAME

LONG = {"max_tokens": 4000, "ignore_eos": True, "temperature": 0, "stream": True}


def wait_until_idle(server, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (server.metric("kvflow:num_requests_running") == 0 and server.metric("kvflow:num_requests_waiting") == 0
                and server.metric("kvflow:kv_cache_blocks_used") == 0):
            return
        time.sleep(0.1)
    raise AssertionError("the engine still holds requests or blocks")


async def drop_after(url: str, prompt: str, chunks: int) -> int:
    """Stream a long completion and hang up after a few chunks; returns the chunks read."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        async with client.stream("POST", "/v1/completions", json={"prompt": prompt, **LONG}) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen == chunks:
                        break
    return seen


def test_dropped_streams_are_aborted_and_free_their_blocks(tiny_server):
    wait_until_idle(tiny_server)
    aborted_before = tiny_server.metric("kvflow:request_success_total", 'finished_reason="abort"')

    async def sixteen():
        return await asyncio.gather(*[drop_after(tiny_server.base_url, f"client {i} says hello", 3)
                                      for i in range(16)])

    assert asyncio.run(sixteen()) == [3] * 16
    wait_until_idle(tiny_server)
    assert tiny_server.metric("kvflow:kv_cache_usage_perc") == 0.0
    aborted = tiny_server.metric("kvflow:request_success_total", 'finished_reason="abort"') - aborted_before
    assert aborted == 16  # none of them ran to its 4000 tokens
    client = openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="x", max_retries=0)
    after = client.completions.create(model=TINY_NAME, prompt="hello", max_tokens=4, extra_body={"ignore_eos": True})
    assert after.usage.completion_tokens == 4


def test_closing_an_openai_stream_aborts_it(tiny_server):
    wait_until_idle(tiny_server)
    aborted_before = tiny_server.metric("kvflow:request_success_total", 'finished_reason="abort"')
    client = openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.create(
        model=TINY_NAME, messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=4000,
        temperature=0, extra_body={"ignore_eos": True},
    )
    next(iter(stream))
    stream.close()
    wait_until_idle(tiny_server)
    assert tiny_server.metric("kvflow:request_success_total", 'finished_reason="abort"') == aborted_before + 1


def test_non_streaming_client_that_times_out_is_aborted(tiny_server):
    wait_until_idle(tiny_server)
    aborted_before = tiny_server.metric("kvflow:request_success_total", 'finished_reason="abort"')
    body = {"prompt": "hello", "max_tokens": 4000, "ignore_eos": True, "n": 8}
    try:
        httpx.post(f"{tiny_server.base_url}/v1/completions", json=body, timeout=0.3)
    except httpx.TimeoutException:
        pass
    else:
        raise AssertionError("expected the request to outlast the client's timeout")
    wait_until_idle(tiny_server)
    assert tiny_server.metric("kvflow:request_success_total", 'finished_reason="abort"') == aborted_before + 8
