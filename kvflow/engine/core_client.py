"""The front end's handle on an engine core running in its own process (engine/core_process.py).

EngineCoreClient has AsyncEngine's interface (add_request, generate, abort, stats, status, shutdown), so the
server runs on either. Requests go to the core over a pipe; a reader thread takes the core's messages and
hands each output to its request's event loop, as AsyncEngine's step thread does. What the server reads of
the engine itself (model, context, tokenizer, grammars, step history) is an EngineView built from what the
core reports when it is ready. Prompts are tokenized here, and the core's token ids become text here
(engine/output_assembly.py): neither runs on the core, between its steps.

If the core dies, every open stream and every request being admitted get EngineDeadError naming its exit
code, /health answers 503, and the `on_death` callbacks run (the server then exits non-zero).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import threading
from collections.abc import Callable, Sequence
from types import SimpleNamespace

from kvflow.config import EngineConfig
from kvflow.engine.async_engine import (
    EngineDeadError,
    EngineFrontEnd,
    RequestStream,
    _call_soon,
    _resolve,
    new_request_id,
)
from kvflow.engine.core_output import CoreOutput
from kvflow.engine.core_process import CoreInfo, core_main
from kvflow.engine.engine import StepHistory
from kvflow.engine.intake import tokenize_prompt
from kvflow.engine.output_assembly import RequestAssembler
from kvflow.engine.stats import EngineStats
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
        self.longest_request_tokens = info.longest_request_tokens
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
                 wait: bool = True, restarts: int = 0, env: dict[str, str] | None = None):
        """Start the core and wait until its model is loaded (a load error is raised here, as in-process).
        wait=False: return at once; wait_ready() then waits (several cores load side by side).
        restarts: how many times a core that dies is started again (its requests in flight get an error)
        before the front end gives up on it. env: variables the core sets for itself (core_main)."""
        self._core_args = (config, attention_backend, log_level, env)
        self.restarts_left = restarts
        self.num_restarts = 0
        self._spawn()
        if wait:
            self.wait_ready()

    def _spawn(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no copied threads or locks
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=core_main, args=(child, *self._core_args), name="kvflow-engine-core",
                                 daemon=True)
        self._proc.start()
        child.close()

    def _core_ready(self) -> CoreInfo:
        """The core's ready message; the load's own error if it failed."""
        try:
            message = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            raise RuntimeError(f"the engine core exited while loading (exit code {self._proc.exitcode})") from None
        if message[0] == "load_failed":
            self._proc.join(5)
            raise message[1]
        return message[1]

    def wait_ready(self, tokenizer=None) -> None:
        """Wait for the core's model; tokenizer: one already loaded for the same model (else loaded here)."""
        info = self._core_ready()
        from kvflow.loader.model_loader import open_model_files

        self.engine = EngineView(info, tokenizer or open_model_files(info.model.resolved).tokenizer())
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._streams: dict[str, tuple[RequestStream, asyncio.AbstractEventLoop, RequestAssembler]] = {}
        self._admissions: dict[str, tuple[asyncio.Future, asyncio.AbstractEventLoop]] = {}
        self._stats = EngineStats()
        self._steps_before = 0  # steps the cores before this one ran (after a restart)
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
        """Tokenize here (off the event loop), then queue the ids in the core."""
        self.check_running()
        text, ids = await self.prompt_ids(prompt)
        return await self.submit(text, ids, params, request_id)

    async def submit(self, prompt: str | None, token_ids: list[int], params: SamplingParams,
                     request_id: str | None = None) -> RequestStream:
        """Queue a tokenized prompt (prompt: its text, where it had one, for the outputs)."""
        self.check_running()
        loop = asyncio.get_running_loop()
        request_id = request_id or new_request_id()
        stream = RequestStream(request_id, self)
        assembler = RequestAssembler(request_id, prompt, token_ids, params, self.engine.tokenizer)
        admitted = loop.create_future()
        with self._lock:
            self._streams[request_id] = (stream, loop, assembler)
            self._admissions[request_id] = (admitted, loop)
        try:
            try:
                self._send(("add", request_id, token_ids, params))
            except OSError:
                raise EngineDeadError(self.engine.failure or "the engine core is gone") from None
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
                if self._core_died():
                    continue  # a new core runs
                return
            _, admissions, outputs, failures, stats, steps, failure = message
            self._stats = stats
            for record in steps:  # after a restart, numbered on from the steps of the cores before this one
                if self._steps_before:
                    record = dataclasses.replace(record, step=record.step + self._steps_before)
                self.engine.step_history.add(record)
            self.engine.failure = failure
            self._deliver(admissions, outputs, failures)

    def _deliver(self, admissions: list, outputs: list[CoreOutput], failures: list) -> None:
        """One step's news, handed to each caller's event loop in one call per loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for request_id, error in admissions:
                entry = self._admissions.get(request_id)
                if error is not None:
                    self._streams.pop(request_id, None)
                if entry is not None:
                    by_loop.setdefault(entry[1], []).append((_resolve, entry[0], error))
            entries = [(core, self._streams.get(core.request_id)) for core in outputs]
        done = []
        for core, entry in entries:  # the text is made outside the lock: add_request need not wait for it
            if entry is None:
                continue
            stream, loop, assembler = entry
            out, stopped = assembler.apply(core)
            for index, stop in stopped:  # stop strings matched here: the core frees those sequences
                self._send(("stop", core.request_id, index, stop))
            if out.finished:
                done.append(core.request_id)
            by_loop.setdefault(loop, []).append((self._dispatch, stream, out))
        with self._lock:
            for request_id in done:
                self._streams.pop(request_id, None)
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

    def _core_died(self) -> bool:
        """Fail what the dead core held; then start another where restarts are left (True), or give up."""
        if self._stopping:
            return False
        self._proc.join(2)
        reason = f"the engine core process died (exit code {self._proc.exitcode})"
        self.engine.failure = reason
        log.error("%s; failing the requests in flight", reason)
        self._fail_all(EngineDeadError(reason))
        if self.restarts_left > 0 and self._restart(reason):
            return True
        for callback in self.on_death:
            try:
                callback(reason)
            except Exception:
                log.exception("engine-death callback failed")
        return False

    def _restart(self, reason: str) -> bool:
        """Start a new core and wait for its model (meanwhile /health says why, and requests are refused)."""
        self.restarts_left -= 1
        self.engine.failure = f"{reason}; starting a new one"
        log.warning("starting a new engine core (%d restarts left after this one)", self.restarts_left)
        try:
            self._spawn()
            self._core_ready()
            if self._stopping:  # shut down meanwhile
                self.kill()
                return False
        except Exception as exc:  # noqa: BLE001 - reported, and the front end gives up on the core
            log.error("the new engine core failed to start: %s", exc)
            self.engine.failure = f"{reason}; a new one failed to start: {exc}"
            return False
        self.num_restarts += 1
        self._steps_before += self._stats.num_steps
        self._stats = EngineStats()
        self.engine.failure = None
        log.warning("the new engine core is serving")
        return True

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
            admissions = list(self._admissions.values())
        for future, loop in admissions:
            _call_soon(loop, _resolve, future, error)
        for stream, loop, _ in streams.values():
            _call_soon(loop, stream._put, error)


def _run_all(calls: list) -> None:
    for fn, *args in calls:
        fn(*args)
