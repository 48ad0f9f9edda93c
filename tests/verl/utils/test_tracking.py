"""trainer.logger's backends write what the trainer logs where verl users look for it, and one whose
package is missing stops the run at start-up. What TensorBoard and MLflow wrote is read back with
their own readers (EventAccumulator, MlflowClient on a local store); without the package
(`pip install 'search-r1[test]'` installs both) those tests are skipped and say so."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from verl.utils.tracking import BACKENDS, Tracker, check_backends

ROOT = Path(__file__).resolve().parents[3]
CONFIG = {"trainer": {"project_name": "proj", "logger": ["console", "mlflow"], "total_epochs": 2},
          "data": {"train_files": ["a.parquet", "b.parquet"], "val_files": None},
          "actor_rollout_ref": {"actor": {"optim": {"lr": 1e-6}}}}
STEPS = {1: {"reward/mean": 0.25, "response/length": 120, "timing_s/step": 3.5, "reward/em@nq": 0.5,
             "note": "not a number"},
         2: {"reward/mean": 0.5, "response/length": 96, "timing_s/step": 3.25, "reward/em@nq": 0.75,
             "health/alarms": True, "val//em": 0.5}}


def run_tracker(backends, out_dir, project="proj", experiment="exp"):
    tracker = Tracker(backends, str(out_dir), project, experiment, CONFIG)
    for step, metrics in STEPS.items():
        tracker.log(dict(metrics), step=step)
    tracker.finish()
    return tracker


def test_tensorboard_event_files_in_verls_directory_read_back(tmp_path, monkeypatch, caplog):
    pytest.importorskip("tensorboard", reason="the tensorboard package is not installed (pip install tensorboard, "
                                               "or pip install 'search-r1[test]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    with caplog.at_level("WARNING", logger="verl.utils.tracking"):
        run_tracker(["console", "tensorboard"], tmp_path / "run")
    assert "metric note is a str" in caplog.text  # what cannot be plotted is said, once
    events = EventAccumulator(str(tmp_path / "tensorboard_log" / "proj" / "exp"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"reward/mean", "response/length", "timing_s/step", "reward/em@nq",
                                             "health/alarms", "val//em"}
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(1, 0.25), (2, 0.5)]
    assert [(e.step, e.value) for e in events.Scalars("response/length")] == [(1, 120.0), (2, 96.0)]
    assert [(e.step, e.value) for e in events.Scalars("health/alarms")] == [(2, 1.0)]

    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "elsewhere"))
    run_tracker(["tensorboard"], tmp_path / "run2")
    events = EventAccumulator(str(tmp_path / "elsewhere"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("timing_s/step")] == [(1, 3.5), (2, 3.25)]


def mlflow_run(uri: str, project: str = "proj"):
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(project)
    [run] = client.search_runs([experiment.experiment_id])
    return client, run


def test_mlflow_run_in_a_local_store_reads_back(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="the mlflow package is not installed (pip install mlflow, "
                                         "or pip install 'search-r1[test]')")
    from verl.utils.tracking import mlflow_tracking_uri
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert mlflow_tracking_uri() == f"sqlite:///{tmp_path / 'mlflow.db'}"  # the default: ./mlflow.db
    # The test extra installs mlflow-skinny, which has no SQL store: a local file store, which it
    # still writes when allowed, stands in for the database (the same client calls write both).
    store = f"file:{tmp_path / 'mlruns'}"
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    run_tracker(["console", "jsonl", "mlflow"], tmp_path / "run")
    client, run = mlflow_run(store)
    assert run.info.run_name == "exp" and run.info.status == "FINISHED"

    def history(key):
        return [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
    assert history("reward/mean") == [(1, 0.25), (2, 0.5)]
    assert history("response/length") == [(1, 120.0), (2, 96.0)]
    assert history("reward/em_nq") == [(1, 0.5), (2, 0.75)]  # '@' is not a name MLflow takes
    assert history("val/em") == [(2, 0.5)]  # nor a path that is not normalized
    assert "note" not in run.data.metrics
    params = run.data.params
    assert params["trainer/total_epochs"] == "2" and params["actor_rollout_ref/actor/optim/lr"] == "1e-06"
    assert json.loads(params["data/train_files"]) == ["a.parquet", "b.parquet"]
    # the JSONL beside it still has everything, the text included
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["note"] == "not a number"

    # a second store, elsewhere; the run goes where MLFLOW_TRACKING_URI says
    store = f"file:{tmp_path / 'elsewhere'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    run_tracker(["mlflow"], tmp_path / "run2", experiment="exp2")
    assert mlflow_run(store)[1].info.run_name == "exp2"


@pytest.mark.parametrize("backend", ["tensorboard", "mlflow", "wandb"])
def test_a_backend_without_its_package_stops_the_run_at_start_up(backend, tmp_path, monkeypatch):
    """The package made unimportable (as when it is not installed): the trainer stops right after
    reading its config, before the model or any worker, and names the package to install."""
    from hydra import compose, initialize_config_dir

    from verl.config.schema import ConfigError
    from verl.trainer.main_ppo import run

    monkeypatch.setitem(sys.modules, backend, None)
    with pytest.raises(ImportError, match=f"trainer.logger={backend} needs the {backend} package.*pip install "
                                          f"{backend}"):
        check_backends(["console", backend])
    with pytest.raises(ImportError, match=f"pip install {backend}"):
        Tracker(["console", backend], str(tmp_path), "proj", "exp", {})
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        raw = compose("ppo_trainer", overrides=[f"trainer.logger=[console,{backend}]",
                                                f"actor_rollout_ref.model.path={tmp_path / 'no-model'}",
                                                f"trainer.default_local_dir={tmp_path / 'run'}",
                                                f"data.train_files={tmp_path / 'train.parquet'}"])
    with pytest.raises(ConfigError, match=f"needs the {backend} package"):
        run(raw)
    assert not (tmp_path / "run").exists()


def test_mlflow_names_are_ones_mlflow_takes():
    """MLflow refuses a name with other characters, or one that is not a normalized path, and with
    it the whole batch of the step: every metric name is made one it takes, distinct ones kept apart."""
    import posixpath
    import re

    from verl.utils.tracking import mlflow_name
    names = {key: mlflow_name(key) for key in ["reward/em@nq", "reward/em/nq", "/val//em/", "a/./b", "../up",
                                               "critic/", "timing_s/step", "x" * 300, "", "reward/em nq-1.5"]}
    for name in names.values():
        assert re.fullmatch(r"[/\w.\- ]+", name) and posixpath.normpath(name) == name and len(name) <= 250
    assert names["reward/em@nq"] == "reward/em_nq" and names["/val//em/"] == "val/em"
    assert names["timing_s/step"] == "timing_s/step" and names["reward/em nq-1.5"] == "reward/em nq-1.5"


def test_unknown_backend_names_the_known_ones():
    with pytest.raises(ValueError, match="use " + ", ".join(BACKENDS)):
        check_backends(["console", "swanlab"])
    assert {"console", "jsonl", "wandb", "tensorboard", "mlflow"} == set(BACKENDS)
