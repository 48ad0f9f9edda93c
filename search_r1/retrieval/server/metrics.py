"""The retrieval server's Prometheus series, answered at `GET /metrics`."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

disable_created_metrics()  # keep /metrics to the series people graph


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("retrieval_requests", "HTTP requests by answer status", ["status"], registry=r)
        self.queries = Counter("retrieval_queries", "queries answered", registry=r)
        self.errors = Counter("retrieval_errors", "requests that failed inside the retriever", registry=r)
        self.rejected = Counter("retrieval_rejected", "requests shed because the queue was full", registry=r)
        self.expired = Counter("retrieval_expired", "queries dropped unsearched: their client's deadline "
                               "(X-Timeout-S) passed or it disconnected", registry=r)
        self.batch_size = Histogram("retrieval_batch_queries", "queries per search call", registry=r,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048))
        self.latency = Histogram("retrieval_request_seconds", "request latency", registry=r,
                                 buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10))
        self.search_time = Histogram("retrieval_search_seconds", "time of one search call", registry=r,
                                     buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5))
        self.pending = Gauge("retrieval_pending_queries", "queries waiting in the queue", registry=r)
        self.upstream_errors = Gauge("retrieval_upstream_errors",
                                     "queries a web search engine did not answer (since start)", registry=r)
