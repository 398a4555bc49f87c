"""`kvflow launch codex|claude|qwen|openclaw [-- client args]`: a coding agent on a local kvflow server.

As `ollama launch` does: find a kvflow server (--url, default http://127.0.0.1:8000) or start one (with a
context of 32768 tokens, which the agents' first prompts of 6,000 to 21,000 tokens need), write the client's
provider settings into a folder kvflow owns (~/.cache/kvflow/launch/<client>/, never the user's own
configuration: each client is pointed at that folder by its own environment variable), and run the client.
A server found running is left running (the client replaces this process); a server started here (with
`--rope-scaling auto`: a model trained for a shorter context is stretched to it) is stopped when the client
exits.

| client | folder used as | settings written |
|---|---|---|
| codex (Codex CLI) | CODEX_HOME | config.toml: a `kvflow` provider on the Responses API |
| claude (Claude Code) | CLAUDE_CONFIG_DIR | environment: ANTHROPIC_BASE_URL, ANTHROPIC_AUTH_TOKEN, the model names, an answer's cap |
| qwen (Qwen Code) | QWEN_HOME | settings.json (auth type openai) and OPENAI_BASE_URL, OPENAI_API_KEY, OPENAI_MODEL |
| openclaw (OpenClaw) | OPENCLAW_CONFIG_PATH, OPENCLAW_STATE_DIR | openclaw.json: a `kvflow` provider on chat completions |
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.error import URLError
from urllib.parse import urlparse
from urllib.request import Request, urlopen

DEFAULT_URL = "http://127.0.0.1:8000"
LAUNCH_CONTEXT = 32768
# client -> (its command, the npm package that installs it)
CLIENTS = {
    "codex": ("codex", "@openai/codex"),
    "claude": ("claude", "@anthropic-ai/claude-code"),
    "qwen": ("qwen", "@qwen-code/qwen-code"),
    "openclaw": ("openclaw", "openclaw"),
}


@dataclass
class Served:
    """A kvflow server as its /v1/models reports it."""

    base_url: str  # without /v1
    model: str
    context: int
    api_key: str | None = None


@dataclass
class ClientSetup:
    argv: list[str]  # the client's command and the options that point it at kvflow (the user's args follow)
    env: dict[str, str]  # set on top of the environment
    defaults: dict[str, str] = field(default_factory=dict)  # set where the environment has none of its own


def launch_folder(client: str) -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "kvflow" / "launch" / client


def setup_client(client: str, served: Served, folder: Path) -> ClientSetup:
    """Writes the client's settings for `served` into `folder` (created) and says how to run it."""
    folder.mkdir(parents=True, exist_ok=True)
    return _SETUPS[client](served, folder)


def _codex(served: Served, folder: Path) -> ClientSetup:
    # Codex speaks only the Responses API to a custom provider (wire_api "chat" is refused by Codex itself).
    key = 'env_key = "KVFLOW_API_KEY"\n' if served.api_key else ""
    (folder / "config.toml").write_text(
        f"model = {json.dumps(served.model)}\nmodel_provider = \"kvflow\"\n"
        f"model_context_window = {served.context}\n\n"
        f"[model_providers.kvflow]\nname = \"kvflow\"\nbase_url = {json.dumps(served.base_url + '/v1')}\n"
        f"wire_api = \"responses\"\n{key}")
    env = {"CODEX_HOME": str(folder)}
    if served.api_key:
        env["KVFLOW_API_KEY"] = served.api_key
    return ClientSetup([CLIENTS["codex"][0]], env)


def _claude(served: Served, folder: Path) -> ClientSetup:
    state = folder / ".claude.json"  # Claude Code's own state file in its config folder
    if not state.exists():  # skip the first-run questions (theme, login), which a local server has no use for
        state.write_text(json.dumps({"hasCompletedOnboarding": True}))
    env = {"CLAUDE_CONFIG_DIR": str(folder), "ANTHROPIC_BASE_URL": served.base_url,
           "ANTHROPIC_AUTH_TOKEN": served.api_key or "kvflow", "ANTHROPIC_MODEL": served.model,
           "ANTHROPIC_DEFAULT_OPUS_MODEL": served.model, "ANTHROPIC_DEFAULT_SONNET_MODEL": served.model,
           "ANTHROPIC_DEFAULT_HAIKU_MODEL": served.model, "ANTHROPIC_SMALL_FAST_MODEL": served.model,
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1"}
    # Claude Code asks for 32,000 tokens an answer, the whole of a local context: OpenClaw's cap instead
    cap = {"CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(_output_cap(served))}
    return ClientSetup([CLIENTS["claude"][0], "--model", served.model], env, cap)


def _qwen(served: Served, folder: Path) -> ClientSetup:
    settings = {"security": {"auth": {"selectedType": "openai"}},
                "model": {"name": served.model, "generationConfig": {"contextWindowSize": served.context}},
                "privacy": {"usageStatisticsEnabled": False}, "telemetry": {"enabled": False}}
    _merge_json(folder / "settings.json", settings)
    env = {"QWEN_HOME": str(folder), "OPENAI_BASE_URL": served.base_url + "/v1",
           "OPENAI_API_KEY": served.api_key or "kvflow", "OPENAI_MODEL": served.model}
    return ClientSetup([CLIENTS["qwen"][0]], env)


def _openclaw(served: Served, folder: Path) -> ClientSetup:
    model = {"id": served.model, "name": f"{served.model} (kvflow)", "reasoning": False, "input": ["text"],
             "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
             "contextWindow": served.context, "maxTokens": _output_cap(served)}
    config = {"agents": {"defaults": {"model": {"primary": f"kvflow/{served.model}"}}},
              "models": {"mode": "replace", "providers": {"kvflow": {
                  "baseUrl": served.base_url + "/v1", "apiKey": served.api_key or "kvflow",
                  "api": "openai-completions", "models": [model]}}}}
    _merge_json(folder / "openclaw.json", config)
    env = {"OPENCLAW_CONFIG_PATH": str(folder / "openclaw.json"), "OPENCLAW_STATE_DIR": str(folder / "state")}
    return ClientSetup([CLIENTS["openclaw"][0]], env)


def _output_cap(served: Served) -> int:
    """The longest answer a client is set to ask for: a quarter of the context, at most 8,192 tokens."""
    return min(8192, served.context // 4)


_SETUPS = {"codex": _codex, "claude": _claude, "qwen": _qwen, "openclaw": _openclaw}


def _merge_json(path: Path, ours: dict) -> None:
    """Writes `ours` into the JSON file at path, keeping what else is there (a client's own later
    changes, or settings added by hand) and replacing only the keys kvflow sets."""
    try:
        current = json.loads(path.read_text())
    except (OSError, ValueError):
        current = {}
    path.write_text(json.dumps(_deep_merge(current if isinstance(current, dict) else {}, ours), indent=2))


def _deep_merge(base: dict, ours: dict) -> dict:
    merged = dict(base)
    for key, value in ours.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def find_server(url: str, api_key: str | None = None, timeout: float = 2.0) -> Served | None:
    """The kvflow server at url (its first model and served context), or None where nothing answers."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urlopen(Request(url.rstrip("/") + "/v1/models", headers=headers), timeout=timeout) as r:
            models = json.load(r)["data"]
    except (URLError, OSError, ValueError, KeyError):
        return None
    if not models:
        return None
    first = models[0]
    return Served(url.rstrip("/"), first["id"], int(first.get("max_model_len") or LAUNCH_CONTEXT), api_key)


def start_server(url: str, serve_args: list[str], log_path: Path, api_key: str | None) -> subprocess.Popen:
    """`kvflow serve` on url's host and port, with the launch context unless serve_args set one."""
    where = urlparse(url)
    args = [sys.executable, "-m", "kvflow", "serve", "--host", where.hostname or "127.0.0.1",
            "--port", str(where.port or 8000), *serve_args]
    if "--max-model-len" not in serve_args:
        args += ["--max-model-len", str(LAUNCH_CONTEXT)]
    if "--rope-scaling" not in serve_args:  # a model trained for less, stretched (YaRN) rather than past its end
        args += ["--rope-scaling", "auto"]
    if api_key and "--api-key" not in serve_args:
        args += ["--api-key", api_key]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)


def wait_for_server(proc: subprocess.Popen, url: str, api_key: str | None, timeout: float, log: Path) -> Served:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"kvflow launch: kvflow serve exited with {proc.returncode}; its log: {log}")
        served = find_server(url, api_key)
        if served is not None:
            return served
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit(f"kvflow launch: kvflow serve did not answer within {timeout:.0f} s; its log: {log}")


def add_launch_parser(subparsers) -> None:
    p = subparsers.add_parser("launch", help="run a coding agent (codex, claude, qwen, openclaw) on kvflow",
                              description="Run a coding-agent CLI against a kvflow server, found or started.")
    p.add_argument("client", choices=sorted(CLIENTS))
    p.add_argument("--url", default=os.environ.get("KVFLOW_URL", DEFAULT_URL),
                   help=f"the kvflow server to use, or where to start one (default: $KVFLOW_URL or {DEFAULT_URL})")
    p.add_argument("--api-key", default=os.environ.get("KVFLOW_API_KEY"), help="the server's --api-key, if any")
    p.add_argument("--serve-args", default="",
                   help="arguments for a server started here, e.g. \"--model PATH --kv-cache-memory 2GiB\"")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for a started server")
    p.add_argument("--dry-run", action="store_true",
                   help="write the settings and print the environment and command, without running the client")
    # The client's own arguments follow `--`; kvflow.cli.main takes them off before argparse sees them
    # (split_client_args), since argparse's subcommands do not pass `--` through.
    p.set_defaults(handler=cmd_launch, client_args=[])


def split_client_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """(kvflow's arguments, the client's) for `kvflow launch CLIENT [options] -- CLIENT ARGS`."""
    if "--" in argv and "launch" in argv[:argv.index("--")]:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1:]
    return argv, []


def cmd_launch(args: argparse.Namespace) -> int:
    client_args = list(args.client_args)
    command, package = CLIENTS[args.client]
    if not args.dry_run and shutil.which(command) is None:
        raise SystemExit(f"kvflow launch: `{command}` is not on PATH; install it with: npm install -g {package}")
    folder = launch_folder(args.client)
    served, started = find_server(args.url, args.api_key), None
    if served is None:
        if args.dry_run:
            raise SystemExit(f"kvflow launch: no kvflow server at {args.url} (--dry-run starts none); start one "
                             f"with: kvflow serve --max-model-len {LAUNCH_CONTEXT} --rope-scaling auto")
        else:
            log = folder.parent / "serve.log"
            print(f"kvflow launch: no kvflow server at {args.url}; starting one (log: {log})", file=sys.stderr)
            started = start_server(args.url, args.serve_args.split(), log, args.api_key)
            served = wait_for_server(started, args.url, args.api_key, args.start_timeout, log)
    setup = setup_client(args.client, served, folder)
    argv = [*setup.argv, *client_args]
    print(f"kvflow launch: {args.client} on {served.base_url} (model {served.model}, context {served.context} "
          f"tokens); its settings: {folder}", file=sys.stderr, flush=True)
    env = {**setup.defaults, **os.environ, **setup.env}
    if args.dry_run:
        for name in {**setup.defaults, **setup.env}:
            print(f"export {name}={_shell_quote(env[name])}")
        print(" ".join(_shell_quote(a) for a in argv))
        return 0
    if started is None:
        os.execvpe(argv[0], argv, env)  # the client takes this process's place; the server stays as it was
    try:
        return subprocess.run(argv, env=env).returncode
    finally:
        started.terminate()
        try:
            started.wait(30)
        except subprocess.TimeoutExpired:
            started.kill()


def _shell_quote(text: str) -> str:
    import shlex

    return shlex.quote(text)
