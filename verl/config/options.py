"""The options of a part the config names by its code (an agent loop, a reward function): the part
declares them as a dataclass, every field with its default, and the config's free mapping of them
(`actor_rollout_ref.rollout.agent_kwargs`, `reward.reward_kwargs`) is checked against it at start-up.
The trainer thus passes keys it does not know, and still refuses a misspelt or mistyped one, naming it."""
from __future__ import annotations

import dataclasses
from typing import Any

from omegaconf import OmegaConf

from verl.config.schema import ConfigError


def options_from_config(options_cls: type, given: dict[str, Any] | None, where: str, owner: str) -> Any:
    """`given` (the config section `where`) as an instance of the dataclass `options_cls`, which `owner`
    (e.g. "the agent loop package.module:Class") declares. An unknown key, also inside a nested
    section, a wrong type or a value its dataclass refuses (ValueError in `__post_init__`) raises
    ConfigError naming the key or the section."""
    given = dict(given or {})
    for dotted, known in _unknown_keys(options_cls(), given, ""):
        raise ConfigError(f"{where}.{dotted}: {owner} has no such option; its options here: {', '.join(known)}")
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(options_cls), given))
    except Exception as e:  # OmegaConf names the key and the expected type; a dataclass's own check, the values
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
