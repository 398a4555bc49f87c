"""Cache hints under pressure (issue 50): does an agent session that marks its prompt for caching keep its
later turns cached while a load of other prompts overflows the KV cache?

    python benchmarks/cache_pressure.py [--gguf FILE] [--session codex] [--kv-cache-memory 320MiB]
        [--overflow 1.5] [--burst-prompt-tokens 2048] [--repeats 3] [--threads 2] [--out cache_pressure.json]
        [--pauses] [--record]

One `kvflow serve` on the model (the default model's GGUF unless --gguf), with a KV pool (--kv-cache-memory)
that holds the agent's context and a little more. A captured agent session (benchmarks/agent_sessions/
<session>.json, on the client's own API) is replayed request by request, streamed, with at most 16 answer
tokens; between two requests of the session a burst of unrelated prompts goes to /v1/completions, one after
another (random token ids, so no two share a prefix with each other or with the agent; --burst-prompt-tokens
each, --overflow times the pool's tokens in all, 1 answer token each), so that plain LRU eviction would
drop the agent's cached blocks.

Each repeat replays the session twice, under a fresh nonce at the start of its system prompt each time,
alternating which goes first: once with the client's cache hint (Codex's prompt_cache_key on Responses,
Claude Code's cache_control on Messages, a prompt_cache_key added on chat completions) and once with it
taken out. kvflow keeps a hinted request's prompt blocks on a second free queue, evicted only after every
unmarked block (kvflow/engine/block_pool.py), so with the hint the later requests should find their whole
earlier prompt cached (cached_tokens near the prompt, TTFT of a few new tokens) and without it prefill it
all again. Reported per request: prompt tokens, cached tokens and TTFT for both, medians of --repeats.
--pauses: as in agent_turns.py, the stretches this run's processes spent stopped by another user's run
are taken out of each TTFT.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import re
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
from agent_sessions.sessions import API_PATH, chain, load, replay_body
from agent_turns import KVFLOW, WARM_UP, Server, clean, discount_pauses, send, watch_pauses
from results_file import publish, table_section
from side_by_side import default_gguf

from kvflow.kernels.cpu_features import cpu_name, isa_tier

HINT, PLAIN = "with hint", "without hint"


def _strip_cache_control(value):
    if isinstance(value, dict):
        return {k: _strip_cache_control(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [_strip_cache_control(v) for v in value]
    return value


def hinted(body: dict, api: str, hint: bool, key: str) -> dict:
    """The body with its cache hint (prompt_cache_key, or cache_control blocks on Messages) or without any."""
    out = copy.deepcopy(body)
    if api == "messages":
        if not hint:
            return _strip_cache_control(out)
        if "cache_control" not in json.dumps(out):  # a capture without one: mark the system prompt
            system = out.get("system")
            out["system"] = [{"type": "text", "text": system}] if isinstance(system, str) else system
            out["system"][-1]["cache_control"] = {"type": "ephemeral"}
        return out
    out.pop("prompt_cache_key", None)
    if hint:
        out["prompt_cache_key"] = key
    return out


def burst(url: str, model: str, tokens: int, prompt_tokens: int, rng: random.Random) -> dict:
    """Unrelated prompts, one after another, `tokens` in all: (count, seconds)."""
    count = math.ceil(tokens / prompt_tokens)
    started = time.perf_counter()
    for _ in range(count):
        ids = [rng.randrange(1000, 40000) for _ in range(prompt_tokens)]
        httpx.post(url + "/v1/completions", json={"model": model, "prompt": ids, "max_tokens": 1},
                   timeout=600).raise_for_status()
    return {"prompts": count, "seconds": time.perf_counter() - started}


def replay(server: Server, api: str, requests: list[dict], hint: bool, pool_tokens: int, args,
           rng: random.Random) -> list[dict]:
    nonce = f"[session {uuid.uuid4().hex[:8]}] "
    key = f"agent-{uuid.uuid4().hex[:8]}"
    runs = []
    for number, request in enumerate(requests):
        if number:
            done = burst(server.url, server.model, int(args.overflow * pool_tokens), args.burst_prompt_tokens, rng)
            print(f"  burst: {done['prompts']} prompts in {done['seconds']:.0f} s", file=sys.stderr)
        body = hinted(replay_body(request["body"], api, server.model, args.max_tokens, nonce), api, hint, key)
        got = send(server, API_PATH[api], body, args.timeout)
        print(f"  {HINT if hint else PLAIN} request {number + 1}: {got}", file=sys.stderr)
        runs.append(got)
    return runs


def pool_tokens(url: str, block_size: int) -> int:
    """The KV pool's size in tokens, from kvflow's /metrics."""
    found = re.search(r"^kvflow:kv_cache_blocks_total\S* ([0-9.e+]+)$", httpx.get(url + "/metrics").text, re.M)
    if not found:
        raise RuntimeError("no kvflow:kv_cache_blocks_total in /metrics")
    return int(float(found.group(1))) * block_size


def _median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in clean(runs) if r.get(key) is not None]
    return statistics.median(values) if values else None


def table(requests: list[dict], runs: dict[str, list[list[dict]]]) -> tuple[list[str], list[dict]]:
    rows, medians = [], []
    for number, request in enumerate(requests):
        side = {label: {key: _median([rep[number] for rep in runs[label]], key)
                        for key in ("prompt_tokens", "cached_tokens", "ttft_ms")} for label in (HINT, PLAIN)}
        medians.append(side)
        hint, plain = side[HINT], side[PLAIN]
        ratio = hint["ttft_ms"] / plain["ttft_ms"] if hint["ttft_ms"] and plain["ttft_ms"] else None
        cells = [str(number + 1), str(request["turn"]), request["kind"], f"{hint['prompt_tokens'] or 0:.0f}"]
        for s in (hint, plain):
            cells += [f"{s['cached_tokens'] or 0:.0f}", f"{s['ttft_ms'] or 0:.0f}"]
        rows.append("| " + " | ".join([*cells, "-" if ratio is None else f"{ratio:.2f}"]) + " |")
    return rows, medians


COLUMNS = ["request", "turn", "adds", "prompt tokens", "cached (hint)", "TTFT ms (hint)", "cached (no hint)",
           "TTFT ms (no hint)", "hint / no hint"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, help="default: the default model's GGUF")
    ap.add_argument("--session", default="codex", help="a capture in benchmarks/agent_sessions")
    ap.add_argument("--kv-cache-memory", default="320MiB", help="kvflow's KV pool: the agent's context and a bit")
    ap.add_argument("--overflow", type=float, default=1.5, help="each burst, in multiples of the pool's tokens")
    ap.add_argument("--burst-prompt-tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=12288)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", type=Path, default=Path("cache_pressure.json"))
    ap.add_argument("--pauses", action="store_true", help="take stretches stopped by others out of each TTFT")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    gguf = args.gguf or default_gguf()
    session = load(args.session)
    api, requests = session["api"], chain(session)
    rng = random.Random(0)
    runs: dict[str, list[list[dict]]] = {HINT: [], PLAIN: []}
    paused = ""
    with tempfile.TemporaryDirectory(prefix="cache-pressure-") as tmp:
        watcher = watch_pauses(Path(tmp) / "pauses") if args.pauses else None
        server = Server(KVFLOW, [sys.executable, "-m", "kvflow", "serve", "--model", str(gguf), "--threads",
                                 str(args.threads), "--max-model-len", str(args.max_model_len), "--kv-cache-memory",
                                 args.kv_cache_memory, "--block-size", str(args.block_size), "--host", "127.0.0.1"], Path(tmp))
        try:
            pool = pool_tokens(server.url, args.block_size)
            print(f"KV pool: {pool} tokens; bursts of {int(args.overflow * pool)} tokens", file=sys.stderr)
            send(server, API_PATH[api], replay_body(WARM_UP[api], api, server.model, 4), args.timeout)  # warm-up
            burst(server.url, server.model, args.burst_prompt_tokens, args.burst_prompt_tokens, rng)
            for repeat in range(args.repeats):
                for hint in ([True, False] if repeat % 2 == 0 else [False, True]):
                    print(f"repeat {repeat + 1}, {HINT if hint else PLAIN}:", file=sys.stderr)
                    runs[HINT if hint else PLAIN].append(replay(server, api, requests, hint, pool, args, rng))
        finally:
            server.stop()
            if watcher:
                time.sleep(0.5)  # the last pause written
                watcher.terminate()
        if watcher:
            touched, seconds = discount_pauses([r for label in runs.values() for rep in label for r in rep],
                                               Path(tmp) / "pauses")
            paused = (f" Processes stopped by another user's run meanwhile: {seconds:.0f} s over {touched} requests,"
                      " taken out of the TTFTs of those over 30 s, the others left out of the medians (--pauses)."
                      if touched else " No process of the run was stopped by another user's meanwhile (--pauses).")
    rows, medians = table(requests, runs)
    summary = ("\nLater requests' TTFT with the hint over without: "
               + ", ".join(f"{m[HINT]['ttft_ms'] / m[PLAIN]['ttft_ms']:.2f}x" for m in medians[1:]
                           if m[HINT]["ttft_ms"] and m[PLAIN]["ttft_ms"]) + ".\n")
    publish(table_section(
        f"Cache hints under pressure: {args.session} ({api}) on kvflow ({time.strftime('%Y-%m-%d %H:%M')}, "
        f"CPU {cpu_name()}, {args.threads} threads)",
        f"`python benchmarks/cache_pressure.py --session {args.session} --kv-cache-memory {args.kv_cache_memory} "
        f"--max-model-len {args.max_model_len} --overflow {args.overflow} --burst-prompt-tokens "
        f"{args.burst_prompt_tokens} --repeats {args.repeats}`, "
        f"file {gguf.name}, kvflow tier {isa_tier()}: a KV pool of {pool} tokens; between two requests of the "
        f"session, {int(args.overflow * pool)} tokens of unrelated prompts ({args.burst_prompt_tokens} each). "
        f"The session replayed with its cache hint and without, alternating; medians of {args.repeats}.{paused}",
        COLUMNS, rows) + summary, args.record)
    args.out.write_text(json.dumps({"gguf": str(gguf), "session": args.session, "api": api, "pool_tokens": pool,
                                    "kv_cache_memory": args.kv_cache_memory, "overflow": args.overflow,
                                    "burst_prompt_tokens": args.burst_prompt_tokens, "medians": medians,
                                    "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
