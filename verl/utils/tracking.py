"""Metrics to the console, a JSONL file and Weights & Biases (offline mode needs no account)."""
from __future__ import annotations

import json
import logging
import os
import time

log = logging.getLogger(__name__)


class Tracker:
    def __init__(self, backends: list[str], out_dir: str, project: str, experiment: str, config: dict):
        unknown = set(backends) - {"console", "jsonl", "wandb"}
        if unknown:
            raise ValueError(f"trainer.logger has unknown backends {sorted(unknown)}; use console, jsonl, wandb")
        self.backends = set(backends)
        os.makedirs(out_dir, exist_ok=True)
        self.jsonl_path = os.path.join(out_dir, "metrics.jsonl")
        self.wandb = None
        if "wandb" in self.backends:
            import wandb  # WANDB_MODE=offline logs to ./wandb without an account
            self.wandb = wandb.init(project=project, name=experiment, config=config, dir=out_dir)

    def log(self, metrics: dict, step: int):
        metrics = {k: (float(v) if hasattr(v, "__float__") and not isinstance(v, (int, float)) else v)
                   for k, v in metrics.items()}
        if "console" in self.backends:
            keys = sorted(k for k in metrics if not k.startswith("timing_s/")) + \
                sorted(k for k in metrics if k.startswith("timing_s/"))
            log.info("step %d | %s", step, " | ".join(f"{k}={_fmt(metrics[k])}" for k in keys))
        if "jsonl" in self.backends:
            with open(self.jsonl_path, "a") as f:
                f.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def rewind(self, step: int) -> None:
        """Drop the rows of steps after `step` from metrics.jsonl: a run resumed from the checkpoint of
        `step` trains those steps again, and each step is to be listed once. The file is rewritten
        whole into a new one that then replaces it, so a crash meanwhile leaves the old or the new
        file, never a part. A row cut off by an earlier crash is dropped too (it says so)."""
        if not os.path.exists(self.jsonl_path):
            return
        kept, later, broken = [], 0, 0
        with open(self.jsonl_path) as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    row_step = json.loads(line)["step"]
                except (ValueError, KeyError, TypeError):
                    broken += 1
                    continue
                if row_step <= step:
                    kept.append(line if line.endswith("\n") else line + "\n")
                else:
                    later += 1
        if not later and not broken:
            return
        tmp = self.jsonl_path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.jsonl_path)
        log.warning("%s: dropped %d row(s) of steps after step %d, which this run trains again%s", self.jsonl_path,
                    later, step, f", and {broken} unreadable row(s) (cut off by a crash)" if broken else "")

    def finish(self):
        if self.wandb is not None:
            self.wandb.finish()


def _fmt(v):
    return f"{v:.4g}" if isinstance(v, float) else str(v)
