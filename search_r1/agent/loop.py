"""The multi-turn search agent: generate ↔ search until the model answers.

One trajectory = prompt + response, where the response interleaves the model's own tokens (kept
exactly as generated, loss_mask 1) with observation tokens the environment appends (retrieved
passages or a correction, loss_mask 0). A turn ends when the engine stops on `</search>`,
`</answer>` or EOS; the engine handles the stop, so no token is generated past the tag.

The schedules give the same trajectories for a deterministic engine:
- sync: every turn, all active trajectories generate as one batch, then send one batched
  retrieval request; simple, and the engine sees large batches.
- async: each trajectory advances on its own (one coroutine each); the retrieval of one overlaps
  the generation of the others, so a slow search never stalls the whole batch.
- continuous: one loop drives the engine step by step (`VLLMEngine.submit/step`); a trajectory
  whose turn ends is searched (the searches that end in one step go out as one batched request, in
  a thread) and its next turn joins the running batch once the passages arrive (the turns ready
  by then join together, every `admit_every_steps` engine steps). Neither the
  slowest generation of a turn (sync) nor the slowest of a micro-batch (async, whose batched
  `generate` call returns only when all of it is done) holds the others back.

Where we differ from the original: observations are tokenized on their own and appended as ids
(the model's text is never decoded and re-tokenized), over-long observations are cut without
losing `</information>`, a trajectory that runs out of `max_response_length` is cut and marked
`length` instead of silently wrapped, and a failed search becomes an observation saying so.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Protocol

from verl.workers.rollout.agent_loop import AgentLoopSettings, PreflightError, TrajectoryStats
from verl.workers.rollout.engines import SamplingConfig

log = logging.getLogger(__name__)

STOP = ["</search>", "</answer>"]
SEARCH_RE = re.compile(r"<search>(.*?)</search>", re.DOTALL)
INVALID_ACTION = ("\n<information>That was not a valid action. Put a search query between <search> "
                  "and </search>, or the final answer between <answer> and </answer>.</information>\n")
SEARCH_FAILED = "\n<information>The search failed: no results could be retrieved.</information>\n"


class Finish(StrEnum):
    ANSWER = "answer"        # the model closed </answer>
    EOS = "eos"              # the model ended without an answer
    LENGTH = "length"        # max_response_length reached; the trajectory was cut here
    MAX_TURNS = "max_turns"  # the model searched again after its last allowed search
    TIMEOUT = "timeout"      # the rollout's overall time limit ran out


class Schedule(StrEnum):
    SYNC = "sync"
    ASYNC = "async"
    CONTINUOUS = "continuous"  # needs an engine with submit/step (VLLMEngine)


@dataclass
class AgentConfig:
    max_turns: int = 4                # searches allowed per trajectory
    max_response_tokens: int = 1024   # tokens after the prompt, all turns: model tokens + observations
                                      # (response_budget gives the one that fits every turn)
    max_obs_length: int = 512         # tokens per observation
    topk: int = 3                     # passages per search
    # A policy can write a query of thousands of characters; a server refuses those (HTTP 400) and,
    # in the sync schedule, with them the whole turn's batch. Longer queries are cut to this length.
    max_query_chars: int = 1024
    schedule: Schedule = Schedule.SYNC
    timeout_s: float = 1800.0         # for the whole rollout
    # continuous: turns ready to go on join the running batch together, every this many engine
    # steps. A step that carries a prefill is slower than a decode-only step (vLLM replays a whole
    # CUDA graph only for the latter): admitting one turn per step made every step such a step.
    admit_every_steps: int = 32


@dataclass
class Trajectory:
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)   # 1 = model token, 0 = observation
    index: int = 0                                        # its prompt's position in the run
    finish: Finish | None = None
    turns: int = 0
    searches: int = 0
    valid_actions: int = 0
    invalid_actions: int = 0
    retrieval_failed: bool = False
    retrieval_s: float = 0.0

    @property
    def done(self) -> bool:
        return self.finish is not None

    def append(self, ids: list[int], model: bool):
        self.response_ids += ids
        self.loss_mask += [int(model)] * len(ids)

    def stats(self) -> TrajectoryStats:
        return TrajectoryStats(
            str(self.finish), len(self.response_ids), sum(self.loss_mask), tool_calls=self.searches,
            tool_failed=self.retrieval_failed,
            # retrieval_s: seconds this trajectory waited for passages (overlapped with others' turns)
            metrics={"turns": self.turns, "searches": self.searches, "valid_actions": self.valid_actions,
                     "invalid_actions": self.invalid_actions, "retrieval_s": round(self.retrieval_s, 4)})


def response_budget(max_turns: int, max_tokens_per_turn: int, max_obs_length: int) -> int:
    """The most tokens a trajectory can hold after its prompt: a generation for every search and one
    for the answer, and an observation for every search."""
    return (max_turns + 1) * max_tokens_per_turn + max_turns * max_obs_length


class Searcher(Protocol):
    """Anything that maps queries to hit lists in the `/retrieve` layout."""

    def search(self, queries: list[str], topk: int) -> list[list[dict]]: ...

    async def asearch(self, queries: list[str], topk: int) -> list[list[dict]]: ...


class HTTPSearcher:
    """The retrieval server through the retried, pooled clients."""

    def __init__(self, cfg):
        from search_r1.retrieval.client import AsyncRetrievalClient, RetrievalClient
        self.cfg = cfg
        self.sync = RetrievalClient(cfg)
        self._async_cls = AsyncRetrievalClient
        self._async = None

    def search(self, queries, topk):
        return self.sync.retrieve(queries, topk)

    async def asearch(self, queries, topk):
        loop = asyncio.get_running_loop()
        if self._async is None or self._async[0] is not loop:  # httpx clients bind to one loop
            self._async = (loop, self._async_cls(self.cfg))
        return await self._async[1].retrieve(queries, topk)


def format_passages(hits: list[dict]) -> str:
    """`Doc i(Title: …) text` lines, the layout the Search-R1 models were trained on."""
    lines = []
    for i, hit in enumerate(hits, 1):
        doc = hit.get("document", hit)
        title, _, text = doc["contents"].partition("\n")
        lines.append(f"Doc {i}(Title: {title.strip().strip(chr(34))}) {text.strip()}")
    return "\n".join(lines)


class SearchAgent:
    def __init__(self, engine, searcher: Searcher, cfg: AgentConfig | None = None, on_event=None):
        self.engine, self.searcher = engine, searcher
        self.cfg = cfg or AgentConfig()
        # Optional callback(trajectory, kind, token_ids) as the rollout goes: kind is "model"
        # (a turn's tokens) or "observation"; infer.py uses it to show progress live.
        self.on_event = on_event or (lambda *a: None)
        tok = engine.tokenizer
        self._encode = lambda text: tok.encode(text, add_special_tokens=False)
        self._open_ids = self._encode("\n\n<information>")
        self._close_ids = self._encode("</information>\n\n")

    # -- pieces shared by both schedules ------------------------------------------------------

    def _observation_ids(self, hits: list[dict] | None) -> list[int]:
        if hits is None:
            return self._encode(SEARCH_FAILED)
        body = self._encode(format_passages(hits))
        room = self.cfg.max_obs_length - len(self._open_ids) - len(self._close_ids)
        return self._open_ids + body[:max(0, room)] + self._close_ids  # the closing tag survives

    def _take_turn(self, t: Trajectory, gen, last_turn: bool) -> str | None:
        """Append the model's tokens; decide what happens next. Returns a query to search, or None."""
        # A few tokens of context in front, so an opening <search> written just before this turn
        # (e.g. prefilled at the end of the prompt) is seen too. Decoding only parses; the ids
        # stay as generated.
        context = (t.prompt_ids + t.response_ids)[-8:]
        t.append(gen.token_ids, model=True)
        self.on_event(t, "model", gen.token_ids)
        t.turns += 1
        if gen.stop_reason == "</answer>":
            t.valid_actions += 1
            t.finish = Finish.ANSWER
        elif gen.stop_reason == "</search>":
            text = self.engine.tokenizer.decode(context + gen.token_ids, skip_special_tokens=True)
            found = SEARCH_RE.findall(text)
            query = found[-1].strip()[:self.cfg.max_query_chars] if found else ""
            if last_turn:
                t.finish = Finish.MAX_TURNS
            elif not query or "<search>" in query:
                t.invalid_actions += 1
                return ""  # the correction goes in as an observation
            else:
                t.valid_actions += 1
                t.searches += 1
                return query
        elif gen.finish_reason == "length":
            t.finish = Finish.LENGTH
        else:
            t.finish = Finish.EOS
        return None

    def _add_observation(self, t: Trajectory, query: str, hits: list[dict] | None):
        ids = self._encode(INVALID_ACTION) if query == "" else self._observation_ids(hits)
        if len(t.response_ids) + len(ids) >= self.cfg.max_response_tokens:
            t.finish = Finish.LENGTH  # no room left to read it and answer: cut here
            return
        t.append(ids, model=False)
        self.on_event(t, "observation", ids)

    def _sampling(self, t: Trajectory, base: SamplingConfig) -> SamplingConfig:
        """The settings of t's next turn: max_tokens cut to the room left; with a seed, one of its own
        for each trajectory and turn, so a run (and a resumed run) samples the same tokens whatever
        the order in which turns reach the engine."""
        room = self.cfg.max_response_tokens - len(t.response_ids)
        seed = None if base.seed is None else (base.seed + 1_009 * t.index + t.turns) % 2**31
        return replace(base, max_tokens=max(1, min(base.max_tokens, room)), seed=seed)  # keeps logit_bias

    # -- schedules ----------------------------------------------------------------------------

    def run(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[Trajectory]:
        trajectories = [Trajectory(list(p), index=i) for i, p in enumerate(prompts)]
        if self.cfg.schedule == Schedule.ASYNC:
            asyncio.run(self._run_async(trajectories, sampling))
        elif self.cfg.schedule == Schedule.CONTINUOUS:
            if not self.engine.continuous:
                raise ValueError(f"the continuous schedule needs an engine with submit/step (vLLM); "
                                 f"{type(self.engine).__name__} has none: use schedule 'sync' or 'async'")
            self._run_continuous(trajectories, sampling)
        else:
            self._run_sync(trajectories, sampling)
        return trajectories

    def _run_sync(self, trajectories: list[Trajectory], sampling: SamplingConfig):
        deadline = time.monotonic() + self.cfg.timeout_s
        for turn in range(self.cfg.max_turns + 1):
            active = [t for t in trajectories if not t.done]
            if not active:
                return
            if time.monotonic() > deadline:
                break
            # Trajectories with equal remaining room share one engine call.
            by_room: dict[int, list[Trajectory]] = {}
            for t in active:
                by_room.setdefault(self._sampling(t, sampling).max_tokens, []).append(t)
            queries: dict[int, str] = {}
            for group in by_room.values():
                gens = self.engine.generate([t.prompt_ids + t.response_ids for t in group],
                                            self._sampling(group[0], sampling), STOP)
                for t, gen in zip(group, gens):
                    q = self._take_turn(t, gen, last_turn=turn == self.cfg.max_turns)
                    if q is not None:
                        queries[id(t)] = q
            asking = [t for t in active if queries.get(id(t))]
            results = self._search_sync([queries[id(t)] for t in asking], asking)
            for t in active:
                if id(t) in queries:
                    self._add_observation(t, queries[id(t)], results.get(id(t)))
        for t in trajectories:
            if not t.done:
                t.finish = Finish.TIMEOUT

    def _search_sync(self, queries: list[str], asking: list[Trajectory]) -> dict[int, list[dict] | None]:
        if not queries:
            return {}
        t0 = time.perf_counter()
        try:
            hits = self.searcher.search(queries, self.cfg.topk)
        except Exception as e:  # retries are the client's job; here the search is over
            log.warning("retrieval failed for %d queries: %s", len(queries), e)
            hits = [None] * len(queries)
        dt = time.perf_counter() - t0
        for t, h in zip(asking, hits):
            t.retrieval_s += dt
            t.retrieval_failed |= h is None
        return {id(t): h for t, h in zip(asking, hits)}

    def _run_continuous(self, trajectories: list[Trajectory], sampling: SamplingConfig):
        engine, deadline = self.engine, time.monotonic() + self.cfg.timeout_s
        by_id = {id(t): t for t in trajectories}
        turns = dict.fromkeys(by_id, 0)
        searches: list[tuple[Future, list[Trajectory], list[str]]] = []  # in flight, in threads
        ready: list[Trajectory] = list(trajectories)  # next turns waiting to be admitted
        steps_since_admit = 0

        def admit():
            nonlocal steps_since_admit
            for t in ready:
                engine.submit(id(t), t.prompt_ids + t.response_ids, self._sampling(t, sampling), STOP)
            ready.clear()
            steps_since_admit = 0

        admit()
        with ThreadPoolExecutor(max_workers=4, thread_name_prefix="search") as pool:
            while engine.has_unfinished() or searches or ready:
                if ready and (steps_since_admit >= self.cfg.admit_every_steps or not engine.has_unfinished()):
                    admit()
                if time.monotonic() > deadline:
                    engine.abort_all()
                    break
                asking, queries = [], []
                steps_since_admit += 1
                for key, gen in (engine.step() if engine.has_unfinished() else []):
                    t = by_id[key]
                    query = self._take_turn(t, gen, last_turn=turns[key] == self.cfg.max_turns)
                    turns[key] += 1
                    if query:
                        asking.append(t)
                        queries.append(query)
                    elif query == "":  # invalid action: the correction needs no search
                        self._add_observation(t, query, None)
                        if not t.done:
                            ready.append(t)
                if asking:
                    searches.append((pool.submit(self._search_sync, queries, asking), asking, queries))
                if searches and not engine.has_unfinished() and not ready:  # nothing to do: wait for passages
                    wait([f for f, _, _ in searches], timeout=max(0.0, deadline - time.monotonic()),
                         return_when=FIRST_COMPLETED)
                pending = []
                for future, asking_, queries_ in searches:
                    if not future.done():
                        pending.append((future, asking_, queries_))
                        continue
                    results = future.result()  # _search_sync turns failures into None hits
                    for t, q in zip(asking_, queries_):
                        self._add_observation(t, q, results.get(id(t)))
                        if not t.done:
                            ready.append(t)
                searches = pending
        for t in trajectories:
            if not t.done:
                t.finish = Finish.TIMEOUT

    async def _run_async(self, trajectories: list[Trajectory], sampling: SamplingConfig):
        async def one(t: Trajectory):
            for turn in range(self.cfg.max_turns + 1):
                gen = await self.engine.generate_one(t.prompt_ids + t.response_ids,
                                                     self._sampling(t, sampling), STOP)
                query = self._take_turn(t, gen, last_turn=turn == self.cfg.max_turns)
                if query is None:
                    return
                hits = None
                if query:
                    t0 = time.perf_counter()
                    try:
                        hits = (await self.searcher.asearch([query], self.cfg.topk))[0]
                    except Exception as e:
                        log.warning("retrieval failed: %s", e)
                        t.retrieval_failed = True
                    t.retrieval_s += time.perf_counter() - t0
                self._add_observation(t, query, hits)
                if t.done:
                    return

        tasks = [asyncio.create_task(one(t)) for t in trajectories]
        _, pending = await asyncio.wait(tasks, timeout=self.cfg.timeout_s)
        for task in pending:
            task.cancel()
        for t in trajectories:
            if not t.done:
                t.finish = Finish.TIMEOUT


class SearchAgentLoop:
    """The search agent as a trainer agent loop
    (`actor_rollout_ref.rollout.agent_loop=search_r1.agent.loop:SearchAgentLoop`).

    Its options (`settings.options`): `max_turns` (searches allowed) and `retriever` (the fields of
    `RetrieverConfig`: url, topk, api_key, timeout_s, connect_timeout_s, retries). The trainer fills
    them from the original's top-level keys `max_turns` and `retriever.*`."""

    def __init__(self, engine, settings: AgentLoopSettings):
        max_turns, retriever = self._options(settings)
        cfg = AgentConfig(max_turns=max_turns, max_response_tokens=self.max_response_tokens(settings),
                          max_obs_length=settings.max_obs_length, topk=retriever.topk,
                          schedule=Schedule(settings.schedule), admit_every_steps=settings.admit_every_steps)
        self.agent = SearchAgent(engine, HTTPSearcher(retriever), cfg)
        self.max_tokens_per_turn = settings.max_tokens_per_turn

    @staticmethod
    def _options(settings: AgentLoopSettings):
        from search_r1.retrieval.client import RetrieverConfig
        options = dict(settings.options)
        unknown = sorted(set(options) - {"max_turns", "retriever"})
        if unknown:
            raise ValueError(f"the search agent has no option {unknown} (actor_rollout_ref.rollout.agent_kwargs): "
                             "it takes max_turns and retriever")
        # max_failure_rate is the trainer's (it masks and counts failed trajectories), not the client's
        retriever = {k: v for k, v in (options.get("retriever") or {}).items() if k != "max_failure_rate"}
        try:
            return int(options.get("max_turns", 1)), RetrieverConfig(**retriever)
        except TypeError as e:
            raise ValueError(f"the search agent's retriever options: {e}") from None

    @classmethod
    def max_response_tokens(cls, settings: AgentLoopSettings) -> int:
        return response_budget(cls._options(settings)[0], settings.max_tokens_per_turn, settings.max_obs_length)

    @classmethod
    def preflight(cls, settings: AgentLoopSettings) -> None:
        """One search before the trainer starts its workers: a retriever that is down, refuses the
        key or answers in another shape stops the run here, with the URL and the error."""
        from search_r1.retrieval.client import RetrievalClient, RetrievalError
        retriever = replace(cls._options(settings)[1], retries=1)
        url = retriever.url
        try:
            with RetrievalClient(retriever) as client:
                hits = client.retrieve(["preflight check"], retriever.topk)
                health = client.http.get(url.rsplit("/", 1)[0] + "/health")
        except RetrievalError as e:
            raise PreflightError(f"the retriever is not ready: {e}. Start it (`search-r1 serve …`, "
                                 "retrieval_launch.sh) or fix retriever.url / retriever.api_key") from None
        if health.status_code == 503:  # e.g. a web engine that refuses the server's key
            raise PreflightError(f"the retriever at {url} is unhealthy: {health.json().get('problems')}")
        if not (isinstance(hits[0], list) and all("document" in h for h in hits[0])):
            raise PreflightError(f"the retriever at {url} answered {str(hits)[:200]}: not the "
                                 "/retrieve layout ({'result': [[{'document': …, 'score': …}]]})")

    def run(self, prompts, sampling):
        sampling = replace(sampling, max_tokens=min(sampling.max_tokens, self.max_tokens_per_turn))
        return self.agent.run(prompts, sampling)
