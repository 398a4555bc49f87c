"""Where a decode step's time goes: median step time at batch 1 (and a given depth), the median of each
phase of the engine's step (the native forward, when the model runs on it, is one of them; the rest is the
engine's Python between two forwards), then a torch.profiler table.

    python benchmarks/profile_decode_step.py [--depth 0] [--steps 64] [--threads 2] [--dtype float32]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

from kvflow import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--depth", type=int, default=0)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--no-profile", action="store_true")
    args = ap.parse_args()
    llm = LLM(args.model, threads=args.threads, dtype=args.dtype, quantization=args.quantization,
              max_model_len=args.depth + args.steps * 3 + 64, kv_cache_memory=1 << 30,
              speculative_config="off")  # one token a step: the step is what is timed
    engine = llm.engine
    prompt = torch.randint(100, 20000, (max(args.depth, 8),)).tolist()
    engine.add_request("p", prompt, SamplingParams(max_tokens=args.steps * 3, ignore_eos=True, temperature=0))
    while engine.scheduler.get_request("p").num_output_tokens < 4:
        engine.step()
    phases = time_phases(engine)
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    ms = statistics.median(times) * 1e3
    print(f"decode step at depth {args.depth}: median {ms:.2f} ms = {1000 / ms:.1f} tok/s "
          f"({torch.get_num_threads()} threads, {engine.loaded.dtype})")
    for name, seconds in phases.items():
        print(f"  {name:<28} {statistics.median(seconds) * 1e6:8.1f} µs")
    if not args.no_profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(16):
                engine.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def time_phases(engine) -> dict[str, list[float]]:
    """Wrap the step's phases (as attributes of this engine's objects) so each call's time is kept."""
    phases: dict[str, list[float]] = collections.defaultdict(list)

    def wrap(owner, attribute: str, name: str) -> None:
        inner = getattr(owner, attribute)
        phases[name] = []  # printed in this order

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                phases[name].append(time.perf_counter() - t)
        setattr(owner, attribute, timed)

    executor = engine.runner.executor
    wrap(engine.scheduler, "schedule", "schedule")
    wrap(engine.scheduler.step_budget, "start_step", "  of it the step budget")
    wrap(engine.runner, "prepare", "step inputs (prepare)")
    if getattr(executor, "forward_native", None) is not None:
        wrap(executor, "forward_native", "native forward")
    wrap(engine, "_sample", "sampling")
    wrap(engine.scheduler, "update_from_output", "scheduler update")
    wrap(engine, "_process_tokens", "detokenizing, outputs")
    wrap(engine.scheduler.step_budget, "observe", "step budget observe")
    wrap(engine, "_record_step", "step record")
    return phases


if __name__ == "__main__":
    main()
