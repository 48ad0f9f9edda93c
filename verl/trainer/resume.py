"""The run's checkpoints, as the step loop uses them: saving the policy's and the critic's halves
together, resuming from the newest checkpoint that verifies, and rolling back to an earlier one when
the health watch asks for it. A checkpoint that fails verification is skipped, naming the file, and
the one before it is tried."""
from __future__ import annotations

import json
import logging
import os

from verl.checkpoint.export import export_hf
from verl.checkpoint.manifest import CheckpointCorrupt, verify_checkpoint
from verl.checkpoint.store import checkpoint_dir, complete_steps, resume_steps
from verl.config.schema import TrainerConfig

log = logging.getLogger(__name__)


class Checkpoints:
    """The checkpoints under <trainer.default_local_dir>/checkpoints: the policy's there, the critic's
    under critic/. `policy`, `critic`: the worker groups (critic None without one)."""

    def __init__(self, cfg: TrainerConfig, policy, critic, out_dir: str):
        self.cfg, self.policy, self.critic = cfg, policy, critic
        self.root = os.path.join(out_dir, "checkpoints")
        self.hf_dir = os.path.join(out_dir, "hf_actor")

    def save(self, step: int, state: dict) -> None:
        """Checkpoint `step` with the trainer state `state`, on every worker; then the actor's export
        (trainer.export_hf_on_save)."""
        root, keep = self.root, self.cfg.trainer.keep_last_checkpoints
        if self.critic is not None:  # the critic first: the actor's `latest` marks a complete step
            self.critic.get([w.save.remote(root, step, state, keep) for w in self.critic.workers], "save", step)
        self.policy.get([w.save.remote(root, step, state, keep) for w in self.policy.workers], "save", step)
        if self.cfg.trainer.export_hf_on_save:
            export_hf(checkpoint_dir(root, step), "actor", self.hf_dir, self.cfg.actor_rollout_ref.model.path,
                      overwrite=True)

    def load_newest(self) -> dict | None:
        """Load the newest checkpoint that verifies: one whose files fail their checksums, lack a
        manifest (unless trainer.allow_unverified_checkpoint) or cannot be read is skipped with a
        warning naming the file, and the one before it is tried. The trainer state saved with it, or
        None where there is no checkpoint; raises where there are some and none verifies."""
        failed = []
        for step in self.candidates():
            try:
                state = self.load(step, "resume", at=None)
            except CheckpointCorrupt as error:
                error = getattr(error, "cause", error)  # what the worker raised, without Ray's wrapping
                failed.append(str(error))
                log.warning("%s; trying the checkpoint before it", error)
                continue
            log.info("resumed from step %d (%s)", step, self.root)
            return state
        if failed:
            raise RuntimeError(
                f"No checkpoint under {self.root} verifies: {'; '.join(failed)}. To start fresh, set "
                f"trainer.resume_mode=disable (the checkpoints are left as they are) or a new "
                f"trainer.default_local_dir.")
        return None

    def candidates(self) -> list[int]:
        """Steps to resume from, newest first; with a critic, only steps it saved too (it saves
        first: a step without the actor's half is incomplete)."""
        steps = resume_steps(self.root)
        if self.critic is not None:
            critic_steps = set(complete_steps(os.path.join(self.root, "critic")))
            steps = [s for s in steps if s in critic_steps]
        return steps

    def load(self, step: int, what: str, at: int | None) -> dict:
        """Load checkpoint `step` into every worker (the policy's, then the critic's), for `what`
        (resume, rollback) at training step `at`; the trainer state saved with it. Raises
        CheckpointCorrupt where a file fails verification."""
        state = self.policy.get([w.load.remote(self.root, step) for w in self.policy.workers], what, at)[0]
        if self.critic is not None:
            self.critic.get([w.load.remote(self.root, step) for w in self.critic.workers], what, at)
        return state

    def newest_intact(self) -> tuple[int | None, list[str]]:
        """The newest checkpoint whose files verify (both halves with a critic), checked here on the
        driver without loading it; and why each newer one failed."""
        allow, failed = self.cfg.trainer.allow_unverified_checkpoint, []
        for step in self.candidates():
            try:
                verify_checkpoint(checkpoint_dir(self.root, step), allow)
                if self.critic is not None:
                    verify_checkpoint(checkpoint_dir(os.path.join(self.root, "critic"), step), allow)
            except CheckpointCorrupt as error:
                failed.append(str(error))
                continue
            return step, failed
        return None, failed

    def roll_back(self, pick, at: int, failed: list[str]) -> int | None:
        """Load the checkpoint `pick(kept steps)` chooses to go back to (the health watch's choice) at
        training step `at`; where it fails verification, the one it picks among those left, and so
        on. The step loaded, or None; `failed` gets why each checkpoint tried was refused."""
        kept = complete_steps(self.root)
        while (target := pick(kept)) is not None:
            try:
                self.load(target, "rollback", at=at)
                return target
            except CheckpointCorrupt as error:
                error = getattr(error, "cause", error)  # what the worker raised, without Ray's wrapping
                failed.append(str(error))
                log.warning("%s; rolling back to an earlier checkpoint instead", error)
                kept.remove(target)
        return None


def trim_data_order(out_dir: str, step: int) -> None:
    """Drop the data_order.jsonl lines of steps after `step`, the one resumed from: those steps are
    trained again, and each step is to be listed once."""
    path = os.path.join(out_dir, "data_order.jsonl")
    if not os.path.exists(path):
        return
    with open(path) as f:
        kept = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    with open(path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)
