"""The Ollama API on a tiny random model, through the official ollama client and raw NDJSON."""

from __future__ import annotations

import json

import httpx
import ollama
import pytest
from tiny_models import TINY_CONTEXT, TINY_NAME

GREEDY = {"temperature": 0, "num_predict": 6}


@pytest.fixture(scope="module")
def client(tiny_server) -> ollama.Client:
    return ollama.Client(host=tiny_server.base_url)


def test_root_version_tags_and_show(client, tiny_server):
    r = httpx.get(tiny_server.base_url + "/")
    assert r.status_code == 200 and r.text == "kvflow is running"
    page = httpx.get(tiny_server.base_url + "/", headers={"Accept": "text/html,*/*"})  # a browser: the chat page
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html") and "kvflow" in page.text
    assert httpx.get(tiny_server.base_url + "/api/version").json() == {"version": "0.1.0"}
    (model,) = client.list().models
    assert model.model == TINY_NAME and model.size > 0 and model.details.family == "llama"
    shown = client.show(TINY_NAME)
    assert "assistant" in shown.template and shown.modelinfo["llama.context_length"] == TINY_CONTEXT
    assert shown.capabilities == ["completion", "tools"]
    with pytest.raises(ollama.ResponseError) as info:
        client.show("other-model")
    assert info.value.status_code == 404


def test_generate_stream_equals_non_stream_and_reports_durations(client):
    whole = client.generate(model=TINY_NAME, prompt="hello", options=GREEDY)
    assert whole.done and whole.done_reason in ("stop", "length")
    assert whole.eval_count <= 6 and whole.prompt_eval_count > 0
    assert whole.total_duration >= whole.prompt_eval_duration > 0 and whole.load_duration == 0
    assert whole.context[-whole.eval_count:] and len(whole.context) == whole.prompt_eval_count + whole.eval_count
    parts = list(client.generate(model=TINY_NAME, prompt="hello", options=GREEDY, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.response for p in parts) == whole.response
    assert parts[-1].eval_count == whole.eval_count and parts[-1].done_reason == whole.done_reason


def test_generate_raw_and_system(client):
    raw = client.generate(model=TINY_NAME, prompt="the quick", raw=True, options=GREEDY)
    templated = client.generate(model=TINY_NAME, prompt="the quick", options=GREEDY)
    assert raw.prompt_eval_count < templated.prompt_eval_count  # no chat template around it
    with_system = client.generate(model=TINY_NAME, prompt="the quick", system="be nice", options=GREEDY)
    assert with_system.prompt_eval_count > templated.prompt_eval_count


def test_empty_prompt_loads_the_model(client):
    r = client.generate(model=TINY_NAME, prompt="")
    assert r.done and r.done_reason == "load"


def test_chat_stream_equals_non_stream(client):
    messages = [{"role": "user", "content": "how are you today?"}]
    whole = client.chat(model=TINY_NAME, messages=messages, options=GREEDY)
    assert whole.message.role == "assistant" and whole.done
    parts = list(client.chat(model=TINY_NAME, messages=messages, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].done and parts[-1].eval_count == whole.eval_count


def test_ndjson_streams_by_default(tiny_server):
    body = {"model": TINY_NAME, "prompt": "hello", "options": {"num_predict": 3, "temperature": 0}}
    with httpx.stream("POST", f"{tiny_server.base_url}/api/generate", json=body) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[-1]["done"] is True and "kvflow_timings" in lines[-1]
    assert all(not line["done"] for line in lines[:-1])


def test_options_map_to_sampling(client):
    seeded = {"temperature": 1.0, "seed": 3, "top_k": 20, "top_p": 0.95, "min_p": 0.01, "num_predict": 12,
              "repeat_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.5}
    a = client.generate(model=TINY_NAME, prompt="hello", options=seeded)
    b = client.generate(model=TINY_NAME, prompt="hello", options=seeded)
    assert a.response == b.response and a.eval_count <= 12
    stop_text = client.generate(model=TINY_NAME, prompt="hello", options={**GREEDY, "num_predict": 12}).response
    if len(stop_text) > 3:
        stop = stop_text[2:4]
        stopped = client.generate(model=TINY_NAME, prompt="hello",
                                  options={**GREEDY, "num_predict": 12, "stop": [stop]})
        assert stopped.response == stop_text[: stop_text.index(stop)] and stopped.done_reason == "stop"
    with pytest.raises(ollama.ResponseError) as info:
        client.generate(model=TINY_NAME, prompt="hello", options={"temperature": -1})
    assert info.value.status_code == 400 and "temperature" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        client.generate(model=TINY_NAME, prompt="hello", options={"mirostat": 2})
    assert info.value.status_code == 400 and "mirostat" in info.value.error
