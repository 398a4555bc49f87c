"""The engine core in a process of its own: the model, the scheduler and the step loop, away from HTTP.

The server's front end (engine/core_client.py) keeps the event loop, the routes, chat templates, tool-call
parsing, JSON and the streams; the core runs steps. Between them is one multiprocessing pipe of pickled
messages, so the Python work of serving never holds the GIL a step needs. The core is one thread: it takes
what the pipe holds (without waiting while requests run), steps, and sends one message per step with every
output the step made, as vLLM's engine core does.

    front end -> core   ("add", request_id, prompt token ids, params) | ("abort", request_id)
                        ("stop", request_id, sequence index, stop string) | ("shutdown",)
    core -> front end   ("ready", CoreInfo) | ("load_failed", exception)
                        ("step", admissions, outputs, failures, stats, step records, engine failure)
                          admissions: [(request_id, error or None)]; outputs: [CoreOutput];
                          failures: [(request_id, exception)]

The front end tokenizes prompts, and makes the text from the ids the core sends (engine/output_assembly.py):
it matches stop strings too, and sends "stop" for a sequence one ended.
"""

from __future__ import annotations

import logging
import os
import pickle
from dataclasses import dataclass

from kvflow.config import EngineConfig
from kvflow.engine.core_output import core_output
from kvflow.executors.model_setup import ModelSummary

log = logging.getLogger("kvflow")


@dataclass(frozen=True)
class CoreInfo:
    """What the front end knows of the engine once the core has loaded it."""

    model: ModelSummary
    max_model_len: int
    kv_capacity_tokens: int
    kv_element_bytes: float
    longest_request_tokens: int
    eos_token_ids: list[int]


def core_main(conn, config: EngineConfig, attention_backend: str, log_level: int,
              env: dict[str, str] | None = None) -> None:
    """The core process: load, say ready, then serve the pipe until shutdown or the front end goes away.
    env: variables set first, before CUDA starts (a data-parallel replica's CUDA_VISIBLE_DEVICES); the
    tensor-parallel ranks it starts inherit them."""
    os.environ.update(env or {})
    logging.basicConfig(format="%(asctime)s core %(levelname)s %(message)s")
    logging.getLogger("kvflow").setLevel(log_level)
    from kvflow.engine.async_engine import build_off_the_main_thread
    from kvflow.engine.engine import LLMEngine

    try:
        engine = build_off_the_main_thread(lambda: _warmed_up(LLMEngine(config, attention_backend)))
        engine.detokenize = False  # the front end makes the text
    except BaseException as exc:  # noqa: BLE001 - the front end re-raises it
        conn.send(("load_failed", _picklable(exc)))
        return
    conn.send(("ready", CoreInfo(engine.model_summary, engine.max_model_len, engine.kv_capacity_tokens,
                                 engine.runner.kv_element_bytes, engine.longest_request_tokens,
                                 list(engine.eos_token_ids))))
    try:
        CoreLoop(conn, engine).run()
    finally:
        engine.close()


def _warmed_up(engine):
    engine.warm_up()
    return engine


class CoreLoop:
    """Take commands, step, report: the only thread that touches the engine."""

    def __init__(self, conn, engine) -> None:
        self.conn, self.engine = conn, engine
        self.running: set[str] = set()  # requests admitted and not finished
        self.prompt_logprobs_sent: dict[str, int] = {}  # by request: entries earlier outputs carried
        self.last_step = 0

    def run(self) -> None:
        from kvflow.engine.async_engine import EngineDeadError, engine_stats

        self._report([], [], [], engine_stats(self.engine))  # the cache's size and state before any request
        while True:
            admissions, outputs, failures = [], [], []
            # Idle: sleep on the pipe for the next command. Then take whatever else has arrived, and step.
            waiting = not self.engine.has_unfinished_requests()
            while waiting or self.conn.poll():
                waiting = False
                try:
                    message = self.conn.recv()
                except (EOFError, OSError):  # the front end is gone
                    return
                if message[0] == "shutdown":
                    return
                self._apply(message, admissions, outputs)
            if self.engine.has_unfinished_requests():
                try:
                    outputs += self.engine.step()
                except Exception as exc:  # noqa: BLE001 - fail what is in flight, keep serving
                    log.exception("engine step failed; failing the requests in flight")
                    error = EngineDeadError(f"engine step failed: {exc}")
                    for request_id in list(self.running):
                        self.engine.abort_request(request_id)
                        failures.append((request_id, error))
                    self.running.clear()
                    self.prompt_logprobs_sent.clear()
            self._report(admissions, [self._lean(out) for out in outputs], failures, engine_stats(self.engine))

    def _apply(self, message: tuple, admissions: list, outputs: list) -> None:
        from kvflow.engine.async_engine import EngineDeadError

        if message[0] == "abort":
            out = self.engine.abort_request(message[1])
            if out is not None:
                outputs.append(out)
            return
        if message[0] == "stop":
            _, request_id, index, stop_string = message
            if self.engine.stop_sequence(request_id, index, stop_string):
                self._forget(request_id)
            return
        _, request_id, prompt, params = message
        try:
            self.engine.add_request(request_id, prompt, params)
            self.running.add(request_id)
            admissions.append((request_id, None))
        except ValueError as exc:  # bad input: this caller hears why
            admissions.append((request_id, _picklable(exc)))
        except Exception as exc:  # noqa: BLE001 - a bug, not bad input: report it, keep serving others
            log.exception("adding request %s failed", request_id)
            admissions.append((request_id, EngineDeadError(f"the engine could not add the request: {exc}")))

    def _lean(self, out):
        """A step's RequestOutput as the pipe carries it (engine/core_output.py)."""
        lean = core_output(out, self.prompt_logprobs_sent.get(out.request_id, 0))
        if out.finished:
            self._forget(out.request_id)
        elif out.prompt_logprobs is not None:
            self.prompt_logprobs_sent[out.request_id] = len(out.prompt_logprobs)
        return lean

    def _forget(self, request_id: str) -> None:
        self.running.discard(request_id)
        self.prompt_logprobs_sent.pop(request_id, None)

    def _report(self, admissions: list, outputs: list, failures: list, stats) -> None:
        steps = self.engine.step_history.since(self.last_step)
        if steps:
            self.last_step = steps[-1].step
        self.conn.send(("step", admissions, outputs, failures, stats, steps, self.engine.failure))


def _picklable(exc: BaseException) -> BaseException:
    """exc itself where it pickles (ValueError, EngineDeadError...), else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(exc).__name__}: {exc}")
