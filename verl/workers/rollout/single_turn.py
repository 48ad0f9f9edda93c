"""The default agent loop: one generation per prompt, no tools."""
from __future__ import annotations

from dataclasses import dataclass, replace

from verl.workers.rollout.agent_loop import AgentLoopSettings, TrajectoryStats
from verl.workers.rollout.engine import Engine, SamplingConfig


@dataclass
class Completion:
    response_ids: list[int]
    loss_mask: list[int]
    finish: str
    rollout_logprobs: list[float] | None = None  # the engine's, when asked for (SamplingConfig.logprobs)

    def stats(self) -> TrajectoryStats:
        return TrajectoryStats(self.finish, len(self.response_ids), len(self.response_ids), metrics={"turns": 1})


@dataclass
class SingleTurnOptions:
    """One generation per prompt takes no options of its own."""


class SingleTurnLoop:
    Options = SingleTurnOptions

    def __init__(self, engine: Engine, settings: AgentLoopSettings):
        self.engine, self.settings = engine, settings

    @classmethod
    def preflight(cls, settings: AgentLoopSettings) -> None:
        """No tools, nothing to check."""

    @classmethod
    def max_response_tokens(cls, settings: AgentLoopSettings) -> int:
        return settings.max_tokens_per_turn

    def run(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[Completion]:
        sampling = replace(sampling, max_tokens=min(sampling.max_tokens, self.settings.max_tokens_per_turn))
        gens = self.engine.generate(prompts, sampling, stop=[])
        return [Completion(g.token_ids, [1] * len(g.token_ids), "length" if g.finish_reason == "length" else "eos",
                           g.logprobs) for g in gens]
