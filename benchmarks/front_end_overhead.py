"""What serving over HTTP adds to a decode step: TPOT of concurrent streaming requests (8 by default) through `kvflow serve`
(`--engine-process on`: the engine core in its own process; `off`: on a thread of the server's) against the same 8 requests run
by the engine alone (LLM.generate), on the default model, rounds alternated, medians taken.

TPOT through HTTP is measured by the client, from the arrival of each stream's chunks (first token to last,
over the tokens between); the engine's own from its request metrics. Resident memory is the server's process
tree (front end plus core) after the runs.

    python benchmarks/front_end_overhead.py [--rounds 5] [--max-tokens 128] [--record]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import httpx
from results_file import publish, table_section

from kvflow import LLM, SamplingParams
from kvflow.kernels.cpu_features import cpu_name

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from server.server_process import ServerProcess  # noqa: E402
from server.test_engine_core import core_pids, descendants  # noqa: E402

QUESTIONS = ["Explain how a hash map works.", "Write a short story about a lighthouse.",
             "List ten uses of a paperclip.", "Describe the water cycle.", "How do vaccines work?",
             "Summarize the plot of Hamlet.", "What makes a good API design?", "Explain recursion to a child."]


async def _http_tpots(base_url: str, max_tokens: int, questions: list[str]) -> list[float]:
    """The streams read as plain SSE lines: the openai package's per-chunk parsing cost this 2-core machine a
    fifth of a core at concurrency 8, taken from the engine and charged to the server otherwise."""
    async with httpx.AsyncClient(timeout=600) as client:

        async def one(question: str) -> float:
            body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": question}],
                    "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
            times = []
            async with client.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        choices = json.loads(line[6:])["choices"]
                        if choices and choices[0]["delta"].get("content"):
                            times.append(time.perf_counter())
            return (times[-1] - times[0]) / (len(times) - 1)

        return list(await asyncio.gather(*(one(q) for q in questions)))


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuShares:
    """Cores each process used over a round (CPU seconds over wall seconds): where the machine's time went."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.samples: dict[str, list[float]] = {name: [] for name in pids}

    def measure(self, run):
        before = {name: _cpu_seconds(pid) for name, pid in self.pids.items()}
        t0 = time.perf_counter()
        result = run()
        wall = time.perf_counter() - t0
        for name, pid in self.pids.items():
            self.samples[name].append((_cpu_seconds(pid) - before[name]) / wall)
        return result

    def median(self, name: str) -> str:
        values = self.samples.get(name, [])[1:]
        return f"{statistics.median(values):.2f}" if values else "-"


def _engine_tpots(llm: LLM, max_tokens: int, questions: list[str]) -> list[float]:
    prompts = [[{"role": "user", "content": q}] for q in questions]
    outs = llm.chat(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return [o.metrics.tpot for o in outs]


def _rss_mib(pid: int) -> float:
    total = 0
    for p in [pid] + [child for child, _ in descendants(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8, choices=range(1, len(QUESTIONS) + 1))
    parser.add_argument("--record", action="store_true", help="add the table to benchmarks/history/<today>.md (listed in RESULTS.md)")
    args = parser.parse_args()

    questions = QUESTIONS[: args.concurrency]
    common = ("--threads", str(args.threads), "--kv-cache-memory", "256MiB")
    servers = {"HTTP, core process": ServerProcess(*common, "--engine-process", "on"),
               "HTTP, engine in process": ServerProcess(*common, "--engine-process", "off")}
    llm = LLM(threads=args.threads, kv_cache_memory=256 << 20)
    samples: dict[str, list[float]] = {"engine alone": [], **{name: [] for name in servers}}
    shares = {}
    for name, server in servers.items():
        cores = core_pids(server)
        shares[name] = CpuShares({"front end": server.proc.pid, "client": os.getpid(),
                                  **({"core": cores[0]} if cores else {})})
    shares["engine alone"] = CpuShares({"core": os.getpid()})
    try:
        for _ in range(args.rounds + 1):  # the first round warms every path up and is dropped
            for name in samples:
                if name == "engine alone":
                    tpots = shares[name].measure(lambda: _engine_tpots(llm, args.max_tokens, questions))
                else:
                    tpots = shares[name].measure(lambda url=servers[name].base_url: asyncio.run(
                        _http_tpots(url, args.max_tokens, questions)))
                samples[name].append(statistics.median(tpots))
        rss = {name: _rss_mib(server.proc.pid) for name, server in servers.items()}
    finally:
        for server in servers.values():
            server.stop()
    base = statistics.median(samples["engine alone"][1:])
    rows = []
    for name, values in samples.items():
        tpot = statistics.median(values[1:])
        memory = f"{rss[name]:.0f}" if name in rss else "-"
        cpu = " | ".join(shares[name].median(part) for part in ("core", "front end", "client"))
        rows.append(f"| {name} | {tpot * 1000:.2f} | {tpot / base:.3f} | {cpu} | {memory} |")
    intro = (f"`python benchmarks/front_end_overhead.py --rounds {args.rounds} --max-tokens {args.max_tokens} "
             f"--threads {args.threads} --concurrency {args.concurrency}`, "
             f"{time.strftime('%Y-%m-%d %H:%M')}, CPU: {cpu_name()} ({platform.machine()}), {args.threads} threads, "
             f"default model, dtype auto, {args.concurrency} concurrent streaming chat requests, greedy, EOS ignored. TPOT: median over "
             "requests, then over rounds (alternated). Goal (issue 23): through HTTP with the core in its own "
             "process, within 5% of the engine alone. Cores used: CPU seconds over wall seconds per process "
             "during a round (the engine alone runs in the benchmark's own process; with the core in-process, "
             "the front end's figure holds the steps too); the client reads the SSE lines with httpx.")
    publish(table_section(f"Front-end overhead: TPOT at concurrency {args.concurrency}, HTTP against the engine "
                          "alone", intro,
                          ["path", "TPOT ms", "vs engine alone", "cores: core", "cores: front end", "cores: client",
                           "server RSS MiB"], rows), args.record)


if __name__ == "__main__":
    main()
