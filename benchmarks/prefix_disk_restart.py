"""The prefix cache's disk tier across a restart: TTFT of an agent's first turn on a long context, cold (empty
store) and after a restart with the store warm, on the default model as `kvflow serve` runs it (dtype auto).

Each repeat builds a new context (Python files an agent has read, then a question), and runs, alternating
the order between repeats:
  plain  a new engine without the disk tier (what a restart costs today);
  cold   a new engine with an empty store: it computes the context and writes its blocks as they fill;
  warm   another new engine over that store (a restart): the context's blocks are read back from disk.
Every engine is warmed up first, as `kvflow serve` does, so no TTFT pays for first page faults. Goal (issue
21): warm TTFT <= 0.2x cold; cold with the store within noise of plain.

    python benchmarks/prefix_disk_restart.py [--tokens 6000] [--repeats 3] [--record]
"""

from __future__ import annotations

import argparse
import platform
import shutil
import statistics
import tempfile
import time

from results_file import publish, table_section
from speculative import source_file

from kvflow import LLM, SamplingParams
from kvflow.config import ModelConfig
from kvflow.executors.model_setup import load_model
from kvflow.kernels.cpu_features import cpu_name, isa_tier

ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1)


def context(tokenizer, seed: int, tokens: int) -> str:
    parts, i = [], 0
    while True:
        code, name = source_file(seed * 100 + i)
        parts.append(f"File pipeline_{i}.py:\n```python\n{code}\n```\n")
        text = "".join(parts) + f"Which function calls `{name}`?"
        if len(tokenizer(text).input_ids) >= tokens:
            return text
        i += 1


def first_turn(loaded, prompt: str, folder: str | None, memory: int) -> tuple[float, int, int]:
    """TTFT of a new engine's first request, its disk-cached tokens, and its prompt tokens."""
    with LLM(loaded_model=loaded, kv_cache_memory=memory, prefix_cache_dir=folder) as llm:
        llm.engine.warm_up()
        out = llm.generate(prompt, ONE_TOKEN)[0]
    return out.metrics.ttft, out.metrics.num_disk_cached_tokens, out.metrics.num_prompt_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=6000, help="context length (the default model's is 8192)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--record", action="store_true", help="add the table to benchmarks/history/<today>.md (listed in RESULTS.md)")
    args = parser.parse_args()
    loaded = load_model(ModelConfig(device="cpu", threads=args.threads, max_model_len=8192))
    memory = 1 << 30
    runs: dict[str, list[float]] = {"plain": [], "cold": [], "warm": []}
    disk_tokens, prompt_tokens = [], 0
    for r in range(args.repeats):
        prompt = context(loaded.tokenizer, r, args.tokens)
        folder = tempfile.mkdtemp(prefix="kvflow-prefix-bench-")
        try:
            order = ["plain", "cold"] if r % 2 == 0 else ["cold", "plain"]
            for kind in [*order, "warm"]:
                ttft, from_disk, prompt_tokens = first_turn(loaded, prompt, None if kind == "plain" else folder,
                                                            memory)
                runs[kind].append(ttft)
                if kind == "warm":
                    disk_tokens.append(from_disk)
                print(f"repeat {r} {kind}: TTFT {ttft * 1000:.0f} ms, {from_disk} tokens from disk", flush=True)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    rows = [f"| {prompt_tokens} | {med['plain'] * 1000:.0f} | {med['cold'] * 1000:.0f} | {med['warm'] * 1000:.0f} | "
            f"{med['warm'] / med['cold']:.3f} | {med['cold'] / med['plain']:.2f} | {min(disk_tokens)} |"]
    intro = (f"`python benchmarks/prefix_disk_restart.py --tokens {args.tokens} --repeats {args.repeats}`, "
             f"{time.strftime('%Y-%m-%d %H:%M')}, CPU: {cpu_name()} ({platform.machine()}, tier {isa_tier()}), "
             f"{args.threads} threads, default model, dtype auto. TTFT of a new engine's first request (medians; "
             "plain and cold alternated). Goal (issue 21): warm <= 0.2x cold.")
    publish(table_section("Prefix cache on disk: first turn after a restart", intro,
                          ["prompt tokens", "plain TTFT ms", "cold TTFT ms (writing)", "warm TTFT ms (restart)",
                           "warm / cold", "cold / plain", "tokens from disk"], rows), args.record)


if __name__ == "__main__":
    main()
