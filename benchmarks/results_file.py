"""Where benchmark scripts put their tables: printed, and appended to benchmarks/RESULTS.md when asked."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def publish(text: str, record: bool) -> None:
    print(text)
    if record:
        with RESULTS.open("a") as f:
            f.write(text + "\n")
