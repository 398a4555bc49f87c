"""Which of kvflow's Python files one chat request runs code in, from the HTTP handler to its last token.

Starts the real server app (uvicorn on 127.0.0.1, the default model unless --model says otherwise),
sends one warm-up chat request, then profiles every thread while a second one runs: each kvflow file in
which a function is entered counts once. Prints the files in the order they were first entered and their
count; with --json, writes them too. The goal is at most 16 files (README, "Layout").

    kvflow bench path [--model PATH] [--stream] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]


class FileRecorder:
    """A profile hook for every thread: records the kvflow files whose functions are called while on."""

    def __init__(self) -> None:
        self.on = False
        self.files: dict[str, None] = {}  # insertion-ordered set
        self._lock = threading.Lock()

    def hook(self, frame, event, arg):  # noqa: ARG002 - sys.setprofile's signature
        if not self.on or event != "call":
            return
        name = frame.f_code.co_filename
        if name.startswith(str(PACKAGE)) and not name.startswith(str(PACKAGE / "bench")) and name not in self.files:
            with self._lock:
                self.files.setdefault(name, None)

    def install(self) -> None:
        threading.setprofile(self.hook)
        sys.setprofile(self.hook)

    def relative(self) -> list[str]:
        return [str(Path(f).relative_to(PACKAGE.parent)) for f in self.files]


def trace_chat_request(model: str | None, stream: bool) -> list[str]:
    import uvicorn
    from openai import OpenAI

    from kvflow.config import engine_config
    from kvflow.engine.async_engine import AsyncEngine
    from kvflow.engine.engine import LLMEngine
    from kvflow.server.app import create_app
    from kvflow.server.serving import ServerSettings

    recorder = FileRecorder()
    recorder.install()  # before the server and engine threads start, so they inherit the hook
    engine = LLMEngine(engine_config(model=model, max_model_len=2048, kv_cache_memory=64 << 20))
    app = create_app(AsyncEngine(engine), ServerSettings(served_model_name="m"))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
    messages = [{"role": "user", "content": "What is the capital of France?"}]

    def ask() -> str:
        if not stream:
            reply = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0)
            return reply.choices[0].message.content
        parts = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0,
                                               stream=True)
        return "".join(chunk.choices[0].delta.content or "" for chunk in parts if chunk.choices)

    ask()  # warm-up: first-call imports and lazy builds are not the request path
    recorder.on = True
    text = ask()
    recorder.on = False
    server.should_exit = True
    thread.join(timeout=10)
    print(f"answer: {text!r}", file=sys.stderr)
    return recorder.relative()


def add_path_parser(subparsers) -> None:
    p = subparsers.add_parser("path", help="the Python files one chat request runs code in")
    p.add_argument("--model", default=None)
    p.add_argument("--stream", action="store_true", help="stream the answer (SSE)")
    p.add_argument("--json", default=None, help="also write the list of files here")
    p.set_defaults(func=cmd_path)


def cmd_path(args: argparse.Namespace) -> int:
    files = trace_chat_request(args.model, args.stream)
    for f in files:
        print(f)
    print(f"{len(files)} kvflow files")
    if args.json:
        Path(args.json).write_text(json.dumps({"files": files, "count": len(files)}, indent=1))
    return 0
