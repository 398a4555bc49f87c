"""Whether this CPU's tiers were measured since the kernels or the executors last changed.

The CPU differs from one session to the next, and a tier's side-by-side table (benchmarks/current/<tier>.json,
written by `side_by_side.py --record`) is refreshed only when a session draws a CPU that runs it. Each table
records the commit it was measured at; a table whose commit does not contain the last commit that touched
kvflow/kernels/ or kvflow/executors/ is stale, and so is a tier with no table, or one recorded before tables
carried a commit.

    python benchmarks/stale_tiers.py    # every tier this CPU runs; exit 1 when its own tier is stale

The CPU's own tier decides the exit status: lower tiers are forced here (KVFLOW_ISA) against a peer built for
them, and are listed so that a session with time to spare can refresh them too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvflow.kernels import cpu_features

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WATCHED = ("kvflow/kernels", "kvflow/executors")
PEERS = {"generic": "sse", "avx2": "avx2"}  # LLAMACPP_ISA of the peer a forced tier is measured against


def git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)


def last_change(repo: Path = REPO) -> str:
    """The newest commit that touched the kernels or the executors."""
    return git(repo, "log", "-1", "--format=%H", "--", *WATCHED).stdout.strip()


def current_table(tier: str) -> dict | None:
    path = HERE / "current" / f"{tier}.json"
    return json.loads(path.read_text()) if path.exists() else None


def verdict(table: dict | None, changed: str, repo: Path = REPO) -> tuple[bool, str]:
    """(stale, why) for one tier's current table, given the last commit that changed what it measures."""
    if table is None:
        return True, "no table"
    commit = table.get("commit")
    where = f"{table['cpu']}, {table['date']}"
    if table.get("dirty"):
        where += ", with uncommitted changes to kvflow/"
    if not commit:
        return True, f"measured {where}, at no recorded commit"
    if git(repo, "cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
        return True, f"measured {where} at {commit[:10]}, a commit this clone does not have"
    if git(repo, "merge-base", "--is-ancestor", changed, commit).returncode != 0:
        return True, f"measured {where} at {commit[:10]}, before {changed[:10]} changed {' or '.join(WATCHED)}"
    return False, f"measured {where} at {commit[:10]}, since the last change ({changed[:10]})"


def how_to_measure(tier: str, own: str) -> str:
    if tier == own:
        return "python benchmarks/side_by_side.py --record"
    return (f"LLAMACPP_ISA={PEERS[tier]} benchmarks/setup_llamacpp.sh && "
            f"KVFLOW_ISA={tier} python benchmarks/side_by_side.py --record")


def main() -> int:
    own = cpu_features.machine_tier()
    changed = last_change()
    print(f"This CPU: {cpu_features.cpu_name()}, tier {own}. Last change to {' or '.join(WATCHED)}: {changed[:10]}.")
    own_stale = False
    for tier in reversed(cpu_features.runnable_tiers()):
        stale, why = verdict(current_table(tier), changed)
        label = tier if tier == own else f"{tier} (forced)"
        print(f"  {label}: {'STALE' if stale else 'current'}: {why}")
        if stale and (tier == own or tier in PEERS):
            print(f"    re-measure: {how_to_measure(tier, own)}")
        own_stale |= stale and tier == own
    return 1 if own_stale else 0


if __name__ == "__main__":
    sys.exit(main())
