"""HTTP retrieval server: the Search-R1 `/retrieve` API with cross-request batching.

One module per job, each read on its own:
- `config.py`: `ServerConfig`, every limit and setting of the server;
- `checks.py`: what a request must pass before it is queued (the API key, the body's content type,
  size and arrival time, its JSON shape, the limits on queries and `topk`, `X-Timeout-S`);
- `batcher.py`: the queue, admission by load, and the worker threads that own the retriever and
  answer queued requests in batches;
- `app.py`: `create_app`, the FastAPI routes (`/retrieve`, `/access`, `/health`, `/metrics`);
- `metrics.py`: the Prometheus series of `/metrics`;
- `launch.py`: `serve`, running the app on uvicorn (`search-r1 serve` calls it).

Differences from the original server:
- `return_scores: false` works (each entry is the document alone, the shape ASearcher's and RLinf's
  clients read); the original failed on it.
- Each document is the whole corpus row, as in the original: extra fields such as `url` and
  `title` come back beside `id` and `contents`.
- `/access` with `--pages_path` (ASearcher's and RLinf's servers): `{"urls": [...]}` answers
  `{"result": [page row or null, ...]}`, one entry per URL in order. Unlike theirs, a URL asked again
  in the same request is read and sent once: its later entries are `{"url", "contents": "",
  "duplicate_of": i}`, i the index of its first entry. An answer over `max_access_response_bytes`
  is refused (413): a short request naming large pages must not make the server build gigabytes.
- Accepted as the original accepted them: `{"queries": []}` (→ `{"result": []}`), blank queries
  (what `<search> </search>` sends; BM25 finds nothing for them), requests of thousands of queries
  (up to `max_queries_per_request`), over-long queries (the encoder cuts them at its max length), and
  unknown body fields (ignored, each field name logged once as a warning: `return_score` is one).
- Refused with an answer that says why, all as `{"error": "..."}`: a body that is not JSON or not the
  request's shape (422), a query that is not valid Unicode such as a lone surrogate (400, before it
  reaches a batch), a `topk` out of range (400), more than `max_queries_per_request` queries, a query
  over `max_query_chars` characters or a body over `max_body_bytes` (413: split the request, do not
  retry it), a wrong API key (401), a POST body not sent as `Content-Type: application/json` (415:
  a web page may send `text/plain` across origins without asking, JSON it may not). These limits
  are far above what clients send; they stop abuse.
  Stricter than the original: `topk` must be a JSON integer of at least 1 and `return_scores` a JSON
  boolean (its lax pydantic model read "3" as 3 and "yes" as true, and it took topk 0 for the default).
- `/health` and `/metrics` exist.
"""
from search_r1.retrieval.server.app import create_app
from search_r1.retrieval.server.batcher import Admission, Batcher, Expired, Job
from search_r1.retrieval.server.checks import (ACCESS_SHAPE, RETRIEVE_SHAPE, AccessRequest, BadRequest,
                                               RetrieveRequest, UnknownFields)
from search_r1.retrieval.server.config import ServerConfig
from search_r1.retrieval.server.launch import parallel_tokenizers, serve, uvicorn_config
from search_r1.retrieval.server.metrics import Metrics

__all__ = ["ACCESS_SHAPE", "RETRIEVE_SHAPE", "AccessRequest", "Admission", "BadRequest", "Batcher", "Expired",
           "Job", "Metrics", "RetrieveRequest", "ServerConfig", "UnknownFields", "create_app",
           "parallel_tokenizers", "serve", "uvicorn_config"]
