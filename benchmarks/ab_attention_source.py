"""A/B of the CPU paged attention kernel between two versions of its sources, in one process.

The working tree's csrc/ and the csrc/ of a git revision are each built into a library of their own (this
CPU's tier, the same flags as kernels/build.py); both attend over the same caches (SmolLM2-135M's heads:
9 query heads, 3 KV heads of 64, float16, 30 layers, blocks on huge pages in a random order), calls
alternated, medians printed, and the outputs compared bit for bit.

    python benchmarks/ab_attention_source.py --base HEAD [--depth 1900] [--rows 1] [--threads 2] [--rounds 40]
        [--base-layout head|token] [--tiles]

--tiles times the prompt attention on AMX tiles (kvflow_prefill_attention_bf16) instead: --rows query rows
of one chunk at --depth cached positions before it, as one chunk of a long prefill; outputs are compared
by their largest difference (the two versions may sum in another order).
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from bench_cpu_attention import HEAD_DIM, HEADS, LAYERS, DecodeSetup

from kvflow.kernels import abi, build, cpu_features
from kvflow.kernels.huge_pages import huge_page_zeros

REPO = Path(__file__).resolve().parent.parent
CSRC_IN_REPO = build.CSRC.relative_to(REPO)


def library(csrc: Path, out: Path, tier: str | None = None, extra_flags: tuple[str, ...] = ()):
    """The kernel sources in csrc built into out for a tier (default: this CPU's, or KVFLOW_ISA's), bound."""
    build.compile_library(build.compiler(), tier or cpu_features.isa_tier(), csrc, out, extra_flags=extra_flags)
    return abi.bind(ctypes.CDLL(str(out)))


def sources_at(revision: str, into: Path) -> Path:
    into.mkdir(parents=True)
    names = subprocess.run(["git", "-C", str(REPO), "ls-tree", "--name-only", f"{revision}:{CSRC_IN_REPO}"],
                           check=True, capture_output=True, text=True).stdout.split()
    for name in names:
        blob = subprocess.run(["git", "-C", str(REPO), "show", f"{revision}:{CSRC_IN_REPO}/{name}"], check=True,
                              capture_output=True).stdout
        (into / name).write_bytes(blob)
    return into


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    out = huge_page_zeros(t.numel() * t.element_size()).view(t.dtype).view(t.shape)
    return out.copy_(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="HEAD", help="the git revision to compare the working tree against")
    ap.add_argument("--depth", type=int, default=1900)
    ap.add_argument("--rows", type=int, default=1, help="query rows of the one sequence (1: decode)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--base-layout", choices=("head", "token"), default="head",
                    help="the cache layout the base reads (token: revisions before the head-major cache)")
    ap.add_argument("--base-csrc", type=Path, help="a csrc/ folder to build as the base instead of --base's")
    ap.add_argument("--tiles", action="store_true", help="the AMX prompt attention of --rows rows at --depth")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="kvflow-ab-"))
    if args.base_csrc:
        args.base = str(args.base_csrc)
    base_csrc = args.base_csrc or sources_at(args.base, work / "base")
    libs = {args.base: library(base_csrc, work / "base.so"),
            "working tree": library(build.CSRC, work / "tree.so")}
    # The same values for both, each in the layout it reads (one setup where the layouts agree).
    head = DecodeSetup(args.depth, args.rows, place=on_huge_pages, layout="head")
    setups = {args.base: head if args.base_layout == "head" else
              DecodeSetup(args.depth, args.rows, place=on_huge_pages, layout="token"), "working tree": head}
    outs = {name: torch.empty(args.rows, HEADS, HEAD_DIM) for name in libs}
    if args.tiles:
        outs = {name: torch.zeros(args.rows, HEADS * HEAD_DIM, dtype=torch.bfloat16) for name in libs}

    def attend(name: str) -> float:
        setup = setups[name]
        if args.tiles:
            q = setup.q.view(args.rows, -1)
            t = time.perf_counter()
            for layer in setup.layers:
                rc = libs[name].kvflow_prefill_attention_bf16(
                    layer=ctypes.byref(layer), step=ctypes.byref(setup.meta), q=q.data_ptr(), q_stride=q.stride(0),
                    out=outs[name].data_ptr(), out_stride=outs[name].stride(0), num_threads=args.threads)
                assert rc == 0, "the tile kernel refused (no AMX here?)"
            return time.perf_counter() - t
        rows = abi.KvflowRows(q=setup.q.data_ptr(), q_stride=setup.q.stride(0), k=setup.k.data_ptr(),
                              k_stride=setup.k.stride(0), v=setup.v.data_ptr(), v_stride=setup.v.stride(0))
        t = time.perf_counter()
        for layer in setup.layers:
            libs[name].kvflow_paged_attention(layer=ctypes.byref(layer), step=ctypes.byref(setup.meta),
                                              rows=ctypes.byref(rows), out=outs[name].data_ptr(),
                                              out_stride=outs[name].stride(0), all_rows=int(args.rows > 1),
                                              num_threads=args.threads)
        return time.perf_counter() - t

    names = list(libs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for name in names * 3:  # warm up
        attend(name)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(attend(name))
    base, tree = (statistics.median(times[n]) * 1e3 for n in names)
    same = torch.equal(outs[names[0]], outs[names[1]])
    diff = (outs[names[0]].float() - outs[names[1]].float()).abs().max().item()
    print(f"{'prompt attention (tiles)' if args.tiles else 'paged attention'}, {LAYERS} layers, depth {args.depth}, {args.rows} row(s), {args.threads} threads, "
          f"CPU {cpu_features.cpu_name()} (tier {cpu_features.isa_tier()}): {args.base} {base:.3f} ms, "
          f"working tree {tree:.3f} ms, ratio {base / tree:.2f}x; outputs "
          f"{'bitwise equal' if same else f'differ by up to {diff:.2e}'}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
