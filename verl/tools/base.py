"""Tools a model calls during rollout, and the YAML file that lists them.

A tool has a name, a JSON schema (the OpenAI function layout the chat templates render) and an
async `call(arguments) -> text`. The tool config is verl's layout, so its files load unchanged:

    tools:
      - class_name: search_r1.agent.search_tool.SearchTool   # import path, module.Class
        config: {retrieval_service_url: http://127.0.0.1:8000/retrieve, num_workers: 120,
                 rate_limit: 120, timeout: 30}
        tool_schema: {type: function, function: {name: search, ...}}   # optional: the class's own

Limits every tool takes in `config`, read by `ToolRunner`:
- `num_workers`: calls of this tool in flight at once in one rollout worker;
- `rate_limit`: calls of this tool in flight at once across all rollout workers of a node. verl's
  search tool gives out that many tokens from one shared bucket and takes each back when its call
  ends, so the key bounds concurrency, not calls per second; it means the same here. Under Ray the
  bucket is an actor on the node; without Ray (one process) it is local;
- `timeout`: seconds one call may take before the model is told it timed out.
A call that fails (an exception, a timeout) never stops the rollout: the model reads an error
message as the tool's answer and the trajectory counts it.
"""
from __future__ import annotations

import asyncio
import importlib
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Tool classes of other projects whose job one of ours does with the same config keys.
SAME_JOB_AS = {"verl.tools.search_tool.SearchTool": "search_r1.agent.search_tool.SearchTool"}


class ToolArgumentError(ValueError):
    """The model called a tool with arguments it does not take; the message is shown to the model."""


class Tool:
    """Subclasses set `default_schema` and implement `call`; `check` runs once before training."""

    default_schema: dict[str, Any] = {}

    def __init__(self, config: dict[str, Any], schema: dict[str, Any] | None = None):
        self.config = dict(config or {})
        self.schema = schema or self.default_schema
        function = self.schema.get("function") or {}
        if not function.get("name"):
            raise ValueError(f"{type(self).__name__}: its tool_schema has no function.name: {self.schema}")
        self.name: str = function["name"]
        self.num_workers = int(self.config.get("num_workers", 16))
        # verl's enable_global_rate_limit=false: no node-wide bound, num_workers only
        shared = self.config.get("enable_global_rate_limit", True)
        self.rate_limit = int(self.config.get("rate_limit", self.num_workers)) if shared else None
        self.timeout_s = float(self.config.get("timeout", 30))
        if min(self.num_workers, self.rate_limit or 1) < 1 or self.timeout_s <= 0:
            raise ValueError(f"tool {self.name}: num_workers, rate_limit and timeout must be positive "
                             f"(got {self.num_workers}, {self.rate_limit}, {self.timeout_s})")

    async def call(self, arguments: dict[str, Any]) -> str:
        raise NotImplementedError

    def check(self) -> None:
        """Raise verl.workers.rollout.agent_loop.PreflightError if the tool cannot work (a service down)."""

    async def aclose(self) -> None:
        """Free what the tool holds (connections) in the loop its calls ran in."""


@dataclass
class ToolSpec:
    class_name: str
    config: dict[str, Any]
    schema: dict[str, Any] | None


def read_tool_config(path: str | Path) -> list[ToolSpec]:
    """The tool entries of a verl-style tool YAML, checked for shape."""
    from omegaconf import OmegaConf
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no tool config {path} (actor_rollout_ref.rollout.multi_turn.tool_config_path)")
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    entries = (raw or {}).get("tools") if isinstance(raw, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: expected a `tools:` list of {{class_name, config, tool_schema}} entries")
    specs = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not entry.get("class_name"):
            raise ValueError(f"{path}: tools[{i}] has no class_name")
        config = dict(entry.get("config") or {})
        if config.get("type", "native") != "native":
            raise ValueError(f"{path}: tools[{i}] has config.type={config['type']!r}; only native tools (Python "
                             "classes) are supported, not MCP servers")
        specs.append(ToolSpec(entry["class_name"], config, entry.get("tool_schema")))
    return specs


def tool_class(class_name: str) -> type[Tool]:
    """`package.module.Class` (or `package.module:Class`) → the class."""
    if class_name in SAME_JOB_AS:
        log.info("tool %s: using %s, which takes the same config keys", class_name, SAME_JOB_AS[class_name])
        class_name = SAME_JOB_AS[class_name]
    module, sep, name = class_name.partition(":") if ":" in class_name else class_name.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"tool class_name {class_name!r} cannot be loaded ({e}); give it as package.module.Class") \
            from None
    if not (isinstance(cls, type) and issubclass(cls, Tool)):
        raise ValueError(f"tool class_name {class_name!r} is not a verl.tools.base.Tool subclass")
    return cls


def build_tools(specs: list[ToolSpec]) -> dict[str, Tool]:
    tools: dict[str, Tool] = {}
    for spec in specs:
        tool = tool_class(spec.class_name)(spec.config, spec.schema)
        if tool.name in tools:
            raise ValueError(f"two tools are named {tool.name!r}: tool names must be unique")
        tools[tool.name] = tool
    return tools


def tool_schemas(specs: list[ToolSpec]) -> list[dict[str, Any]]:
    """The schemas the chat template renders, without building the tools (no connections)."""
    return [spec.schema or tool_class(spec.class_name).default_schema for spec in specs]


# -- running calls: one event loop, limits per worker and per node ---------------------------------

class _LocalBucket:
    """One process's bucket (no Ray): made in the runner's loop, used only there."""

    def __init__(self, tokens: int):
        self._sem = asyncio.Semaphore(tokens)

    async def acquire(self):
        await self._sem.acquire()

    async def release(self):
        self._sem.release()


def _node_bucket(tool_name: str, tokens: int):
    """The bucket shared by the rollout workers of this node: a named Ray actor pinned to it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    class NodeBucket:
        def __init__(self, tokens: int):
            self.sem = asyncio.Semaphore(tokens)

        async def acquire(self):
            await self.sem.acquire()

        async def release(self):
            self.sem.release()

    node = ray.get_runtime_context().get_node_id()
    actor = NodeBucket.options(name=f"tool-bucket:{tool_name}:{node}", get_if_exists=True, max_concurrency=10_000,
                               scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(tokens)

    class Remote:
        async def acquire(self):
            await actor.acquire.remote()

        async def release(self):
            await actor.release.remote()

    return Remote()


@dataclass
class ToolResult:
    text: str
    status: str = "ok"   # ok | bad_arguments | error | timeout


class ToolRunner:
    """Runs tool calls on one background event loop, within each tool's limits.

    One loop for the whole rollout worker keeps the tools' async clients and semaphores in the loop
    they were made in, whichever schedule (a thread of the continuous one, the async one's own loop,
    the sync one's caller) asks for a call."""

    def __init__(self, tools: dict[str, Tool]):
        self.tools = tools
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tools", daemon=True)
        self._thread.start()
        self._ready = asyncio.run_coroutine_threadsafe(self._setup(), self._loop).result()

    async def _setup(self):
        import ray
        shared = ray.is_initialized()
        self._workers = {name: asyncio.Semaphore(t.num_workers) for name, t in self.tools.items()}
        self._buckets = {name: None if t.rate_limit is None else
                         _node_bucket(name, t.rate_limit) if shared else _LocalBucket(t.rate_limit)
                         for name, t in self.tools.items()}
        return True

    async def _call(self, name: str, arguments: dict) -> ToolResult:
        tool, bucket = self.tools[name], self._buckets[name]
        async with self._workers[name]:
            if bucket:
                await bucket.acquire()
            try:
                return ToolResult(await asyncio.wait_for(tool.call(arguments), tool.timeout_s))
            except ToolArgumentError as e:
                return ToolResult(f"Error: {e}", "bad_arguments")
            except asyncio.TimeoutError:
                return ToolResult(f"Error: the {name} tool did not answer within {tool.timeout_s:g} s.", "timeout")
            except Exception as e:  # the rollout goes on; the trajectory counts the failure
                log.warning("tool %s failed: %s", name, e)
                return ToolResult(f"Error: the {name} tool failed ({type(e).__name__}).", "error")
            finally:
                if bucket:
                    await bucket.release()

    def call_many(self, calls: list[tuple[str, dict]]) -> list[ToolResult]:
        """Blocking: the calls run concurrently; results in order."""
        async def gather():
            return await asyncio.gather(*(self._call(n, a) for n, a in calls))
        return asyncio.run_coroutine_threadsafe(gather(), self._loop).result()

    async def acall(self, name: str, arguments: dict) -> ToolResult:
        """From another event loop (the async schedule's)."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._call(name, arguments), self._loop))

    def close(self):
        if self._loop.is_running():
            async def close_all():
                for tool in self.tools.values():
                    await tool.aclose()
            asyncio.run_coroutine_threadsafe(close_all(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
