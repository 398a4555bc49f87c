"""Every wire API ignores the fields it does not know (top level and nested), logs each once per route at
debug level and counts it in /metrics, while a known field of the wrong type still gets a 400 naming it."""

from __future__ import annotations

import httpx
import pytest
from tiny_models import TINY_NAME

from server.server_process import ServerProcess
from server.test_errors import assert_still_serves, post

CHAT = {"model": TINY_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
# route -> (a good body with unknown fields at the top and inside, those fields' paths, a known field mistyped)
CASES = {
    "/v1/chat/completions": (
        {**CHAT, "stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False},
         "prompt_cache_key": "session-1", "verbosity": "low",
         "messages": [{"role": "user", "content": "hi", "x_vendor": 1}],
         "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "x_new": 1},
                    "x_tool": 2}]},
        ["prompt_cache_key", "verbosity", "stream_options.include_obfuscation", "messages.*.x_vendor",
         "tools.*.function.x_new", "tools.*.x_tool"],
        ("temperature", "hot")),
    "/v1/completions": ({"model": TINY_NAME, "prompt": "hi", "max_tokens": 2, "future_knob": {"a": 1}},
                        ["future_knob"], ("max_tokens", "many")),
    "/v1/responses": (
        {"model": TINY_NAME, "input": [{"type": "message", "role": "user", "content": "hi", "x_item": 1}],
         "max_output_tokens": 2, "client_metadata": {"thread_id": "t"}, "text": {"verbosity": "low"}},
        ["client_metadata", "input.*.x_item", "text.verbosity"], ("max_output_tokens", [1])),
    "/v1/messages": (
        {"model": TINY_NAME, "max_tokens": 2, "context_management": {"edits": []}, "future": True,
         "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "citations": None}]}]},
        ["context_management", "future", "messages.*.content.*.citations"], ("max_tokens", "lots")),
    "/api/chat": (
        {"model": TINY_NAME, "stream": False, "messages": [{"role": "user", "content": "hi", "x": 1}],
         "options": {"num_predict": 2, "num_keep": 4, "penalize_newline": True}, "truncate": True},
        ["truncate", "messages.*.x", "options.num_keep", "options.penalize_newline"],
        ("options", {"temperature": "hot"})),
    "/api/generate": ({"model": TINY_NAME, "prompt": "hi", "stream": False, "options": {"num_predict": 2},
                       "shift": True}, ["shift"], ("raw", [1])),
    "/tokenize": ({"model": TINY_NAME, "prompt": "hi", "future": 1}, ["future"], ("prompt", 5)),
}


@pytest.fixture(scope="module")
def debug_server(tiny_model_dir):
    """The tiny model served with --log-level debug, so the once-per-field log lines can be read."""
    server = ServerProcess("--model", str(tiny_model_dir), "--kv-cache-memory", "64MiB", "--log-level", "debug")
    yield server
    server.stop()


def _error_text(r: httpx.Response) -> str:
    return r.text  # OpenAI, Anthropic and Ollama shapes all carry the field's name in their message


@pytest.mark.parametrize("route", list(CASES))
def test_unknown_fields_are_ignored_logged_once_and_counted(debug_server, route):
    body, fields, (known, wrong) = CASES[route]
    for _ in range(2):
        r = post(debug_server, route, body)
        assert r.status_code == 200, r.text
    for field in fields:
        assert debug_server.metric("kvflow:request_ignored_fields_total", f'field="{field}",route="{route}"') == 2
        line = f"ignoring the field {field!r} on {route}"
        assert debug_server.output().count(line) == 1, line
    r = post(debug_server, route, {**body, known: wrong})
    assert r.status_code == 400 and known in _error_text(r), r.text
    assert_still_serves(debug_server)


def test_neutral_ollama_options_pass_and_others_are_refused(tiny_server):
    body = {"model": TINY_NAME, "prompt": "hi", "stream": False}
    neutral = {"num_predict": 2, "mirostat": 0, "typical_p": 1.0, "tfs_z": 1.0}
    assert post(tiny_server, "/api/generate", {**body, "options": neutral}).status_code == 200
    r = post(tiny_server, "/api/generate", {**body, "options": {"typical_p": 0.5}})
    assert r.status_code == 400 and "options.typical_p" in r.json()["error"]
