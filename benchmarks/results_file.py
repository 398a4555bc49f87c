"""Where benchmark scripts put their tables: printed, and with --record appended to the day's history file.

benchmarks/RESULTS.md is a dashboard: its header, the current figures per CPU tier (current_figures.py), and
under "# History" one line per day linking benchmarks/history/<day>.md, where that day's sections stand in
the order they were written. A section recorded today goes to today's file, and RESULTS.md lists the day.

    python benchmarks/results_file.py   # file the sections written below RESULTS.md's day list (a merge of a
                                        # branch that still appended there) into their days' files
"""

from __future__ import annotations

import re
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
HISTORY = HERE / "history"
HISTORY_HEADING = "# History"
DAYS_BEGIN, DAYS_END = "<!-- history days: benchmarks/results_file.py -->", "<!-- end of history days -->"
SIDE_BY_SIDE = "Side by side with llama.cpp"
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def publish(text: str, record: bool) -> None:
    print(text)
    if record:
        add_to_history(text)


def table_section(heading: str, intro: str, columns: list[str], rows: list[str]) -> str:
    """A RESULTS.md section: a level-3 heading, a paragraph saying how the figures were made, and a table
    (rows already formatted as `| a | b |`)."""
    return "\n".join([f"### {heading}", "", intro, "", "| " + " | ".join(columns) + " |",
                      "|" + "---|" * len(columns), *rows, ""])


def history_file(day: str, history: Path | None = None) -> Path:
    return (history or HISTORY) / f"{day}.md"


def add_to_history(text: str, day: str | None = None, results: Path | None = None, history: Path | None = None) -> Path:
    """Append a section to its day's file (today's, on this machine's clock), then list the days in RESULTS.md."""
    results, history = results or RESULTS, history or HISTORY
    path = history_file(day or time.strftime("%Y-%m-%d"), history)
    history.mkdir(exist_ok=True)
    if not path.exists():
        path.write_text(f"# kvflow benchmark history, {path.stem}\n\nSections in the order they were written "
                        "(the current figures: [RESULTS.md](../RESULTS.md)).\n")
    with path.open("a") as f:
        f.write("\n" + text.strip("\n") + "\n")
    list_days(results, history)
    return path


def split_by_day(text: str, first_day: str) -> list[tuple[str, str]]:
    """(day, section) for each level-2 section of `text`, in order: the day is the first date in its heading,
    else the day of the section before it (first_day for text before any dated heading)."""
    sections: list[tuple[str, str]] = []
    day = first_day
    for chunk in re.split(r"(?m)^(?=## )", text):
        if not chunk.strip():
            continue
        heading = chunk.split("\n", 1)[0]
        found = _DATE.search(heading) if heading.startswith("## ") else None
        day = found.group(0) if found else day
        sections.append((day, chunk.strip("\n")))
    return sections


def file_history(results: Path | None = None, history: Path | None = None) -> int:
    """Move every section below RESULTS.md's day list (or below "# History", where there is no list yet) into
    its day's file, then list the days; returns how many sections moved."""
    results, history = results or RESULTS, history or HISTORY
    text = results.read_text()
    head, heading, below = text.partition(HISTORY_HEADING)
    if not heading:
        raise ValueError(f"{results} has no {HISTORY_HEADING!r} heading")
    if DAYS_END in below:
        listed, end, below = below.partition(DAYS_END)
        head += heading + listed + end
    else:
        head += heading
    days = sorted(p.stem for p in history.glob("*.md")) if history.is_dir() else []
    sections = split_by_day(below, days[-1] if days else time.strftime("%Y-%m-%d"))
    results.write_text(head.rstrip("\n") + "\n")
    for day, section in sections:
        add_to_history(section, day, results, history)
    list_days(results, history)
    return len(sections)


def day_line(path: Path) -> str:
    """`- [day](history/day.md): its sections' headings` (side-by-side runs counted, not each named)."""
    headings = [line[3:].strip() for line in path.read_text().splitlines() if line.startswith("## ")]
    runs = sum(h.startswith(SIDE_BY_SIDE) for h in headings)
    named = [h for h in headings if not h.startswith(SIDE_BY_SIDE)]
    if runs:
        named.append(f"{runs} side-by-side run{'s' * (runs > 1)} with llama.cpp")
    return f"- [{path.stem}](history/{path.name})" + (": " + "; ".join(named) if named else "")


def list_days(results: Path | None = None, history: Path | None = None) -> None:
    """Rewrite RESULTS.md's list of days (newest first) under its "# History" heading."""
    results, history = results or RESULTS, history or HISTORY
    days = sorted(history.glob("*.md"), reverse=True) if history.is_dir() else []
    block = "\n".join([DAYS_BEGIN, *[day_line(p) for p in days], DAYS_END])
    text = results.read_text()
    if DAYS_BEGIN in text:
        before, _, rest = text.partition(DAYS_BEGIN)
        _, _, after = rest.partition(DAYS_END)
        text = before + block + after
    else:
        head, heading, below = text.partition(HISTORY_HEADING)
        if not heading:
            head, heading, below = text.rstrip("\n") + "\n\n", HISTORY_HEADING, "\n"
        intro = ("\n\nEvery section measured so far, one file a day under `history/` (a script's `--record` adds "
                 "to the day's file); newest day first.\n\n")
        text = head + heading + intro + block + "\n" + below.lstrip("\n")
    results.write_text(text)


if __name__ == "__main__":
    print(f"{file_history()} sections filed under {HISTORY}")
