"""Speculative decoding (--method ngram, suffix or draft_model) against plain decoding, side by side on one loaded model,
runs alternated and medians taken, greedy, the default model as `kvflow serve` runs it (dtype auto):

  agent edit   the prompt holds a Python file of about 1,500 tokens and asks for it back with one
               function renamed: batch-1 decode tok/s (goal >= 2.5x), output identical.
  story        free-form text, nothing to copy: batch-1 decode tok/s (goal >= 0.97x).
  agent x8     eight agent edits at once: output tok/s over the batch's wall time (goal >= 1.5x).
  random x8    eight prompts of 200 random tokens, 128 out (the serving benchmark's random workload):
               output tok/s (goal >= 0.97x).

Each repeat asks for something new (another file, another story). The table also gives the draft tokens
verified and kept.

    python benchmarks/speculative.py [--method ngram] [--repeats 3] [--max-tokens 384] [--record]
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
from kvflow.kernels.cpu_features import cpu_name, isa_tier

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


STORIES = ["a lighthouse keeper who finds a map inside a bottle", "a clockmaker whose clocks start running backwards",
           "a girl who can hear what trees are thinking", "a train that stops at a station missing from every map",
           "a baker whose bread makes people remember their dreams"]


def story_prompt(tokenizer, seed: int) -> str:
    ask = f"Write a long, imaginative story about {STORIES[seed % len(STORIES)]}."
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
    parser.add_argument("--method", default="ngram", choices=("ngram", "suffix", "draft_model"))
    parser.add_argument("--draft-model", default=None, help="method draft_model: the draft's name or path")
    parser.add_argument("--fixed", action="store_true",
                        help="draft k tokens every step (adaptive off): the plumbing checks of acceptance")
    parser.add_argument("--only", default=None, help="comma-separated workloads to run (default: all)")
    parser.add_argument("--record", action="store_true", help="add the table to benchmarks/history/<today>.md (listed in RESULTS.md)")
    args = parser.parse_args()

    loaded = load_model(ModelConfig(threads=args.threads))
    spec_config = {"method": args.method, "num_speculative_tokens": args.k, "adaptive": not args.fixed}
    if args.method == "draft_model":
        spec_config["model"] = args.draft_model or "smollm2-135m"  # the default model as its own draft
    plain = LLM(loaded_model=loaded, kv_cache_memory=1 << 30, speculative_config="off")
    spec = LLM(loaded_model=loaded, kv_cache_memory=1 << 30,
               speculative_config=spec_config)
    tok = plain.get_tokenizer()
    vocab = loaded.arch.vocab_size
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)

    def random_prompts(seed: int) -> list:
        rng = random.Random(seed)
        return [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(200)]} for _ in range(8)]

    # Each repeat asks for something new (another file, another story): the suffix method's index then
    # holds earlier, similar answers, as in an agent session, never the very answer it is asked for.
    workloads = [
        ("agent edit", lambda r: [agent_prompt(tok, r)], greedy, 0),
        ("story", lambda r: [story_prompt(tok, r)], SamplingParams(temperature=0, max_tokens=256, ignore_eos=True), 0),
        ("agent x8", lambda r: [agent_prompt(tok, 100 + 8 * r + i) for i in range(8)], greedy, 1),
        ("random x8", random_prompts, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True), 1),
    ]
    if args.only:
        workloads = [w for w in workloads if w[0] in args.only.split(",")]
    rows = []
    for label, prompts_of, params, figure in workloads:
        figures: dict[str, list[float]] = {"plain": [], "spec": []}
        same = True
        drafted0, kept0 = spec.engine.speculator.num_draft_tokens, spec.engine.speculator.num_accepted_tokens
        for r in range(args.repeats):
            prompts = prompts_of(r)
            for llm in (plain, spec):
                llm.generate(prompts, SamplingParams(max_tokens=2))  # prompts into the prefix cache, warm up
            outputs = {}
            order = (("plain", plain), ("spec", spec))
            for name, llm in order if r % 2 == 0 else order[::-1]:  # ABBA: neither always runs first
                result = run(llm, prompts, params)
                figures[name].append(result[figure])
                outputs[name] = result[2]
            same &= outputs["plain"] == outputs["spec"]
        p, s = statistics.median(figures["plain"]), statistics.median(figures["spec"])
        drafted = spec.engine.speculator.num_draft_tokens - drafted0
        kept = spec.engine.speculator.num_accepted_tokens - kept0
        rate = f"{100 * kept / drafted:.0f}%" if drafted else "-"
        unit = "decode tok/s (batch 1)" if figure == 0 else "output tok/s"
        rows.append(f"| {label} | {unit} | {p:.1f} | {s:.1f} | {s / p:.2f}x | {'yes' if same else 'NO'} | "
                    f"{kept} of {drafted} ({rate}) |")
        print(rows[-1], flush=True)
    flags = ((f" --draft-model {args.draft_model}" if args.draft_model else "") + (" --fixed" if args.fixed else "")
             + (f' --only "{args.only}"' if args.only else ""))
    intro = (f"`python benchmarks/speculative.py --method {args.method}{flags} --repeats {args.repeats} "
             f"--max-tokens {args.max_tokens} --k {args.k}`, {time.strftime('%Y-%m-%d %H:%M')}, CPU: {cpu_name()} "
             f"({platform.machine()}, tier {isa_tier()}), {args.threads} threads, default model, dtype auto, greedy. Median over runs "
             "alternated plain / speculative (ABBA), on one loaded model, each repeat on new prompts (warmed into "
             "the prefix cache). Goals (issue 20): agent edit >= 2.5x, story >= 0.97x, agent x8 >= 1.5x, random x8 "
             ">= 0.97x; output identical.")
    publish(table_section(f"Speculative decoding: {args.method}", intro,
                          ["workload", "figure", "plain", "speculative", "ratio", "identical", "drafts kept"], rows),
            args.record)


if __name__ == "__main__":
    main()
