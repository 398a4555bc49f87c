"""A long prompt arrives while other requests decode: how much slower do their tokens come, and how long does
the prompt take to its first token, with the decode-slowdown bound on and off.

    python benchmarks/prefill_among_decoders.py [--model PATH] [--prompt 6000] [--decoders 8]
        [--slowdowns 0,2] [--repeats 2] [--threads 2] [--record]

One engine in this process. Per run: `--decoders` requests (64 random prompt tokens each, greedy, EOS
ignored) decode for 30 steps, then a prompt of `--prompt` random tokens arrives, and after its first token
they decode 30 steps more; their pace without the prompt (the baseline) is the mean of the median step
before and after it, since their contexts grow meanwhile. Every step gives each decoder one token, so a decoder's time between tokens is
the step's time. Runs alternate between the `--slowdowns` settings (SchedulerConfig.max_decode_slowdown; 0:
the token budget alone; `--max-step-ms` sets SchedulerConfig.max_step_ms) on the same engine. Goal (issue 21): during a 32K prefill among 8 decoders their
TPOT p99 rises by at most 2x, and no step outlasts the limit it was planned to (`over limit` counts the
steps more than 25% over it).
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time

from results_file import publish, table_section

from kvflow import LLM, SamplingParams
from kvflow.engine.engine import StepHistory
from kvflow.kernels.cpu_features import cpu_name, isa_tier

BASELINE_STEPS = 30
SHORT_PROMPT = 64
OVER = 1.25  # a step this much over its planned limit counts as over it


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def one_run(llm: LLM, slowdown: float, prompt_len: int, decoders: int, rng: random.Random,
            max_step: float) -> dict:
    engine = llm.engine
    engine.scheduler.step_budget.max_decode_slowdown = slowdown
    engine.scheduler.step_budget.max_step_seconds = max_step
    vocab = engine.loaded.arch.vocab_size
    room = engine.max_model_len - SHORT_PROMPT - 1
    ids = [engine.add_request(None, [rng.randrange(100, vocab) for _ in range(SHORT_PROMPT)],
                              SamplingParams(max_tokens=room, temperature=0, ignore_eos=True))
           for _ in range(decoders)]
    while any(engine.groups[i].sequences[0].request.num_output_tokens == 0 for i in ids):
        engine.step()
    first = engine.num_steps
    for _ in range(BASELINE_STEPS):
        engine.step()
    preempted = engine.scheduler.num_preemptions
    t0 = time.perf_counter()
    long_id = engine.add_request(None, [rng.randrange(100, vocab) for _ in range(prompt_len)],
                                 SamplingParams(max_tokens=1, temperature=0))
    added = engine.num_steps
    while long_id in engine.groups:
        engine.step()
    ttft = time.perf_counter() - t0
    finished = engine.num_steps
    preempted = engine.scheduler.num_preemptions - preempted
    for _ in range(BASELINE_STEPS):  # their pace again, at the contexts they have reached
        engine.step()
    records = engine.step_history.since(first)
    for i in ids:
        engine.abort_request(i)
    while engine.has_unfinished_requests():
        engine.step()
    before = [r.seconds for r in records if r.step <= added]
    after = [r.seconds for r in records if r.step > finished]
    during = [r for r in records if added < r.step <= finished]
    seconds = [r.seconds for r in during]
    # The decoders' contexts grow while the prompt is prefilled, and their own steps with them: their pace
    # without the prompt is taken as the mean of the medians before and after it.
    base_p50 = (statistics.median(before) + statistics.median(after)) / 2
    limited = [r for r in during if r.limit_seconds > 0]
    return {
        "slowdown": slowdown, "base_ms": base_p50 * 1e3, "steps": len(during),
        "p50": statistics.median(seconds) / base_p50, "p99": percentile(seconds, 0.99) / base_p50,
        "mean": statistics.fmean(seconds) / base_p50, "max_ms": max(seconds) * 1e3, "ttft": ttft,
        "preemptions": preempted,
        "over": sum(r.seconds > OVER * r.limit_seconds for r in limited), "limited": len(limited),
        # The longest steps as (ms, limit ms, prompt rows, decode rows): what an overrun carried.
        "longest": [(round(r.seconds * 1e3), round(r.limit_seconds * 1e3), r.prefill_tokens, r.decode_tokens)
                    for r in sorted(during, key=lambda r: r.seconds)[-3:]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF file or model folder (default: the default model)")
    ap.add_argument("--prompt", type=int, default=6000, help="tokens of the long prompt")
    ap.add_argument("--decoders", type=int, default=8)
    ap.add_argument("--slowdowns", default="0,2")
    ap.add_argument("--max-step-ms", type=float, default=200.0, help="max_step_ms for the bounded runs")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--record", action="store_true", help="add the table to benchmarks/history/<today>.md (listed in RESULTS.md)")
    args = ap.parse_args()
    options = {"max_model_len": args.prompt + 2048} if args.model else {}
    llm = LLM(args.model, threads=args.threads, enable_prefix_caching=False, speculative_config="off", **options)
    llm.engine.warm_up()
    llm.engine.step_history = StepHistory(capacity=1 << 20)  # a bounded prefill takes thousands of steps
    rng = random.Random(0)
    settings = [float(s) for s in args.slowdowns.split(",")]
    runs = []
    for repeat in range(args.repeats):
        for slowdown in settings:
            run = one_run(llm, slowdown, args.prompt, args.decoders, rng, args.max_step_ms / 1000)
            print(f"repeat {repeat} slowdown {slowdown:g}: " + ", ".join(
                f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in run.items()), flush=True)
            runs.append(run)
    rows = []
    for slowdown in settings:
        mine = [r for r in runs if r["slowdown"] == slowdown]

        def med(key: str, runs: list[dict] = mine) -> float:
            return statistics.median(r[key] for r in runs)

        rows.append(f"| {slowdown:g} | {med('base_ms'):.1f} | {med('p50'):.2f}x | {med('mean'):.2f}x | "
                    f"{med('p99'):.2f}x | {med('max_ms'):.0f} | {med('ttft'):.1f} | {med('steps'):.0f} | "
                    f"{sum(r['over'] for r in mine)} of {sum(r['limited'] for r in mine)} |")
    model = args.model or "SmolLM2-135M-Instruct Q4_1 (the default model)"
    intro = (f"`python benchmarks/prefill_among_decoders.py --prompt {args.prompt} --decoders {args.decoders} "
             f"--slowdowns {args.slowdowns} --max-step-ms {args.max_step_ms:g} --repeats {args.repeats} --threads {args.threads}`"
             f"{' --model ' + args.model if args.model else ''}: {model}; CPU {cpu_name()} ({platform.machine()}, "
             f"kernel tier {isa_tier()}), {time.strftime('%Y-%m-%d %H:%M')}. Decoders' time between tokens "
             f"while the {args.prompt}-token prompt is prefilled, as multiples of their decode-only step "
             f"(the mean of the medians before and after it; medians over {args.repeats} runs per setting, alternated on one engine).")
    publish(table_section(f"A {args.prompt}-token prompt among {args.decoders} decoding requests", intro,
                          ["max_decode_slowdown", "decode-only step ms", "ITL p50", "TPOT (mean ITL)", "ITL p99",
                           "longest step ms", "prompt TTFT s", "steps", "steps over their limit"], rows),
            args.record)


if __name__ == "__main__":
    main()
