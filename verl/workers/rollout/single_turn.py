"""Default agent loop: one generation per prompt, no tools. Agent loops are named in the config
(`actor_rollout_ref.rollout.agent_loop: "module:Class"`); each is built as
`Class(engine, **options)` and returns, per prompt, an object with `response_ids`, `loss_mask`,
`finish` and `stats()`."""
from __future__ import annotations

from dataclasses import dataclass, field

from verl.workers.rollout.engines import SamplingConfig


@dataclass
class Completion:
    response_ids: list[int]
    loss_mask: list[int]
    finish: str
    extra: dict = field(default_factory=dict)

    def stats(self) -> dict:
        return {"turns": 1, "finish": self.finish, "response_tokens": len(self.response_ids),
                "model_tokens": len(self.response_ids)}


class PreflightError(RuntimeError):
    """An agent loop's tool is not ready: the trainer stops before starting its workers."""


class SingleTurnLoop:
    def __init__(self, engine, max_response_length: int = 512, **_ignored):
        self.engine, self.max_response_length = engine, max_response_length

    @classmethod
    def preflight(cls, **settings) -> None:
        """Checked by the driver before any worker starts (an agent loop's tools, say); nothing here."""

    def run(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[Completion]:
        sampling = SamplingConfig(sampling.temperature, sampling.top_p,
                                  min(sampling.max_tokens, self.max_response_length), sampling.seed)
        gens = self.engine.generate(prompts, sampling, stop=[])
        return [Completion(g.token_ids, [1] * len(g.token_ids),
                           "length" if g.finish_reason == "length" else "eos") for g in gens]


def load_agent_loop(spec: str | None):
    """'module:Class' → the class; None → SingleTurnLoop."""
    if not spec:
        return SingleTurnLoop
    import importlib
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"actor_rollout_ref.rollout.agent_loop={spec!r} cannot be loaded ({e}); "
                         "give it as 'package.module:ClassName'") from None
