"""benchmarks/agent_turns.py's input and requests, without servers: the captured sessions
(benchmarks/agent_sessions/<client>.json) parse, their chains grow turn by turn, and the replay's bodies are
the captured ones, streamed, bounded and marked with the nonce."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import agent_turns  # noqa: E402
from agent_sessions import sessions  # noqa: E402

CAPTURES = sorted((BENCHMARKS / "agent_sessions").glob("*.json"))


def test_every_client_is_captured():
    assert {p.stem for p in CAPTURES} >= {"qwen"}, "the Qwen Code session (the issue's 16K-token goal) is missing"
    assert {p.stem for p in CAPTURES} <= set(sessions.CLIENT_API)


def _unmarked(node):
    if isinstance(node, dict):
        return {key: _unmarked(value) for key, value in node.items() if key != "cache_control"}
    return [_unmarked(item) for item in node] if isinstance(node, list) else node


@pytest.mark.parametrize("path", CAPTURES, ids=lambda p: p.stem)
def test_a_capture_is_a_growing_chain_on_its_clients_api(path: Path):
    text = path.read_text()
    assert len(text) < 400_000, f"{path.name}: {len(text)} characters"
    assert "kvflow-capture-" not in text, "the capture's temporary paths were not scrubbed"
    session = json.loads(text)
    api = session["api"]
    assert api == sessions.CLIENT_API[session["client"]] and session["path"] == sessions.API_PATH[api]
    chain = sessions.chain(session)
    assert len(chain) >= 2, "a session needs its first request and a follow-up"
    assert chain[0]["kind"] == "first" and chain[0]["turn"] == 1 and chain[-1]["turn"] == 2
    assert all(r["kind"] in ("tool result", "user", "user (synthesized)") for r in chain[1:])
    for before, after in zip(chain, chain[1:], strict=False):
        old, new = (sessions.conversation(r["body"], api) for r in (before, after))
        assert len(new) > len(old), "a follow-up appends to the conversation"
        assert sessions.system_text(before["body"], api) == sessions.system_text(after["body"], api)
        assert sessions.tool_names(before["body"], api) == sessions.tool_names(after["body"], api)
        # what the user said first is still there, in its place (Claude Code moves its cache_control marks)
        assert _unmarked(old[0]) == _unmarked(new[0])


@pytest.mark.parametrize("path", CAPTURES, ids=lambda p: p.stem)
def test_the_replay_sends_the_captured_body_streamed_bounded_and_marked(path: Path):
    session = json.loads(path.read_text())
    api = session["api"]
    for request in sessions.chain(session):
        captured = json.dumps(request["body"], sort_keys=True)
        body = sessions.replay_body(request["body"], api, "m", 16, "[session 1234] ")
        assert json.dumps(request["body"], sort_keys=True) == captured, "the capture itself is left as it was"
        assert body["model"] == "m" and body["stream"] is True
        assert body[{"responses": "max_output_tokens"}.get(api, "max_tokens")] == 16
        assert sessions.system_text(body, api) == "[session 1234] " + sessions.system_text(request["body"], api)
        assert body.get("tools") == request["body"].get("tools")
        assert sessions.conversation(body, api) == sessions.conversation(request["body"], api)


def test_side_requests_are_left_off_the_chain():
    main = {"messages": [{"role": "system", "content": "agent"}, {"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "read_file"}}]}
    grown = {**main, "messages": [*main["messages"], {"role": "assistant", "content": "x"},
                                  {"role": "tool", "content": "file"}]}
    title = {"messages": [{"role": "system", "content": "write a title"}, {"role": "user", "content": "hi"}]}
    assert sessions.chain_kinds([main, title, grown], "chat") == ["first", "side", "tool result"]
    # a side request with a longer conversation than the chain's (Qwen Code's memory extraction) stays off it
    memory = {"messages": [{"role": "system", "content": "extract memories"}, *grown["messages"][1:],
                           {"role": "user", "content": "save what matters"}]}
    assert sessions.chain_kinds([title, main, grown, memory], "chat") == ["side", "first", "tool result", "side"]


def test_first_tokens_and_prefill_counts_in_each_api():
    assert not sessions.is_first_token({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
    assert sessions.is_first_token({"choices": [{"delta": {"content": "He"}}]})
    assert sessions.is_first_token({"choices": [{"delta": {"tool_calls": [{"index": 0}]}}]})
    assert sessions.is_first_token({"type": "response.output_text.delta", "delta": "He"})
    assert not sessions.is_first_token({"type": "response.created", "response": {}})
    assert sessions.is_first_token({"type": "content_block_delta", "delta": {"type": "text_delta", "text": "a"}})
    assert not sessions.is_first_token({"type": "message_start", "message": {}})
    llama = [{"choices": []}, {"usage": {"prompt_tokens": 900}, "timings": {"prompt_n": 100, "cache_n": 800}}]
    assert sessions.prefill_counts(llama) == (900, 800)
    kvflow = [{"usage": {"prompt_tokens": 900, "prompt_tokens_details": {"cached_tokens": 784}}}]
    assert sessions.prefill_counts(kvflow) == (900, 784)
    anthropic = [{"type": "message_start", "message": {"usage": {"input_tokens": 116, "cache_read_input_tokens": 784}}}]
    assert sessions.prefill_counts(anthropic) == (900, 784)
    responses = [{"type": "response.completed",
                  "response": {"usage": {"input_tokens": 900, "input_tokens_details": {"cached_tokens": 0}}}}]
    assert sessions.prefill_counts(responses) == (900, 0)
    assert sessions.prefill_counts([{"choices": []}]) == (None, None)


def test_the_table_has_medians_and_the_ratio():
    def run(ttft: float, cached: int) -> dict:
        return {"ttft_ms": ttft, "first_token": True, "prompt_tokens": 1000, "cached_tokens": cached}

    entry = {"api": "chat", "requests": [
        {"turn": 1, "kind": "first", "kvflow": [run(100, 0), run(300, 0), run(200, 0)],
         "llama-server": [run(500, 0), run(400, 0), run(600, 0)]},
        {"turn": 2, "kind": "user", "kvflow": [run(10, 900)], "llama-server": [{"error": "500: no"}]}]}
    rows = agent_turns.session_rows(entry)
    assert rows[0] == "| 1 | 1 | first | 1000 | 0% | 200 | 5000 | 1000 | 0% | 500 | 2000 | 0.40 |"
    assert entry["requests"][0]["ratio"] == pytest.approx(0.4)
    assert "90%" in rows[1] and "500: no" in rows[1] and rows[1].endswith("| - |")
    assert len(agent_turns.COLUMNS) == rows[0].count("|") - 1
    assert "First request: 0.40x" in agent_turns.goal_line(entry) and "follow-ups: -" in agent_turns.goal_line(entry)


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_a_one_turn_session_gets_a_synthesized_second_turn(api):
    first = {"chat": {"messages": [{"role": "system", "content": "agent"}, {"role": "user", "content": "hi"}]},
             "messages": {"system": "agent", "messages": [{"role": "user", "content": "hi"}]},
             "responses": {"instructions": "agent", "input": [{"type": "message", "role": "user",
                                                                "content": [{"type": "input_text", "text": "hi"}]}]}}[api]
    session = {"api": api, "requests": [{"turn": 1, "kind": "first", "body": first}]}
    chain = sessions.chain(session)
    assert [r["kind"] for r in chain] == ["first", "user (synthesized)"] and chain[1]["turn"] == 2
    old, new = (sessions.conversation(r["body"], api) for r in chain)
    assert new[:len(old)] == old and len(new) == len(old) + 2
    assert sessions.TURN_2 in json.dumps(new[-1]) and sessions.last_kind(chain[1]["body"], api) == "user"
    assert len(sessions.conversation(first, api)) == 1, "the captured body is left as it was"


@pytest.mark.parametrize("path", CAPTURES, ids=lambda p: p.stem)
def test_the_chat_form_is_what_kvflows_endpoint_would_render(path: Path):
    """--same-tokens: each body's /tokenize form, validated as /tokenize does, is the chat request kvflow's
    own endpoint for the API builds (messages and tools), the system prompt's nonce kept."""
    from agent_sessions.kvflow_prompt import chat_form

    from kvflow.server.protocol import ChatCompletionRequest

    session = json.loads(path.read_text())
    api = session["api"]
    for request in sessions.chain(session):
        body = sessions.replay_body(request["body"], api, "m", 16, "[session 1234] ")
        form = chat_form(body, api)
        assert "[session 1234] " in json.dumps(form["messages"][0])
        assert form.get("tools"), "the session's tools are in the prompt"
        tokenized = ChatCompletionRequest.model_validate({k: v for k, v in form.items() if v is not None})
        if api == "chat":
            continue
        from kvflow.server.anthropic_protocol import MessagesRequest
        from kvflow.server.responses_protocol import ResponsesRequest

        own = (MessagesRequest.model_validate(body).as_chat() if api == "messages"
               else ResponsesRequest.model_validate(body).as_chat()[0])
        assert tokenized.messages == own.messages and tokenized.tools == own.tools


def test_pauses_are_taken_out_of_long_ttfts_and_short_ones_left_out(tmp_path: Path):
    pauses = tmp_path / "pauses"
    pauses.write_text("100.5 101.0\n103.0 110.0\n")
    runs = [{"ttft_ms": 2000.0, "started_at": 100.0}, {"ttft_ms": 500.0, "started_at": 101.5},
            {"ttft_ms": 40000.0, "started_at": 102.0}, {"error": "x"}]
    assert agent_turns.discount_pauses(runs, pauses) == (2, 0.5 + 7.0)
    assert runs[0]["excluded"] and runs[0]["ttft_ms"] == 2000.0 and runs[0]["paused_ms"] == 500.0
    assert "paused_ms" not in runs[1] and runs[2]["ttft_ms"] == 33000.0 and not runs[2].get("excluded")
    assert agent_turns.clean(runs) == runs[1:3] and agent_turns.clean(runs[:1]) == runs[:1]
