"""Plots of benchmark results: ``kvflow bench plot RESULTS... --out-dir DIR``.

Each input's kind is read from its content:

* ``"kind": "latency"`` (written by ``kvflow bench latency``)::

      {"kind": "latency", "model": str, "probe": {...probe JSON, see kvflow.machine.probe...},
       "results": [{"test": "pp512", "n_prompt": 512, "n_gen": 0, "depth": 0, "batch": 1,
                    "tokens_per_s": float, "roofline_tokens_per_s": float,
                    "fraction_of_roofline": float}, ...]}

  Entries with ``n_gen == 0`` are prefill tests (``ppN``); entries with ``n_gen > 0`` are decode
  tests (``tgN``, at ``depth`` cached tokens and ``batch`` sequences).  An optional top-level
  "label" names the curve (default: the model).
  -> ``ttft_vs_prompt.png`` (time to process the prompt, n_prompt / tokens_per_s, vs prompt length)
  -> ``decode_vs_batch.png`` (decode tokens/s vs batch size, the roofline dashed)

* ``"kind": "serve"`` (written by ``kvflow bench serve``; per-request records under "requests")
  -> ``serve_cdf.png``: CDFs of TTFT, TPOT and E2E, one curve per file (server)
  -> ``agent_turns.png`` for agent-scenario files: TTFT and cached tokens per turn

* an engine trace, a ``.jsonl`` file of one step per line::

      {"t": seconds, "prefill_tokens": int, "decode_tokens": int, "batch_size": int, "kv_usage": float}

  -> ``trace_<name>.png``: prefill vs decode tokens per step over time, batch size and KV usage
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers
import matplotlib.pyplot as plt  # noqa: E402


def load_input(path: str | Path) -> tuple[str, Any]:
    """(kind, content) of a results file: JSON lines are a trace, JSON documents say their kind."""
    p = Path(path)
    text = p.read_text()
    if p.suffix == ".jsonl":
        return "trace", [json.loads(line) for line in text.splitlines() if line.strip()]
    doc = json.loads(text)
    kind = doc.get("kind") if isinstance(doc, dict) else None
    if kind not in ("latency", "serve", "trace"):
        raise ValueError(f"{p}: unknown result kind {kind!r} (want latency, serve or trace)")
    if kind == "trace":
        return "trace", doc["steps"]
    return kind, doc


def _label(doc: dict, path: Path) -> str:
    return doc.get("label") or doc.get("model") or path.stem


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_ttft_vs_prompt(docs: list[tuple[Path, dict]], out: Path) -> Path | None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = False
    for path, doc in docs:
        rows = sorted((r for r in doc["results"] if r.get("n_gen", 0) == 0 and r.get("tokens_per_s")),
                      key=lambda r: r["n_prompt"])
        if not rows:
            continue
        x = [r["n_prompt"] for r in rows]
        line = ax.plot(x, [1000 * r["n_prompt"] / r["tokens_per_s"] for r in rows], "o-", label=_label(doc, path))
        roof = [(r["n_prompt"], 1000 * r["n_prompt"] / r["roofline_tokens_per_s"])
                for r in rows if r.get("roofline_tokens_per_s")]
        if roof:
            ax.plot(*zip(*roof, strict=True), "--", color=line[0].get_color(), alpha=0.6,
                    label=f"{_label(doc, path)} roofline")
        drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set(xlabel="prompt length (tokens)", ylabel="time to first token (ms)", title="TTFT vs prompt length")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, out)


def plot_decode_vs_batch(docs: list[tuple[Path, dict]], out: Path) -> Path | None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = False
    batches: set[int] = set()
    for path, doc in docs:
        by_depth: dict[int, list[dict]] = defaultdict(list)
        for r in doc["results"]:
            if r.get("n_gen", 0) > 0 and r.get("tokens_per_s"):
                by_depth[r.get("depth", 0)].append(r)
        for depth, rows in sorted(by_depth.items()):
            rows.sort(key=lambda r: r.get("batch", 1))
            name = _label(doc, path) + (f" @depth {depth}" if depth else "")
            x = [r.get("batch", 1) for r in rows]
            batches.update(x)
            line = ax.plot(x, [r["tokens_per_s"] for r in rows], "o-", label=name)
            roof = [(r.get("batch", 1), r["roofline_tokens_per_s"]) for r in rows if r.get("roofline_tokens_per_s")]
            if roof:
                ax.plot(*zip(*roof, strict=True), "--", color=line[0].get_color(), alpha=0.6,
                        label=f"{name} roofline")
            drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set(xlabel="batch size", ylabel="decode tokens/s", title="Decode throughput vs batch size")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(batches), [str(b) for b in sorted(batches)])
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, out)


def _cdf(values: list[float]) -> tuple[list[float], list[float]]:
    xs = sorted(values)
    return xs, [(i + 1) / len(xs) for i in range(len(xs))]


def plot_serve_cdfs(docs: list[tuple[Path, dict]], out: Path) -> Path:
    metrics = [("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("e2e_ms", "end-to-end latency (ms)")]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for ax, (key, title) in zip(axes, metrics, strict=True):
        for path, doc in docs:
            values = [r[key] for r in doc["requests"] if r.get("success") and r.get(key) is not None]
            if values:
                ax.step(*_cdf(values), where="post", label=_label(doc, path))
        ax.set(xlabel=title, ylabel="fraction of requests", title=f"{title.split(' (')[0]} CDF")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, out)


def plot_agent_turns(docs: list[tuple[Path, dict]], out: Path) -> Path | None:
    docs = [(p, d) for p, d in docs if d.get("turns")]
    if not docs:
        return None
    fig, (ax_t, ax_c) = plt.subplots(1, 2, figsize=(12, 4.2))
    for path, doc in docs:
        turns = [t for t in doc["turns"] if t.get("ttft_ms") is not None]
        ax_t.plot([t["prompt_tokens"] for t in turns], [t["ttft_ms"] for t in turns], "o-", label=_label(doc, path))
        cached = [(t["prompt_tokens"], t["cached_tokens"]) for t in turns if t.get("cached_tokens") is not None]
        if cached:
            ax_c.plot(*zip(*cached, strict=True), "o-", label=_label(doc, path))
    ax_t.set(xlabel="context (prompt tokens)", ylabel="TTFT (ms)", title="Agent: TTFT per turn")
    ax_c.set(xlabel="context (prompt tokens)", ylabel="cached tokens reported", title="Agent: cached tokens per turn")
    for ax in (ax_t, ax_c):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, out)


def plot_trace(steps: list[dict], out: Path, title: str) -> Path:
    t0 = steps[0]["t"] if steps else 0.0
    t = [s["t"] - t0 for s in steps]
    prefill = [s.get("prefill_tokens", 0) for s in steps]
    decode = [s.get("decode_tokens", 0) for s in steps]
    fig, (ax_tok, ax_b) = plt.subplots(2, 1, figsize=(10, 6), sharex=True, height_ratios=[2, 1])
    # Stacked areas over step index-aligned time: what each step spent its tokens on.
    ax_tok.stackplot(t, prefill, decode, labels=["prefill tokens", "decode tokens"], step="post", alpha=0.8)
    ax_tok.set(ylabel="tokens per step", title=f"Engine steps: {title}")
    ax_tok.legend(loc="upper right")
    ax_tok.grid(alpha=0.3)
    ax_b.step(t, [s.get("batch_size", 0) for s in steps], where="post", label="batch size")
    ax_b.set(xlabel="time (s)", ylabel="batch size")
    ax_kv = ax_b.twinx()
    ax_kv.plot(t, [100 * s.get("kv_usage", 0.0) for s in steps], color="tab:red", label="KV usage")
    ax_kv.set(ylabel="KV cache used (%)", ylim=(0, 105))
    ax_b.grid(alpha=0.3)
    ax_b.legend(loc="upper left")
    ax_kv.legend(loc="upper right")
    return _save(fig, out)


def plot_results(paths: list[str | Path], out_dir: str | Path) -> list[Path]:
    """Draw every plot the inputs allow; return the PNG paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    grouped: dict[str, list[tuple[Path, Any]]] = defaultdict(list)
    for p in paths:
        kind, content = load_input(p)
        grouped[kind].append((Path(p), content))
    written: list[Path | None] = []
    if grouped["latency"]:
        written.append(plot_ttft_vs_prompt(grouped["latency"], out / "ttft_vs_prompt.png"))
        written.append(plot_decode_vs_batch(grouped["latency"], out / "decode_vs_batch.png"))
    if grouped["serve"]:
        written.append(plot_serve_cdfs(grouped["serve"], out / "serve_cdf.png"))
        written.append(plot_agent_turns(grouped["serve"], out / "agent_turns.png"))
    for path, steps in grouped["trace"]:
        written.append(plot_trace(steps, out / f"trace_{path.stem}.png", path.stem))
    return [w for w in written if w is not None]
