"""Where benchmark scripts put their tables: printed, and appended to benchmarks/RESULTS.md when asked."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def publish(text: str, record: bool) -> None:
    print(text)
    if record:
        with RESULTS.open("a") as f:
            f.write(text + "\n")


def table_section(heading: str, intro: str, columns: list[str], rows: list[str]) -> str:
    """A RESULTS.md section: a level-3 heading, a paragraph saying how the figures were made, and a table
    (rows already formatted as `| a | b |`)."""
    return "\n".join([f"### {heading}", "", intro, "", "| " + " | ".join(columns) + " |",
                      "|" + "---|" * len(columns), *rows, ""])
