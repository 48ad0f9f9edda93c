"""Range checks of `load_config`: a value out of range fails at load time, naming its key."""
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from verl.trainer.config import ConfigError, load_config

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "ppo_trainer.yaml"


@pytest.mark.parametrize("key", ["actor_rollout_ref.model.gradient_checkpointing_ratio",
                                 "critic.model.gradient_checkpointing_ratio"])
def test_gradient_checkpointing_ratio_in_range(key):
    base = ["data.train_files=t.parquet", "actor_rollout_ref.model.path=m"]
    cfg = load_config(OmegaConf.merge(OmegaConf.load(CONFIG), OmegaConf.from_dotlist(base + [f"{key}=0.5"])))
    assert OmegaConf.select(OmegaConf.structured(cfg), key) == 0.5
    with pytest.raises(ConfigError, match=key):
        load_config(OmegaConf.merge(OmegaConf.load(CONFIG), OmegaConf.from_dotlist(base + [f"{key}=1.5"])))
