"""What a request must pass before it is queued: the API key (checked before the body is read), the
body's content type, size and arrival time, its JSON shape, the limits on queries, URLs and `topk`,
and the client's `X-Timeout-S`. Each refusal is a `BadRequest` carrying the HTTP status to answer."""
from __future__ import annotations

import asyncio
import difflib
import hmac
import json
import logging

from fastapi import Request
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr, ValidationError

from search_r1.retrieval.server.config import ServerConfig

log = logging.getLogger(__name__)

RETRIEVE_SHAPE = '{"queries": [str, ...], "topk": int, "return_scores": bool}'
ACCESS_SHAPE = '{"urls": [str, ...]}'


class RetrieveRequest(BaseModel):
    # Unknown fields are kept aside (and logged), not refused: the original accepted them.
    model_config = ConfigDict(extra="allow")
    queries: list[StrictStr]
    topk: StrictInt | None = None
    return_scores: StrictBool = False


class AccessRequest(BaseModel):
    """ASearcher's `/access`: pages by URL."""
    model_config = ConfigDict(extra="allow")
    urls: list[StrictStr]


class BadRequest(Exception):
    """A request the server refuses, with the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def authorized(request: Request, api_key: str | None) -> bool:
    """Whether the request carries the server's API key (any request does, on a server without one)."""
    if not api_key:
        return True
    # The scheme is case-insensitive (RFC 7235): `bearer KEY` is as good as `Bearer KEY`.
    scheme, _, token = request.headers.get("authorization", "").strip().partition(" ")
    # compare_digest: the time taken does not tell how much of a guessed token was right
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


def validate_retrieve(req: RetrieveRequest, cfg: ServerConfig) -> int:
    """The request's topk; raises BadRequest for what the server refuses."""
    topk = cfg.topk if req.topk is None else req.topk
    if not 1 <= topk <= cfg.max_topk:
        raise BadRequest(f"topk must be between 1 and {cfg.max_topk}, got {topk}")
    check_texts(req.queries, "queries", cfg)
    return topk


def client_wait_s(request: Request) -> float | None:
    """A client may say how long it waits (`X-Timeout-S: seconds`, as our client does): queued work
    past that is dropped instead of searched."""
    value = request.headers.get("x-timeout-s")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise BadRequest(f"X-Timeout-S: {value!r}: give the seconds the client waits, a positive number")
    return seconds


def check_texts(texts: list[str], field: str, cfg: ServerConfig) -> None:
    if len(texts) > cfg.max_queries_per_request:
        raise BadRequest(f"{len(texts):,} {field} in one request; this server takes at most "
                         f"{cfg.max_queries_per_request:,} (--max_queries_per_request): split the request",
                         413)
    for i, text in enumerate(texts):
        if len(text) > cfg.max_query_chars:
            raise BadRequest(f"{field}[{i}] has {len(text):,} characters; this server takes at most "
                             f"{cfg.max_query_chars:,} (--max_query_chars)", 413)
    # JSON may carry a lone surrogate ("\ud800"), which no tokenizer can take: refused here, or it
    # would fail the whole batch it lands in.
    try:
        "".join(texts).encode("utf-8")
    except UnicodeEncodeError:
        i = next(i for i, text in enumerate(texts) if not _encodable(text))
        raise BadRequest(f"{field}[{i}] is not valid Unicode (it holds a lone surrogate such as "
                         "\\ud800)") from None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


async def read_json(request: Request, max_bytes: int, timeout_s: float = 60.0):
    """The request body parsed as JSON, read no further than `max_bytes` and for no longer than
    `timeout_s` (408 after it). Only a body sent as JSON is read (415 otherwise): a web page can make
    a browser POST `text/plain` (or untyped) bodies to any address without asking, so a server on
    127.0.0.1 without a key would answer any site its user visits; `application/json` needs the
    server's consent first (a CORS preflight, which this server never grants)."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise BadRequest(f"the body is sent as {media_type or 'no content type'!r}; send it as JSON with "
                         "`Content-Type: application/json` (requests.post(url, json=...), "
                         "curl -H 'Content-Type: application/json')", 415)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise BadRequest(f"the body has {int(declared):,} bytes; this server takes at most {max_bytes:,} "
                         "(--max_body_bytes): split the request", 413)
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                body += chunk
                if len(body) > max_bytes:
                    raise BadRequest(f"the body is over {max_bytes:,} bytes (--max_body_bytes): split the "
                                     "request", 413)
    except TimeoutError:
        raise BadRequest(f"the body did not arrive within {timeout_s:g} s", 408) from None
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:  # ValueError: bad JSON or bad UTF-8
        raise BadRequest(f"the body is not JSON ({e.__class__.__name__}: {e})", 422) from None


def parse_request(model: type[BaseModel], data, expected: str) -> BaseModel:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}"
                             for err in e.errors()[:5])
        more = f" (and {e.error_count() - 5} more)" if e.error_count() > 5 else ""
        raise BadRequest(f"invalid request: {problems}{more}. Expected {expected}", 422) from None


class UnknownFields:
    """Logs each unknown request field once per endpoint (at most `limit` names, so a client that
    invents names fills neither the log nor memory)."""

    def __init__(self, limit: int = 100):
        self.seen: set[tuple[str, str]] = set()
        self.limit = limit

    def check(self, endpoint: str, req: BaseModel) -> None:
        for name in req.model_extra or ():
            if (endpoint, name) in self.seen or len(self.seen) >= self.limit:
                continue
            self.seen.add((endpoint, name))
            close = difflib.get_close_matches(name, type(req).model_fields, n=1)
            log.warning("%s: ignoring the unknown request field %r%s; logged once per field name",
                        endpoint, name, f" (did you mean {close[0]!r}?)" if close else "")


