"""Multi-turn rollout: the model writes a turn, a tool answers, the model goes on, until it is done.

`MultiTurnAgent` owns what every multi-turn loop shares — trajectories, token budgets, seeds, the
three schedules — and a subclass says what a turn means: which strings end a turn (`stop`), what
the turn asks for (`parse_turn`), how requests are answered (`run_tools`, `arun_tool`) and which
tokens the answer adds (`observation_ids`). The Search-R1 tag agent (`search_r1.agent.loop`) and
the chat-template tool-calling loop (`verl.workers.rollout.tool_loop`) are the two subclasses.

One trajectory = prompt + response, where the response interleaves the model's own tokens (kept
exactly as generated, loss_mask 1) with observation tokens the environment appends (loss_mask 0).
A turn ends when the engine stops on one of `stop` or EOS; the engine handles the stop, so no
token is generated past it.

The schedules give the same trajectories for a deterministic engine:
- sync: every turn, all active trajectories generate as one batch, then their requests are
  answered together (`run_tools` with the whole turn's requests); simple, and the engine sees
  large batches.
- async: each trajectory advances on its own (one coroutine each); the tool call of one overlaps
  the generation of the others, so a slow tool never stalls the whole batch.
- continuous: one loop drives the engine step by step (`VLLMEngine.submit/step`); the requests of
  the turns that end in one engine step are answered together in a thread, and each trajectory's
  next turn joins the running batch once its answer arrives (the turns ready by then join
  together, every `admit_every_steps` engine steps). Neither the slowest generation of a turn
  (sync) nor the slowest of a micro-batch (async) holds the others back.

A trajectory that runs out of room is cut and marked `length`, never silently wrapped; a tool that
fails becomes an observation saying so, counted in `tool_failed`.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from verl.workers.rollout.agent_loop import TrajectoryStats
from verl.workers.rollout.engine import Generation, SamplingConfig


class Finish(StrEnum):
    ANSWER = "answer"        # the model gave its final answer (a closing tag the loop stops on)
    EOS = "eos"              # the model ended its turn without asking for a tool
    LENGTH = "length"        # the response budget ran out; the trajectory was cut here
    MAX_TURNS = "max_turns"  # the model asked for a tool after its last allowed call
    TIMEOUT = "timeout"      # the rollout's overall time limit ran out


class Schedule(StrEnum):
    SYNC = "sync"
    ASYNC = "async"
    CONTINUOUS = "continuous"  # needs an engine with submit/step (VLLMEngine)


@dataclass
class TurnConfig:
    """What the shared machinery reads; each agent's own config extends it."""
    max_turns: int = 4                # tool calls (searches) allowed per trajectory
    max_response_tokens: int = 1024   # tokens after the prompt, all turns: model tokens + observations
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
    tool_calls: int = 0               # requests that reached a tool
    valid_actions: int = 0            # turns that asked for a tool or answered, well formed
    invalid_actions: int = 0          # turns that asked in a way the loop could not read
    tool_failed: bool = False         # a tool call failed: the model saw an error instead
    tool_s: float = 0.0               # seconds this trajectory waited for tools
    done_s: float | None = None       # seconds from the rollout's start until it ended
    metrics: dict[str, float] = field(default_factory=dict)  # an agent's own per-trajectory counts
    # The engine's log-prob of each response token as sampled (0 on observations); None once a
    # turn came without them (the engine was not asked: SamplingConfig.logprobs).
    rollout_logprobs: list[float] | None = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.finish is not None

    @property
    def prompt_and_response_ids(self) -> list[int]:
        """What the engine continues for the next turn."""
        return self.prompt_ids + self.response_ids

    def append(self, ids: list[int], model: bool, logprobs: list[float] | None = None):
        self.response_ids += ids
        self.loss_mask += [int(model)] * len(ids)
        if self.rollout_logprobs is not None:
            if model and logprobs is None:
                self.rollout_logprobs = None
            else:
                self.rollout_logprobs += list(logprobs) if model else [0.0] * len(ids)

    def count(self, name: str, n: float = 1) -> None:
        self.metrics[name] = self.metrics.get(name, 0) + n

    def stats(self) -> TrajectoryStats:
        return TrajectoryStats(
            str(self.finish), len(self.response_ids), sum(self.loss_mask), tool_calls=self.tool_calls,
            tool_failed=self.tool_failed, done_s=self.done_s,
            metrics={"turns": self.turns, "tool_calls": self.tool_calls, "valid_actions": self.valid_actions,
                     "invalid_actions": self.invalid_actions, "tool_s": round(self.tool_s, 4), **self.metrics})


class MultiTurnAgent:
    """Drives an engine through the turns of many trajectories; subclasses define a turn."""

    stop: list[str] = []              # strings that end a turn besides EOS (kept in the output)
    trajectory_cls: type[Trajectory] = Trajectory
    context_tokens = 8                # tokens before a turn that parse_turn sees with it

    def __init__(self, engine, cfg: TurnConfig, on_event=None):
        self.engine, self.cfg = engine, cfg
        # Optional callback(trajectory, kind, token_ids) as the rollout goes: kind is "model"
        # (a turn's tokens) or "observation"; infer.py uses it to show progress live.
        self.on_event = on_event or (lambda *a: None)

    # -- what a subclass defines -----------------------------------------------------------------

    def parse_turn(self, trajectory: Trajectory, gen: Generation, context: list[int],
                   last_turn: bool) -> Any | None:
        """Read the turn just appended (`gen`; `context`: the few tokens before it). Set
        `trajectory.finish` and return None when the trajectory is over; else return a request for
        `run_tools`."""
        raise NotImplementedError

    def run_tools(self, trajectories: list[Trajectory], requests: list) -> list:
        """Answer the requests of several trajectories at once (blocking). Never raises: a failure
        is an answer that `observation_ids` turns into an error message."""
        raise NotImplementedError

    async def arun_tool(self, trajectory: Trajectory, request) -> Any:
        """Answer one trajectory's request (async schedule). Never raises."""
        raise NotImplementedError

    def observation_ids(self, trajectory: Trajectory, request, result) -> list[int]:
        """The tokens that answer `request` in the trajectory (loss_mask 0)."""
        raise NotImplementedError

    # -- pieces every schedule uses --------------------------------------------------------------

    def _take_turn(self, trajectory: Trajectory, gen: Generation, last_turn: bool):
        # A few tokens of context in front, so an opening tag written just before this turn (e.g.
        # prefilled at the end of the prompt) is seen too. The ids stay as generated.
        context = trajectory.prompt_and_response_ids[-self.context_tokens:]
        trajectory.append(gen.token_ids, model=True, logprobs=gen.logprobs)
        self.on_event(trajectory, "model", gen.token_ids)
        trajectory.turns += 1
        request = self.parse_turn(trajectory, gen, context, last_turn)
        self._stamp_if_done(trajectory)
        return request

    def _add_observation(self, trajectory: Trajectory, request, result):
        ids = self.observation_ids(trajectory, request, result)
        if len(trajectory.response_ids) + len(ids) >= self.cfg.max_response_tokens:
            trajectory.finish = Finish.LENGTH  # no room left to read it and answer: cut here
            self._stamp_if_done(trajectory)
            return
        trajectory.append(ids, model=False)
        self.on_event(trajectory, "observation", ids)

    def _stamp_if_done(self, trajectory: Trajectory):
        """When a trajectory ends, note how long into the rollout: the spread of these times is what the
        rollout's slowest trajectories cost the step (the trainer's rollout/done_s_* quantiles)."""
        if trajectory.done and trajectory.done_s is None:
            trajectory.done_s = round(time.monotonic() - self._started, 4)

    def _timed_run_tools(self, trajectories: list[Trajectory], requests: list) -> list:
        t0 = time.perf_counter()
        results = self.run_tools(trajectories, requests)
        dt = time.perf_counter() - t0
        for trajectory in trajectories:
            trajectory.tool_s += dt
        return results

    def _sampling(self, trajectory: Trajectory, base: SamplingConfig) -> SamplingConfig:
        """The settings of the trajectory's next turn: max_tokens cut to the room left; with a seed,
        one of its own for each trajectory and turn, so a run (and a resumed run) samples the same
        tokens whatever the order in which turns reach the engine."""
        room = self.cfg.max_response_tokens - len(trajectory.response_ids)
        seed = (None if base.seed is None
                else (base.seed + 1_009 * trajectory.index + trajectory.turns) % 2**31)
        return replace(base, max_tokens=max(1, min(base.max_tokens, room)), seed=seed)  # keeps logit_bias

    # -- schedules -------------------------------------------------------------------------------

    def run(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[Trajectory]:
        trajectories = [self.trajectory_cls(list(p), index=i) for i, p in enumerate(prompts)]
        self._started = time.monotonic()
        if self.cfg.schedule == Schedule.ASYNC:
            asyncio.run(self._run_async(trajectories, sampling))
        elif self.cfg.schedule == Schedule.CONTINUOUS:
            if not self.engine.continuous:
                raise ValueError(f"the continuous schedule needs an engine with submit/step (vLLM); "
                                 f"{type(self.engine).__name__} has none: use schedule 'sync' or 'async'")
            self._run_continuous(trajectories, sampling)
        else:
            self._run_sync(trajectories, sampling)
        for trajectory in trajectories:
            if not trajectory.done:
                trajectory.finish = Finish.TIMEOUT
                self._stamp_if_done(trajectory)
        return trajectories

    def _run_sync(self, trajectories: list[Trajectory], sampling: SamplingConfig):
        deadline = time.monotonic() + self.cfg.timeout_s
        for turn in range(self.cfg.max_turns + 1):
            active = [trajectory for trajectory in trajectories if not trajectory.done]
            if not active or time.monotonic() > deadline:
                return
            # Trajectories with equal remaining room share one engine call.
            by_room: dict[int, list[Trajectory]] = {}
            for trajectory in active:
                by_room.setdefault(self._sampling(trajectory, sampling).max_tokens, []).append(trajectory)
            asking, requests = [], []
            for group in by_room.values():
                gens = self.engine.generate([trajectory.prompt_and_response_ids for trajectory in group],
                                            self._sampling(group[0], sampling), self.stop)
                for trajectory, gen in zip(group, gens):
                    request = self._take_turn(trajectory, gen, last_turn=turn == self.cfg.max_turns)
                    if request is not None:
                        asking.append(trajectory)
                        requests.append(request)
            results = self._timed_run_tools(asking, requests) if asking else []
            for trajectory, request, result in zip(asking, requests, results):
                self._add_observation(trajectory, request, result)

    def _run_continuous(self, trajectories: list[Trajectory], sampling: SamplingConfig):
        engine, deadline = self.engine, time.monotonic() + self.cfg.timeout_s
        by_id = {id(trajectory): trajectory for trajectory in trajectories}
        in_flight: list[tuple[Future, list[Trajectory], list]] = []  # tool calls running in threads
        ready: list[Trajectory] = list(trajectories)  # next turns waiting to be admitted
        steps_since_admit = 0

        def admit():
            nonlocal steps_since_admit
            for trajectory in ready:
                engine.submit(id(trajectory), trajectory.prompt_and_response_ids,
                              self._sampling(trajectory, sampling), self.stop)
            ready.clear()
            steps_since_admit = 0

        admit()
        with ThreadPoolExecutor(max_workers=4, thread_name_prefix="tools") as pool:
            while engine.has_unfinished() or in_flight or ready:
                if ready and (steps_since_admit >= self.cfg.admit_every_steps or not engine.has_unfinished()):
                    admit()
                if time.monotonic() > deadline:
                    engine.abort_all()
                    return
                asking, requests = [], []
                finished = []
                if engine.has_unfinished():  # only engine steps count toward the next admission
                    steps_since_admit += 1
                    finished = engine.step()
                for key, gen in finished:
                    trajectory = by_id[key]
                    request = self._take_turn(trajectory, gen, last_turn=trajectory.turns == self.cfg.max_turns)
                    if request is not None:
                        asking.append(trajectory)
                        requests.append(request)
                if asking:
                    in_flight.append((pool.submit(self._timed_run_tools, asking, requests), asking, requests))
                if in_flight and not engine.has_unfinished() and not ready:  # nothing to do: wait for tools
                    wait([f for f, _, _ in in_flight], timeout=max(0.0, deadline - time.monotonic()),
                         return_when=FIRST_COMPLETED)
                pending = []
                for future, asking_, requests_ in in_flight:
                    if not future.done():
                        pending.append((future, asking_, requests_))
                        continue
                    for trajectory, request, result in zip(asking_, requests_, future.result()):
                        self._add_observation(trajectory, request, result)
                        if not trajectory.done:
                            ready.append(trajectory)
                in_flight = pending

    async def _run_async(self, trajectories: list[Trajectory], sampling: SamplingConfig):
        async def run_trajectory(trajectory: Trajectory):
            for turn in range(self.cfg.max_turns + 1):
                gen = await self.engine.generate_one(trajectory.prompt_and_response_ids,
                                                     self._sampling(trajectory, sampling), self.stop)
                request = self._take_turn(trajectory, gen, last_turn=turn == self.cfg.max_turns)
                if request is None:
                    return
                asked_at = time.perf_counter()
                result = await self.arun_tool(trajectory, request)
                trajectory.tool_s += time.perf_counter() - asked_at
                self._add_observation(trajectory, request, result)
                if trajectory.done:
                    return

        tasks = [asyncio.create_task(run_trajectory(trajectory)) for trajectory in trajectories]
        _, pending = await asyncio.wait(tasks, timeout=self.cfg.timeout_s)
        for task in pending:
            task.cancel()
