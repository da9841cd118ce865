"""``GET /metrics``: the server's counters in Prometheus' text format (prometheus-client), on a registry of the app's
own (so that a process can hold several apps, as the tests do). docs/serving.md#metrics lists them."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter("xenc_requests", "HTTP requests answered, by route and status", ["route", "status"],
                                registry=r)
        self.latency = Histogram("xenc_request_duration_seconds", "time from a request's head to its answer, by route",
                                 ["route"], buckets=LATENCY, registry=r)
        self.pairs = Counter("xenc_pairs_scored", "pairs scored and answered", registry=r)
        self.tokens = Counter("xenc_prompt_tokens", "tokens of the pairs answered (usage.prompt_tokens)", registry=r)
        self.computed = Counter("xenc_tokens_computed", "tokens the model ran: fewer than xenc_prompt_tokens where a "
                                                        "decoder shares a query's prefix", registry=r)
        self.queue = Gauge("xenc_queue_depth", "requests waiting for the engine", registry=r)
        self.batch_pairs = Histogram("xenc_engine_batch_pairs", "pairs per engine (predict) call", buckets=SIZES,
                                     registry=r)
        self.batch_requests = Histogram("xenc_engine_batch_requests", "requests per engine (predict) call",
                                        buckets=SIZES, registry=r)
        self.timeouts = Counter("xenc_timeouts", "connections and requests ended by a timeout, by kind: body (408), "
                                                 "request (504), headers, keep_alive", ["kind"], registry=r)
        for kind in ("body", "request", "headers", "keep_alive"):
            self.timeouts.labels(kind)  # every kind shows, at 0

    def on_call(self, requests: int, pairs: int, computed: int | None) -> None:
        """The batcher's report of one predict call."""
        self.batch_requests.observe(requests)
        self.batch_pairs.observe(pairs)
        if computed is not None:
            self.computed.inc(computed)

    def text(self) -> bytes:
        return generate_latest(self.registry)
