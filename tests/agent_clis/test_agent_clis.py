"""The coding-agent CLIs people use, from npm (pinned), against a real `kvflow serve` through a recording
proxy: each runs two non-interactive turns of one session, the first steered into a tool round trip (the
model calls the client's own file-reading tool, the client reads notes.txt and sends the result back), and
every request is answered 2xx, both turns exit 0, and turn 2 is served >= 90% from the prefix cache."""

from __future__ import annotations

import json

import pytest

from agent_clis.clients import MARKER, NOTES, OUTPUT_TOKENS, make_session
from agent_clis.proxy import AgentProxy
from agent_clis.steer import steer_to, tool_results

CLIENTS = ["qwen", "openclaw", "codex", "claude"]
SHORT_ANSWER = {"type": "string", "maxLength": 24}
TURN_1 = f"Read the file {NOTES} with your tool and say what it holds."
TURN_2 = "Thank you. Now say goodbye in two words."


def _report(session, proxy) -> str:
    lines = [f"{e.request_id} {e.method} {e.path} -> {e.status} {'(steered) ' if e.steered else ''}"
             f"usage {e.usage()} in {e.seconds:.1f} s: {e.answer()[:200]!r}" for e in proxy.exchanges]
    for i, run in enumerate(session.runs, 1):
        lines.append(f"turn {i}: exit {run.returncode}\nstdout: {run.stdout[-1500:]}\nstderr: {run.stderr[-1500:]}")
    return "\n".join(lines)


@pytest.mark.parametrize("client", CLIENTS)
def test_two_turns_with_a_tool_round_trip(client, agent_bin, agent_cli_server, tmp_path):
    proxy = AgentProxy(agent_cli_server.base_url, output_cap=OUTPUT_TOKENS)
    if client in ("codex", "claude"):
        # These two take an answer cut at its bound for an error (Codex: "Incomplete response returned";
        # Claude Code: "response exceeded the N output token maximum"): their answers are held to a short
        # JSON string, which the model ends well within the bound.
        proxy.answer_schema = SHORT_ANSWER
    try:
        session = make_session(client, proxy.base_url, tmp_path, agent_bin)
        proxy.steer = steer_to(*session.tool)
        first = session.turn(TURN_1)
        proxy.wait_idle()
        turn_1 = proxy.generations()
        assert first.returncode == 0, _report(session, proxy)
        second = session.turn(TURN_2)
        proxy.wait_idle()
        turn_2 = proxy.generations()[len(turn_1):]
        report = _report(session, proxy)
        assert second.returncode == 0, report
        assert all(e.status is not None and 200 <= e.status < 300 for e in proxy.exchanges), report

        # The round trip: a steered call, then a request that carries the file's text as the tool's result.
        assert any(e.steered for e in turn_1), f"no request offered {session.tool[0]}:\n{report}"
        follow_ups = [e for e in turn_1 if any(MARKER in r for r in tool_results(e))]
        assert follow_ups, f"no request sent {NOTES}'s text back as a tool result:\n{report}"

        # Turn 2 continues the session: its requests carry turn 1 and are served from the prefix cache.
        continued = [e for e in turn_2 if TURN_2 in json.dumps(e.body) and TURN_1 in json.dumps(e.body)]
        assert continued, f"no turn-2 request carried the session:\n{report}"
        for exchange in continued:
            usage = exchange.usage()
            assert usage is not None, f"{exchange.request_id} reported no usage:\n{report}"
            prompt, cached = usage
            assert cached >= 0.9 * prompt, f"{exchange.request_id}: {cached} of {prompt} prompt tokens cached"
        print(report)  # shown with -rP: what each request cost
    finally:
        proxy.stop()
