"""`kvflow launch` starts light: neither importing kvflow.launch nor running the command (its parser is
the whole kvflow command's) imports torch or transformers, which took 4 s of every launch."""

from __future__ import annotations

import os
import subprocess
import sys

HEAVY = ("torch", "transformers", "fastapi", "numpy")


def test_importing_the_launcher_imports_no_torch():
    code = ("import sys, kvflow.launch, kvflow.cli; kvflow.cli.build_parser(); "
            f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""


def test_the_launch_command_imports_no_torch(tmp_path):
    """The command itself, to its end (no server at --url, so --dry-run stops there), with every import
    listed by -X importtime."""
    env = {**os.environ, "HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    env.pop("KVFLOW_URL", None)
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "kvflow", "launch", "codex", "--dry-run",
                           "--url", "http://127.0.0.1:9"], capture_output=True, text=True, timeout=120, env=env)
    assert "no kvflow server at http://127.0.0.1:9" in done.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "kvflow.launch" in imported
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))
