"""benchmarks/stale_tiers.py: a tier's table is current only when measured at or after the last commit that
changed the kernels or the executors."""

import importlib.util
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("stale_tiers", ROOT / "benchmarks" / "stale_tiers.py")
stale_tiers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(stale_tiers)


def commit(repo: Path, path: str) -> str:
    (repo / path).parent.mkdir(parents=True, exist_ok=True)
    (repo / path).write_text(str(len(list(repo.rglob("*")))))
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", path], cwd=repo, check=True)
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()


def table(sha: str | None) -> dict:
    return {"cpu": "a CPU", "date": "2026-12-06 12:00", "commit": sha}


def test_a_table_is_stale_until_measured_at_or_after_the_last_kernel_change(tmp_path: Path) -> None:
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    before = commit(tmp_path, "README.md")
    kernel = commit(tmp_path, "kvflow/kernels/packed.h")
    after = commit(tmp_path, "kvflow/server/app.py")  # not watched: a table measured at it is current
    changed = stale_tiers.last_change(tmp_path)
    assert changed == kernel
    assert stale_tiers.verdict(table(before), changed, tmp_path)[0]
    assert not stale_tiers.verdict(table(kernel), changed, tmp_path)[0]
    assert not stale_tiers.verdict(table(after), changed, tmp_path)[0]
    assert stale_tiers.verdict(table(None), changed, tmp_path)[0]
    assert stale_tiers.verdict(None, changed, tmp_path) == (True, "no table")
    assert stale_tiers.verdict(table("0" * 40), changed, tmp_path)[0]  # a commit this clone lacks
    executor = commit(tmp_path, "kvflow/executors/step.py")
    assert stale_tiers.last_change(tmp_path) == executor
    assert stale_tiers.verdict(table(after), executor, tmp_path)[0]
