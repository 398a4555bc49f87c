"""The front end's handle on an engine core running in its own process (engine/core_process.py).

EngineCoreClient has AsyncEngine's interface (add_request, generate, abort, stats, status, shutdown), so the
server runs on either. Requests go to the core over a pipe; a reader thread takes the core's messages and
hands each output to its request's event loop, as AsyncEngine's step thread does. What the server reads of
the engine itself (model, context, tokenizer, grammars, step history) is an EngineView built from what the
core reports when it is ready.

If the core dies, every open stream and every request being admitted get EngineDeadError naming its exit
code, /health answers 503, and the `on_death` callbacks run (the server then exits non-zero).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import threading
import uuid
from collections.abc import Callable, Sequence
from types import SimpleNamespace

from kvflow.config import EngineConfig
from kvflow.engine.async_engine import (
    EngineDeadError,
    EngineFrontEnd,
    EngineStats,
    RequestStream,
    _call_soon,
    _resolve,
)
from kvflow.engine.core_process import CoreInfo, core_main
from kvflow.engine.engine import tokenize_prompt
from kvflow.engine.step_history import StepHistory
from kvflow.outputs import RequestOutput
from kvflow.sampling_params import SamplingParams

log = logging.getLogger("kvflow")


class EngineView:
    """The engine's attributes the server reads, as the core reported them."""

    def __init__(self, info: CoreInfo, tokenizer) -> None:
        self.model_summary = info.model
        self.loaded = info.model  # resolved, arch, dtype, device: what the routes read of the loaded model
        self.tokenizer = tokenizer
        self.max_model_len = info.max_model_len
        self.kv_capacity_tokens = info.kv_capacity_tokens
        self.runner = SimpleNamespace(kv_element_bytes=info.kv_element_bytes)
        self.eos_token_ids = info.eos_token_ids
        self.step_history = StepHistory()
        self.failure: str | None = None
        self._grammars = None

    def tokenize(self, prompt: str) -> list[int]:
        return tokenize_prompt(self.tokenizer, prompt)

    @property
    def grammars(self):
        """The same compiler as the core's, to refuse a bad schema before the request is queued."""
        if self._grammars is None:
            from kvflow.structured.compiler import GrammarCompiler

            self._grammars = GrammarCompiler(self.tokenizer, self.loaded.arch.vocab_size,
                                             self.eos_token_ids[0] if self.eos_token_ids else None)
        return self._grammars


class EngineCoreClient(EngineFrontEnd):
    def __init__(self, config: EngineConfig, attention_backend: str = "auto", log_level: int = logging.WARNING,
                 wait: bool = True):
        """Start the core and wait until its model is loaded (a load error is raised here, as in-process).
        wait=False: return at once; wait_ready() then waits (several cores load side by side)."""
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no copied threads or locks
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=core_main, args=(child, config, attention_backend, log_level),
                                 name="kvflow-engine-core", daemon=True)
        self._proc.start()
        child.close()
        if wait:
            self.wait_ready()

    def wait_ready(self, tokenizer=None) -> None:
        """Wait for the core's model; tokenizer: one already loaded for the same model (else loaded here)."""
        try:
            message = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            raise RuntimeError(f"the engine core exited while loading (exit code {self._proc.exitcode})") from None
        if message[0] == "load_failed":
            self._proc.join(5)
            raise message[1]
        info: CoreInfo = message[1]
        from kvflow.loader.model_loader import open_model_files

        self.engine = EngineView(info, tokenizer or open_model_files(info.model.resolved).tokenizer())
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._streams: dict[str, tuple[RequestStream, asyncio.AbstractEventLoop]] = {}
        self._admissions: dict[str, tuple[asyncio.Future, asyncio.AbstractEventLoop]] = {}
        self._stats = EngineStats()
        self._ids = itertools.count(1)
        self._running = False
        self._stopping = False
        self.finished_listeners: list[Callable[[RequestOutput], None]] = []
        self.on_death: list[Callable[[str], None]] = []
        self.num_engine_errors = 0

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        if not self._running:
            self._running = True
            threading.Thread(target=self._read, name="kvflow-core-client", daemon=True).start()

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the core; requests still running get EngineDeadError."""
        self._stopping = True
        try:
            self._send(("shutdown",))
        except OSError:
            pass
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._fail_all(EngineDeadError("the engine was shut down"))

    def kill(self) -> None:
        """Stop the core at once (a replica whose sibling failed to load)."""
        self._stopping = True
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join()

    @property
    def is_running(self) -> bool:
        return self._running and not self._stopping and self._proc.is_alive() and self.engine.failure is None

    # ---- any thread --------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        with self._lock:
            return self._stats.num_waiting + len(self._admissions)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def has_request(self, request_id: str) -> bool:
        """Whether this core runs (or is admitting) the request."""
        with self._lock:
            return request_id in self._streams

    def abort(self, request_id: str) -> None:
        try:
            self._send(("abort", request_id))
        except OSError:  # the core is gone: nothing runs anyway
            pass

    async def add_request(self, prompt: str | Sequence[int], params: SamplingParams,
                          request_id: str | None = None) -> RequestStream:
        self.check_running()
        loop = asyncio.get_running_loop()
        request_id = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        stream = RequestStream(request_id, self)
        admitted = loop.create_future()
        with self._lock:
            self._streams[request_id] = (stream, loop)
            self._admissions[request_id] = (admitted, loop)
        try:
            self._send(("add", request_id, prompt if isinstance(prompt, str) else list(prompt), params))
            await admitted
        except asyncio.CancelledError:
            self.abort(request_id)  # the caller went away before admission: don't leave it running
            raise
        except BaseException:
            with self._lock:
                self._streams.pop(request_id, None)
            raise
        finally:
            with self._lock:
                self._admissions.pop(request_id, None)
        return stream

    # ---- the reader thread -------------------------------------------------------------------------
    def _send(self, message: tuple) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                self._core_died()
                return
            _, admissions, outputs, failures, stats, steps, failure = message
            self._stats = stats
            for record in steps:
                self.engine.step_history.add(record)
            self.engine.failure = failure
            self._deliver(admissions, outputs, failures)

    def _deliver(self, admissions: list, outputs: list[RequestOutput], failures: list) -> None:
        """One step's news, handed to each caller's event loop in one call per loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for request_id, error in admissions:
                entry = self._admissions.get(request_id)
                if error is not None:
                    self._streams.pop(request_id, None)
                if entry is not None:
                    by_loop.setdefault(entry[1], []).append((_resolve, entry[0], error))
            for out in outputs:
                entry = (self._streams.pop(out.request_id, None) if out.finished
                         else self._streams.get(out.request_id))
                if entry is not None:
                    by_loop.setdefault(entry[1], []).append((self._dispatch, entry[0], out))
            for request_id, error in failures:
                entry = self._streams.pop(request_id, None)
                if entry is not None:
                    self.num_engine_errors += 1
                    by_loop.setdefault(entry[1], []).append((RequestStream._put, entry[0], error))
        for loop, calls in by_loop.items():
            _call_soon(loop, _run_all, calls)

    def _dispatch(self, stream: RequestStream, out: RequestOutput) -> None:
        """Runs on the caller's event loop."""
        stream._put(out)
        if out.finished:
            for listener in self.finished_listeners:
                try:
                    listener(out)
                except Exception:
                    log.exception("finished-request listener failed")

    def _core_died(self) -> None:
        if self._stopping:
            return
        self._proc.join(2)
        reason = f"the engine core process died (exit code {self._proc.exitcode})"
        self.engine.failure = reason
        log.error("%s; failing the requests in flight", reason)
        self._fail_all(EngineDeadError(reason))
        for callback in self.on_death:
            try:
                callback(reason)
            except Exception:
                log.exception("engine-death callback failed")

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
            admissions = list(self._admissions.values())
        for future, loop in admissions:
            _call_soon(loop, _resolve, future, error)
        for stream, loop in streams.values():
            _call_soon(loop, stream._put, error)


def _run_all(calls: list) -> None:
    for fn, *args in calls:
        fn(*args)
