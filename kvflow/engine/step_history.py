"""The engine's last steps, summarised: how many prompt (prefill) and decode tokens each one ran, how long it
took and how full the KV cache was. The server's page draws them (a long prompt's chunks between other
users' decode steps); --trace writes the same records to a file.

The engine thread appends one record a step; any other thread reads the records after a step number. A
bounded deque under a lock: a step pays one append, a reader a copy of what it asks for.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class StepRecord:
    step: int  # the engine's step number, from 1
    t: float  # wall clock (time.time()) at the step's end
    seconds: float  # the step's duration
    prefill_tokens: int  # tokens of prompt chunks (and of outputs recomputed after a preemption)
    decode_tokens: int  # tokens of sequences decoding: one each, plus the drafts a speculative step verifies
    batch_size: int  # sequences in the step
    kv_usage: float  # fraction of KV blocks held by requests after the step
    # The time this step was planned to stay within, with sequences decoding beside prompt chunks
    # (engine/step_budget.py); 0 where no such bound applied.
    limit_seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


class StepHistory:
    def __init__(self, capacity: int = 1024) -> None:
        self._records: deque[StepRecord] = deque(maxlen=capacity)
        self._lock = threading.Lock()

    def add(self, record: StepRecord) -> None:
        with self._lock:
            self._records.append(record)

    def since(self, step: int, limit: int | None = None) -> list[StepRecord]:
        """The records after step number `step`, oldest first (at most the last `limit` of them)."""
        with self._lock:
            records = list(self._records)
        newer = [r for r in records if r.step > step]
        return newer[-limit:] if limit else newer
