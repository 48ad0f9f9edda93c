"""Metrics to the console, a JSONL file, Weights & Biases, TensorBoard and MLflow (`trainer.logger`).

The backends keep verl's names, and TensorBoard and MLflow verl's places, so a verl user's
`trainer.logger=[console,tensorboard]` writes where they look for it:
- tensorboard: event files in `$TENSORBOARD_DIR`, else `tensorboard_log/<project_name>/<experiment_name>`
  (relative to the working directory), through `torch.utils.tensorboard` (needs the `tensorboard`
  package);
- mlflow: the experiment `<project_name>`, a run named `<experiment_name>`, at `$MLFLOW_TRACKING_URI`.
  Deviation from verl, whose default is an SQLite file in /tmp shared by every user of the machine:
  without the variable, the SQLite database `./mlflow.db` in the working directory, MLflow's own
  default since 3.7 (`mlflow ui` started there reads it; older versions need
  `--backend-store-uri sqlite:///mlflow.db`). Not the file store `./mlruns`, MLflow's older default:
  it is deprecated there, and recent versions refuse it without an opt-in; a `file:` URI in the
  variable is used as given. Metric names keep the characters MLflow takes, any other becomes `_`
  (verl replaces `@` only); the config goes in as parameters, flattened with `/`.
- wandb: `WANDB_MODE=offline` logs to `<out_dir>/wandb` without an account.
A backend whose package is missing stops the run at start-up (`check_backends`), naming the package.
Values that are not numbers (none of the trainer's metrics) go to the console and JSONL only; each
such key is logged once as a warning.
"""
from __future__ import annotations

import importlib
import json
import logging
import os
import re
import time
from pathlib import Path

log = logging.getLogger(__name__)

BACKENDS = ("console", "jsonl", "wandb", "tensorboard", "mlflow")
# The package each backend imports (and the extra of pyproject.toml that installs it).
PACKAGES = {"wandb": "wandb", "tensorboard": "tensorboard", "mlflow": "mlflow"}


def check_backends(backends: list[str]) -> None:
    """Unknown names raise ValueError, missing packages ImportError, each naming what to do."""
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown:
        raise ValueError(f"trainer.logger has unknown backends {unknown}; use {', '.join(BACKENDS)}")
    for backend in backends:
        package = PACKAGES.get(backend)
        if package is None:
            continue
        try:
            importlib.import_module(package)
        except ImportError as e:
            raise ImportError(f"trainer.logger={backend} needs the {package} package, which cannot be imported "
                              f"({e}): pip install {package} (or pip install 'search-r1[{backend}]'), or drop "
                              f"{backend} from trainer.logger") from None


class Tracker:
    def __init__(self, backends: list[str], out_dir: str, project: str, experiment: str, config: dict):
        check_backends(backends)
        self.backends = set(backends)
        os.makedirs(out_dir, exist_ok=True)
        self.jsonl_path = os.path.join(out_dir, "metrics.jsonl")
        self._not_numbers: set[str] = set()
        self.wandb = None
        if "wandb" in self.backends:
            import wandb  # WANDB_MODE=offline logs to ./wandb without an account
            self.wandb = wandb.init(project=project, name=experiment, config=config, dir=out_dir)
        self.tensorboard = TensorBoardLog(project, experiment) if "tensorboard" in self.backends else None
        self.mlflow = MlflowLog(project, experiment, config) if "mlflow" in self.backends else None

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
        if self.tensorboard is not None or self.mlflow is not None:
            numbers = self._numbers(metrics)
            if self.tensorboard is not None:
                self.tensorboard.log(numbers, step)
            if self.mlflow is not None:
                self.mlflow.log(numbers, step)

    def _numbers(self, metrics: dict) -> dict[str, float]:
        """The metrics TensorBoard and MLflow can plot (bools count as 0/1)."""
        numbers = {}
        for k, v in metrics.items():
            if isinstance(v, (int, float)):
                numbers[k] = float(v)
            elif k not in self._not_numbers:
                self._not_numbers.add(k)
                log.warning("metric %s is a %s, not a number: logged to the console and JSONL only",
                            k, type(v).__name__)
        return numbers

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
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.mlflow is not None:
            self.mlflow.close()


def tensorboard_dir(project: str, experiment: str) -> Path:
    """verl's place for the event files: $TENSORBOARD_DIR, else tensorboard_log/<project>/<experiment>."""
    return Path(os.environ.get("TENSORBOARD_DIR") or Path("tensorboard_log", project, experiment))


class TensorBoardLog:
    """Scalars as TensorBoard event files, flushed every step: a run that dies keeps its curves."""

    def __init__(self, project: str, experiment: str):
        from torch.utils.tensorboard import SummaryWriter

        self.dir = tensorboard_dir(project, experiment)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(log_dir=str(self.dir))
        log.info("TensorBoard event files in %s", self.dir)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def mlflow_tracking_uri() -> str:
    """$MLFLOW_TRACKING_URI, else the SQLite database ./mlflow.db (its absolute path: the workers or a
    later chdir do not move it)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path('mlflow.db').resolve()}"


# MLflow takes letters, digits, and _ - . space / in metric and parameter names (: too on some
# systems), of at most 250 characters, and refuses one that is not a normalized path ("a//b", "/a",
# "a/./b", "../a"): any of these would fail the whole batch, and with it the step.
_MLFLOW_UNSAFE = re.compile(r"[^\w\-. /]")
MLFLOW_MAX_NAME = 250


def mlflow_name(key: str) -> str:
    parts = [p for p in _MLFLOW_UNSAFE.sub("_", key).split("/") if p not in ("", ".")]
    return "/".join("__" if p == ".." else p for p in parts)[:MLFLOW_MAX_NAME] or "_"


class MlflowLog:
    """One MLflow run: experiment `project`, run name `experiment`, the config as its parameters.

    Through `MlflowClient` rather than mlflow's module-level active run, so nothing else in the
    process (a library that starts runs of its own) can log into it or end it."""

    # MLflow's per-request limits of log_batch (parameters, metrics).
    MAX_PARAMS, MAX_METRICS = 100, 1000

    def __init__(self, project: str, experiment: str, config: dict | None):
        from mlflow.tracking import MlflowClient

        self.uri = mlflow_tracking_uri()
        self.client = MlflowClient(tracking_uri=self.uri)
        found = self.client.get_experiment_by_name(project)
        experiment_id = found.experiment_id if found is not None else self.client.create_experiment(project)
        self.run_id = self.client.create_run(experiment_id, run_name=experiment).info.run_id
        self._log_params(config or {})
        log.info("MLflow run %s (experiment %s) at %s", self.run_id, project, self.uri)

    def _log_params(self, config: dict) -> None:
        from mlflow.entities import Param
        try:
            from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH as limit
        except ImportError:
            limit = 500  # the oldest servers' limit
        params = flatten(config)
        cut = [k for k, v in params.items() if len(v) > limit]
        if cut:
            log.info("MLflow: %d config values longer than %d characters are cut there (e.g. %s); "
                     "config.yaml in the run's directory has them whole", len(cut), limit, cut[0])
        items = [Param(mlflow_name(k), v[:limit]) for k, v in params.items()]
        for lo in range(0, len(items), self.MAX_PARAMS):
            self.client.log_batch(self.run_id, params=items[lo:lo + self.MAX_PARAMS])

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        items = [Metric(mlflow_name(k), v, now, step) for k, v in metrics.items()]
        for lo in range(0, len(items), self.MAX_METRICS):
            self.client.log_batch(self.run_id, metrics=items[lo:lo + self.MAX_METRICS])

    def close(self) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED")


def flatten(config: dict, prefix: str = "") -> dict[str, str]:
    """Nested config → {"a/b/c": "value"}; lists and scalars as JSON text (verl joins keys with `/`)."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "/"))
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value, default=str)
    return out


def _fmt(v):
    return f"{v:.4g}" if isinstance(v, float) else str(v)
