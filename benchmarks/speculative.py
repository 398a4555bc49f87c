"""Speculative decoding (n-gram prompt lookup) against plain decoding, side by side on one loaded model,
runs alternated and medians taken, greedy, the default model as `kvflow serve` runs it (dtype auto):

  agent edit   the prompt holds a Python file of about 1,500 tokens and asks for it back with one
               function renamed: batch-1 decode tok/s (goal >= 2.5x), output identical.
  story        free-form text, nothing to copy: batch-1 decode tok/s (goal >= 0.97x).
  agent x8     eight agent edits at once: output tok/s over the batch's wall time (goal >= 1.5x).
  random x8    eight prompts of 200 random tokens, 128 out (the serving benchmark's random workload):
               output tok/s (goal >= 0.97x).

    python benchmarks/speculative.py [--repeats 3] [--max-tokens 384] [--record]
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time

from results_file import publish, table_section

from kvflow import LLM, SamplingParams
from kvflow.config import ModelConfig
from kvflow.executors.model_setup import load_model
from kvflow.kernels.cpu_features import cpu_name

WORDS = ["order", "price", "total", "item", "customer", "invoice", "discount", "tax", "line", "stock",
         "report", "cache", "record", "entry", "window", "budget", "ledger", "refund", "batch", "queue"]


def source_file(seed: int, functions: int = 24) -> tuple[str, str]:
    """A plausible Python module (seeded), and the name of one of its functions."""
    rng = random.Random(seed)
    parts = ['"""Helpers for the order pipeline."""', "", "from __future__ import annotations", "",
             "import math", "from dataclasses import dataclass", ""]
    names = []
    for i in range(functions):
        a, b, c = rng.sample(WORDS, 3)
        name = f"{a}_{b}_{i}"
        names.append(name)
        op = rng.choice(["+", "-", "*"])
        parts += [f"def {name}({a}: float, {b}: float) -> float:",
                  f'    """Return the {c} from the {a} and the {b}."""',
                  f"    {c} = {a} {op} {b} * {rng.randint(2, 9)}",
                  f"    if {c} < {rng.randint(0, 50)}:",
                  f"        return math.floor({c})",
                  f"    return round({c}, {rng.randint(1, 4)})", ""]
    return "\n".join(parts), names[len(names) // 2]


def agent_prompt(tokenizer, seed: int) -> str:
    code, name = source_file(seed)
    ask = (f"Here is a file:\n```python\n{code}\n```\nRename the function `{name}` to `{name}_renamed` and "
           "give me back the whole file, unchanged otherwise.")
    # The answer is started for the model (as agents do to steer the format): a 135M model asked plainly
    # talks about the rename instead of writing the file.
    return tokenizer.apply_chat_template([{"role": "user", "content": ask}], tokenize=False,
                                         add_generation_prompt=True) + "```python\n"


def story_prompt(tokenizer) -> str:
    ask = "Write a long, imaginative story about a lighthouse keeper who finds a map inside a bottle."
    return tokenizer.apply_chat_template([{"role": "user", "content": ask}], tokenize=False,
                                         add_generation_prompt=True)


def run(llm: LLM, prompts: list, params: SamplingParams) -> tuple[float, float, list[list[int]]]:
    """(batch-1 decode tok/s of the first request, output tok/s over the wall time, outputs)."""
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t
    m = outs[0].metrics
    decode = (m.num_generated_tokens - 1) / m.decode_time if m.decode_time else 0.0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return decode, tokens / wall, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=384)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--k", type=int, default=16, help="num_speculative_tokens (the most per step)")
    parser.add_argument("--record", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()

    loaded = load_model(ModelConfig(threads=args.threads))
    plain = LLM(loaded_model=loaded, kv_cache_memory=1 << 30)
    spec = LLM(loaded_model=loaded, kv_cache_memory=1 << 30,
               speculative_config={"method": "ngram", "num_speculative_tokens": args.k})
    tok = plain.get_tokenizer()
    rng = random.Random(0)
    vocab = loaded.arch.vocab_size
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    workloads = [
        ("agent edit", [agent_prompt(tok, 0)], greedy, 0),
        ("story", [story_prompt(tok)], SamplingParams(temperature=0, max_tokens=256, ignore_eos=True), 0),
        ("agent x8", [agent_prompt(tok, s) for s in range(1, 9)], greedy, 1),
        ("random x8", [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(200)]} for _ in range(8)],
         SamplingParams(temperature=0, max_tokens=128, ignore_eos=True), 1),
    ]
    rows = []
    for label, prompts, params, figure in workloads:
        for llm in (plain, spec):
            llm.generate(prompts, SamplingParams(max_tokens=2))  # prompts into the prefix cache, warm up
        figures: dict[str, list[float]] = {"plain": [], "spec": []}
        outputs = {}
        for _ in range(args.repeats):
            for name, llm in (("plain", plain), ("spec", spec)):
                result = run(llm, prompts, params)
                figures[name].append(result[figure])
                outputs[name] = result[2]
        p, s = statistics.median(figures["plain"]), statistics.median(figures["spec"])
        accepted = spec.engine.speculator.num_accepted_tokens
        same = "yes" if outputs["plain"] == outputs["spec"] else "NO"
        unit = "decode tok/s (batch 1)" if figure == 0 else "output tok/s"
        rows.append(f"| {label} | {unit} | {p:.1f} | {s:.1f} | {s / p:.2f}x | {same} |")
        print(rows[-1], f"(tokens out: {sum(len(o) for o in outputs['spec'])}, accepted so far {accepted})",
              flush=True)
    intro = (f"`python benchmarks/speculative.py --repeats {args.repeats} --max-tokens {args.max_tokens} "
             f"--k {args.k}`, {time.strftime('%Y-%m-%d %H:%M')}, CPU: {cpu_name()} ({platform.machine()}), "
             f"{args.threads} threads, default model, dtype auto, greedy. Median over runs alternated plain / "
             "speculative, on one loaded model. Goals (issue 20): agent edit >= 2.5x, story >= 0.97x, "
             "agent x8 >= 1.5x, random x8 >= 0.97x; output identical.")
    publish(table_section("Speculative decoding: n-gram prompt lookup", intro,
                          ["workload", "figure", "plain", "speculative", "ratio", "identical"], rows), args.record)


if __name__ == "__main__":
    main()
