"""`ServerConfig`: the retrieval server's limits and settings (`search-r1 serve` fills it from its flags)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServerConfig:
    topk: int = 3                   # default when a request gives none
    max_topk: int = 100
    # The original Search-R1 sends every search of a turn in one request (train batch × rollouts:
    # thousands on an 8-GPU run); the cap is far above that and only stops abuse.
    max_queries_per_request: int = 65536
    # Only against abuse as well: a dense encoder cuts a query at its max length, as the original did.
    max_query_chars: int = 100_000
    max_body_bytes: int = 256 << 20
    # The most bytes one /access answer may hold. Pages run to megabytes: without a cap, a request
    # of a few kilobytes naming them thousands of times makes the server build gigabytes.
    max_access_response_bytes: int = 32 << 20
    max_batch: int = 512            # queries per encode+search call
    max_wait_ms: float = 2.0        # how long the worker waits to fill a batch
    max_pending: int = 16384        # queries queued before the server sheds load
    api_key: str | None = None
    switch_interval_s: float = 0.0005  # GIL hand-over; see launch.serve()
    # Two-stage retrievers: encode a batch while the last is searched. On by default: on a GPU it
    # serves more queries/s than one thread under many concurrent clients and as many under fewer,
    # and on CPU as many (benchmarks/RESULTS.md, "Whole server").
    pipeline: bool = True
    # A connection waiting longer than this for a request's headers (a new connection, or one kept
    # alive after a response) is closed, and a request body that takes longer to arrive is refused
    # (408): slow clients (slowloris) cannot hold connections or handlers forever.
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
