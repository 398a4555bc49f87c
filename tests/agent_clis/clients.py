"""The four coding-agent CLIs, each set up as `kvflow launch` sets it up (kvflow/launch.py), in a HOME of its
own, and run non-interactively for a turn at a time.

What the tests add to launch's settings only keeps them quick on 2 cores: a short system prompt where the
client takes one, and a short list of tools where it takes one (so first prompts are 1,000 to 6,000 tokens,
not 6,000 to 21,000; the full prompts are measured by the benchmarks, not here), no background
memory-extraction request (Qwen Code), and output bounded by the test proxy. Each client keeps its own
wire API, request shapes, tools and session handling.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from kvflow.launch import Served, _merge_json, setup_client

MODEL = "smollm2-135m"
CONTEXT = 32768
NOTES = "notes.txt"
MARKER = "kvflow-marker-7311"  # what notes.txt holds: the tool result a follow-up request must carry
SHORT_PROMPT = "You are a coding agent. Use your tools when asked; answer in one short sentence."
TURN_TIMEOUT_S = 300
# Each answer's bound, set in the client where it takes one: a client that finds its answer cut shorter than
# it asked for goes on asking (Qwen Code does); the test proxy cuts the others' (Codex sends none). Room for
# a short JSON string (the test holds Codex's and Claude Code's answers to one).
OUTPUT_TOKENS = 48


@dataclass
class AgentSession:
    client: str
    home: Path
    work: Path  # the working directory, with notes.txt in it
    env: dict[str, str]
    argv: list[str]  # the client's command and the options launch and the test give it
    tool: tuple[str, dict[str, str]]  # the client's own file-reading tool and the arguments to read notes.txt
    runs: list[subprocess.CompletedProcess] = field(default_factory=list)

    def turn(self, prompt: str) -> subprocess.CompletedProcess:
        """One non-interactive turn: the first starts the session, later ones continue it."""
        later = bool(self.runs)
        argv = [*self.argv, *_TURN_ARGS[self.client](prompt, later)]
        try:
            done = subprocess.run(argv, cwd=self.work, env=self.env, stdin=subprocess.DEVNULL,
                                  capture_output=True, text=True, timeout=TURN_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:  # reported like a failed turn, with what it wrote
            done = subprocess.CompletedProcess(argv, 124, _text(exc.stdout), _text(exc.stderr) + "\n(timed out)")
        self.runs.append(done)
        return done


def _text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def make_session(client: str, base_url: str, root: Path, bin_dir: Path, trim: bool = True) -> AgentSession:
    """`client` pointed at base_url (the test proxy), with HOME and working directory under root; trim=False
    keeps the client's own system prompt and tools, as `kvflow launch` runs it (benchmarks/agent_sessions)."""
    home, work = root / "home", root / "work"
    home.mkdir(parents=True)
    work.mkdir(parents=True)
    (work / NOTES).write_text(MARKER + "\n")
    subprocess.run(["git", "init", "-q"], cwd=work, check=True)  # Codex resumes sessions inside a repository
    env = {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
           "XDG_CACHE_HOME": str(home / ".cache"), "XDG_DATA_HOME": str(home / ".local" / "share"),
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "NO_COLOR": "1",
           "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(OUTPUT_TOKENS)}
    for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL", "CODEX_HOME"):
        env.pop(name, None)
    served = Served(base_url, MODEL, CONTEXT)
    setup = setup_client(client, served, _FOLDERS[client](home))
    env = {**setup.defaults, **env, **setup.env}  # as kvflow launch sets them
    if client == "openclaw":  # no update check, no LAN announcement, no channels or cron for a one-shot run
        env.update({"OPENCLAW_NO_AUTO_UPDATE": "1", "OPENCLAW_DISABLE_BONJOUR": "1", "OPENCLAW_SKIP_CHANNELS": "1",
                    "OPENCLAW_SKIP_CRON": "1", "OPENCLAW_NO_RESPAWN": "1"})
    argv = [*setup.argv, *(_TRIM[client](home, work, served) if trim else [])]
    notes = str(work / NOTES)
    tool = {"codex": ("exec_command", {"cmd": f"cat {NOTES}"}), "claude": ("Read", {"file_path": notes}),
            "qwen": ("read_file", {"file_path": notes}), "openclaw": ("read", {"path": notes})}[client]
    return AgentSession(client, home, work, env, argv, tool)


# Where launch's folder goes in the test HOME (for `kvflow launch` itself: ~/.cache/kvflow/launch/<client>).
_FOLDERS = {
    "codex": lambda home: home / ".codex",
    "claude": lambda home: home / ".claude",
    "qwen": lambda home: home / ".qwen",
    "openclaw": lambda home: home / ".openclaw-kvflow",
}


def _trim_codex(home: Path, work: Path, served: Served) -> list[str]:
    instructions = home / "instructions.md"
    instructions.write_text(SHORT_PROMPT + "\n")
    # (a -c option: config.toml's top-level keys cannot follow launch's [model_providers.kvflow] table)
    return ["-c", f"model_instructions_file={json.dumps(str(instructions))}"]


def _trim_claude(home: Path, work: Path, served: Served) -> list[str]:
    # Its own system prompt (about 2,500 tokens with one tool) is kept: with a short one, turn 2's prompt
    # would be a few hundred tokens, of which the new question alone is a tenth.
    # (CLAUDE_CODE_MAX_OUTPUT_TOKENS, in make_session's environment, bounds its answers)
    return ["--tools", "Read", "--max-turns", "4"]


def _trim_qwen(home: Path, work: Path, served: Served) -> list[str]:
    _merge_json(home / ".qwen" / "settings.json", {
        "tools": {"core": ["read_file"], "exclude": ["agent", "task_stop", "send_message", "skill", "tool_search"]},
        "memory": {"enableManagedAutoMemory": False},
        "model": {"generationConfig": {"samplingParams": {"max_tokens": OUTPUT_TOKENS}}}})
    return ["--system-prompt", SHORT_PROMPT, "--max-session-turns", "4"]


def _trim_openclaw(home: Path, work: Path, served: Served) -> list[str]:
    config = home / ".openclaw-kvflow" / "openclaw.json"
    settings = json.loads(config.read_text())
    settings["models"]["providers"]["kvflow"]["models"][0]["maxTokens"] = OUTPUT_TOKENS
    config.write_text(json.dumps(settings))
    _merge_json(config, {
        "agents": {"defaults": {"workspace": str(work), "skipBootstrap": True, "contextInjection": "never",
                                "skills": []}},
        "tools": {"profile": "minimal", "alsoAllow": ["read"]}})
    return []


_TRIM = {"codex": _trim_codex, "claude": _trim_claude, "qwen": _trim_qwen, "openclaw": _trim_openclaw}

_TURN_ARGS = {
    # Codex: `exec`, then `exec resume --last` (the newest session of this working directory)
    "codex": lambda prompt, later: ["exec", "--skip-git-repo-check", *(["resume", "--last"] if later else []), prompt],
    # Claude Code: `-p`, then `-p --continue`
    "claude": lambda prompt, later: ["-p", prompt, *(["--continue"] if later else [])],
    # Qwen Code: `-p`, then `-p --continue`
    "qwen": lambda prompt, later: ["-p", prompt, *(["--continue"] if later else [])],
    # OpenClaw: `agent --local` with the same session id each turn
    "openclaw": lambda prompt, later: ["agent", "--local", "--session-id", "kvflow-test", "--model",
                                       f"kvflow/{MODEL}", "--json", "--message", prompt],
}
