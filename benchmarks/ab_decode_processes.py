"""A/B of whole decode steps between the working tree and a git revision, each version in its own processes.

benchmarks/ab_decode_source.py swaps two kernel libraries step by step inside one engine: the fairest test
of a kernel alone, but blind to what builds up over consecutive steps of one version (what the caches hold
when the engine's Python runs between two forwards, what stays in the last-level cache) and to changes in
the Python. Here each version decodes in a process of its own: the revision is checked out into a
temporary git worktree, and `import kvflow` in a process started there loads that tree (its kernels built
from its own sources). The versions alternate in a shuffled order each round, so host drift falls on both;
each process prints the median step of its greedy runs, and the medians over rounds are compared.

    python benchmarks/ab_decode_processes.py --base HEAD [--rounds 5] [--steps 256] [--model M] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Run in a tree's root with `python -c`, so the interpreter imports that tree's kvflow: three greedy
# runs of `steps` plain decode steps at batch 1 (no speculation), the median step of each, their median.
DECODE = r"""
import json, statistics, sys, time
from kvflow import LLM, SamplingParams
model, steps, threads = (sys.argv[1] or None), int(sys.argv[2]), int(sys.argv[3])
llm = LLM(model, threads=threads, max_model_len=steps + 64, kv_cache_memory=1 << 30, speculative_config="off")
engine, medians = llm.engine, []
for run in range(3):
    engine.add_request(str(run), list(range(100 + run, 108 + run)),
                       SamplingParams(max_tokens=steps, ignore_eos=True, temperature=0))
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    medians.append(statistics.median(times[4:]))
print(json.dumps({"step_ms": 1e3 * statistics.median(medians)}))
"""


def step_ms(tree: Path, args: argparse.Namespace) -> float:
    out = subprocess.run([sys.executable, "-c", DECODE, args.model or "", str(args.steps), str(args.threads)],
                         cwd=tree, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["step_ms"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="HEAD", help="the git revision to compare the working tree against")
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="also write the figures as JSON here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvflow-ab-") as work:
        base_tree = Path(work) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base_tree), args.base], cwd=REPO, check=True)
        try:
            trees = {args.base: base_tree, "working tree": REPO}
            times: dict[str, list[float]] = {name: [] for name in trees}
            for round_ in range(args.rounds):
                order = list(trees)
                random.shuffle(order)
                for name in order:
                    times[name].append(step_ms(trees[name], args))
                print(f"round {round_ + 1}: " + ", ".join(f"{n} {times[n][-1]:.3f} ms" for n in trees), flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=REPO, check=False)
    base, tree = (statistics.median(times[n]) for n in (args.base, "working tree"))
    print(f"decode steps at batch 1, {args.threads} threads, median over {args.rounds} rounds of each version's "
          f"median step: {args.base} {base:.3f} ms, working tree {tree:.3f} ms, ratio {base / tree:.3f}x")
    if args.out:
        Path(args.out).write_text(json.dumps({"base": args.base, "rounds": times, "ratio": base / tree}, indent=2))


if __name__ == "__main__":
    main()
