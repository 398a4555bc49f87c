"""kvflow against llama.cpp on the same GGUF file and thread count, in one run; with --record, the tables go to
the day's file of benchmarks/history/ and the figures to RESULTS.md's current table (current_figures.py).

1. the machine probe (bandwidth, matmul rate);
2. pp512 and tg128 at batch 1: llama.cpp through llama-cpp-python (in its own virtualenv, installed by
   benchmarks/setup_llamacpp.sh when missing) and kvflow through its engine (kvflow bench latency);
3. llama.cpp's server against `kvflow serve` under the same `kvflow bench serve` load (200-token prompts,
   128 output tokens, EOS ignored) at concurrency 1 and 8: llama.cpp's own llama-server with 8 slots when
   benchmarks/setup_llama_server.sh has built it, else llama-cpp-python's server (which stops at EOS);
   kvflow without speculation, as the peer decodes.

    python benchmarks/side_by_side.py [--threads 2] [--quantization gguf] [--depth 4096] [--rounds 3]
        [--num-prompts 16] [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import current_figures
from results_file import publish

HERE = Path(__file__).resolve().parent
LLAMACPP_VENV = Path(os.environ.get("LLAMACPP_VENV", HERE.parent / ".venv-llamacpp"))

LLAMACPP_BENCH = r"""
import json, sys, time
from llama_cpp import Llama
path, threads, n_prompt, n_gen, reps, depth = sys.argv[1], *map(int, sys.argv[2:7])
llm = Llama(model_path=path, n_ctx=depth + n_gen + 64, n_threads=threads, n_threads_batch=threads, n_batch=512,
            verbose=False)
context = [100 + (i * 7919) % 20000 for i in range(max(n_prompt, depth))]
def pp():
    llm.reset(); t = time.perf_counter(); llm.eval(context[:n_prompt]); return n_prompt / (time.perf_counter() - t)
def tg(d):
    llm.reset(); llm.eval(context[:max(d, 1)]); t = time.perf_counter()
    for i in range(n_gen):
        llm.eval([200 + i])
    return n_gen / (time.perf_counter() - t)
def median(xs):
    return sorted(xs)[len(xs) // 2]
pp(); tg(0)  # warm-up
print(json.dumps({"pp": median([pp() for _ in range(reps)]), "tg": median([tg(0) for _ in range(reps)]),
                  "tg_depth": median([tg(depth) for _ in range(reps)])}))
"""


def result(run: dict, test: str, depth: int) -> dict:
    return next(r for r in run["results"] if r["test"] == test and r["depth"] == depth)


def median_result(runs: list[dict], test: str, depth: int) -> dict:
    """The run's result with the median tokens/s (the lower middle for an even count), whole, so its share
    of roofline goes with it."""
    ordered = sorted((result(run, test, depth) for run in runs), key=lambda r: r["tokens_per_s"])
    return ordered[(len(ordered) - 1) // 2]


def default_gguf() -> Path:
    from kvflow.loader.resolve import resolve_model

    return resolve_model(None).path


def ensure_llamacpp() -> Path:
    python = LLAMACPP_VENV / "bin" / "python"
    ok = python.exists() and subprocess.run([python, "-c", "import llama_cpp"], capture_output=True).returncode == 0
    if not ok:
        subprocess.run(["bash", str(HERE / "setup_llamacpp.sh")], check=True)
    return python


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not healthy after {timeout} s")


def peak_rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def run_load(base_url: str, label: str, concurrency: int, num_prompts: int, out_dir: Path) -> dict:
    """One load; its prompts are seeded by the concurrency, so the c8 load does not repeat the c1 load's
    prompts (which a prefix cache would then serve from memory) and both servers get the same ones."""
    out = out_dir / f"serve_{label}_c{concurrency}.json"
    subprocess.run(
        [sys.executable, "-m", "kvflow", "bench", "serve", "--base-url", base_url, "--label", label,
         "--concurrency", str(concurrency), "--num-prompts", str(num_prompts), "--input-len", "200",
         "--output-len", "128", "--seed", str(concurrency), "--no-progress", "--out", str(out)],
        check=True,
    )
    return json.loads(out.read_text())["summary"]


def serve_both(args, gguf: Path, llamacpp_python: Path, out_dir: Path) -> dict:
    results = {}
    llama_server = llamacpp_python.parent / "llama-server"
    if llama_server.exists():  # llama.cpp's own server: 8 parallel slots, honours ignore_eos
        peer = lambda port: [  # noqa: E731
            str(llama_server), "--model", str(gguf), "--threads", str(args.threads), "--threads-batch",
            str(args.threads), "--ctx-size", "16384", "--parallel", "8", "--host", "127.0.0.1", "--port", str(port)]
    else:  # llama-cpp-python's server: one request at a time, stops at EOS whatever ignore_eos says
        peer = lambda port: [  # noqa: E731
            str(llamacpp_python), "-m", "llama_cpp.server", "--model", str(gguf), "--n_threads", str(args.threads),
            "--n_threads_batch", str(args.threads), "--n_ctx", "16384", "--host", "127.0.0.1", "--port", str(port)]
    results["peer_server"] = "llama-server" if llama_server.exists() else "llama_cpp.server"
    servers = {
        "llama.cpp": peer,
        "kvflow": lambda port: [
            sys.executable, "-m", "kvflow", "serve", "--model", str(gguf), "--threads", str(args.threads),
            # The same context as llama.cpp's -c 16384: 16,384 tokens of float16 K/V (22.5 KiB each).
            "--host", "127.0.0.1", "--port", str(port), "--kv-cache-memory", "360MiB",
            # The same work as the peer's: no drafts (kvflow's default n-gram speculation has its own
            # benchmark, benchmarks/speculative.py).
            "--speculative-config", "off",
            *(["--quantization", args.quantization] if args.quantization else [])],
    }
    health = {"llama.cpp": "/v1/models" if results["peer_server"] == "llama_cpp.server" else "/health",
              "kvflow": "/health"}
    # Both servers up at once (idle, neither takes CPU), loads in ABBA order: peer c1, kvflow c1, kvflow c8,
    # peer c8. A host that drifts over the minutes shifts both engines' figures alike.
    procs, urls = {}, {}
    try:
        for label, command in servers.items():
            port = free_port()
            procs[label] = subprocess.Popen(command(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            urls[label] = f"http://127.0.0.1:{port}"
            wait_healthy(urls[label] + health[label], procs[label])
        for label, conc in (("llama.cpp", 1), ("kvflow", 1), ("kvflow", 8), ("llama.cpp", 8)):
            prompts = args.num_prompts if conc == 1 else args.num_prompts * 2
            results[(label, conc)] = run_load(urls[label], label, conc, prompts, out_dir)
        for label, proc in procs.items():
            results[(label, "rss")] = peak_rss_mib(proc.pid)
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(timeout=60)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantization", default=None, help="kvflow --quantization (e.g. gguf)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of the batch-1 tests (medians)")
    ap.add_argument("--depth", type=int, default=4096, help="context depth of the long-context decode test")
    ap.add_argument("--num-prompts", type=int, default=16, help="requests at concurrency 1 (twice that at 8)")
    ap.add_argument("--skip-serve", action="store_true")
    ap.add_argument("--record", action="store_true", help="add the tables to benchmarks/history/<today>.md (listed in RESULTS.md)")
    args = ap.parse_args()
    measured_at = current_figures.commit_measured()  # the code as it was when the run started

    import torch

    from kvflow.bench.latency import run_latency
    from kvflow.machine.probe import run_probe, save_probe

    torch.set_num_threads(args.threads)
    gguf = default_gguf()
    llamacpp_python = ensure_llamacpp()
    out_dir = Path(tempfile.mkdtemp(prefix="kvflow-sbs-"))
    probe = run_probe(threads=[args.threads])
    save_probe(probe)
    row = probe["results"][-1]

    def run_peer() -> dict:
        proc = subprocess.run([str(llamacpp_python), "-c", LLAMACPP_BENCH, str(gguf), str(args.threads), "512",
                               "128", str(args.reps), str(args.depth)], capture_output=True, text=True, check=True)
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def run_ours() -> dict:
        return run_latency(None, [512], 128, [0, args.depth], [1], reps=args.reps, probe=probe, threads=args.threads,
                           **({"quantization": args.quantization} if args.quantization else {}))

    # Rounds alternate which engine goes first, and each figure is the median over rounds: the host's speed
    # drifts over minutes, and one engine measured minutes after the other would carry that drift.
    peers, ours_runs = [], []
    for r in range(args.rounds):
        for who in (("peer", "ours") if r % 2 == 0 else ("ours", "peer")):
            (peers.append(run_peer()) if who == "peer" else ours_runs.append(run_ours()))
    peer = {key: sorted(p[key] for p in peers)[(len(peers) - 1) // 2] for key in ("pp", "tg", "tg_depth")}
    ours = ours_runs[0]  # the per-step byte counts, the same in every round
    pp = median_result(ours_runs, "pp512", 0)
    tg = median_result(ours_runs, "tg128", 0)
    tg_deep = median_result(ours_runs, "tg128", args.depth)
    per_round = {
        name: ", ".join(f"{result(run, test, depth)['tokens_per_s'] / p[key]:.2f}" for run, p in zip(ours_runs, peers))
        for name, test, depth, key in (("pp512", "pp512", 0, "pp"), ("tg128", "tg128", 0, "tg"),
                                       (f"tg at depth {args.depth}", "tg128", args.depth, "tg_depth"))
    }

    from kvflow.kernels import cpu_features

    peer_info = subprocess.run([str(llamacpp_python), "-c", "import llama_cpp; print(llama_cpp.llama_print_system_info()"
                                ".decode().strip())"], capture_output=True, text=True).stdout.strip()
    lines = [
        f"## Side by side with llama.cpp ({time.strftime('%Y-%m-%d %H:%M')}, {args.threads} threads)",
        "",
        f"CPU {cpu_features.cpu_name()}; kvflow kernel tier `{cpu_features.isa_tier()}` (the CPU's own: "
        f"`{cpu_features.machine_tier()}`); llama.cpp from `{LLAMACPP_VENV.name}`: {peer_info}",
        "",
        f"`python benchmarks/side_by_side.py --threads {args.threads}"
        f"{' --quantization ' + args.quantization if args.quantization else ''}`, file {gguf.name}; "
        f"kvflow default mode, {ours['weight_bytes_per_step'] / 2**20:.0f} MiB of weights read per decode step, "
        f"K/V {ours['kv_bytes_per_token']} bytes per token.",
        "",
        f"Read rate around kvflow's decode runs (their rooflines'): {tg['read_bytes_per_s'] / 1e9:.1f} GB/s at "
        f"depth 0, {tg_deep['read_bytes_per_s'] / 1e9:.1f} at depth {args.depth}.",
        "",
        (f"Probe at the start: read {row['read_dram_gb_s']:.1f} GB/s, " if row.get("read_dram_gb_s") else "Probe: ")
        + f"copy {row['copy_dram_gb_s']:.1f} GB/s (1 GiB arrays), {row['copy_cache_gb_s']:.1f} GB/s "
        f"(16 MiB), matmul {row['matmul_f32_tflop_s']:.2f} TFLOP/s f32, "
        + (f"{row['matmul_bf16_tflop_s']:.2f} bf16, " if row.get("matmul_bf16_tflop_s") else "bf16 not native, ")
        + (f"{row['matmul_packed_tflop_s']:.2f} packed (kvflow's int kernel, 512 rows)."
           if row.get("matmul_packed_tflop_s") else "no packed kernel."),
        "",
        "| test | llama.cpp (llama-cpp-python) | kvflow | kvflow / llama.cpp | kvflow % of roofline |",
        "|---|---|---|---|---|",
        f"| pp512 tok/s | {peer['pp']:.1f} | {pp['tokens_per_s']:.1f} | {pp['tokens_per_s'] / peer['pp']:.2f} | "
        f"{100 * pp['fraction_of_roofline']:.0f}% |",
        f"| tg128 tok/s | {peer['tg']:.1f} | {tg['tokens_per_s']:.1f} | {tg['tokens_per_s'] / peer['tg']:.2f} | "
        f"{100 * tg['fraction_of_roofline']:.0f}% |",
        f"| tg128 at depth {args.depth} tok/s | {peer['tg_depth']:.1f} | {tg_deep['tokens_per_s']:.1f} | "
        f"{tg_deep['tokens_per_s'] / peer['tg_depth']:.2f} | {100 * tg_deep['fraction_of_roofline']:.0f}% |",
        "",
        f"Medians over {args.rounds} rounds (alternating which engine goes first). kvflow / llama.cpp by round: "
        + "; ".join(f"{name} {ratios}" for name, ratios in per_round.items()) + ".",
        "",
    ]
    if not args.skip_serve:
        served = serve_both(args, gguf, llamacpp_python, out_dir)
        lines += [
            f"Serving: {args.num_prompts} (concurrency 1) and {2 * args.num_prompts} (concurrency 8) streaming "
            "requests of 200 prompt tokens and 128 output tokens, EOS ignored, `kvflow bench serve`; the peer "
            f"is llama.cpp's `{served['peer_server']}` (`benchmarks/setup_llama_server.sh` builds llama-server); "
            "kvflow with `--speculative-config off`, the peer's plain decoding.",
            "",
            "| server | concurrency | output tok/s | TTFT mean ms | TTFT p99 ms | TPOT mean ms | peak RSS MiB |",
            "|---|---|---|---|---|---|---|",
        ]
        for label in ("llama.cpp", "kvflow"):
            for conc in (1, 8):
                s = served[(label, conc)]
                lines.append(
                    f"| {label} | {conc} | {s['output_throughput']:.1f} | {s['ttft_ms']['mean']:.0f} | "
                    f"{s['ttft_ms']['p99']:.0f} | {s['tpot_ms']['mean']:.1f} | {served[(label, 'rss')]:.0f} |"
                )
        for conc in (1, 8):
            a, b = served[("llama.cpp", conc)], served[("kvflow", conc)]
            lines.append(f"\nConcurrency {conc}: kvflow/llama.cpp output tok/s "
                         f"{b['output_throughput'] / a['output_throughput']:.2f}, p99 TTFT ratio "
                         f"{b['ttft_ms']['p99'] / a['ttft_ms']['p99']:.2f}.")
        lines.append("")
    publish("\n".join(lines), args.record)
    if args.record and not args.skip_serve:
        figures = {"pp512": (pp["tokens_per_s"], peer["pp"]), "tg128": (tg["tokens_per_s"], peer["tg"]),
                   "tg_depth": (tg_deep["tokens_per_s"], peer["tg_depth"])}
        for key, conc, value in (("c1_output", 1, lambda r: r["output_throughput"]),
                                 ("c8_output", 8, lambda r: r["output_throughput"]),
                                 ("c8_ttft_p99", 8, lambda r: r["ttft_ms"]["p99"])):
            figures[key] = (value(served[("kvflow", conc)]), value(served[("llama.cpp", conc)]))
        figures["rss"] = (served[("kvflow", "rss")], served[("llama.cpp", "rss")])
        current_figures.save({
            "tier": cpu_features.isa_tier(), "machine_tier": cpu_features.machine_tier(), "cpu": cpu_features.cpu_name(),
            "flags": sorted(cpu_features.cpu_flags() & set(current_figures.TIER_FLAGS)),
            "date": time.strftime("%Y-%m-%d %H:%M"), "peer": LLAMACPP_VENV.name, "threads": args.threads,
            **measured_at,
            "figures": {k: {"kvflow": a, "llama.cpp": b} for k, (a, b) in figures.items()},
            "tg128_roofline": tg["fraction_of_roofline"]})
        current_figures.refresh()


if __name__ == "__main__":
    main()
