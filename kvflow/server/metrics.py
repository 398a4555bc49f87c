"""What the server records of the requests it serves: Prometheus metrics, named like vLLM's with the
prefix `kvflow:`, in a registry per app; the log line of each finished request; and where each response's
time went (request_timings), as the APIs report it in their usage blocks and x-kvflow-* headers.

Per-request histograms and counters are recorded when a request finishes (from its RequestMetrics);
engine gauges and the preemption counter are read from the engine thread's latest snapshot at scrape
time, so they are current whenever /metrics is read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvflow.engine.stats import EngineStats
from kvflow.outputs import RequestOutput

log = logging.getLogger("kvflow")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MAX_IGNORED_LABELS = 200

_FAST = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
         20.0, 40.0, 80.0, 160.0, 640.0]
_PER_TOKEN = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
              5.0, 10.0, 20.0, 80.0]
_LONG = [0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
         60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        gauges = [
            ("kvflow:num_requests_running", "Requests in the running batch.", s.num_running),
            ("kvflow:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            ("kvflow:kv_cache_usage_perc", "Fraction of KV cache blocks held by requests (0 to 1).",
             s.kv_cache_usage),
            ("kvflow:kv_cache_blocks_used", "KV cache blocks held by requests (cached free blocks excluded).",
             s.num_blocks_used),
            ("kvflow:kv_cache_blocks_total", "KV cache blocks in the pool.", s.num_blocks),
            ("kvflow:prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / tokens looked up.",
             s.prefix_cache_hit_rate),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        counters = [
            ("kvflow:num_preemptions", "Preemptions (recompute) since start.", s.num_preemptions),
            ("kvflow:prefix_cache_queries", "Tokens looked up in the prefix cache.", s.prefix_queried_tokens),
            ("kvflow:prefix_cache_hits", "Tokens found in the prefix cache.", s.prefix_hit_tokens),
            ("kvflow:engine_steps", "Engine steps since start.", s.num_steps),
        ]
        if s.disk_store is not None:  # the prefix cache's disk tier (--prefix-cache-dir)
            d = s.disk_store
            counters += [
                ("kvflow:prefix_cache_disk_hits", "Tokens read back from the prefix cache's disk tier.",
                 s.prefix_disk_hit_tokens),
                ("kvflow:prefix_cache_disk_writes", "Blocks written to the disk tier.", d.writes),
                ("kvflow:prefix_cache_disk_refused", "Disk-tier blocks that failed a check and were deleted.",
                 d.refused),
                ("kvflow:prefix_cache_disk_evicted", "Disk-tier blocks removed to stay under its bound.", d.evicted),
                ("kvflow:prefix_cache_disk_dropped", "Blocks not written because the write queue was full.",
                 d.dropped),
            ]
            yield GaugeMetricFamily("kvflow:prefix_cache_disk_blocks", "Blocks in the disk tier.",
                                    value=s.disk_store_blocks)
            yield GaugeMetricFamily("kvflow:prefix_cache_disk_bytes", "Bytes in the disk tier.",
                                    value=s.disk_store_bytes)
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)


class _ReplicaCollector(Collector):
    """Per replica of a data-parallel server (--data-parallel-size): the figures that say where work went."""

    def __init__(self, replica_stats: Callable[[], list[tuple[int, bool, EngineStats]]]) -> None:
        self._replica_stats = replica_stats

    def collect(self) -> Iterator[Metric]:
        replicas = self._replica_stats()
        up = GaugeMetricFamily("kvflow:replica_up", "1 while a replica's engine core runs; its process id.",
                               labels=["replica", "pid"])
        for i, (pid, running, _) in enumerate(replicas):
            up.add_metric([str(i), str(pid)], 1.0 if running else 0.0)
        yield up
        stats = [s for _, _, s in replicas]
        families = [
            (GaugeMetricFamily, "kvflow:replica_num_requests_running", "Requests running, per replica.",
             lambda s: s.num_running),
            (GaugeMetricFamily, "kvflow:replica_num_requests_waiting", "Requests waiting, per replica.",
             lambda s: s.num_waiting),
            (GaugeMetricFamily, "kvflow:replica_kv_cache_usage_perc", "KV cache usage, per replica.",
             lambda s: s.kv_cache_usage),
            (CounterMetricFamily, "kvflow:replica_prefix_cache_hits", "Prefix-cache hit tokens, per replica.",
             lambda s: s.prefix_hit_tokens),
            (CounterMetricFamily, "kvflow:replica_engine_steps", "Engine steps, per replica.", lambda s: s.num_steps),
        ]
        for kind, name, doc, value in families:
            family = kind(name, doc, labels=["replica"])
            for i, s in enumerate(stats):
                family.add_metric([str(i)], value(s))
            yield family


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats],
                 replica_stats: Callable[[], list[tuple[int, bool, EngineStats]]] | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("kvflow:time_to_first_token_seconds", "Time to first token.", buckets=_FAST,
                              registry=r)
        self.tpot = Histogram("kvflow:time_per_output_token_seconds", "Mean time per output token after "
                              "the first, per request.", buckets=_PER_TOKEN, registry=r)
        self.itl = Histogram("kvflow:inter_token_latency_seconds", "Time between consecutive output tokens.",
                             buckets=_PER_TOKEN, registry=r)
        self.e2e = Histogram("kvflow:e2e_request_latency_seconds", "Arrival to finish.", buckets=_LONG,
                             registry=r)
        self.queue = Histogram("kvflow:request_queue_time_seconds", "Arrival to first scheduled.",
                               buckets=_LONG, registry=r)
        self.prefill = Histogram("kvflow:request_prefill_time_seconds", "First scheduled to first token.",
                                 buckets=_LONG, registry=r)
        self.prompt_tokens = Counter("kvflow:prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=r)
        self.cached_tokens = Counter("kvflow:prompt_tokens_cached", "Prompt tokens served from the prefix "
                                     "cache.", registry=r)
        self.generation_tokens = Counter("kvflow:generation_tokens", "Generated tokens.", registry=r)
        self.draft_tokens = Counter("kvflow:spec_decode_num_draft_tokens", "Speculative decoding: draft tokens "
                                    "verified.", registry=r)
        self.accepted_tokens = Counter("kvflow:spec_decode_num_accepted_tokens", "Speculative decoding: draft "
                                       "tokens kept.", registry=r)
        self.success = Counter("kvflow:request_success", "Finished requests by finish reason.",
                               ["finished_reason"], registry=r)
        self.errors = Counter("kvflow:request_errors", "Requests refused or failed, by kind.", ["kind"],
                              registry=r)
        self.ignored_fields = Counter("kvflow:request_ignored_fields", "Fields of request bodies that kvflow "
                                      "does not know and ignored, by route and field path (server/serving.py).",
                                      ["route", "field"], registry=r)
        self._ignored_seen: set[tuple[str, str]] = set()
        r.register(_EngineCollector(stats))
        if replica_stats is not None:
            r.register(_ReplicaCollector(replica_stats))

    def observe_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        for histogram, value in ((self.ttft, m.ttft), (self.tpot, m.tpot), (self.queue, m.queue_time),
                                 (self.prefill, m.prefill_time)):
            if value is not None:
                histogram.observe(value)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
        times = m.token_times
        for earlier, later in zip(times, times[1:]):
            self.itl.observe(later - earlier)
        self.prompt_tokens.inc(m.num_prompt_tokens)
        self.cached_tokens.inc(m.num_cached_tokens)
        self.generation_tokens.inc(m.num_generated_tokens)
        self.draft_tokens.inc(m.num_draft_tokens)
        self.accepted_tokens.inc(m.num_accepted_tokens)
        for completion in out.outputs:
            self.success.labels(finished_reason=completion.finish_reason or "abort").inc()

    def count_error(self, kind: str) -> None:
        self.errors.labels(kind=kind).inc()

    def count_ignored_field(self, route: str, field: str) -> bool:
        """Count one ignored field; True the first time this route saw it. Past MAX_IGNORED_LABELS kinds of
        field (a client that makes names up), the others are counted together as "other", and not logged."""
        key = (route, field)
        first = key not in self._ignored_seen
        if first and len(self._ignored_seen) >= MAX_IGNORED_LABELS:
            key, first = (route, "other"), False
        self._ignored_seen.add(key)
        self.ignored_fields.labels(route=key[0], field=key[1]).inc()
        return first

    def render(self) -> bytes:
        return generate_latest(self.registry)


def log_finished(out: RequestOutput) -> None:
    """One INFO line per finished request, under its id (the client's X-Request-Id when it sent one)."""
    if not log.isEnabledFor(logging.INFO):
        return
    m = out.metrics
    how = out.error or ",".join(sorted({c.finish_reason or "unfinished" for c in out.outputs}))
    log.info("request %s finished (%s): %d prompt tokens (%d cached), %d generated, queue %s, TTFT %s, TPOT %s",
             out.request_id, how, m.num_prompt_tokens, m.num_cached_tokens, m.num_generated_tokens,
             _ms(m.queue_time), _ms(m.ttft), _ms(m.tpot))


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"


_PHASES = (("queue_ms", "queue_time"), ("ttft_ms", "ttft"), ("prefill_ms", "prefill_time"),
           ("decode_ms", "decode_time"))


def request_timings(outputs: Sequence[RequestOutput]) -> dict:
    """Where a response's time went: queue, TTFT, prefill, decode (ms), cached prompt tokens and speculated
    tokens. Reported as usage.kvflow_timings (OpenAI), kvflow_timings (Ollama) and x-kvflow-* headers; a
    request with several prompts reports the slowest prompt's times and the sum of their cached tokens."""
    timings: dict = {}
    for key, attr in _PHASES:
        values = [getattr(o.metrics, attr) for o in outputs]
        known = [v for v in values if v is not None]
        timings[key] = round(max(known) * 1000, 3) if known else None
    timings["cached_tokens"] = sum(o.metrics.num_cached_tokens for o in outputs)
    timings["disk_cached_tokens"] = sum(o.metrics.num_disk_cached_tokens for o in outputs)  # of those, from disk
    # Speculative decoding: guessed tokens verified, and those kept (their ratio is the acceptance rate).
    timings["spec_draft_tokens"] = sum(o.metrics.num_draft_tokens for o in outputs)
    timings["spec_accepted_tokens"] = sum(o.metrics.num_accepted_tokens for o in outputs)
    return timings


def timing_headers(timings: dict) -> dict[str, str]:
    """request_timings as x-kvflow-* response headers (x-kvflow-ttft-ms, x-kvflow-cached-tokens...)."""
    headers = {}
    for key, value in timings.items():
        if value is None:
            continue
        name = "x-kvflow-" + key.replace("_ms", "-ms").replace("_", "-")
        headers[name] = str(value)
    return headers
