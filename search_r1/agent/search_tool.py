"""The search tool of the tool-calling protocol: `search(query_list)` → the retrieved passages.

Configured as verl's search tool is, so its YAML works unchanged (its class name
`verl.tools.search_tool.SearchTool` resolves to this class):

    tools:
      - class_name: search_r1.agent.search_tool.SearchTool
        config: {retrieval_service_url: http://127.0.0.1:8000/retrieve, num_workers: 120,
                 rate_limit: 120, timeout: 30, topk: 3}

Config keys: `retrieval_service_url` (required), `topk` (3), `timeout` (seconds per call), the
limits of `verl.tools.base` (`num_workers`, `rate_limit`, `enable_global_rate_limit`), and ours:
`api_key` (the server's key), `retries` (attempts after the first; the client backs off) and
`batch_window_ms` (2: calls of one worker that arrive within it share one request; 0: a request
per call; benchmarks/RESULTS.md, "Search tool calls").

Where we differ from verl's tool: the model reads the passages as the original Search-R1 formats
them (`Doc 1(Title: …) text`), not a JSON string with escaped newlines; with several queries each
block is headed by its query. A search that fails is an error message to the model and counts as a
failed tool call (`tool_failed`), which the trainer checks against `actor_rollout_ref.rollout.max_tool_failure_rate`.
"""
from __future__ import annotations

import asyncio
from typing import Any

from search_r1.agent.loop import check_retriever, format_passages
from verl.tools.base import Tool, ToolArgumentError

SCHEMA = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Look things up in the knowledge source: returns the most relevant passages for each query.",
        "parameters": {
            "type": "object",
            "properties": {
                "query_list": {"type": "array", "items": {"type": "string"},
                               "description": "One or more search queries, each a complete question or phrase."},
            },
            "required": ["query_list"],
        },
    },
}

KEYS = {"retrieval_service_url", "topk", "timeout", "num_workers", "rate_limit", "enable_global_rate_limit",
        "type", "api_key", "retries", "batch_window_ms"}


class _Batcher:
    """Joins the queries of calls that arrive together into one /retrieve request.

    Each tool call is one trajectory's search; sent one request each, the calls of a rollout step
    queue at the server one by one. Calls that arrive within `window_s` of the first waiting one go
    out together (the server answers a batch in about the time of one query), and each call gets
    its own queries' hits back; a failed request fails every call in it."""

    def __init__(self, client, topk: int, window_s: float):
        self.client, self.topk, self.window_s = client, topk, window_s
        self.waiting: list[tuple[list[str], asyncio.Future]] = []

    async def retrieve(self, queries: list[str]) -> list[list[dict]]:
        future = asyncio.get_running_loop().create_future()
        self.waiting.append((queries, future))
        if len(self.waiting) == 1:   # the first of a batch sends it
            asyncio.get_running_loop().call_later(self.window_s, lambda: asyncio.ensure_future(self._send()))
        return await future

    async def _send(self):
        batch, self.waiting = self.waiting, []
        try:
            hits = await self.client.retrieve([q for queries, _ in batch for q in queries], self.topk)
        except Exception as e:
            for _, future in batch:
                if not future.done():
                    future.set_exception(e)
            return
        start = 0
        for queries, future in batch:
            if not future.done():   # a call cut by its timeout is no longer waiting
                future.set_result(hits[start:start + len(queries)])
            start += len(queries)


class SearchTool(Tool):
    default_schema = SCHEMA

    def __init__(self, config: dict[str, Any], schema: dict[str, Any] | None = None):
        super().__init__(config, schema)
        from search_r1.retrieval.client import RetrieverConfig
        unknown = sorted(set(self.config) - KEYS)
        if unknown:
            raise ValueError(f"the search tool has no config key {unknown}; it takes {sorted(KEYS)}")
        if not self.config.get("retrieval_service_url"):
            raise ValueError("the search tool's config needs retrieval_service_url "
                             "(e.g. http://127.0.0.1:8000/retrieve)")
        self.retriever = RetrieverConfig(url=self.config["retrieval_service_url"],
                                         topk=int(self.config.get("topk", 3)), timeout_s=self.timeout_s,
                                         api_key=self.config.get("api_key"),
                                         retries=int(self.config.get("retries", 2)))
        # seconds a call waits for others to share its request; 0: one request per call
        self.batch_window_s = float(self.config.get("batch_window_ms", 2)) / 1000
        self._client = self._batcher = None   # made on the first call, in the event loop the calls run in

    async def call(self, arguments: dict[str, Any]) -> str:
        queries = arguments.get("query_list")
        if isinstance(queries, str):
            queries = [queries]
        if not isinstance(queries, list) or not queries or not all(isinstance(q, str) and q.strip() for q in queries):
            raise ToolArgumentError('search takes {"query_list": ["a query", …]}: a non-empty list of '
                                    f"non-empty strings (got {str(arguments)[:200]})")
        if self._client is None:
            from search_r1.retrieval.client import AsyncRetrievalClient
            self._client = AsyncRetrievalClient(self.retriever)
            self._batcher = _Batcher(self._client, self.retriever.topk, self.batch_window_s)
        queries = [q.strip() for q in queries]
        if self.batch_window_s > 0:
            hits = await self._batcher.retrieve(queries)
        else:
            hits = await self._client.retrieve(queries, self.retriever.topk)
        if len(queries) == 1:
            return format_passages(hits[0])
        return "\n\n".join(f"Results for {q.strip()!r}:\n{format_passages(h)}" for q, h in zip(queries, hits))

    def check(self) -> None:
        check_retriever(self.retriever)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()


def search_chat_format(tokenizer, template_kwargs: dict | None = None):
    """The chat format that lists the search tool (our schema) in prompts; `template_kwargs`: more
    keyword arguments of the chat template (e.g. {"enable_thinking": False})."""
    from verl.tools.chat import ChatFormat
    return ChatFormat(tokenizer, [SCHEMA], template_kwargs)


def search_tool_agent(engine, retriever, cfg, on_event=None, template_kwargs: dict | None = None):
    """The tool-calling loop with the search tool over `retriever` (a RetrieverConfig), for
    evaluation and infer.py; `cfg` is a ToolAgentConfig. Close it with `agent.runner.close()`."""
    from verl.tools.base import ToolRunner
    from verl.workers.rollout.tool_loop import ToolCallingAgent
    tool = SearchTool({"retrieval_service_url": retriever.url, "topk": retriever.topk, "api_key": retriever.api_key,
                       "timeout": retriever.timeout_s})
    return ToolCallingAgent(engine, search_chat_format(engine.tokenizer, template_kwargs), ToolRunner({tool.name: tool}),
                            cfg, on_event)
