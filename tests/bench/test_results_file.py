"""benchmarks/results_file.py: RESULTS.md stays a dashboard; recorded sections go to their day's history file."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("results_file", ROOT / "benchmarks" / "results_file.py")
results_file = importlib.util.module_from_spec(spec)
spec.loader.exec_module(results_file)

HEAD = "# kvflow benchmark results\n\nIntro.\n\n<!-- current figures -->\n| a |\n<!-- end -->\n\n"


def test_history_below_the_dashboard_is_filed_by_day(tmp_path: Path) -> None:
    results, history = tmp_path / "RESULTS.md", tmp_path / "history"
    results.write_text(HEAD + "# History\n\n"
                       "## Side by side with llama.cpp (2026-11-30 02:12, 2 threads)\n\nrun 1\n\n"
                       "### a table of that run\n\n| x |\n\n"
                       "## Session 12 (2026-12-01/02, AMD EPYC): sliding windows\n\nnotes\n\n"
                       "## Undated notes\n\nmore\n\n"
                       "## Side by side with llama.cpp (2026-12-02 05:08, 2 threads)\n\nrun 2\n")
    assert results_file.file_history(results, history) == 4
    assert sorted(p.name for p in history.iterdir()) == ["2026-11-30.md", "2026-12-01.md", "2026-12-02.md"]
    first = (history / "2026-11-30.md").read_text()
    assert "run 1" in first and "### a table of that run" in first
    dec1 = (history / "2026-12-01.md").read_text()
    assert dec1.index("## Session 12") < dec1.index("## Undated notes")  # in order, undated with the one before
    text = results.read_text()
    assert text.startswith(HEAD) and "run 1" not in text
    assert text.index("[2026-12-02](history/2026-12-02.md)") < text.index("[2026-11-30](history/2026-11-30.md)")
    assert "- [2026-12-01](history/2026-12-01.md): Session 12 (2026-12-01/02, AMD EPYC): sliding windows; " \
           "Undated notes" in text
    assert "- [2026-11-30](history/2026-11-30.md): 1 side-by-side run with llama.cpp" in text

    # A merged branch that still appended to RESULTS.md: its section is filed too, the dashboard kept.
    results.write_text(results.read_text() + "\n## Session 40 (2026-12-02): late\n\nlate notes\n")
    assert results_file.file_history(results, history) == 1
    assert "late notes" in (history / "2026-12-02.md").read_text() and "late notes" not in results.read_text()
    assert results.read_text().count("<!-- history days") == 1


def test_a_recorded_section_goes_to_todays_file_and_the_day_is_listed(tmp_path: Path, monkeypatch) -> None:
    results, history = tmp_path / "RESULTS.md", tmp_path / "history"
    results.write_text(HEAD + "# History\n")
    monkeypatch.setattr(results_file, "RESULTS", results)
    monkeypatch.setattr(results_file, "HISTORY", history)
    monkeypatch.setattr(results_file.time, "strftime", lambda fmt: "2026-12-07")
    for n in (1, 2):
        results_file.publish(results_file.table_section(f"Figures {n}", "How.", ["a"], ["| 1 |"]), record=True)
    results_file.publish("## Not recorded", record=False)
    day = (history / "2026-12-07.md").read_text()
    assert day.startswith("# kvflow benchmark history, 2026-12-07") and day.index("Figures 1") < day.index("Figures 2")
    assert "Not recorded" not in day
    text = results.read_text()
    assert text.startswith(HEAD) and "Figures 1" not in text
    assert text.count("[2026-12-07](history/2026-12-07.md)") == 1
