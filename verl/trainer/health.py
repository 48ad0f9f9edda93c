"""Signs that a run is collapsing, read from each step's metrics (`trainer.health`).

GRPO runs can collapse: the reward falls to zero, the entropy explodes into gibberish, the KL to the
reference runs away, the loss turns NaN. `HealthWatch` reads a step's metrics and names the signs it
sees; the trainer decides what to do (warn, stop, or roll back to a checkpoint saved while healthy,
see `PPOTrainer.respond_to_collapse_signs`). The watch is plain data, saved with every checkpoint,
so a resumed run compares against the same history.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from verl.config.schema import HealthConfig

# The share of trajectories that took no action: the mean of the agent loop's own per-trajectory
# metric `no_action` (e.g. neither called a tool nor answered), logged as agent/<name> by the trainer.
NO_ACTION = "agent/no_action"


# The metrics the signs read (the KL under either of its names): a nan or inf in one is a sign of
# its own, whether or not its threshold is set, and never enters the history.
WATCHED = ("entropy", "kl_loss", "kl/reward_kl", "val/reward/em", NO_ACTION)


class Unhealthy(RuntimeError):
    """The run showed a collapse sign and trainer.health.action says stop (or rollbacks ran out)."""


def _not_finite(value) -> bool:
    return isinstance(value, (int, float)) and not math.isfinite(value)


def non_finite_metrics(metrics: dict) -> list[str]:
    """Names of the losses and gradient norms in `metrics` (pg_loss, kl_loss, critic/vf_loss, grad_norm, …)
    that are nan or inf."""
    return sorted(k for k, v in metrics.items()
                  if k.endswith(("loss", "grad_norm")) and isinstance(v, (int, float)) and not math.isfinite(v))


@dataclass
class HealthWatch:
    cfg: HealthConfig
    entropy: deque = field(default_factory=deque)        # the previous steps' values, newest last
    no_action: deque = field(default_factory=deque)
    best_val: float | None = None
    best_val_step: int = 0
    healthy_saves: list[int] = field(default_factory=list)  # checkpoint steps saved with no sign showing
    rollbacks: int = 0

    def check(self, step: int, metrics: dict) -> list[str]:
        """The signs this step's metrics show, each as a sentence; a step that shows none joins the
        history the next steps are compared with."""
        c = self.cfg
        broken = non_finite_metrics(metrics)
        broken += [k for k in WATCHED if k not in broken and _not_finite(metrics.get(k))]
        # A nan compares false with every threshold, so the checks below would pass it: it is a sign
        # here, and a step with a sign never joins the history.
        signs = [f"{k}={metrics[k]} is not finite" for k in broken]
        metrics = {k: v for k, v in metrics.items() if k not in broken}   # the thresholds read finite values
        entropy = metrics.get("entropy")
        if c.entropy_spike is not None and entropy is not None and len(self.entropy) >= 3:
            # Up: the policy writes gibberish. Down: it collapses onto one output in a few steps
            # (e.g. a learning rate far too high); learning lowers entropy too, but not that fast.
            median = statistics.median(self.entropy)
            if entropy > c.entropy_spike * median:
                signs.append(f"entropy {entropy:.3g} is above {c.entropy_spike:g}× its median {median:.3g} "
                             f"of the previous {len(self.entropy)} steps (trainer.health.entropy_spike)")
            elif entropy * c.entropy_spike < median:
                signs.append(f"entropy {entropy:.3g} is below 1/{c.entropy_spike:g} of its median {median:.3g} "
                             f"of the previous {len(self.entropy)} steps (trainer.health.entropy_spike)")
        kl = metrics.get("kl_loss", metrics.get("kl/reward_kl"))
        if c.max_kl is not None and kl is not None and kl > c.max_kl:
            signs.append(f"KL to the reference {kl:.3g} is above trainer.health.max_kl={c.max_kl:g}")
        val = metrics.get("val/reward/em")
        if c.val_drop is not None and val is not None and self.best_val is not None \
                and val < self.best_val - c.val_drop:
            signs.append(f"validation EM {val:.3f} is more than {c.val_drop:g} below its best {self.best_val:.3f} "
                         f"(step {self.best_val_step}; trainer.health.val_drop)")
        share = metrics.get(NO_ACTION)
        if c.no_action_rise is not None and share is not None and self.no_action:   # one step is a baseline
            low = min(self.no_action)
            if share > low + c.no_action_rise:
                signs.append(f"{share:.0%} of the trajectories took no action ({NO_ACTION}), up from {low:.0%} "
                             f"within the previous {len(self.no_action)} steps (trainer.health.no_action_rise)")
        if signs:   # the history holds healthy steps only: a collapse never becomes the norm
            return signs
        for history, value in ((self.entropy, entropy), (self.no_action, share)):
            if value is not None:
                history.append(value)
                while len(history) > c.window:
                    history.popleft()
        if val is not None and (self.best_val is None or val > self.best_val):
            self.best_val, self.best_val_step = val, step
        return signs

    def saved(self, step: int, healthy: bool) -> None:
        if healthy:
            self.healthy_saves.append(step)

    def rollback_target(self, kept: list[int], signs: list[str]) -> int | None:
        """The checkpoint to go back to: the newest of those on disk (`kept`) saved while healthy;
        for a validation drop, the newest of those saved by the best validation step, where one is kept."""
        healthy = sorted(set(kept) & set(self.healthy_saves))
        if not healthy:
            return None
        if any("validation EM" in s for s in signs):
            before_best = [s for s in healthy if s <= self.best_val_step]
            if before_best:
                return before_best[-1]
        return healthy[-1]

    def rolled_back(self, target: int) -> None:
        """Checkpoints saved after `target` belong to the abandoned path: never go back to them."""
        self.rollbacks += 1
        self.healthy_saves = [s for s in self.healthy_saves if s <= target]

    def state(self) -> dict:
        return {"entropy": list(self.entropy), "no_action": list(self.no_action), "best_val": self.best_val,
                "best_val_step": self.best_val_step, "healthy_saves": list(self.healthy_saves),
                "rollbacks": self.rollbacks}

    def restore(self, state: dict) -> None:
        self.entropy, self.no_action = deque(state["entropy"]), deque(state["no_action"])
        self.best_val, self.best_val_step = state["best_val"], state["best_val_step"]
        self.healthy_saves, self.rollbacks = list(state["healthy_saves"]), state["rollbacks"]
