"""A/B of the native decoder's kernels between two versions of their sources: whole decode steps, one process.

The working tree's csrc/ and the csrc/ of a git revision are each built into a library of their own (this
CPU's tier, kernels/build.py's flags). One engine decodes a greedy sequence on the default model (or
--model); its fast executor's C++ forward is switched between the two libraries step by step (alternating
ABBA), so both see the same weights, caches and host drift. Each library's forward time is the median over
its steps. Every fourth step the other library also runs on the same inputs, untimed, and the greedy
tokens of the two are compared (they must agree, unless a change means to round differently); the step
after such a check is not timed, since the check has just read the weights (the last-level cache would
then hold their tail, which a real decode step does not find there).

    python benchmarks/ab_decode_source.py --base HEAD [--depth 0] [--batch 1] [--steps 200] [--threads 2]
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from ab_attention_source import library, sources_at

from kvflow import LLM, SamplingParams
from kvflow.executors.thresholds import ROW_THRESHOLDS
from kvflow.kernels import build, cpu_features


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="HEAD", help="the git revision to compare the working tree against")
    ap.add_argument("--model", default=None)
    ap.add_argument("--depth", type=int, default=0, help="prompt tokens before decoding starts")
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="kvflow-ab-"))
    libs = {args.base: library(sources_at(args.base, work / "base"), work / "base.so"),
            "working tree": library(build.CSRC, work / "tree.so")}
    for lib in libs.values():
        lib.kvflow_set_tuning(tuning=ROW_THRESHOLDS.kernel_tuning())
    llm = LLM(args.model, threads=args.threads, max_model_len=args.depth + args.steps + 64,
              kv_cache_memory=1 << 30, enable_prefix_caching=False,
              speculative_config="off")  # one token a step: the step is what is timed
    engine = llm.engine
    executor = engine.runner.executor
    if executor.native is None:
        raise SystemExit("this model does not run on the native decoder")
    gen = torch.Generator().manual_seed(0)
    for i in range(args.batch):
        prompt = torch.randint(100, 20000, (max(args.depth, 8),), generator=gen).tolist()
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=args.steps + 16, ignore_eos=True, temperature=0))
    while any(engine.scheduler.get_request(str(i)).num_output_tokens < 2 for i in range(args.batch)):
        engine.step()

    names = list(libs)
    times: dict[str, list[float]] = {name: [] for name in names}
    mismatches = 0

    checked_last = False

    def timed(name: str, check: bool):
        forward = libs[name].kvflow_decoder_forward
        other = libs[names[1 - names.index(name)]].kvflow_decoder_forward

        def call(**kw):
            nonlocal mismatches, checked_last
            t = time.perf_counter()
            rc = forward(**kw)
            if not checked_last:
                times[name].append(time.perf_counter() - t)
            checked_last = check
            if check and rc == 0 and kw["num_logits"]:
                logits = torch.frombuffer(_buffer(kw["logits"], kw["num_logits"] * executor.vocab_size),
                                          dtype=torch.float32).clone()
                other(**kw)  # the other library on the same inputs (its K/V writes are the same values)
                again = torch.frombuffer(_buffer(kw["logits"], logits.numel()), dtype=torch.float32)
                mismatches += int(not torch.equal(logits.view(-1, executor.vocab_size).argmax(-1),
                                                  again.view(-1, executor.vocab_size).argmax(-1)))
            return rc
        return call

    for step in range(args.steps):
        name = names[(step // 2 + step) % 2]  # A B B A ...
        executor.forward_native = timed(name, check=step % 4 == 3)
        engine.step()
    a, b = (statistics.median(times[n]) * 1e3 for n in names)
    print(f"decode steps, batch {args.batch}, depth {args.depth}, {args.threads} threads, CPU "
          f"{cpu_features.cpu_name()} (tier {cpu_features.isa_tier()}): {args.base} {a:.3f} ms, working tree "
          f"{b:.3f} ms ({len(times[names[0]])} and {len(times[names[1]])} steps), ratio {a / b:.3f}x; "
          f"steps whose greedy tokens differ between the two: {mismatches}")
    shutil.rmtree(work, ignore_errors=True)


def _buffer(address: int, floats: int):
    return (ctypes.c_float * floats).from_address(address)


if __name__ == "__main__":
    main()
