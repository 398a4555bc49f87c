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
import platform
import statistics
import sys
import time
from pathlib import Path

import openai
from results_file import publish, table_section

from kvflow import LLM, SamplingParams
from kvflow.kernels.cpu_features import cpu_name

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from server.server_process import ServerProcess  # noqa: E402
from server.test_engine_core import descendants  # noqa: E402

QUESTIONS = ["Explain how a hash map works.", "Write a short story about a lighthouse.",
             "List ten uses of a paperclip.", "Describe the water cycle.", "How do vaccines work?",
             "Summarize the plot of Hamlet.", "What makes a good API design?", "Explain recursion to a child."]


async def _http_tpots(base_url: str, max_tokens: int, questions: list[str]) -> list[float]:
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none")

    async def one(question: str) -> float:
        stream = await client.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": question}], max_tokens=max_tokens,
            temperature=0, stream=True, extra_body={"ignore_eos": True})
        times = []
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                times.append(time.perf_counter())
        return (times[-1] - times[0]) / (len(times) - 1)

    tpots = await asyncio.gather(*(one(q) for q in questions))
    await client.close()
    return list(tpots)


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
    parser.add_argument("--record", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()

    questions = QUESTIONS[: args.concurrency]
    common = ("--threads", str(args.threads), "--kv-cache-memory", "256MiB")
    servers = {"HTTP, core process": ServerProcess(*common, "--engine-process", "on"),
               "HTTP, engine in process": ServerProcess(*common, "--engine-process", "off")}
    llm = LLM(threads=args.threads, kv_cache_memory=256 << 20)
    samples: dict[str, list[float]] = {"engine alone": [], **{name: [] for name in servers}}
    try:
        for _ in range(args.rounds + 1):  # the first round warms every path up and is dropped
            for name in samples:
                if name == "engine alone":
                    tpots = _engine_tpots(llm, args.max_tokens, questions)
                else:
                    tpots = asyncio.run(_http_tpots(servers[name].base_url, args.max_tokens, questions))
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
        rows.append(f"| {name} | {tpot * 1000:.2f} | {tpot / base:.3f} | {memory} |")
    intro = (f"`python benchmarks/front_end_overhead.py --rounds {args.rounds} --max-tokens {args.max_tokens} "
             f"--threads {args.threads} --concurrency {args.concurrency}`, "
             f"{time.strftime('%Y-%m-%d %H:%M')}, CPU: {cpu_name()} ({platform.machine()}), {args.threads} threads, "
             f"default model, dtype auto, {args.concurrency} concurrent streaming chat requests, greedy, EOS ignored. TPOT: median over "
             "requests, then over rounds (alternated). Goal (issue 23): through HTTP with the core in its own "
             "process, within 5% of the engine alone.")
    publish(table_section(f"Front-end overhead: TPOT at concurrency {args.concurrency}, HTTP against the engine "
                          "alone", intro,
                          ["path", "TPOT ms", "vs engine alone", "server RSS MiB"], rows), args.record)


if __name__ == "__main__":
    main()
