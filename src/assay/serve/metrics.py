"""The server's Prometheus metrics, in a registry of its own (two servers in one process do not mix)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


@dataclass
class ServeMetrics:
    registry: CollectorRegistry
    requests: Counter  # by route and status: an HTTP code, or "disconnected" (the client left; aborted)
    prompt_tokens: Counter
    generated_tokens: Counter
    aborted: Counter  # requests whose client left, taken out of the engine (or the queue) unfinished
    latency: Histogram  # by route: request received to last byte
    first_token: Histogram  # streamed requests: request received to the first token sent
    queue_wait: Histogram  # queued to admitted into the engine's batch
    step_seconds: Histogram  # one engine step

    def render(self) -> bytes:
        return generate_latest(self.registry)


def make_metrics(queue_depth: Callable[[], float], running: Callable[[], float]) -> ServeMetrics:
    r = CollectorRegistry()
    Gauge("assay_serve_queue_depth", "Requests waiting in the bounded queue", registry=r).set_function(queue_depth)
    Gauge("assay_serve_running_requests", "Requests in the engine's batch", registry=r).set_function(running)
    return ServeMetrics(
        registry=r,
        requests=Counter("assay_serve_requests", "Requests answered, by route and status", ["route", "status"],
                         registry=r),
        prompt_tokens=Counter("assay_serve_prompt_tokens", "Prompt tokens of admitted requests", registry=r),
        generated_tokens=Counter("assay_serve_generated_tokens", "Tokens sampled and delivered (streamed, or in a "
                                 "finished response)", registry=r),
        aborted=Counter("assay_serve_aborted_requests", "Requests aborted unfinished because their client left",
                        registry=r),
        latency=Histogram("assay_serve_request_seconds", "Request latency, received to answered", ["route"],
                          buckets=LATENCY_BUCKETS, registry=r),
        first_token=Histogram("assay_serve_time_to_first_token_seconds", "Streamed requests: received to the first "
                              "token", buckets=LATENCY_BUCKETS, registry=r),
        queue_wait=Histogram("assay_serve_queue_wait_seconds", "Queued to admitted into the batch",
                             buckets=LATENCY_BUCKETS, registry=r),
        step_seconds=Histogram("assay_serve_engine_step_seconds", "One engine step",
                               buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
                               registry=r),
    )
