"""Real coding-agent sessions replayed against `kvflow serve` and llama.cpp's `llama-server`: TTFT per turn.

    python benchmarks/agent_turns.py --gguf FILE [--sessions qwen,claude,codex,openclaw] [--repeats 3]
        [--threads 2] [--ctx 32768] [--max-tokens 16] [--same-tokens] [--pauses] [--out agent_turns.json] [--record]

The sessions are the real clients' requests, captured by benchmarks/agent_sessions/capture.py into
benchmarks/agent_sessions/<client>.json: Qwen Code and OpenClaw on chat completions, Claude Code on
Anthropic Messages (/v1/messages), Codex CLI on Responses (/v1/responses). Each session's chain is replayed
request by request as the client sent it, on the client's own API (llama-server serves all three): the first
request, then the follow-ups that append to it (the client's tool result, the next user message). Both
servers get the same bodies: the captured answers, not the replaying server's, are the ones appended, so
turn k's prompt is the same on both. Each body is streamed with at most --max-tokens of answer, and TTFT is
the time to the first answer or tool-call token (to the response's end when none came, marked `*`). A short
request on each API first warms both servers up (not counted).

Both servers run side by side, each started once with the same context (--ctx) and --threads, and take
turns per session (kvflow first in even repeats for even sessions, llama-server first otherwise). Before
each replay of a session a fresh nonce starts its system prompt, and llama-server's one slot is erased (it
runs with --parallel 1 --cache-reuse 256 and --cache-ram 0, so nothing from an earlier replay is restored
into it; --slot-save-path only enables the erase), so turn 1 prefills everything on both servers and later
turns reuse only what this replay left.

Per request: prompt tokens, the share served from cache (kvflow's usage `cached_tokens` or
`cache_read_input_tokens`; llama-server's `timings.cache_n` of cache_n + prompt_n), the prefill rate (new
tokens / TTFT) and kvflow's TTFT over llama-server's; medians over --repeats.

The same body is the same prompt only when both servers render it alike: llama-server caps its context at
the model's training context, and under a chat template without tools (SmolLM2's, which the 32K shape
benchmarks/long_context.py writes also carries) it leaves the tools out where kvflow describes them in the
system prompt (the table says so when the first prompts differ by over 10%). `--same-tokens` sends every
session as token ids instead: each body becomes the prompt kvflow's own endpoint for its API would prefill
(chat bodies as they are, Messages and Responses bodies through kvflow's translation into its chat request,
agent_sessions/kvflow_prompt.py), kvflow's /tokenize renders that, and both servers get the ids on
/v1/completions, so the prompts are the same to the token whatever the template (the API layer is skipped).
Before the timed replays each session's chain is sent once to kvflow on its own API (max 1 token, a nonce
of its own) and the prompt tokens it reports are checked against the rendered ids' count (printed; a
difference of over 4 tokens stops the run).
On a shared machine where others pause python and llama processes for runs of theirs (SIGSTOP), `--pauses`
watches this run's processes (benchmarks/pause_watch.sh) and takes the stretches they spent stopped out of
each TTFT (kept per run as paused_ms; the table's intro says how much).
Goals: issue 50, turn 1 at <= 0.7x llama-server's TTFT and later turns at <= 0.5x; issue 52, on the
16K-token Qwen Code session, turn 1 at <= 0.4x and later turns at <= 0.15x.

`--synthetic` runs the older synthetic conversation instead (issue 21: `kvflow bench serve --scenario agent`,
a --system-len-token system prompt and --turns turns, each server alone).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
from agent_sessions.kvflow_prompt import chat_form
from agent_sessions.sessions import API_PATH, chain, is_first_token, load, prefill_counts, replay_body
from agent_sessions.sessions import HERE as CAPTURES
from results_file import publish, table_section
from side_by_side import LLAMACPP_VENV, free_port, wait_healthy

from kvflow.kernels.cpu_features import cpu_name, isa_tier

LLAMA = "llama-server"
KVFLOW = "kvflow"


def gguf_architecture(gguf: Path) -> str:
    """general.architecture of the file (llama, qwen2, ...): the prefix of its context-length key."""
    from gguf import GGUFReader

    field = GGUFReader(str(gguf)).fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()


def server_commands(gguf: Path, threads: int, ctx: int, scratch: Path) -> dict[str, list[str]]:
    # llama-server caps its context at the file's trained length (8,192 for the default model) unless told
    # otherwise; kvflow serves --max-model-len past it (with a warning), so both get the same context.
    override = f"{gguf_architecture(gguf)}.context_length=int:{ctx}"
    return {
        KVFLOW: [sys.executable, "-m", "kvflow", "serve", "--model", str(gguf), "--threads", str(threads),
                 "--max-model-len", str(ctx), "--host", "127.0.0.1"],
        LLAMA: [str(LLAMACPP_VENV / "bin" / "llama-server"), "--model", str(gguf), "--threads", str(threads),
                "--threads-batch", str(threads), "--ctx-size", str(ctx), "--parallel", "1", "--cache-reuse", "256",
                "--cache-ram", "0", "--slot-save-path", str(scratch), "--override-kv", override, "--host", "127.0.0.1"],
    }


class Server:
    def __init__(self, label: str, command: list[str], log_dir: Path) -> None:
        self.label = label
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = (log_dir / f"{label}.log").open("w")
        self.proc = subprocess.Popen([*command, "--port", str(port)], stdout=self.log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.url + "/health", self.proc, timeout=900)
        except (RuntimeError, TimeoutError):
            self.stop()
            raise
        self.model = httpx.get(self.url + "/v1/models", timeout=30).json()["data"][0]["id"]

    def forget(self) -> None:
        """llama-server's slot emptied (kvflow has nothing to erase: the nonce keeps its prefix cache out)."""
        if self.label == LLAMA:
            httpx.post(self.url + "/slots/0?action=erase", timeout=60).raise_for_status()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def send(server: Server, path: str, body: dict, timeout: float) -> dict:
    """One streamed request: TTFT (ms), whether a first token came, prompt and cached tokens, or an error."""
    try:
        return _send(server, path, body, timeout)
    except httpx.HTTPError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def _send(server: Server, path: str, body: dict, timeout: float) -> dict:
    payload = json.dumps(body).encode()
    events: list[dict] = []
    first = None
    started_at = time.time()
    started = time.perf_counter()
    with httpx.stream("POST", server.url + path, content=payload, timeout=timeout,
                      headers={"content-type": "application/json", "x-api-key": "replay",
                               "anthropic-version": "2023-06-01"}) as response:
        if response.status_code != 200:
            return {"error": f"{response.status_code}: {response.read().decode(errors='replace')[:300]}"}
        for line in response.iter_lines():
            text = line.removeprefix("data:").strip()
            if not text.startswith("{"):
                continue
            event = json.loads(text)
            events.append(event)
            if first is None and is_first_token(event):
                first = time.perf_counter() - started
    ended = time.perf_counter() - started
    prompt, cached = prefill_counts(events)
    got = {"ttft_ms": 1000 * (first if first is not None else ended), "first_token": first is not None,
           "prompt_tokens": prompt, "cached_tokens": cached, "started_at": started_at}
    for event in events:  # kvflow's own account (usage.kvflow_timings): its TTFT and prefill time, in ms
        for holder in (event, event.get("response") or {}, event.get("message") or {}):
            timings = (holder.get("usage") or {}).get("kvflow_timings") if isinstance(holder, dict) else None
            if isinstance(timings, dict):
                got.update(server_ttft_ms=timings.get("ttft_ms"), server_prefill_ms=timings.get("prefill_ms"))
    return got


def watch_pauses(out: Path) -> subprocess.Popen:
    """benchmarks/pause_watch.sh on this process's session: the stretches its processes spend stopped go to out."""
    return subprocess.Popen(["bash", str(Path(__file__).resolve().parent / "pause_watch.sh"), str(out),
                             str(os.getsid(0))])


def discount_pauses(runs: list[dict], pauses: Path, long_ms: float = 30_000) -> tuple[int, float]:
    """The watched pauses (pause_watch.sh's file) each run overlapped, as paused_ms: a run of over long_ms has
    them taken out of its TTFT (the watch's 0.2 s polling is then a small error), a shorter one is marked
    excluded (left out of the medians while any run of its request is clean): (runs touched, seconds)."""
    spans = [tuple(map(float, line.split())) for line in pauses.read_text().splitlines() if line.strip()] \
        if pauses.exists() else []
    touched, total = 0, 0.0
    for run in runs:
        if "started_at" not in run or "ttft_ms" not in run or "paused_ms" in run:
            continue
        start, end = run["started_at"], run["started_at"] + run["ttft_ms"] / 1000
        paused = sum(max(0.0, min(end, b) - max(start, a)) for a, b in spans)
        if paused:
            run["paused_ms"] = 1000 * paused
            if run["ttft_ms"] > long_ms:
                run["ttft_ms"] -= 1000 * paused
            else:
                run["excluded"] = True
            touched, total = touched + 1, total + paused
    return touched, total


def clean(runs: list[dict]) -> list[dict]:
    """The runs without an error, less those a pause excluded (unless that leaves none)."""
    ok = [r for r in runs if "error" not in r]
    return [r for r in ok if not r.get("excluded")] or ok


WARM_UP = {"chat": {"messages": [{"role": "user", "content": "Hello"}]}, "responses": {"input": "Hello"},
           "messages": {"messages": [{"role": "user", "content": "Hello"}]}}


def as_tokens(kvflow: Server, body: dict, api: str) -> list[int]:
    """kvflow's own prompt for a body on `api`: its /tokenize renders the chat form as /v1/chat/completions does."""
    got = httpx.post(kvflow.url + "/tokenize", json={"model": kvflow.model, **chat_form(body, api)}, timeout=600)
    got.raise_for_status()
    return got.json()["tokens"]


def check_rendering(kvflow: Server, client: str, api: str, requests: list[dict], timeout: float,
                    tolerance: int = 4) -> list[tuple[int, int]]:
    """Each body of the chain, under a nonce of its own, rendered into ids and sent to kvflow on its own API
    (at most 1 answer token): (rendered count, the prompt tokens the API reports) per body, printed; a
    difference past `tolerance` raises."""
    nonce = f"[check {uuid.uuid4().hex[:8]}] "
    pairs = []
    for number, request in enumerate(requests, 1):
        body = replay_body(request["body"], api, kvflow.model, 1, nonce)
        rendered = len(as_tokens(kvflow, body, api))
        got = send(kvflow, API_PATH[api], body, timeout)
        reported = got.get("prompt_tokens")
        print(f"{client} request {number} ({api}): rendered {rendered} tokens, kvflow's {API_PATH[api]} reports "
              f"{reported}", file=sys.stderr)
        if reported is None or abs(rendered - reported) > tolerance:
            raise RuntimeError(f"{client} request {number}: rendered {rendered} tokens but {API_PATH[api]} "
                               f"reports {reported} ({got.get('error', '')})")
        pairs.append((rendered, reported))
    return pairs


def replay(servers: dict[str, Server], sessions: list[str], folder: Path, repeats: int, max_tokens: int,
           timeout: float, same_tokens: bool = False) -> dict:
    results: dict = {}
    apis = {load(client, folder)["api"] for client in sessions}
    for api in sorted(apis | ({"chat"} if same_tokens else set())):
        for server in servers.values():  # first-request costs, not counted
            send(server, API_PATH[api], replay_body(WARM_UP[api], api, server.model, 4), timeout)
    checks = {}
    if same_tokens:
        for server in servers.values():
            send(server, "/v1/completions", {"model": server.model, "prompt": [1, 2, 3], "max_tokens": 4}, timeout)
        for client in sessions:
            session = load(client, folder)
            checks[client] = check_rendering(servers[KVFLOW], client, session["api"], chain(session), timeout)
    for repeat in range(repeats):
        for index, client in enumerate(sessions):
            session = load(client, folder)
            api, requests = session["api"], chain(session)
            entry = results.setdefault(client, {"api": f"{api} as kvflow's tokens" if same_tokens else api,
                                                "requests": [{"turn": r["turn"], "kind": r["kind"], KVFLOW: [],
                                                              LLAMA: []} for r in requests]})
            if client in checks:
                entry["rendered_vs_reported"] = checks[client]
            nonce = f"[session {uuid.uuid4().hex[:8]}] "
            bodies = [replay_body(r["body"], api, servers[KVFLOW].model, max_tokens, nonce) for r in requests]
            prompts = [as_tokens(servers[KVFLOW], body, api) for body in bodies] if same_tokens else []
            order = [KVFLOW, LLAMA] if (repeat + index) % 2 == 0 else [LLAMA, KVFLOW]
            for label in order:
                server = servers[label]
                server.forget()
                for number, body in enumerate(bodies):
                    path = "/v1/completions" if same_tokens else API_PATH[api]
                    body = ({"prompt": prompts[number], "max_tokens": max_tokens, "stream": True,
                             "stream_options": {"include_usage": True}} if same_tokens else body)
                    got = send(server, path, {**body, "model": server.model}, timeout)
                    entry["requests"][number][label].append(got)
                    print(f"{client} repeat {repeat + 1} {label} request {number + 1}: {got}", file=sys.stderr)
    return results


def _median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def summarize(runs: list[dict]) -> dict:
    ok = clean(runs)
    if not ok:
        return {"error": runs[0]["error"] if runs else "no runs"}
    prompt, cached, ttft = _median(ok, "prompt_tokens"), _median(ok, "cached_tokens"), _median(ok, "ttft_ms")
    new = prompt - cached if prompt is not None and cached is not None else None
    return {"ttft_ms": ttft, "prompt_tokens": prompt, "cached_tokens": cached,
            "prefill_tok_s": 1000 * new / ttft if new is not None and ttft else None,
            "first_token": all(r["first_token"] for r in ok), "runs": len(ok)}


def _cell(value: float | None, form: str = "{:.0f}") -> str:
    return "-" if value is None else form.format(value)


def session_rows(entry: dict) -> list[str]:
    rows = []
    for number, request in enumerate(entry["requests"], 1):
        ours, peer = summarize(request[KVFLOW]), summarize(request[LLAMA])
        request["median"] = {KVFLOW: ours, LLAMA: peer}
        cells = [str(number), str(request["turn"]), request["kind"]]
        for side in (ours, peer):
            if "error" in side:
                cells += [side["error"][:60].replace("|", "/"), "-", "-", "-"]
                continue
            share = side["cached_tokens"] / side["prompt_tokens"] if side["prompt_tokens"] else None
            cells += [_cell(side["prompt_tokens"]), _cell(share and 100 * share, "{:.0f}%"),
                      _cell(side["ttft_ms"]) + ("" if side["first_token"] else "*"), _cell(side["prefill_tok_s"])]
        ratio = (ours["ttft_ms"] / peer["ttft_ms"] if ours.get("ttft_ms") and peer.get("ttft_ms") else None)
        request["ratio"] = ratio
        rows.append("| " + " | ".join([*cells, _cell(ratio, "{:.2f}")]) + " |")
    return rows


def goal_line(entry: dict) -> str:
    """kvflow's TTFT over llama-server's on the first request and on the follow-ups, against issues 50's and 52's
    goals."""
    ratios = [r.get("ratio") for r in entry["requests"]]
    later = [r for r in ratios[1:] if r is not None]
    first = _cell(ratios[0] if ratios else None, "{:.2f}x")
    spread = f"{min(later):.2f}x to {max(later):.2f}x" if later else "-"
    line = (f"\nFirst request: {first} llama-server's TTFT (goals: issue 50 <= 0.7x, issue 52 <= 0.4x); follow-ups: "
            f"{spread} (issue 50 <= 0.5x, issue 52 <= 0.15x).")
    if entry.get("rendered_vs_reported"):
        pairs = ", ".join(f"{a}/{b}" for a, b in entry["rendered_vs_reported"])
        line += f" Rendered ids / prompt tokens kvflow's own {entry['api'].split()[0]} API reports, per request: {pairs}."
    medians = entry["requests"][0].get("median", {}) if entry["requests"] else {}
    ours, peer = (medians.get(label, {}).get("prompt_tokens") for label in (KVFLOW, LLAMA))
    if ours and peer and abs(ours - peer) > 0.1 * max(ours, peer):  # e.g. a chat template that drops the tools
        line += (f" The prompts differ: {ours:.0f} tokens on kvflow, {peer:.0f} on llama-server, so this compares"
                 " different work.")
    return line + "\n"


COLUMNS = ["request", "turn", "adds", "kvflow prompt tokens", "kvflow cached", "kvflow TTFT ms", "kvflow prefill tok/s",
           "llama-server prompt tokens", "llama-server cached", "llama-server TTFT ms", "llama-server prefill tok/s",
           "kvflow / llama-server"]


def run_sessions(args) -> None:
    sessions = args.sessions.split(",")
    servers: dict[str, Server] = {}
    paused = ""
    with tempfile.TemporaryDirectory(prefix="agent-turns-") as tmp:
        watcher = watch_pauses(Path(tmp) / "pauses") if args.pauses else None
        try:
            for label, command in server_commands(args.gguf, args.threads, args.ctx, Path(tmp)).items():
                servers[label] = Server(label, command, Path(tmp))
            results = replay(servers, sessions, args.captures, args.repeats, args.max_tokens, args.timeout,
                             args.same_tokens)
        finally:
            for server in servers.values():
                server.stop()
            if watcher:
                time.sleep(0.5)  # the last pause written
                watcher.terminate()
        if watcher:
            touched, seconds = discount_pauses([run for entry in results.values() for request in entry["requests"]
                                                for label in (KVFLOW, LLAMA) for run in request[label]],
                                               Path(tmp) / "pauses")
            paused = (f" Processes stopped by another user's run meanwhile: {seconds:.0f} s over {touched} requests,"
                      " taken out of the TTFTs of those over 30 s, the others left out of the medians (--pauses)."
                      if touched else " No process of the run was stopped by another user's meanwhile (--pauses).")
    stamp = time.strftime("%Y-%m-%d %H:%M")
    same = ("the same token ids (kvflow's /tokenize of the prompt its own endpoint for the API would run) on "
            "/v1/completions" if args.same_tokens else "the same bodies")
    sections = []
    for client, entry in results.items():
        rows = session_rows(entry)
        sections.append(table_section(
            f"Agent session replay: {client} ({entry['api']}) against llama-server ({stamp}, CPU {cpu_name()}, "
            f"{args.threads} threads)",
            f"`python benchmarks/agent_turns.py --gguf {args.gguf.name} --sessions {client} --repeats "
            f"{args.repeats} --ctx {args.ctx} --max-tokens {args.max_tokens}"
            f"{' --same-tokens' if args.same_tokens else ''}`: benchmarks/agent_sessions/{client}.json's requests on the session's chain, "
            f"{same} to both servers (at most {args.max_tokens} answer tokens), context {args.ctx}; kvflow "
            f"tier {isa_tier()}; llama-server with one slot, --cache-reuse 256, --cache-ram 0. Medians of "
            f"{args.repeats}; `*`: no token streamed before the end.{paused}", COLUMNS, rows) + goal_line(entry))
    publish("\n".join(sections), args.record)
    if args.out:
        args.out.write_text(json.dumps({"gguf": str(args.gguf), "threads": args.threads, "ctx": args.ctx,
                                        "max_tokens": args.max_tokens, "date": stamp, "sessions": results}, indent=1))


def run_synthetic(args) -> None:
    """Issue 21's synthetic conversation through `kvflow bench serve --scenario agent`, each server alone."""
    ctx = args.system_len + args.turns * (args.user_len + args.output_len) + 2048
    turns = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, command in server_commands(args.gguf, args.threads, ctx, Path(tmp)).items():
            port = free_port()
            proc = subprocess.Popen([*command, "--port", str(port)], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
            url, out = f"http://127.0.0.1:{port}", Path(tmp) / f"{label}.json"
            try:
                wait_healthy(url + "/health", proc, timeout=600)
                subprocess.run(
                    [sys.executable, "-m", "kvflow", "bench", "serve", "--base-url", url, "--label", label,
                     "--scenario", "agent", "--concurrency", "1", "--turns", str(args.turns), "--system-len",
                     str(args.system_len), "--user-len", str(args.user_len), "--output-len", str(args.output_len),
                     "--timeout", "3600", "--no-progress", "--out", str(out)], check=True)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
            turns[label] = json.loads(out.read_text())["turns"]
    rows = []
    for ours, peer in zip(turns[KVFLOW], turns[LLAMA], strict=False):
        ratio = f"{ours['ttft_ms'] / peer['ttft_ms']:.2f}" if ours.get("ttft_ms") and peer.get("ttft_ms") else "-"
        rows.append(f"| {ours['turn']} | {ours['prompt_tokens'] or '-'} | {ours.get('cached_tokens') or 0} | "
                    f"{ours.get('ttft_ms') or 0:.0f} | {peer['prompt_tokens'] or '-'} | {peer.get('ttft_ms') or 0:.0f} | "
                    f"{ratio} |")
    publish(table_section(
        f"Agent turns on a long context against llama-server ({time.strftime('%Y-%m-%d %H:%M')}, CPU {cpu_name()}, "
        f"{args.threads} threads)",
        f"`python benchmarks/agent_turns.py --synthetic --gguf {args.gguf.name} --system-len {args.system_len} "
        f"--turns {args.turns}`: one conversation, {args.user_len} new user tokens and {args.output_len} answer "
        f"tokens a turn; kvflow tier {isa_tier()}; llama-server with one slot and --cache-reuse 256. TTFT per turn.",
        ["turn", "prompt tokens (kvflow)", "kvflow cached", "kvflow TTFT ms", "prompt tokens (llama-server)",
         "llama-server TTFT ms", "kvflow / llama-server"], rows), args.record)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--sessions", default="qwen,claude,codex,openclaw", help="captured clients, in order")
    ap.add_argument("--captures", type=Path, default=CAPTURES, help="the folder of <client>.json captures")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=32768, help="both servers' context")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per request")
    ap.add_argument("--out", type=Path, help="also write every run's figures here (JSON)")
    ap.add_argument("--same-tokens", action="store_true",
                    help="every session as kvflow's prompt tokens to both servers' /v1/completions")
    ap.add_argument("--pauses", action="store_true",
                    help="take the stretches this run's processes spend stopped (another user's quiet script: "
                         "benchmarks/pause_watch.sh) out of each TTFT")
    ap.add_argument("--synthetic", action="store_true", help="issue 21's synthetic conversation instead")
    ap.add_argument("--system-len", type=int, default=20000)
    ap.add_argument("--user-len", type=int, default=300)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    args = ap.parse_args()
    run_synthetic(args) if args.synthetic else run_sessions(args)


if __name__ == "__main__":
    main()
