"""The agent loop a config names, and what it is built with: the loop's class
(`actor_rollout_ref.rollout.agent_loop: "package.module:Class"`, default SingleTurnLoop), its options
checked against the options dataclass it declares, and the settings every loop gets."""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from verl.config.load import agent_loop_spec
from verl.config.options import options_from_config
from verl.config.schema import ConfigError, TrainerConfig
from verl.workers.rollout.agent_loop import AgentLoop, AgentLoopSettings
from verl.workers.rollout.single_turn import SingleTurnLoop


def load_agent_loop(spec: str | None) -> type[AgentLoop]:
    """'module:Class' → the class; None → SingleTurnLoop."""
    if not spec:
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
    name = f"{loop_cls.__module__}:{loop_cls.__name__}"
    options_cls = getattr(loop_cls, "Options", None)
    if options_cls is None or not dataclasses.is_dataclass(options_cls):
        raise ConfigError(f"the agent loop {name} declares no options dataclass (its class attribute Options)")
    return options_from_config(options_cls, given, where, f"the agent loop {name}")


def agent_schedule(rollout, device: str) -> str:
    """The agent loop's schedule (rollout.schedule; auto: continuous where the engine can step, i.e.
    vLLM, on a GPU, and sync otherwise)."""
    if rollout.schedule != "auto":
        return rollout.schedule
    return "continuous" if rollout.name == "vllm" and device == "cuda" else "sync"


def agent_loop_settings(cfg: TrainerConfig, device: str) -> AgentLoopSettings:
    """The agent loop's settings, for the workers and the driver's preflight. Its options are checked
    against the options dataclass of its class: with rollout.multi_turn.enable, verl's multi_turn
    keys (the tool-calling loop's); in any case rollout.agent_kwargs, over them."""
    rollout = cfg.actor_rollout_ref.rollout
    given = dataclasses.asdict(rollout.multi_turn) if rollout.multi_turn.enable else {}
    options = build_options(load_agent_loop(agent_loop_spec(cfg)), given | dict(rollout.agent_kwargs or {}),
                            "actor_rollout_ref.rollout.agent_kwargs")
    return AgentLoopSettings(max_tokens_per_turn=cfg.data.max_response_length, max_obs_length=cfg.data.max_obs_length,
                             schedule=agent_schedule(rollout, device), admit_every_steps=rollout.admit_every_steps,
                             options=options, chat_template_kwargs=dict(cfg.data.apply_chat_template_kwargs or {}))
