"""Prometheus metrics; one CollectorRegistry per app, so several apps can live in one process."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Metrics:
    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("bert_serve_requests", "HTTP requests", ["endpoint", "status"], registry=registry)
        self.request_seconds = Histogram("bert_serve_request_duration_seconds", "HTTP request latency",
                                         ["endpoint", "status"], buckets=LATENCY_BUCKETS, registry=registry)
        self.queue_depth = Gauge("bert_serve_queue_depth", "inputs waiting for a batch", ["model"], registry=registry)
        self.queue_seconds = Histogram("bert_serve_queue_duration_seconds", "time an input waits in the queue",
                                       ["model"], buckets=LATENCY_BUCKETS, registry=registry)
        self.batch_size = Histogram("bert_serve_batch_size", "inputs per batch", ["model"],
                                    buckets=SIZE_BUCKETS, registry=registry)
        self.batches = Counter("bert_serve_batches", "batches run, by compute path (bucket-BxS, generic, torch)",
                               ["model", "path"], registry=registry)
        self.fallbacks = Counter("bert_serve_fallback", "batches no bucket fitted, run on the generic library",
                                 ["model"], registry=registry)
        self.batch_failures = Counter("bert_serve_batch_failures", "batches that raised", ["model"], registry=registry)
        self.inference_seconds = Histogram("bert_serve_inference_duration_seconds", "time to run one batch",
                                           ["model", "path"], buckets=LATENCY_BUCKETS, registry=registry)
        self.tokens = Counter("bert_serve_tokens", "real input tokens run", ["model"], registry=registry)
        self.padding_tokens = Counter("bert_serve_padding_tokens", "padding tokens computed (waste)",
                                      ["model"], registry=registry)
        self.admitted = Gauge("bert_serve_admitted_inputs", "inputs admitted and not yet answered (queued or running)",
                              ["model"], registry=registry)
        self.timeouts = Counter("bert_serve_request_timeouts", "requests answered 504 past --request-timeout",
                                ["model"], registry=registry)
        self.loop_crashes = Counter("bert_serve_batcher_crashes", "times the batching loop failed and was restarted",
                                    ["model"], registry=registry)
        self.rejected = Counter("bert_serve_rejected_inputs", "inputs refused because the queue was full",
                                ["model"], registry=registry)
        self.dropped = Counter("bert_serve_dropped_inputs", "queued inputs dropped before they ran: their request "
                               "ended first (client gone, timed out or failed)", ["model"], registry=registry)

    def register_model(self, model: str) -> None:
        """Create a model's series at zero, so dashboards and tests see them before the first batch."""
        for family in (self.queue_depth, self.queue_seconds, self.batch_size, self.fallbacks, self.batch_failures,
                       self.tokens, self.padding_tokens, self.rejected, self.dropped,
                       self.admitted, self.timeouts, self.loop_crashes):
            family.labels(model)

    def render(self) -> bytes:
        return generate_latest(self.registry)
