"""Failed searches (tool calls) in training: counted, masked out of the loss, and past
actor_rollout_ref.rollout.max_tool_failure_rate the step stops before anything is trained or saved. A retriever that is
down stops the trainer at start-up, before Ray and the workers."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import free_port
from verl.config.schema import TrainerConfig
from verl.trainer.ppo_trainer import PPOTrainer, ToolFailures
from verl.trainer.resume import trim_data_order
from verl.workers.rollout.agent_loop import TrajectoryStats

ROOT = Path(__file__).resolve().parents[3]


def batch_with(calls_and_failures):
    """(tool calls, failed) per trajectory."""
    stats = [TrajectoryStats("answer", 4, 4, tool_calls=calls, tool_failed=failed)
             for calls, failed in calls_and_failures]
    n = len(stats)
    return SimpleNamespace(info={"stats": stats}, loss_mask_BR=torch.ones(n, 4), response_mask_BR=torch.ones(n, 4))


def trainer(max_failure_rate=0.5):
    cfg = TrainerConfig()
    cfg.actor_rollout_ref.rollout.max_tool_failure_rate = max_failure_rate
    return SimpleNamespace(cfg=cfg, step=6)


def test_failed_searches_are_counted_and_masked_out_of_the_loss():
    stats = [(1, True), (2, False), (0, False), (1, False)]
    batch = batch_with(stats)
    metrics = PPOTrainer.drop_failed_tool_calls(trainer(), batch)
    assert metrics == {"agent/tool_failures": 1.0, "agent/tool_failure_rate": pytest.approx(1 / 3)}
    assert batch.loss_mask_BR[0].sum() == 0 and batch.response_mask_BR[0].sum() == 0
    assert batch.loss_mask_BR[1:].sum() == 12  # the others keep every token


def test_too_many_failures_stop_the_step_with_the_cause():
    stats = [(1, True)] * 3 + [(1, False)]
    batch = batch_with(stats)
    with pytest.raises(ToolFailures, match=r"step 7: 3 of 4 tool-calling trajectories .*rollout.max_tool_failure_rate=0.5"):
        PPOTrainer.drop_failed_tool_calls(trainer(), batch)
    assert batch.loss_mask_BR.sum() == 16  # nothing was changed: the step is not trained at all


@pytest.mark.e2e  # launches the trainer
def test_a_retriever_that_is_down_stops_the_trainer_at_start_up(tmp_path):
    url = f"http://127.0.0.1:{free_port()}/retrieve"  # nothing listens there
    r = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", f"data.train_files={tmp_path / 'x.parquet'}",
                        "actor_rollout_ref.model.path=unused", "trainer.device=cpu",
                        "actor_rollout_ref.rollout.agent_loop=search_r1.agent.loop:SearchAgentLoop",
                        "reward.function=search_r1.rewards:score_for", f"retriever.url={url}",
                        f"hydra.run.dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "start-up check failed" in r.stderr and url in r.stderr


def test_a_resumed_run_lists_each_step_once_in_data_order(tmp_path):
    import json
    lines = [json.dumps({"step": s, "indices": [s]}) + "\n" for s in (1, 2, 3)]
    (tmp_path / "data_order.jsonl").write_text("".join(lines))
    trim_data_order(str(tmp_path), step=2)  # step 3 ran but was not saved
    assert [json.loads(l)["step"] for l in (tmp_path / "data_order.jsonl").read_text().splitlines()] == [1, 2]
