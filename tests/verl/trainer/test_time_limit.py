"""trainer.time_limit_minutes: the stopping rule of `PPOTrainer.fit` and the key's way through the
config. The loop itself (stop, validate, save, resume) runs in test_main_ppo's resumed run."""
from pathlib import Path

from omegaconf import OmegaConf

from verl.config.load import load_config
from verl.trainer.ppo_trainer import is_last_step

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "ppo_trainer.yaml"


def test_last_step_at_the_planned_total_without_a_limit():
    assert not is_last_step(4, 5, elapsed_s=1e9, limit_minutes=None)
    assert is_last_step(5, 5, elapsed_s=0.0, limit_minutes=None)


def test_last_step_once_the_time_is_spent():
    assert not is_last_step(3, 1000, elapsed_s=599.9, limit_minutes=10)
    assert is_last_step(3, 1000, elapsed_s=600.0, limit_minutes=10)
    assert is_last_step(1, 1000, elapsed_s=0.1, limit_minutes=0.001)  # at least one step runs
    assert is_last_step(1000, 1000, elapsed_s=0.0, limit_minutes=10)   # the total still ends it


def test_key_in_the_yaml_and_typed():
    raw = OmegaConf.merge(OmegaConf.load(CONFIG), OmegaConf.from_dotlist(
        ["data.train_files=t.parquet", "actor_rollout_ref.model.path=m"]))
    assert load_config(raw).trainer.time_limit_minutes is None
    raw.trainer.time_limit_minutes = 10  # what `trainer.time_limit_minutes=10` on the command line gives
    assert load_config(raw).trainer.time_limit_minutes == 10.0
