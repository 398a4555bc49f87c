"""Run a selection of the suite in a fresh process with a lower kernel tier forced (KVFLOW_ISA), so that one
machine covers its own tier and every tier below it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvflow.kernels import cpu_features

TESTS = Path(__file__).resolve().parent
LOWER = cpu_features.runnable_tiers()[:-1]  # every tier below this CPU's own


def assert_passes_on_tier(tier: str, selection: list[str], keyword: str | None = None) -> None:
    """Every selected test passes with tier forced; fails with their output otherwise."""
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(str(TESTS / s) for s in selection)]
    if keyword:
        args += ["-k", keyword]
    done = subprocess.run(args, env={**os.environ, "KVFLOW_ISA": tier}, cwd=TESTS.parent, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout and "skipped" not in done.stdout
