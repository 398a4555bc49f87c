"""What every route needs: the engine, the served model's names, limits and metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fastapi import Request

from kvflow.engine.async_engine import AsyncEngine
from kvflow.server.errors import APIError
from kvflow.server.metrics import ServerMetrics

DEFAULT_MAX_BODY_BYTES = 4 * 2**20


@dataclass
class ServerSettings:
    served_model_name: str
    model_aliases: set[str] = field(default_factory=set)  # other names the model answers to
    api_key: str | None = None
    max_waiting: int | None = None  # refuse new requests (503) while this many wait; None: no limit
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    retry_after_s: int = 1


class ServerState:
    def __init__(self, engine: AsyncEngine, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = ServerMetrics(lambda: engine.stats)
        engine.finished_listeners.append(self.metrics.observe_finished)
        self.started = time.time()

    @property
    def model_name(self) -> str:
        return self.settings.served_model_name

    @property
    def tokenizer(self):
        return self.engine.engine.tokenizer

    def check_model(self, name: str | None) -> None:
        """404 unless name is empty, the served name or one of its aliases (Ollama's ':latest' tag allowed)."""
        if not name:
            return
        names = {self.model_name, *self.settings.model_aliases}
        if name in names or name.removesuffix(":latest") in names:
            return
        raise APIError(404, f"The model `{name}` does not exist. This server serves `{self.model_name}`.",
                       "model", "model_not_found")

    def check_capacity(self, num_new: int = 1) -> None:
        """503 with Retry-After while the waiting queue is full."""
        limit = self.settings.max_waiting
        waiting = self.engine.num_waiting
        if limit is not None and waiting + num_new > limit:
            raise APIError(503, f"the server is busy: {waiting} requests are waiting (limit {limit}); "
                           "retry later", None, "server_overloaded",
                           headers={"Retry-After": str(self.settings.retry_after_s)})


def get_state(request: Request) -> ServerState:
    return request.app.state.kvflow
