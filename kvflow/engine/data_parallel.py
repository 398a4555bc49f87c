"""Data parallelism on one machine: N engine cores (each a process with its own model copy and KV cache)
behind one front end that sends each request to the replica holding the longest part of its prompt.

Routing: the front end tokenizes the prompt and hashes its full blocks the way the prefix cache does (the same
chained sha256, engine/block_pool.hash_block_tokens); each replica remembers the block hashes of the prompts
sent to it (a bounded LRU set). The replica whose set holds the longest run of leading blocks gets the request;
with no match worth a block, the least loaded one does (running + waiting). An agent's next turn extends its
last prompt, so it lands where that prompt's blocks are cached. This is SGLang's cache-aware idea made exact
for the in-process case, where the front end tokenizes as the engine does; across machines, replicas are plain
`kvflow serve` processes behind sglang-router (README). A request that names a prompt cache key (OpenAI's
prompt_cache_key) goes where that key went before, while that replica lives.

A replica that dies fails its own requests (core_client.py) and gets no new ones; the others keep serving.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from kvflow.config import EngineConfig
from kvflow.engine.async_engine import EngineDeadError, EngineFrontEnd, RequestStream
from kvflow.engine.block_pool import hash_block_tokens
from kvflow.engine.core_client import EngineCoreClient
from kvflow.engine.stats import EngineStats
from kvflow.outputs import RequestOutput
from kvflow.sampling_params import SamplingParams

log = logging.getLogger("kvflow")

MAX_REMEMBERED_BLOCKS = 200_000  # per replica: 16-byte hashes, a few MB; far more than a CPU cache holds
MAX_REMEMBERED_KEYS = 100_000  # prompt cache keys (sessions) the router sends back where they went


class PrefixRouter:
    def __init__(self, replicas: int, block_size: int) -> None:
        self.block_size = block_size
        self.blocks: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(replicas)]
        self.sent = [0] * replicas  # requests routed to each: ties go to the one sent fewest
        self.keys: OrderedDict[str, int] = OrderedDict()  # prompt cache key -> its replica (LRU-bounded)

    def block_hashes(self, token_ids: Sequence[int]) -> list[int]:
        hashes, parent = [], None
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            parent = hash_block_tokens(parent, token_ids[start: start + self.block_size])
            hashes.append(parent)
        return hashes

    def matched(self, replica: int, hashes: list[int]) -> int:
        """Leading blocks of the prompt this replica was sent before."""
        known = self.blocks[replica]
        n = 0
        while n < len(hashes) and hashes[n] in known:
            n += 1
        return n

    def pick(self, hashes: list[int], loads: dict[int, int], key: str | None = None) -> int:
        """Among the live replicas (loads' keys): the one a prompt cache key went to before, where it is
        alive; else the longest match, then the lightest load (and the key goes there from now on)."""
        if key and self.keys.get(key) in loads:
            self.keys.move_to_end(key)
            return self.keys[key]
        chosen = max(loads, key=lambda r: (self.matched(r, hashes), -loads[r], -self.sent[r]))
        if key:
            self.keys[key] = chosen
            while len(self.keys) > MAX_REMEMBERED_KEYS:
                self.keys.popitem(last=False)
        return chosen

    def remember(self, replica: int, hashes: list[int]) -> None:
        known = self.blocks[replica]
        for h in hashes:
            known[h] = None
            known.move_to_end(h)
        while len(known) > MAX_REMEMBERED_BLOCKS:
            known.popitem(last=False)


def replica_gpus(device: str, size: int, tp: int) -> list[str] | None:
    """On CUDA, each replica's own GPUs (tp of them, as CUDA_VISIBLE_DEVICES); None on CPU."""
    from kvflow.executors.plan import pick_device

    if pick_device(device).type != "cuda":
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    if size * tp > len(ids):
        raise ValueError(f"--data-parallel-size {size} x --tensor-parallel-size {tp} needs {size * tp} GPUs, one "
                         f"set per replica; this machine shows {len(ids)}")
    return [",".join(ids[i * tp:(i + 1) * tp]) for i in range(size)]


class DataParallelClient(EngineFrontEnd):
    """AsyncEngine's interface over several engine cores."""

    def __init__(self, config: EngineConfig, size: int, log_level: int = logging.WARNING, restarts: int = 0) -> None:
        from kvflow.executors.model_setup import physical_cores

        tp = config.model.tensor_parallel_size
        threads = config.model.threads or max(1, physical_cores() // (size * tp))  # per rank of each replica
        replica_config = dataclasses.replace(config, model=dataclasses.replace(config.model, threads=threads))
        gpus = replica_gpus(config.model.device, size, tp)
        # The replicas load side by side; the front end loads the tokenizer once.
        self.replicas = [EngineCoreClient(replica_config, log_level=log_level, wait=False, restarts=restarts,
                                          env=None if gpus is None else {"CUDA_VISIBLE_DEVICES": gpus[i]})
                         for i in range(size)]
        try:
            for replica in self.replicas:
                replica.wait_ready(self.replicas[0].engine.tokenizer if replica is not self.replicas[0] else None)
        except BaseException:
            for replica in self.replicas:
                replica.kill()
            raise
        self.engine = self.replicas[0].engine  # model, tokenizer, context: the same for every replica
        self.router = PrefixRouter(size, config.cache.block_size)
        self.finished_listeners: list[Callable[[RequestOutput], None]] = []
        for replica in self.replicas:
            replica.finished_listeners = self.finished_listeners  # one list: the server's metrics see all
        self.on_death: list[Callable[[str], None]] = []  # run when the last replica dies
        for i, replica in enumerate(self.replicas):
            replica.on_death.append(lambda reason, i=i: self._replica_died(i, reason))

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        for replica in self.replicas:
            replica.start()

    def shutdown(self, timeout: float | None = 10.0) -> None:
        for replica in self.replicas:
            replica.shutdown(timeout)

    @property
    def is_running(self) -> bool:
        return any(r.is_running for r in self.replicas)

    @property
    def status(self) -> str:
        dead = [f"replica {i}: {r.status}" for i, r in enumerate(self.replicas) if not r.is_running]
        if not dead:
            return "ok"
        return ("ok; " if self.is_running else "") + "; ".join(dead)

    @property
    def num_engine_errors(self) -> int:
        return sum(r.num_engine_errors for r in self.replicas)

    # ---- any thread --------------------------------------------------------------------------------
    @property
    def stats(self) -> EngineStats:
        """The replicas' figures summed (their usage as the share of all their blocks)."""
        parts = [r.stats for r in self.replicas if r.is_running] or [EngineStats()]
        total = {f.name: sum(getattr(p, f.name) for p in parts) for f in dataclasses.fields(EngineStats)
                 if f.name not in ("kv_cache_usage", "disk_store")}
        blocks = total["num_blocks"]
        usage = sum(p.kv_cache_usage * p.num_blocks for p in parts) / blocks if blocks else 0.0
        return EngineStats(**total, kv_cache_usage=usage)

    def replica_stats(self) -> list[tuple[int, bool, EngineStats]]:
        """(core process id, running, stats) per replica."""
        return [(r.pid, r.is_running, r.stats) for r in self.replicas]

    @property
    def num_waiting(self) -> int:
        return sum(r.num_waiting for r in self.replicas if r.is_running)

    def abort(self, request_id: str) -> None:
        for replica in self.replicas:
            if replica.has_request(request_id):
                replica.abort(request_id)

    def _replica_died(self, index: int, reason: str) -> None:
        log.error("replica %d is out of service (%s); %s", index, reason,
                  "the others keep serving" if self.is_running else "none is left")
        if not self.is_running:
            for callback in self.on_death:
                callback(reason)

    async def add_request(self, prompt: str | Sequence[int], params: SamplingParams,
                          request_id: str | None = None) -> RequestStream:
        loads = {i: r.stats.num_running + r.num_waiting for i, r in enumerate(self.replicas) if r.is_running}
        if not loads:
            raise EngineDeadError(f"no replica is running ({self.status})")
        text, ids = await self.prompt_ids(prompt)
        hashes = self.router.block_hashes(ids)
        chosen = self.router.pick(hashes, loads, params.cache_key)
        self.router.remember(chosen, hashes)
        self.router.sent[chosen] += 1
        return await self.replicas[chosen].submit(text, ids, params, request_id)
