"""The steps of benchmarks/gpu_check.sh, one subcommand each, every result written under --out.

    python benchmarks/gpu_check.py parity              # default model vs transformers on CUDA (float32)
    python benchmarks/gpu_check.py probe               # copy bandwidth and matmul rate of the card
    python benchmarks/gpu_check.py bench-kvflow        # pp512, pp4096, tg128 x batch x depth
    python benchmarks/gpu_check.py bench-transformers  # the same shapes through transformers
    python benchmarks/gpu_check.py report              # one table: fraction of roofline, ratio to transformers

Benchmarks use random bf16 weights built in memory from a config (nothing downloaded), and fill the KV
cache's "depth" context with zeros instead of computing it: speed does not depend on the values.
Each subcommand stops starting new measurements at --budget seconds and writes rows as it goes, so a
time-out loses only the measurement in flight. `--tiny` shrinks every shape for a CPU smoke run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch
from gpu_common import hf_config, shapes
from gpu_kvflow import bench_kvflow, parity
from gpu_transformers import bench_transformers

from kvflow.machine import roofline


# ---- probe and report ------------------------------------------------------------------------------------
def probe(out: Path, budget: float, tiny: bool) -> None:
    from kvflow.machine.probe import format_row, run_probe, save_probe

    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = run_probe(device=device, quick=tiny, log=print)
    save_probe(result, out / "probe.json")
    print(format_row(result["results"][0]))


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def report(out: Path, budget: float, tiny: bool) -> None:
    """One table: kvflow (best of CUDA graph / eager) as a fraction of roofline and as a ratio to transformers."""
    probe_data = json.loads((out / "probe.json").read_text()) if (out / "probe.json").exists() else None
    ours = [r for r in read_rows(out / "bench_kvflow.jsonl") if "tokens_per_s" in r]
    theirs = {(r["model"], r["test"], r["batch"], r["depth"]): r["tokens_per_s"]
              for r in read_rows(out / "bench_transformers.jsonl") if "tokens_per_s" in r}
    s = shapes(tiny)
    best: dict[tuple, dict] = {}
    for r in ours:
        key = (r["model"], r["test"], r["batch"], r["depth"])
        entry = best.setdefault(key, {})
        entry[r["mode"]] = r["tokens_per_s"]
    header = f"{'model':<14}{'test':<8}{'batch':>6}{'depth':>7}{'eager t/s':>12}{'graph t/s':>12}" \
             f"{'roofline':>10}{'hf t/s':>11}{'vs hf':>8}"
    lines = [header, "-" * len(header)]
    for (model, test, batch, depth), modes in best.items():
        value = max(modes.values())
        frac = roofline_fraction(probe_data, s, model, test, batch, depth, value)
        hf = theirs.get((model, test, batch, depth))
        lines.append(
            f"{model:<14}{test:<8}{batch:>6}{depth:>7}{_fmt(modes.get('eager')):>12}{_fmt(modes.get('graph')):>12}"
            f"{_pct(frac):>10}{_fmt(hf):>11}{(f'{value / hf:.2f}x' if hf else '-'):>8}"
        )
    if probe_data:
        row = probe_data["results"][0]
        lines.append(f"probe: copy {row['copy_dram_gb_s']:.0f} GB/s, bf16 matmul {row['matmul_bf16_tflop_s']:.0f} "
                     f"TFLOP/s ({probe_data['machine'].get('gpu', probe_data['device'])})")
    text = "\n".join(lines)
    print(text)
    (out / "report.txt").write_text(text + "\n")


def roofline_fraction(probe_data, s, model, test, batch, depth, value) -> float | None:
    if probe_data is None:
        return None
    fields = s["models"].get(model)
    if fields is None:
        return None
    shape = roofline.ModelShape.from_hf_config(hf_config(fields, 0))
    row = probe_data["results"][0]
    n = int(test[2:])
    if test.startswith("pp"):
        limit = roofline.prefill_roofline_tokens_per_s(
            shape, row["matmul_bf16_tflop_s"] * 1e12, n_prompt=n, depth=depth, all_logits=False)
    else:  # the context grows from depth to depth + n over the run: charge the mean
        limit = roofline.decode_roofline_tokens_per_s(
            shape, row["copy_dram_gb_s"] * 1e9, 2, depth=depth + n // 2, batch=batch)
    return roofline.fraction_of_roofline(value, limit)


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def _pct(v: float | None) -> str:
    return "-" if v is None or math.isnan(v) else f"{100 * v:.0f}%"


# ---- main ------------------------------------------------------------------------------------------------
STEPS = {
    "parity": parity,
    "probe": probe,
    "bench-kvflow": bench_kvflow,
    "bench-transformers": bench_transformers,
    "report": report,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=list(STEPS))
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out")
    parser.add_argument("--budget", type=float, default=120.0, help="seconds after which no new measurement starts")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: a smoke run on the CPU")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU smoke runs: Triton kernels interpreted
    rc = STEPS[args.step](Path(args.out), args.budget, args.tiny)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
