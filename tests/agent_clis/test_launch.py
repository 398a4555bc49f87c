"""`kvflow launch` with a real client (Qwen Code, for one turn): on a server it finds, and on one it starts
and stops again; the client's settings go to kvflow's own folder, never to the user's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
from server.server_process import free_port
from tiny_models import TINY_NAME

from agent_clis.clients import SHORT_PROMPT
from agent_clis.proxy import AgentProxy

# Qwen Code's own prompt, made short (its default is 16,000 tokens): client arguments after `--`.
QWEN_ARGS = ["-p", "Say hello.", "--system-prompt", SHORT_PROMPT, "--core-tools", "read_file",
             "--exclude-tools", "agent", "task_stop", "send_message", "skill", "tool_search"]


def _launch(args: list[str], root: Path, bin_dir: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    # kvflow's own caches (built kernels, packed weights) stay where they were: only launch's folder moves.
    kvflow_cache = os.environ.get("KVFLOW_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvflow")
    env = {**os.environ, "HOME": str(root / "home"), "XDG_CACHE_HOME": str(root / "cache"),
           "KVFLOW_CACHE_DIR": kvflow_cache,
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "NO_COLOR": "1"}
    for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "KVFLOW_URL", "QWEN_HOME"):
        env.pop(name, None)
    (root / "home").mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, "-m", "kvflow", "launch", *args], cwd=root / "home", env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)


def test_launch_runs_a_client_on_the_server_it_finds(agent_bin, agent_cli_server, tmp_path):
    # The proxy records what the client sends and holds its answers short (no client bound is set here).
    proxy = AgentProxy(agent_cli_server.base_url, output_cap=48, answer_schema={"type": "string", "maxLength": 24})
    try:
        done = _launch(["qwen", "--url", proxy.base_url, "--", *QWEN_ARGS], tmp_path, agent_bin)
        proxy.wait_idle()
        calls = [f"{e.method} {e.path} -> {e.status}" for e in proxy.exchanges]
        assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{calls}"
        assert proxy.generations() and all(e.status == 200 for e in proxy.exchanges), calls
        assert "smollm2-135m" in json.dumps(proxy.generations()[0].body)
    finally:
        proxy.stop()
    settings = tmp_path / "cache" / "kvflow" / "launch" / "qwen" / "settings.json"
    assert json.loads(settings.read_text())["security"]["auth"]["selectedType"] == "openai"
    assert not (tmp_path / "home" / ".qwen" / "settings.json").exists()  # the user's own settings: untouched


def test_launch_starts_a_server_and_stops_it(agent_bin, tiny_model_dir, tmp_path):
    """With no server at --url, launch starts one there (the tiny model, quick to load), runs the client
    (here only for its version: the session tests above run real turns), then stops the server."""
    url = f"http://127.0.0.1:{free_port()}"
    # A setting of the user's own in kvflow's folder survives launch's rewrite.
    folder = tmp_path / "cache" / "kvflow" / "launch" / "qwen"
    folder.mkdir(parents=True)
    (folder / "settings.json").write_text(json.dumps(
        {"model": {"generationConfig": {"samplingParams": {"max_tokens": 8}}}}))
    serve_args = f"--model {tiny_model_dir} --kv-cache-memory 64MiB --dtype float32"
    done = _launch(["qwen", "--url", url, f"--serve-args={serve_args}", "--", "--version"], tmp_path, agent_bin)
    log = (tmp_path / "cache" / "kvflow" / "launch" / "serve.log").read_text()
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{log[-3000:]}"
    assert done.stdout.strip() == "0.15.10"
    assert "starting one" in done.stderr and TINY_NAME in log and "context 32768 tokens" in log
    # launch's context on a model trained for 4096: stretched by YaRN (--rope-scaling auto), not run past its end
    assert "rotary scaling: yarn x8 over 4096 tokens" in log and "trained for" not in log
    settings = json.loads((folder / "settings.json").read_text())
    assert settings["model"]["generationConfig"]["samplingParams"]["max_tokens"] == 8
    assert settings["model"]["generationConfig"]["contextWindowSize"] == 32768
    try:
        httpx.get(f"{url}/health", timeout=2)
        raise AssertionError("the server launch started still answers after the client exited")
    except httpx.TransportError:
        pass
