"""The multi-turn search agent with the Search-R1 tags: generate ↔ search until the model answers.

A turn ends when the engine stops on `</search>`, `</answer>` or EOS. `</search>` sends the query
to the retriever and the passages come back as an `<information>` observation (loss_mask 0);
`</answer>` ends the trajectory. The turns, budgets and schedules (sync, async, continuous) are the
shared multi-turn machinery of `verl.workers.rollout.multi_turn`; this module says what a turn
means with tags. The chat-template tool-calling protocol (`<tool_call>` JSON, tool messages) is
`verl.workers.rollout.tool_loop` with the search tool of `search_r1.agent.search_tool`.

Where we differ from the original: observations are tokenized on their own and appended as ids
(the model's text is never decoded and re-tokenized), over-long observations are cut without
losing `</information>`, a trajectory that runs out of `max_response_length` is cut and marked
`length` instead of silently wrapped, and a failed search becomes an observation saying so. An
empty `<search></search>`, or a query that still holds `<search>`, is an invalid action answered
with a correction, where the original sent it to the retriever as written: the search loop's option
`search_malformed_queries=true` restores the original's behaviour.
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
from dataclasses import dataclass, field, replace
from typing import Protocol

from search_r1.retrieval.client import RetrieverConfig
from verl.workers.rollout.agent_loop import AgentLoopSettings, PreflightError, TrajectoryStats
from verl.workers.rollout.multi_turn import Finish, MultiTurnAgent, Schedule, Trajectory, TurnConfig

log = logging.getLogger(__name__)

STOP = ["</search>", "</answer>"]
SEARCH_RE = re.compile(r"<search>(.*?)</search>", re.DOTALL)
INVALID_ACTION = ("\n<information>That was not a valid action. Put a search query between <search> "
                  "and </search>, or the final answer between <answer> and </answer>.</information>\n")
SEARCH_FAILED = "\n<information>The search failed: no results could be retrieved.</information>\n"


@dataclass
class AgentConfig(TurnConfig):
    """max_turns: searches allowed per trajectory; max_response_tokens: all turns' tokens after the
    prompt (response_budget gives the one that fits every turn)."""
    max_obs_length: int = 512         # tokens per observation
    topk: int = 3                     # passages per search
    # A policy can write a query of thousands of characters; a server refuses those (HTTP 400) and,
    # in the sync schedule, with them the whole turn's batch. Longer queries are cut to this length.
    max_query_chars: int = 1024
    # Text the environment writes after each observation, opening the model's next turn, as a response
    # prefix opens its first (e.g. "<think>": a small model trained without SFT otherwise writes plain
    # text after the passages, out of the format the reward pays). Part of the observation: not trained on.
    turn_prefix: str = ""
    # The original searched an empty query or one that still holds <search> as written; here such a
    # turn is an invalid action, answered with a correction, unless this is true.
    search_malformed_queries: bool = False


@dataclass
class SearchRequest:
    """What a `</search>` turn asks for: `query` None when the loop could not read one (answered by
    a correction, without a search)."""
    query: str | None


class SearchTrajectory(Trajectory):
    """A trajectory of the tag protocol: its tool calls are searches."""

    @property
    def searches(self) -> int:
        return self.tool_calls

    @property
    def retrieval_failed(self) -> bool:
        return self.tool_failed

    @property
    def retrieval_s(self) -> float:
        return self.tool_s

    def stats(self) -> TrajectoryStats:
        return TrajectoryStats(
            str(self.finish), len(self.response_ids), sum(self.loss_mask), tool_calls=self.searches,
            tool_failed=self.retrieval_failed, done_s=self.done_s,
            # retrieval_s: seconds this trajectory waited for passages (overlapped with others' turns)
            metrics={"turns": self.turns, "searches": self.searches, "valid_actions": self.valid_actions,
                     "invalid_actions": self.invalid_actions, "retrieval_s": round(self.retrieval_s, 4),
                     # neither searched nor answered: read by the trainer's health watch
                     "no_action": float(self.searches == 0 and self.finish != Finish.ANSWER)})


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


class SearchAgent(MultiTurnAgent):
    """Turns end on `</search>` (a SearchRequest: the query, or None for one the loop cannot read,
    answered by a correction without a search) or `</answer>` (done)."""

    stop = STOP
    trajectory_cls = SearchTrajectory

    def __init__(self, engine, searcher: Searcher, cfg: AgentConfig | None = None, on_event=None):
        super().__init__(engine, cfg or AgentConfig(), on_event)
        self.searcher = searcher
        tok = engine.tokenizer
        self._encode = lambda text: tok.encode(text, add_special_tokens=False)
        self._open_ids = self._encode("\n\n<information>")
        self._close_ids = self._encode("</information>\n\n")
        self._turn_prefix_ids = self._encode(self.cfg.turn_prefix) if self.cfg.turn_prefix else []

    def parse_turn(self, trajectory, gen, context, last_turn) -> SearchRequest | None:
        if gen.stop_reason == "</answer>":
            trajectory.valid_actions += 1
            trajectory.finish = Finish.ANSWER
        elif gen.stop_reason == "</search>":
            # Decoding only parses; the ids stay as generated.
            text = self.engine.tokenizer.decode(context + gen.token_ids, skip_special_tokens=True)
            found = SEARCH_RE.findall(text)
            query = found[-1].strip()[:self.cfg.max_query_chars] if found else None
            malformed = query is None or not query or "<search>" in query
            if last_turn:
                trajectory.finish = Finish.MAX_TURNS
            elif malformed and not (self.cfg.search_malformed_queries and query is not None):
                trajectory.invalid_actions += 1
                return SearchRequest(None)  # the correction goes in as an observation
            else:
                trajectory.valid_actions += 1
                trajectory.tool_calls += 1
                return SearchRequest(query)
        elif gen.finish_reason == "length":
            trajectory.finish = Finish.LENGTH
        else:
            trajectory.finish = Finish.EOS
        return None

    def run_tools(self, trajectories, requests):
        """One batched request for the turn's readable queries; a failed search gives None hits."""
        asking = [i for i, r in enumerate(requests) if r.query is not None]
        results: list[list[dict] | None] = [None] * len(requests)
        if not asking:
            return results
        try:
            hits = self.searcher.search([requests[i].query for i in asking], self.cfg.topk)
        except Exception as e:  # retries are the client's job; here the search is over
            log.warning("retrieval failed for %d queries: %s", len(asking), e)
            hits = [None] * len(asking)
        for i, h in zip(asking, hits):
            results[i] = h
            trajectories[i].tool_failed |= h is None
        return results

    async def arun_tool(self, trajectory, request):
        if request.query is None:
            return None
        try:
            return (await self.searcher.asearch([request.query], self.cfg.topk))[0]
        except Exception as e:
            log.warning("retrieval failed: %s", e)
            trajectory.tool_failed = True
            return None

    def observation_ids(self, trajectory, request, hits) -> list[int]:
        ids = self._encode(INVALID_ACTION) if request.query is None else self.passage_ids(hits)
        return ids + self._turn_prefix_ids

    def passage_ids(self, hits: list[dict] | None) -> list[int]:
        """The `<information>` block of one search's hits (None: the search failed)."""
        if hits is None:
            return self._encode(SEARCH_FAILED)
        body = self._encode(format_passages(hits))
        room = self.cfg.max_obs_length - len(self._open_ids) - len(self._close_ids) - len(self._turn_prefix_ids)
        return self._open_ids + body[:max(0, room)] + self._close_ids  # the closing tag survives


@dataclass
class SearchLoopOptions:
    """The search agent's options in a training run (actor_rollout_ref.rollout.agent_kwargs; the
    original Search-R1's `max_turns` and `retriever.*` are read into them, search_r1.compat)."""
    max_turns: int = 1                # searches allowed per trajectory (then one more turn to answer)
    # the retrieval server: url, topk, api_key (null: SEARCH_R1_API_KEY if set), timeout_s,
    # connect_timeout_s, retries, …
    retriever: RetrieverConfig = field(default_factory=RetrieverConfig)
    turn_prefix: str = ""             # text written after each observation, opening the model's next turn
    search_malformed_queries: bool = False  # true: search an empty query or one holding <search> (the original)


# A prompt that teaches the tool-calling protocol (verl's preprocessed search rows) mentions this and
# never the tags: the tag agent would wait for a <search> its model was never asked to write.
_TOOL_PROTOCOL_MARK = "<tool_call>"


class SearchAgentLoop:
    """The search agent as a trainer agent loop
    (`actor_rollout_ref.rollout.agent_loop=search_r1.agent.loop:SearchAgentLoop`), with the options
    of `SearchLoopOptions` (`settings.options`)."""

    Options = SearchLoopOptions

    def __init__(self, engine, settings: AgentLoopSettings):
        options = self._options(settings)
        cfg = AgentConfig(max_turns=options.max_turns, max_response_tokens=self.max_response_tokens(settings),
                          max_obs_length=settings.max_obs_length, topk=options.retriever.topk,
                          schedule=Schedule(settings.schedule), admit_every_steps=settings.admit_every_steps,
                          turn_prefix=options.turn_prefix,
                          search_malformed_queries=options.search_malformed_queries)
        self.agent = SearchAgent(engine, HTTPSearcher(options.retriever), cfg)
        self.max_tokens_per_turn = settings.max_tokens_per_turn

    @staticmethod
    def _options(settings: AgentLoopSettings) -> SearchLoopOptions:
        options = settings.options
        if not isinstance(options, SearchLoopOptions):
            raise TypeError(f"the search agent's settings.options is a {type(options).__name__}, not "
                            "SearchLoopOptions: build them with verl.workers.rollout.agent_loop.build_options")
        if options.retriever.api_key is None and os.environ.get("SEARCH_R1_API_KEY"):
            options = replace(options, retriever=replace(options.retriever,
                                                         api_key=os.environ["SEARCH_R1_API_KEY"]))
        return options

    @classmethod
    def max_response_tokens(cls, settings: AgentLoopSettings) -> int:
        return response_budget(cls._options(settings).max_turns, settings.max_tokens_per_turn,
                               settings.max_obs_length)

    @classmethod
    def preflight(cls, settings: AgentLoopSettings) -> None:
        check_retriever(cls._options(settings).retriever)

    @classmethod
    def check_prompts(cls, settings: AgentLoopSettings, prompts: list[str]) -> None:
        """Refuse prompts that teach the tool-calling protocol: trained with the tags, such a model
        never searches, and nothing would say so."""
        teaching_tools = [p for p in prompts if _TOOL_PROTOCOL_MARK in p and "<search>" not in p]
        if teaching_tools:
            raise ValueError(
                f"{len(teaching_tools)} of the first {len(prompts)} training prompts teach the tool-calling "
                f"protocol ({_TOOL_PROTOCOL_MARK} …, e.g. verl's preprocessed search rows), but the agent loop is "
                "the tag protocol's search_r1.agent.loop:SearchAgentLoop, which only reads <search>…</search>: "
                "set actor_rollout_ref.rollout.multi_turn.enable=true with actor_rollout_ref.rollout.multi_turn."
                "tool_config_path=configs/tools/search.yaml, or train on data made for the tags "
                "(scripts/data_process)")

    def run(self, prompts, sampling):
        sampling = replace(sampling, max_tokens=min(sampling.max_tokens, self.max_tokens_per_turn))
        return self.agent.run(prompts, sampling)


def check_retriever(retriever) -> None:
    """One search before the trainer starts its workers: a retriever that is down, refuses the key or
    answers in another shape stops the run here, with the URL and the error (PreflightError)."""
    from search_r1.retrieval.client import RetrievalClient, RetrievalError
    retriever = replace(retriever, retries=1)
    url = retriever.url
    try:
        with RetrievalClient(retriever) as client:
            hits = client.retrieve(["preflight check"], retriever.topk)
            health = client.http.get(url.rsplit("/", 1)[0] + "/health")
    except RetrievalError as e:
        raise PreflightError(f"the retriever is not ready: {e}. Start it (`search-r1 serve …`, "
                             "retrieval_launch.sh) or fix its URL / API key") from None
    if health.status_code == 503:  # e.g. a web engine that refuses the server's key
        raise PreflightError(f"the retriever at {url} is unhealthy: {health.json().get('problems')}")
    if not (isinstance(hits[0], list) and all("document" in h for h in hits[0])):
        raise PreflightError(f"the retriever at {url} answered {str(hits)[:200]}: not the "
                             "/retrieve layout ({'result': [[{'document': …, 'score': …}]]})")
