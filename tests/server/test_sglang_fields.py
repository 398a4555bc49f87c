"""SGLang's request fields, which sglang-router adds to every chat request it forwards (test_router.py): each
is honoured or refused by name, never silently dropped."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer


def _chat(server, **body) -> httpx.Response:
    body = {"model": "tiny-llama", "max_tokens": 4, "temperature": 0, **body}
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)


def test_the_routers_defaults_are_accepted(tiny_server):
    defaults = dict(no_stop_trim=False, ignore_eos=False, continue_final_message=False, skip_special_tokens=True,
                    separate_reasoning=True, stream_reasoning=True, return_hidden_states=False)
    r = _chat(tiny_server, messages=[{"role": "user", "content": "hi"}], **defaults)
    assert r.status_code == 200, r.text


def test_continue_final_message_goes_on_with_the_assistants_text(tiny_server, tiny_model_dir):
    messages = [{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "One, two,"}]
    r = _chat(tiny_server, messages=messages, continue_final_message=True)
    assert r.status_code == 200, r.text
    prompt = AutoTokenizer.from_pretrained(tiny_model_dir).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    assert prompt.rstrip().endswith("One, two,")
    plain = httpx.post(f"{tiny_server.base_url}/v1/completions", timeout=60,
                       json={"model": "tiny-llama", "prompt": prompt, "max_tokens": 4, "temperature": 0})
    assert r.json()["choices"][0]["message"]["content"] == plain.json()["choices"][0]["text"]


def test_no_stop_trim_keeps_the_stop_string(tiny_server):
    plain = _chat(tiny_server, messages=[{"role": "user", "content": "hi"}], max_tokens=8).json()
    text = plain["choices"][0]["message"]["content"]
    stop = text[2:4]
    assert stop.strip(), f"need a visible stop string inside {text!r}"
    kept = _chat(tiny_server, messages=[{"role": "user", "content": "hi"}], max_tokens=8, stop=[stop],
                 no_stop_trim=True).json()
    assert kept["choices"][0]["message"]["content"].endswith(stop)


@pytest.mark.parametrize("field, value", [("return_hidden_states", True), ("separate_reasoning", False),
                                          ("stream_reasoning", False)])
def test_what_kvflow_does_not_do_is_refused_by_name(tiny_server, field, value):
    r = _chat(tiny_server, messages=[{"role": "user", "content": "hi"}], **{field: value})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == field


def test_continue_final_message_needs_an_assistant_message_last(tiny_server):
    r = _chat(tiny_server, messages=[{"role": "user", "content": "hi"}], continue_final_message=True)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "continue_final_message"
