"""An agent's turns on a long context, kvflow serve against llama-server: TTFT per turn.

    python benchmarks/agent_turns.py --gguf FILE [--system-len 20000] [--turns 4] [--threads 2] [--record]

One conversation (issue 21's agent scenario): a system prompt of --system-len tokens (tools, memory, code),
then per turn a user message of --user-len tokens and an answer of --output-len tokens, each turn sent as
the whole conversation so far (`kvflow bench serve --scenario agent`). Turn 1 prefills everything; on every
later turn a server that reuses its cached context prefills only what is new. Each server runs alone (one
after the other, the same prompts): `kvflow serve` with its prefix cache, and llama.cpp's `llama-server`
with one slot and `--cache-reuse 256` (its prompt cache keeps the slot's context between requests).
FILE is any GGUF with a long enough context, e.g. the 32K shape benchmarks/long_context.py writes.
Goal (issue 21): turns after the first at <= 0.5x llama-server's TTFT.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results_file import publish, table_section
from side_by_side import LLAMACPP_VENV, free_port, wait_healthy

from kvflow.kernels.cpu_features import cpu_name, isa_tier


def servers(args) -> dict:
    ctx = args.system_len + args.turns * (args.user_len + args.output_len) + 2048
    llama_server = LLAMACPP_VENV / "bin" / "llama-server"
    return {
        "llama-server": ([str(llama_server), "--model", str(args.gguf), "--threads", str(args.threads),
                          "--threads-batch", str(args.threads), "--ctx-size", str(ctx), "--parallel", "1",
                          "--cache-reuse", "256", "--host", "127.0.0.1"], "/health"),
        "kvflow": ([sys.executable, "-m", "kvflow", "serve", "--model", str(args.gguf), "--threads",
                    str(args.threads), "--max-model-len", str(ctx), "--host", "127.0.0.1"], "/health"),
    }


def run_turns(label: str, command: list[str], health: str, args, out_dir: Path) -> list[dict]:
    port = free_port()
    proc = subprocess.Popen([*command, "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    out = out_dir / f"{label}.json"
    try:
        wait_healthy(url + health, proc, timeout=600)
        subprocess.run(
            [sys.executable, "-m", "kvflow", "bench", "serve", "--base-url", url, "--label", label, "--scenario",
             "agent", "--concurrency", "1", "--turns", str(args.turns), "--system-len", str(args.system_len),
             "--user-len", str(args.user_len), "--output-len", str(args.output_len), "--timeout", "3600",
             "--no-progress", "--out", str(out)], check=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return json.loads(out.read_text())["turns"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--system-len", type=int, default=20000)
    ap.add_argument("--user-len", type=int, default=300)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    turns = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, (command, health) in servers(args).items():
            turns[label] = run_turns(label, command, health, args, Path(tmp))
    rows = []
    for ours, peer in zip(turns["kvflow"], turns["llama-server"]):
        ratio = (f"{ours['ttft_ms'] / peer['ttft_ms']:.2f}" if ours.get("ttft_ms") and peer.get("ttft_ms") else "-")
        rows.append(f"| {ours['turn']} | {ours['prompt_tokens'] or '-'} | {ours.get('cached_tokens') or 0} | "
                    f"{ours.get('ttft_ms') or 0:.0f} | {peer['prompt_tokens'] or '-'} | {peer.get('ttft_ms') or 0:.0f} | "
                    f"{ratio} |")
    publish(table_section(
        f"Agent turns on a long context against llama-server ({time.strftime('%Y-%m-%d %H:%M')}, CPU {cpu_name()}, "
        f"{args.threads} threads)",
        f"`python benchmarks/agent_turns.py --gguf {args.gguf.name} --system-len {args.system_len} --turns "
        f"{args.turns}`: one conversation, {args.user_len} new user tokens and {args.output_len} answer tokens a "
        f"turn; kvflow tier {isa_tier()}; llama-server with one slot and --cache-reuse 256. TTFT per turn.",
        ["turn", "prompt tokens (kvflow)", "kvflow cached", "kvflow TTFT ms", "prompt tokens (llama-server)",
         "llama-server TTFT ms", "kvflow / llama-server"], rows), args.record)


if __name__ == "__main__":
    main()
