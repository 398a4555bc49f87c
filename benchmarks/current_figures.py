"""The current side-by-side figures per CPU tier: one JSON file each under benchmarks/current/ (written
by `side_by_side.py --record`), drawn as benchmarks/current/ratios.png and written as the table that
opens benchmarks/RESULTS.md (between its `current figures` markers).

    python benchmarks/current_figures.py          # redraw the plot and the table from the JSON files
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CURRENT = HERE / "current"
RESULTS = HERE / "RESULTS.md"
BEGIN, END = "<!-- current figures: benchmarks/current_figures.py -->", "<!-- end of current figures -->"
README = HERE.parent / "README.md"
README_BEGIN, README_END = "<!-- current ratios: benchmarks/current_figures.py -->", "<!-- end of current ratios -->"
# Flags that decide kvflow's kernel tier (kvflow/kernels/cpu_features.py).
TIER_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni",
              "amx_tile", "amx_int8", "amx_bf16", "asimddp", "i8mm")

# (key, label, higher is better, issue 17's goal on the AVX2 tier)
FIGURES = (
    ("pp512", "pp512 tok/s", True, 1.5),
    ("tg128", "tg128 tok/s", True, 1.2),
    ("tg_depth", "tg at depth 4096 tok/s", True, 1.5),
    ("c1_output", "serving c1 output tok/s", True, None),
    ("c8_output", "serving c8 output tok/s", True, 1.5),
    ("c8_ttft_p99", "serving c8 p99 TTFT ms", False, 0.7),
    ("rss", "server peak RSS MiB", False, 1.2),
)


def save(summary: dict) -> Path:
    """One tier's figures: {"tier", "machine_tier", "cpu", "flags", "date", "peer", "threads",
    "figures": {key: {"kvflow": x, "llama.cpp": y}}, "tg128_roofline": fraction}."""
    CURRENT.mkdir(exist_ok=True)
    path = CURRENT / f"{summary['tier']}.json"
    path.write_text(json.dumps(summary, indent=1) + "\n")
    return path


def commit_measured() -> dict:
    """{"commit": HEAD, "dirty": whether kvflow/ had uncommitted changes}: benchmarks/stale_tiers.py reads it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=HERE.parent, capture_output=True, text=True).stdout.strip()
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--", "kvflow"))}


def load_all() -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(CURRENT.glob("*.json"))]


def table(summaries: list[dict]) -> str:
    lines = ["## Current figures per CPU tier", "",
             "kvflow against llama.cpp, same GGUF file (SmolLM2-135M-Instruct Q4_1), 2 threads, one run of "
             "`benchmarks/side_by_side.py` per tier; ratio = kvflow / llama.cpp (for TTFT and RSS, lower is "
             "better); both decode plainly (kvflow's default n-gram speculation off). Goals are issue 17's for the AVX2 tier.", ""]
    for s in summaries:
        tier_note = s["tier"] if s["tier"] == s["machine_tier"] else f"{s['tier']} (forced; the CPU's own is {s['machine_tier']})"
        lines += [f"### Tier {tier_note}: {s['cpu']}, {s['date']}", "",
                  f"Flags: {' '.join(f for f in TIER_FLAGS if f in s['flags']) or 'none of note'}. "
                  f"Peer: llama.cpp from `{s['peer']}`. {measured_at(s)}Decode at batch 1: {100 * s['tg128_roofline']:.0f}% of "
                  "its roofline.", "",
                  "| figure | kvflow | llama.cpp | ratio | goal |", "|---|---|---|---|---|"]
        for key, label, higher, goal in FIGURES:
            f = s["figures"].get(key)
            if f is None:
                continue
            ratio = f["kvflow"] / f["llama.cpp"]
            goal = goal if s["tier"] == "avx2" else None  # the issue sets them for the AVX2 tier
            met = "" if goal is None else (f">= {goal}" if higher else f"<= {goal}")
            if goal is not None:
                met += " ✓" if (ratio >= goal if higher else ratio <= goal) else " ✗"
            lines.append(f"| {label} | {f['kvflow']:.1f} | {f['llama.cpp']:.1f} | {ratio:.2f} | {met} |")
        lines.append("")
    lines.append("![kvflow / llama.cpp per tier](current/ratios.png)")
    return "\n".join(lines)


def measured_at(s: dict) -> str:
    if not s.get("commit"):
        return "Commit not recorded. "
    return f"Commit {s['commit'][:10]}{' with uncommitted changes' if s.get('dirty') else ''}. "


def ratios_table(summaries: list[dict]) -> str:
    """The README's short form: one column of ratios per tier."""
    head = "| kvflow / llama.cpp | " + " | ".join(
        f"{s['tier']}{'' if s['tier'] == s['machine_tier'] else ' (forced)'}, {s['cpu']}, {s['date'][:10]}"
        for s in summaries) + " |"
    lines = [head, "|---|" + "---|" * len(summaries)]
    for key, label, _, _ in FIGURES:
        cells = []
        for s in summaries:
            f = s["figures"].get(key)
            cells.append("" if f is None else f"{f['kvflow'] / f['llama.cpp']:.2f}")
        lines.append(f"| {label.rsplit(' ', 1)[0]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def replace_between(text: str, begin: str, end: str, body: str) -> str:
    head, rest = text.split(begin, 1)
    return head + begin + "\n" + body + "\n" + end + rest.split(end, 1)[1]


def plot(summaries: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k, *_ in FIGURES]
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / max(1, len(summaries))
    for i, s in enumerate(summaries):
        ratios = []
        for key, _, higher, _ in FIGURES:
            f = s["figures"].get(key)
            # Drawn so that taller is always better: llama.cpp / kvflow for TTFT and RSS.
            ratios.append(0 if f is None else (f["kvflow"] / f["llama.cpp"] if higher else f["llama.cpp"] / f["kvflow"]))
        ax.bar([j + i * width for j in range(len(keys))], ratios, width, label=f"{s['tier']} ({s['cpu']})")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))])
    ax.set_xticklabels([label.replace(" tok/s", "").replace(" ms", "").replace(" MiB", "") for _, label, *_ in FIGURES],
                       rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("kvflow advantage over llama.cpp (x)")
    ax.set_title(f"kvflow vs llama.cpp, 2 threads (taller is better; TTFT and RSS inverted), {time.strftime('%Y-%m-%d')}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def refresh() -> None:
    summaries = load_all()
    plot(summaries, CURRENT / "ratios.png")
    text = RESULTS.read_text()
    if BEGIN in text:
        text = replace_between(text, BEGIN, END, table(summaries))
    else:  # first time: after the file's opening paragraphs, above the list of history days (results_file.py)
        intro, sep, history = text.partition("\n# History")
        text = f"{intro.rstrip()}\n\n{BEGIN}\n{table(summaries)}\n{END}\n\n{sep.lstrip()}{history}"
    RESULTS.write_text(text)
    README.write_text(replace_between(README.read_text(), README_BEGIN, README_END, ratios_table(summaries)))
    print(table(summaries))


if __name__ == "__main__":
    refresh()
