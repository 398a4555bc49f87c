"""Captures real coding-agent sessions, the input of benchmarks/agent_turns.py.

    python benchmarks/agent_sessions/capture.py [--clients qwen,claude,codex,openclaw] [--agent-bin DIR]

Each client (installed by tests/agent_clis/install_clients.sh) runs as `kvflow launch` sets it up, with its
own system prompt and tools (not the agent tests' trimmed ones), for two non-interactive turns of one session
against `kvflow serve` (the default model, --max-model-len 32768) through the agent tests' recording proxy
(tests/agent_clis/proxy.py). Turn 1 asks it to read notes.txt: the proxy steers the model into calling the
client's own file tool, and the client sends the file back (a tool round trip). Turn 2 is a short follow-up.
Answers are bounded as in the agent tests (tests/agent_clis/clients.py, OUTPUT_TOKENS).

Every generation request is saved as the client sent it (before the proxy's steering and bounds), with the
run's temporary paths replaced, into benchmarks/agent_sessions/<client>.json:

    {"client": "qwen", "api": "chat" | "responses" | "messages", "path": "/v1/chat/completions",
     "captured": "YYYY-MM-DD", "requests": [{"turn": 1, "kind": "first" | "tool result" | "user" | "side",
                                             "body": {...}}, ...]}

"side" marks a request off the session's chain (a title or memory request with its own system prompt).

Captured 2026-12-06 on 2 loaded cores (SmolLM2-135M, --max-model-len 32768): Qwen Code (3 chain requests and
its memory-extraction side request), Claude Code and Codex (3 each: first, tool result, turn 2). OpenClaw's
turn 2 failed with its own "worker task timed out" on the loaded machine, so openclaw.json holds turn 1
only (first, tool result) and the replay synthesizes turn 2 (sessions.chain); rerun
`--clients openclaw` on an idle machine to replace it.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(HERE))

import agent_clis.clients  # noqa: E402
from agent_clis.clients import OUTPUT_TOKENS, make_session  # noqa: E402
from agent_clis.proxy import AgentProxy  # noqa: E402
from agent_clis.steer import steer_to  # noqa: E402
from server.server_process import ServerProcess  # noqa: E402
from sessions import CLIENT_API, TURN_1, TURN_2, chain_kinds  # noqa: E402

from kvflow.launch import _merge_json  # noqa: E402

SHORT_ANSWER = {"type": "string", "maxLength": 24}


def bound_answers(client: str, home: Path) -> None:
    """Each answer's bound in the client's own settings, where it takes one (as the agent tests' trims do)."""
    if client == "qwen":
        _merge_json(home / ".qwen" / "settings.json",
                    {"model": {"generationConfig": {"samplingParams": {"max_tokens": OUTPUT_TOKENS}}}})
    elif client == "openclaw":
        config = home / ".openclaw-kvflow" / "openclaw.json"
        settings = json.loads(config.read_text())
        settings["models"]["providers"]["kvflow"]["models"][0]["maxTokens"] = OUTPUT_TOKENS
        config.write_text(json.dumps(settings))
        _merge_json(config, {"agents": {"defaults": {"workspace": str(home.parent / "work"), "skipBootstrap": True}}})


def scrub(node, replacements: list[tuple[str, str]]):
    """The JSON with the run's paths replaced, Claude Code's per-install user id fixed and Codex's
    client_metadata left out (none of them is part of the prompt)."""
    if isinstance(node, str):
        for old, new in replacements:
            node = node.replace(old, new)
        return node
    if isinstance(node, list):
        return [scrub(item, replacements) for item in node]
    if isinstance(node, dict):
        out = {key: scrub(value, replacements) for key, value in node.items()
               if key != "client_metadata"}  # Codex's ids of the run (installation, session, turn)
        if isinstance(out.get("metadata"), dict) and "user_id" in out["metadata"]:
            out["metadata"] = {**out["metadata"], "user_id": "user"}
        return out
    return node


def capture(client: str, base_url: str, agent_bin: Path) -> dict:
    originals: dict[str, dict] = {}
    proxy = AgentProxy(base_url, output_cap=OUTPUT_TOKENS)
    if client in ("codex", "claude"):  # they take an answer cut at its bound for an error (see the agent tests)
        proxy.answer_schema = SHORT_ANSWER
    with tempfile.TemporaryDirectory(prefix="kvflow-capture-") as tmp:
        root = Path(tmp)
        try:
            session = make_session(client, proxy.base_url, root, agent_bin, trim=False)
            bound_answers(client, session.home)
            steer = steer_to(*session.tool)

            def record(exchange):
                originals[exchange.request_id] = copy.deepcopy(exchange.body)
                return steer(exchange)

            proxy.steer = record
            turns = []
            for number, prompt in ((1, TURN_1), (2, TURN_2)):
                started = time.monotonic()
                done = session.turn(prompt)
                proxy.wait_idle(120)
                print(f"{client} turn {number}: exit {done.returncode} in {time.monotonic() - started:.0f} s",
                      file=sys.stderr)
                if done.returncode != 0:
                    print(done.stdout[-2000:], done.stderr[-2000:], file=sys.stderr)
                turns.append(len(proxy.generations()))
            exchanges = proxy.generations()
        finally:
            proxy.stop()
        replacements = [(str(session.work), "/home/user/project"), (str(session.home), "/home/user"),
                        (str(session.work).replace("/", "-"), "-home-user-project"),  # Claude Code's project folder
                        (str(root), "/home/user"), (proxy.base_url, "http://127.0.0.1:8000")]
        bodies = [scrub(originals.get(e.request_id, e.body), replacements) for e in exchanges]
    api = CLIENT_API[client]
    kinds = chain_kinds(bodies, api)
    requests = [{"turn": 1 if i < turns[0] else 2, "kind": kind, "status": e.status, "body": body}
                for i, (e, body, kind) in enumerate(zip(exchanges, bodies, kinds, strict=True))]
    paths = {e.path.split("?")[0] for e in exchanges}
    return {"client": client, "api": api, "path": sorted(paths)[0] if paths else "", "captured": time.strftime("%Y-%m-%d"),
            "requests": requests}


def agent_bin_dir(given: Path | None) -> Path:
    if given is not None:
        return given
    done = subprocess.run([str(REPO / "tests" / "agent_clis" / "install_clients.sh")], capture_output=True,
                          text=True, check=True, timeout=1200)
    return Path(done.stdout.strip().splitlines()[-1]) / "bin"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="qwen,claude,codex,openclaw")
    ap.add_argument("--agent-bin", type=Path, help="the folder with node and the clients' commands "
                    "(default: install_clients.sh's, installed on first use; $KVFLOW_AGENTS_NPM/bin to reuse one)")
    ap.add_argument("--base-url", help="a running kvflow server (default: one started here)")
    ap.add_argument("--out-dir", type=Path, default=HERE)
    ap.add_argument("--turn-timeout", type=float, default=1800, help="seconds a client's turn may take")
    args = ap.parse_args()
    agent_clis.clients.TURN_TIMEOUT_S = args.turn_timeout  # full prompts on a loaded machine take their time
    agent_bin = args.agent_bin or (Path(os.environ["KVFLOW_AGENTS_NPM"]) / "bin"
                                   if os.environ.get("KVFLOW_AGENTS_NPM") else agent_bin_dir(None))
    server = None if args.base_url else ServerProcess("--max-model-len", "32768", "--kv-cache-memory", "1GiB")
    base_url = args.base_url or server.base_url
    try:
        for client in args.clients.split(","):
            found = capture(client, base_url, agent_bin)
            out = args.out_dir / f"{client}.json"
            out.write_text(json.dumps(found, indent=1, ensure_ascii=False) + "\n")
            summary = ", ".join(f"{r['turn']}:{r['kind']}:{r['status']}" for r in found["requests"])
            print(f"{out}: {out.stat().st_size // 1024} KiB, requests {summary}")
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
