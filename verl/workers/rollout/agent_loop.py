"""The contract between the trainer and an agent loop, and how the trainer finds one.

An agent loop turns prompts into trajectories with an engine: one generation (`SingleTurnLoop`, the
default) or many turns with tools between them (the search agent, `search_r1.agent.loop`). The
trainer names it in its config (`actor_rollout_ref.rollout.agent_loop: "package.module:Class"`) and
knows nothing else about it: what a loop needs beyond `AgentLoopSettings` comes in
`settings.options`, a dict only the loop reads, and what it reports per trajectory beyond the
token counts comes back in `TrajectoryStats.metrics`, which the trainer logs as `agent/<name>`.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Protocol

from verl.workers.rollout.engines import Engine, SamplingConfig


class PreflightError(RuntimeError):
    """An agent loop's tool is not ready: the trainer stops before starting its workers."""


@dataclass
class AgentLoopSettings:
    """What every agent loop is built with."""
    max_tokens_per_turn: int          # tokens the model may write in one generation (data.max_response_length)
    max_obs_length: int = 500         # tokens of one tool output kept in the trajectory (data.max_obs_length)
    schedule: str = "sync"            # sync | async | continuous: how the loop drives the engine
    admit_every_steps: int = 32       # continuous schedule: engine steps between admissions of ready turns
    options: dict[str, Any] = field(default_factory=dict)  # the loop's own settings, read by the loop alone


@dataclass
class TrajectoryStats:
    """What the trainer reads of one trajectory, besides its tokens."""
    finish: str                       # why it ended: eos | length | max_turns | timeout | …
    response_tokens: int              # tokens after the prompt: the model's and the tools'
    model_tokens: int                 # tokens the model wrote (loss mask 1)
    tool_calls: int = 0               # tool calls it made
    tool_failed: bool = False         # a tool call failed: it saw an error instead of the tool's output
    metrics: dict[str, float] = field(default_factory=dict)  # the loop's own, logged as means: agent/<name>
    done_s: float | None = None       # seconds from its worker's rollout start until it ended, where the loop says

    def as_row(self) -> dict:
        """One flat dict, as the samples files and the evaluation's records store it."""
        timing = {} if self.done_s is None else {"done_s": self.done_s}
        return {"finish": self.finish, "response_tokens": self.response_tokens, "model_tokens": self.model_tokens,
                "tool_calls": self.tool_calls, "tool_failed": self.tool_failed, **self.metrics, **timing}


class Trajectory(Protocol):
    response_ids: list[int]           # everything after the prompt, model and tool tokens alike
    loss_mask: list[int]              # 1 on the model's tokens, 0 on the tools' (never trained on)
    # Optional: the engine's log-prob of each response token as sampled, 0 on the tools' tokens,
    # when the loop's sampling asked for them (SamplingConfig.logprobs; rollout.calculate_log_probs).
    rollout_logprobs: list[float] | None

    def stats(self) -> TrajectoryStats: ...


class AgentLoop(Protocol):
    def __init__(self, engine: Engine, settings: AgentLoopSettings): ...

    @classmethod
    def preflight(cls, settings: AgentLoopSettings) -> None:
        """Check the loop's tools from the driver before any worker starts; raise PreflightError."""

    @classmethod
    def max_response_tokens(cls, settings: AgentLoopSettings) -> int:
        """The most tokens a trajectory can hold after its prompt (sizes the engine's context)."""

    def run(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[Trajectory]:
        """One trajectory per prompt, in order. `sampling.max_tokens` caps each generation."""


def load_agent_loop(spec: str | None) -> type[AgentLoop]:
    """'module:Class' → the class; None → SingleTurnLoop."""
    if not spec:
        from verl.workers.rollout.single_turn import SingleTurnLoop
        return SingleTurnLoop
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"actor_rollout_ref.rollout.agent_loop={spec!r} cannot be loaded ({e}); "
                         "give it as 'package.module:ClassName'") from None
