"""What structured output costs per decode step: TPOT of requests constrained by a JSON schema against the
same requests unconstrained, at batch 1 and batch 8, on the default model as `kvflow serve` runs it
(dtype auto), runs alternated and medians taken.

The constrained requests use schemas from tests/structured/schemas.json; the free ones the same prompts
with EOS ignored, so each side decodes about as many tokens.

    python benchmarks/structured_overhead.py [--repeats 5] [--max-tokens 96] [--record]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from results_file import publish, table_section

from kvflow import LLM, SamplingParams
from kvflow.kernels.cpu_features import cpu_name
from kvflow.structured.spec import StructuredOutput

ROOT = Path(__file__).resolve().parents[1]
NAMES = ["nested_order", "plan_steps", "deep_nesting", "code_review", "http_request", "email_send",
         "todo_list", "git_commit"]


def _tpot_ms(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> tuple[float, int]:
    outs = llm.generate(prompts, params)
    tpots = [o.metrics.tpot for o in outs if o.metrics.tpot is not None]
    return statistics.median(tpots) * 1000, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--record", action="store_true", help="add the table to benchmarks/history/<today>.md (listed in RESULTS.md)")
    args = parser.parse_args()

    llm = LLM(threads=args.threads)
    tokenizer = llm.engine.tokenizer
    cases = {c["name"]: c for c in json.loads((ROOT / "tests" / "structured" / "schemas.json").read_text())}
    chosen = [cases[n] for n in NAMES]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": c["prompt"] + " Answer in JSON."}],
                                             tokenize=False, add_generation_prompt=True) for c in chosen]
    constrained = [SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                  structured_output=StructuredOutput(json=c["schema"])) for c in chosen]
    free = [SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)] * len(chosen)
    llm.generate(prompts, constrained)  # compile the grammars, build the tokenizer tables, warm up

    rows = []
    for batch in (1, 8):
        samples: dict[str, list[float]] = {"free": [], "constrained": []}
        tokens = {"free": 0, "constrained": 0}
        for _ in range(args.repeats):
            for label, params in (("free", free), ("constrained", constrained)):
                tpot, n = _tpot_ms(llm, prompts[:batch], params[:batch])
                samples[label].append(tpot)
                tokens[label] += n
        free_ms, cons_ms = statistics.median(samples["free"]), statistics.median(samples["constrained"])
        rows.append(f"| {batch} | {free_ms:.2f} | {cons_ms:.2f} | {100 * (cons_ms / free_ms - 1):+.1f}% "
                    f"| {tokens['free'] // args.repeats} / {tokens['constrained'] // args.repeats} |")
    intro = (f"`python benchmarks/structured_overhead.py --repeats {args.repeats} --max-tokens {args.max_tokens}`, "
             f"{time.strftime('%Y-%m-%d %H:%M')}, CPU: {cpu_name()} ({platform.machine()}), {args.threads} threads, "
             "default model, dtype auto. TPOT median over requests, then over runs alternated free / constrained. "
             f"Schemas: {', '.join(NAMES)}; goal (issue 19): overhead at most 10%.")
    publish(table_section("Structured output: mask overhead per decode step", intro,
                          ["batch", "free TPOT ms", "constrained TPOT ms", "overhead", "tokens free / constrained"],
                          rows), args.record)


if __name__ == "__main__":
    main()
