"""The contract between the trainer and an agent loop (how the trainer finds one: loop_from_config).

An agent loop turns prompts into trajectories with an engine: one generation (`SingleTurnLoop`, the
default) or many turns with tools between them (the search agent, `search_r1.agent.loop`). The
trainer names it in its config (`actor_rollout_ref.rollout.agent_loop: "package.module:Class"`) and
knows nothing else about it: what a loop needs beyond `AgentLoopSettings` it declares as a typed
options dataclass (the class attribute `Options`), which the config section of its options
(`actor_rollout_ref.rollout.agent_kwargs`) is checked against at start-up (an unknown key or a
wrong type stops the run, naming the key) and which reaches the loop as `settings.options`; what
it reports per trajectory beyond the token counts comes back in `TrajectoryStats.metrics`, which
the trainer logs as `agent/<name>`. A loop that can tell a
trajectory that took no action (neither called a tool nor answered) reports it as the metric
`no_action` (1 or 0), which the trainer's health watch reads (`trainer.health.no_action_rise`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from verl.workers.rollout.engine import Engine, SamplingConfig


class PreflightError(RuntimeError):
    """An agent loop's tool is not ready: the trainer stops before starting its workers."""


@dataclass
class AgentLoopSettings:
    """What every agent loop is built with."""
    max_tokens_per_turn: int          # tokens the model may write in one generation (data.max_response_length)
    max_obs_length: int = 500         # tokens of one tool output kept in the trajectory (data.max_obs_length)
    schedule: str = "sync"            # sync | async | continuous: how the loop drives the engine
    admit_every_steps: int = 32       # continuous schedule: engine steps between admissions of ready turns
    options: Any = None               # the loop's own options: an instance of its class's Options dataclass
    # more keyword arguments of the chat template, for loops that render it (data.apply_chat_template_kwargs)
    chat_template_kwargs: dict = field(default_factory=dict)


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


class AgentTrajectory(Protocol):
    response_ids: list[int]           # everything after the prompt, model and tool tokens alike
    loss_mask: list[int]              # 1 on the model's tokens, 0 on the tools' (never trained on)
    # Optional: the engine's log-prob of each response token as sampled, 0 on the tools' tokens,
    # when the loop's sampling asked for them (SamplingConfig.logprobs; rollout.calculate_log_probs).
    rollout_logprobs: list[float] | None

    def stats(self) -> TrajectoryStats: ...


class AgentLoop(Protocol):
    Options: ClassVar[type]           # a dataclass, every field with its default: the loop's own options

    def __init__(self, engine: Engine, settings: AgentLoopSettings): ...

    @classmethod
    def preflight(cls, settings: AgentLoopSettings) -> None:
        """Check the loop's tools from the driver before any worker starts; raise PreflightError."""

    @classmethod
    def max_response_tokens(cls, settings: AgentLoopSettings) -> int:
        """The most tokens a trajectory can hold after its prompt (sizes the engine's context)."""

    def run(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[AgentTrajectory]:
        """One trajectory per prompt, in order. `sampling.max_tokens` caps each generation."""
