"""benchmarks/cache_pressure.py's bodies, without a server: the replay with the cache hint carries the
client's own (or one added), the replay without it carries none."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import cache_pressure  # noqa: E402
from agent_sessions import sessions  # noqa: E402


@pytest.mark.parametrize("client", ["codex", "claude", "qwen"])
def test_the_hint_is_put_on_or_taken_off(client):
    session = sessions.load(client)
    api, body = session["api"], sessions.chain(session)[-1]["body"]
    with_hint, without = (cache_pressure.hinted(body, api, hint, "k") for hint in (True, False))
    assert "cache_control" not in json.dumps(without) and "prompt_cache_key" not in without
    if api == "messages":
        assert "cache_control" in json.dumps(with_hint)
    else:
        assert with_hint["prompt_cache_key"] == "k"
    assert sessions.conversation(without, api) != [] and without.get("tools") == body.get("tools")
