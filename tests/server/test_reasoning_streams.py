"""Thinking through each API, on a tiny random model whose chat template opens a think block in the
prompt (as DeepSeek-R1's does): everything it writes is thinking, so every API must carry it as thinking
(chat completions: reasoning_content; Responses: a reasoning item and reasoning_text events; Anthropic: a
thinking block; Ollama: message.thinking), streamed and not, and none of it as content."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from openai import OpenAI

from server.server_process import ServerProcess

THINKING_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                     "{% if add_generation_prompt %}<s>assistant: <think>\n{% endif %}")


@pytest.fixture(scope="module")
def thinking_server(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("thinking") / "tiny-thinker"
    shutil.copytree(tiny_model_dir, folder)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = THINKING_TEMPLATE
    config_file.write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    server = ServerProcess("--model", str(folder), "--kv-cache-memory", "64MiB", "--dtype", "float32")
    yield server
    server.stop()


MESSAGES = [{"role": "user", "content": "hello"}]
OPTIONS = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}


def test_chat_completions_reasoning_content(thinking_server):
    client = OpenAI(base_url=f"{thinking_server.base_url}/v1", api_key="unused", max_retries=0)
    done = client.chat.completions.create(model="tiny-thinker", messages=MESSAGES, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
    message = done.choices[0].message
    assert message.content == "" and message.reasoning_content
    chunks = client.chat.completions.create(model="tiny-thinker", messages=MESSAGES, max_tokens=12, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == message.reasoning_content
    assert not "".join(d.content or "" for d in deltas)


def test_responses_reasoning_item_and_events(thinking_server):
    client = OpenAI(base_url=f"{thinking_server.base_url}/v1", api_key="unused", max_retries=0)
    r = client.responses.create(model="tiny-thinker", input="hello", max_output_tokens=12, temperature=0)
    assert r.output[0].type == "reasoning" and r.output[0].content[0].text and not r.output_text
    events = list(client.responses.create(model="tiny-thinker", input="hello", max_output_tokens=12,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert "response.reasoning_text.delta" in kinds and "response.reasoning_text.done" in kinds
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text == next(e.text for e in events if e.type == "response.reasoning_text.done")


def test_anthropic_thinking_block(thinking_server):
    url = f"{thinking_server.base_url}/v1/messages"
    body = {"model": "tiny-thinker", "max_tokens": 12, "temperature": 0, "messages": MESSAGES}
    doc = httpx.post(url, json=body, timeout=60).json()
    assert [b["type"] for b in doc["content"]][0] == "thinking" and doc["content"][0]["thinking"]
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
        data = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    starts = [d["content_block"]["type"] for d in data if d["type"] == "content_block_start"]
    assert starts[0] == "thinking"
    assert any(d["type"] == "content_block_delta" and d["delta"]["type"] == "thinking_delta" for d in data)


def test_ollama_thinking(thinking_server):
    r = httpx.post(f"{thinking_server.base_url}/api/chat", timeout=60, json={
        "model": "tiny-thinker", "messages": MESSAGES, "stream": False, "options": {"temperature": 0, "num_predict": 12}})
    message = r.json()["message"]
    assert message["thinking"] and message["content"] == ""


def test_include_reasoning_false_leaves_the_thinking_out(thinking_server):
    """vLLM's include_reasoning: false drops the thinking, and, as vLLM, the logprobs and token ids that
    would show it."""
    client = OpenAI(base_url=f"{thinking_server.base_url}/v1", api_key="unused", max_retries=0)
    extra = {"ignore_eos": True, "include_reasoning": False, "return_token_ids": True}
    done = client.chat.completions.create(model="tiny-thinker", messages=MESSAGES, max_tokens=12, temperature=0,
                                          logprobs=True, extra_body=extra)
    choice = done.choices[0]
    assert choice.message.content == "" and getattr(choice.message, "reasoning_content", None) is None
    assert choice.logprobs is None and choice.token_ids is None and done.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(model="tiny-thinker", messages=MESSAGES, max_tokens=12,
                                                 temperature=0, logprobs=True, stream=True, extra_body=extra))
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert not any(getattr(d.delta, "reasoning_content", None) or d.delta.content for d in deltas)
    assert not any(d.logprobs or getattr(d, "token_ids", None) for d in deltas)
    assert deltas[-1].finish_reason == "length"
    shown = client.chat.completions.create(model="tiny-thinker", messages=MESSAGES, max_tokens=12, temperature=0,
                                           extra_body={"ignore_eos": True, "include_reasoning": True})
    assert shown.choices[0].message.reasoning_content
