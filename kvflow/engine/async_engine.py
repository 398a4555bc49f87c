"""AsyncEngine: the LLMEngine step loop on its own thread, with one asyncio stream per request.

The engine is not thread-safe, so exactly one thread (started here) touches it. Other threads talk to it
through a command inbox guarded by a condition variable: adds and aborts are applied before the next step,
and the thread sleeps on the condition when it has nothing to do. Outputs go back to each caller's event
loop with one `call_soon_threadsafe` per step; a stream's queue is unbounded, so a slow client never
blocks a step, and a reader that falls behind gets its pending outputs merged into one.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from kvflow.engine.engine import LLMEngine
from kvflow.engine.stats import EngineStats
from kvflow.outputs import RequestOutput
from kvflow.sampling_params import SamplingParams

log = logging.getLogger("kvflow")
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine loop failed while running this request, or is shut down."""


class RequestFailedError(EngineDeadError):
    """The engine failed on this request alone (the others in its step went on)."""


class RequestStream:
    """Async iterator over one request's outputs; ends after the finished output or raises its error."""

    def __init__(self, request_id: str, engine: AsyncEngine) -> None:
        self.request_id = request_id
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        # A reader that fell behind gets everything pending at once, as one output.
        while isinstance(item, RequestOutput) and not item.finished and not self._queue.empty():
            nxt = self._queue.get_nowait()
            item = merge_outputs(item, nxt) if isinstance(nxt, RequestOutput) else nxt
        if isinstance(item, RequestOutput) and item.error is not None:
            item = RequestFailedError(f"the engine failed on this request: {item.error}")
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def abort(self) -> None:
        """Ask the engine to stop this request (idempotent; a no-op once finished)."""
        if not self.finished:
            self._engine.abort(self.request_id)


def merge_outputs(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """Fold an earlier output's deltas into a later one (cumulative fields are already in the later)."""
    previous = {c.index: c for c in older.outputs}
    for c in newer.outputs:
        p = previous.get(c.index)
        if p is not None:
            c.delta_text = p.delta_text + c.delta_text
            c.delta_token_ids = p.delta_token_ids + c.delta_token_ids
    return newer


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    stream: RequestStream
    loop: asyncio.AbstractEventLoop
    admitted: asyncio.Future


def build_off_the_main_thread(factory: Callable[[], T]) -> T:
    """factory() on a thread that then exits, for an engine whose steps will run on AsyncEngine's thread.

    Loading runs OpenMP regions (PyTorch's and the kernels'), and libgomp keeps a pool of workers for every
    thread that ever started one. With more pooled threads than CPUs it stops spinning between regions,
    so each of a decode step's ~150 regions waits for a futex wake: measured on 2 cores, a batch-1 decode
    step took 14 to 16 ms on the engine thread after a load on the main thread, 7 to 8 ms after this.
    A pool goes away with its thread, so the engine thread's pool is then the only one.
    """
    result: list[T] = []
    error: list[BaseException] = []

    def build() -> None:
        try:
            result.append(factory())
        except BaseException as exc:  # re-raised on the caller's thread
            error.append(exc)

    thread = threading.Thread(target=build, name="kvflow-load", daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


_REQUEST_NUMBERS = itertools.count(1)


def new_request_id() -> str:
    """An id for a request whose caller gave none: unique in this process, and across restarts."""
    return f"req-{next(_REQUEST_NUMBERS)}-{uuid.uuid4().hex[:8]}"


class EngineFrontEnd:
    """What the server's routes use of an engine, shared by the ways of running one: AsyncEngine (a thread of
    this process), EngineCoreClient (a process of its own) and DataParallelClient (several). A subclass keeps
    `engine` (with its `failure`), `_stats`, `is_running` and `add_request`."""

    engine: LLMEngine
    _stats: EngineStats

    @property
    def status(self) -> str:
        """What /health says: ok, or why the engine cannot serve."""
        if self.engine.failure is not None:
            return f"engine failed: {self.engine.failure}"
        return "ok" if self.is_running else "engine not running"

    @property
    def stats(self) -> EngineStats:
        return self._stats

    def check_running(self) -> None:
        """EngineDeadError, saying why, unless the engine takes requests."""
        if not self.is_running:
            failure = self.engine.failure
            raise EngineDeadError(f"the engine failed: {failure}" if failure else "the engine is not running")

    async def prompt_ids(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        """The prompt's text (None where it came as ids) and its ids, tokenized off the event loop."""
        if isinstance(prompt, str):
            return prompt, await asyncio.to_thread(self.engine.tokenize, prompt)
        return None, list(prompt)

    async def generate(
        self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """add_request + iterate, aborting the request if the consumer stops early."""
        stream = await self.add_request(prompt, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()


class AsyncEngine(EngineFrontEnd):
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._cond = threading.Condition()
        self._inbox: list[_Add | str] = []  # a str is an abort
        self._pending_adds = 0
        self._stopping = False
        self._streams: dict[str, tuple[RequestStream, asyncio.AbstractEventLoop]] = {}  # engine thread only
        self._stats = EngineStats()
        self._thread: threading.Thread | None = None
        # Called on the caller's event loop with each finished output (metrics).
        self.finished_listeners: list[Callable[[RequestOutput], None]] = []
        self.num_engine_errors = 0

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._update_stats()
            self._thread = threading.Thread(target=self._run, name="kvflow-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the loop; requests still running are aborted and their streams get EngineDeadError."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        self.engine.close()

    @property
    def is_running(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and not self._stopping
                and self.engine.failure is None)

    # ---- any thread --------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Requests waiting to be scheduled, counting those submitted but not yet seen by the engine."""
        with self._cond:
            return self._stats.num_waiting

    def abort(self, request_id: str) -> None:
        with self._cond:
            self._inbox.append(request_id)
            self._cond.notify()

    async def add_request(
        self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> RequestStream:
        """Queue a request and wait until the engine accepts it. Raises ValueError when it cannot run
        (prompt too long, max_tokens too large...), EngineDeadError once the engine is shut down."""
        self.check_running()
        loop = asyncio.get_running_loop()
        request_id = request_id or new_request_id()
        stream = RequestStream(request_id, self)
        add = _Add(request_id, prompt if isinstance(prompt, str) else list(prompt), params, stream, loop,
                   loop.create_future())
        with self._cond:
            self._inbox.append(add)
            self._pending_adds += 1
            self._stats = _with_waiting(self._stats, self._stats.num_waiting + 1)
            self._cond.notify()
        try:
            await add.admitted
        except asyncio.CancelledError:
            self.abort(request_id)  # the caller went away before admission: don't leave it running
            raise
        return stream

    # ---- engine thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._inbox and not self._stopping and not self.engine.has_unfinished_requests():
                    self._cond.wait()
                inbox, self._inbox = self._inbox, []
                stopping = self._stopping
            try:
                self._apply(inbox)
                if stopping:
                    self._fail_all(EngineDeadError("the engine was shut down"))
                    return
                if self.engine.has_unfinished_requests():
                    self._step()
            except Exception as exc:  # never let the loop die: fail what is in flight and carry on
                log.exception("engine loop error; failing the requests in flight")
                self.num_engine_errors += 1
                self._fail_all(EngineDeadError(f"engine loop failed: {exc}"))

    def _apply(self, inbox: list[_Add | str]) -> None:
        deliveries: list[tuple[RequestStream, asyncio.AbstractEventLoop, RequestOutput]] = []
        admissions: list[tuple[_Add, BaseException | None]] = []
        for item in inbox:
            if isinstance(item, str):
                out = self.engine.abort_request(item)
                entry = self._streams.pop(item, None)
                if entry is not None and out is not None:
                    deliveries.append((entry[0], entry[1], out))
                continue
            error: BaseException | None = None
            try:
                self.engine.add_request(item.request_id, item.prompt, item.params)
                self._streams[item.request_id] = (item.stream, item.loop)
            except ValueError as exc:
                error = exc
            except Exception as exc:  # a bug, not bad input: report it to this caller, keep serving others
                log.exception("adding request %s failed", item.request_id)
                error = EngineDeadError(f"the engine could not add the request: {exc}")
            admissions.append((item, error))
        with self._cond:
            self._pending_adds -= len(admissions)
        self._update_stats()  # before anyone hears back, so what they see next is current
        for item, error in admissions:
            _call_soon(item.loop, _resolve, item.admitted, error)
        self._deliver(deliveries)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            log.exception("engine step failed; failing the requests in flight")
            self.num_engine_errors += 1
            self._fail_all(EngineDeadError(f"engine step failed: {exc}"))
            return
        deliveries = []
        for out in outputs:
            entry = self._streams.get(out.request_id)
            if entry is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            deliveries.append((entry[0], entry[1], out))
        # Stats first: a client reacting to its output (e.g. reading /metrics) must see this step's state.
        self._update_stats()
        self._deliver(deliveries)

    def _fail_all(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for request_id in streams:
            try:
                self.engine.abort_request(request_id)
            except Exception:
                log.exception("abort of %s failed", request_id)
        self._update_stats()
        for stream, loop in streams.values():
            _call_soon(loop, stream._put, error)

    def _deliver(self, deliveries: list[tuple[RequestStream, asyncio.AbstractEventLoop, RequestOutput]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        for stream, loop, out in deliveries:
            by_loop.setdefault(loop, []).append((stream, out))
        for loop, batch in by_loop.items():
            _call_soon(loop, self._dispatch, batch)

    def _dispatch(self, batch: list[tuple[RequestStream, RequestOutput]]) -> None:
        """Runs on the caller's event loop."""
        for stream, out in batch:
            stream._put(out)
            if out.finished:
                for listener in self.finished_listeners:
                    try:
                        listener(out)
                    except Exception:
                        log.exception("finished-request listener failed")

    def _update_stats(self) -> None:
        stats = engine_stats(self.engine, self._pending_adds)
        with self._cond:
            self._stats = stats


def engine_stats(engine: LLMEngine, pending_adds: int = 0) -> EngineStats:
    """A snapshot of the engine's state (on the thread that steps it)."""
    scheduler = engine.scheduler
    kv = scheduler.kv_cache_manager
    store = engine.prefix_store
    return EngineStats(
        num_running=scheduler.num_running,
        num_waiting=scheduler.num_waiting + pending_adds,
        num_blocks=kv.num_blocks,
        num_free_blocks=kv.num_free_blocks,
        kv_cache_usage=kv.usage,
        prefix_queried_tokens=kv.queried_tokens,
        prefix_hit_tokens=kv.hit_tokens,
        prefix_disk_hit_tokens=kv.stats.disk_hit_tokens,
        disk_store=None if store is None else replace(store.stats),
        disk_store_blocks=0 if store is None else len(store),
        disk_store_bytes=0 if store is None else store.size_bytes,
        num_preemptions=scheduler.num_preemptions,
        num_steps=engine.num_steps,
    )


def _with_waiting(stats: EngineStats, num_waiting: int) -> EngineStats:
    return replace(stats, num_waiting=num_waiting)


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():  # the caller was cancelled meanwhile
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that loop is closed: its caller is gone
        pass
