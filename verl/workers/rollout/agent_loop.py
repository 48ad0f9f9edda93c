"""The contract between the trainer and an agent loop, and how the trainer finds one.

An agent loop turns prompts into trajectories with an engine: one generation (`SingleTurnLoop`, the
default) or many turns with tools between them (the search agent, `search_r1.agent.loop`). The
trainer names it in its config (`actor_rollout_ref.rollout.agent_loop: "package.module:Class"`) and
knows nothing else about it: what a loop needs beyond `AgentLoopSettings` it declares as a typed
options dataclass (the class attribute `Options`), which the config section of its options
(`actor_rollout_ref.rollout.agent_kwargs`) is checked against at start-up (`build_options`: an
unknown key or a wrong type stops the run, naming the key) and which reaches the loop as
`settings.options`; what it reports per trajectory beyond the token counts comes back in
`TrajectoryStats.metrics`, which the trainer logs as `agent/<name>`. A loop that can tell a
trajectory that took no action (neither called a tool nor answered) reports it as the metric
`no_action` (1 or 0), which the trainer's health watch reads (`trainer.health.no_action_rise`).
"""
from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from omegaconf import OmegaConf

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
    options: Any = None               # the loop's own options: an instance of its class's Options dataclass


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


def build_options(loop_cls: type, given: dict[str, Any] | None, where: str) -> Any:
    """`given` (the config section `where` of the loop's options) as an instance of `loop_cls.Options`.
    An unknown key, also inside a nested section, or a wrong type raises ConfigError naming it."""
    from verl.config.schema import ConfigError
    name = f"{loop_cls.__module__}:{loop_cls.__name__}"
    options_cls = getattr(loop_cls, "Options", None)
    if options_cls is None or not dataclasses.is_dataclass(options_cls):
        raise ConfigError(f"the agent loop {name} declares no options dataclass (its class attribute Options)")
    given = dict(given or {})
    for dotted, known in _unknown_keys(options_cls(), given, ""):
        raise ConfigError(f"{where}.{dotted}: the agent loop {name} has no such option; its options here: "
                          f"{', '.join(known)}")
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(options_cls), given))
    except Exception as e:  # OmegaConf names the key and the expected type
        key, message = getattr(e, "full_key", None), getattr(e, "msg", str(e))
        raise ConfigError(f"{where}.{key}: {message}" if key else f"{where}: {message}") from None


def _unknown_keys(defaults: Any, given: dict, prefix: str):
    """(dotted key, the known names beside it) for each key of `given` the dataclass `defaults` lacks."""
    known = {f.name: getattr(defaults, f.name) for f in dataclasses.fields(defaults)}
    for key, value in given.items():
        if key not in known:
            yield prefix + str(key), sorted(known)
        elif dataclasses.is_dataclass(known[key]) and isinstance(value, dict):
            yield from _unknown_keys(known[key], value, f"{prefix}{key}.")
