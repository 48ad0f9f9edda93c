"""configs/ppo_trainer.yaml is generated from the dataclasses of verl/config/schema.py: the two must
not drift apart (edit one without regenerating and these fail), every key has its help, and the YAML
Hydra composes loads to exactly the dataclass defaults."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from verl.config.load import load_config
from verl.config.render import main, render_yaml
from verl.config.schema import ConfigError, TrainerConfig, key

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ROOT / "configs" / "ppo_trainer.yaml"
REQUIRED = ["data.train_files=t.parquet", "actor_rollout_ref.model.path=m"]  # the two ??? keys


def leaves(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v and k not in ("logit_bias", "engine_kwargs"):
            out |= leaves(v, f"{prefix}{k}.")
        else:
            out[prefix + k] = v
    return out


def fields_with_help(node, prefix: str = ""):
    """(dotted key, help) of every field of the config tree, sections included."""
    for f in dataclasses.fields(node):
        yield prefix + f.name, f.metadata.get("help", "")
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            yield from fields_with_help(value, f"{prefix}{f.name}.")


HELP = dict(fields_with_help(TrainerConfig()))


def test_the_checked_in_yaml_is_the_generated_one():
    assert CONFIG.read_text(encoding="utf-8") == render_yaml(), (
        "configs/ppo_trainer.yaml differs from verl/config/schema.py: change the dataclasses, then run "
        "python -m verl.config --write configs/ppo_trainer.yaml")
    header = CONFIG.read_text(encoding="utf-8").splitlines()[:3]
    assert "GENERATED from verl/config/schema.py" in header[0] and "do not edit by hand" in header[0]


def test_the_generator_prints_writes_and_checks(tmp_path):
    r = subprocess.run([sys.executable, "-m", "verl.config"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout == render_yaml()
    out = tmp_path / "ppo_trainer.yaml"
    assert main(["--write", str(out)]) == 0 and out.read_text(encoding="utf-8") == render_yaml()
    assert main(["--check", str(out)]) == 0
    out.write_text(render_yaml().replace("train_batch_size: 512", "train_batch_size: 256"), encoding="utf-8")
    assert main(["--check", str(out)]) == 1


def test_every_schema_leaf_is_in_the_yaml_with_its_default_and_no_other():
    from_yaml = leaves(yaml.safe_load(CONFIG.read_text(encoding="utf-8")))
    from_schema = leaves(OmegaConf.to_container(OmegaConf.structured(TrainerConfig)))
    assert sorted(set(from_schema) - set(from_yaml)) == [], "schema keys missing from the yaml"
    assert sorted(set(from_yaml) - set(from_schema)) == [], "yaml keys the schema does not have"
    assert from_yaml == from_schema
    assert from_yaml["data.train_files"] == "???" and from_yaml["actor_rollout_ref.model.path"] == "???"


def test_every_field_has_a_help_text():
    assert len(HELP) > 100
    assert [k for k, h in HELP.items() if not h.strip()] == []


def test_a_field_without_help_is_refused_by_the_generator():
    @dataclasses.dataclass
    class Bad:
        documented: int = key(1, "a count")
        undocumented: int = 2

    with pytest.raises(ValueError, match="Bad.undocumented has no help"):
        render_yaml(Bad())


def test_hydra_composes_the_yaml_to_the_dataclass_defaults():
    from_schema = load_config(OmegaConf.merge(OmegaConf.structured(TrainerConfig), OmegaConf.from_dotlist(REQUIRED)))
    with initialize_config_dir(config_dir=str(CONFIG.parent), version_base=None):
        assert load_config(compose("ppo_trainer", overrides=REQUIRED)) == from_schema
        # the one interpolation: the run directory follows the experiment's name, in both
        assert from_schema.trainer.default_local_dir == "checkpoints/run"
        named = load_config(compose("ppo_trainer", overrides=REQUIRED + ["trainer.experiment_name=exp"]))
        assert named.trainer.default_local_dir == "checkpoints/exp"
        assert load_config(OmegaConf.merge(OmegaConf.structured(TrainerConfig), OmegaConf.from_dotlist(
            REQUIRED + ["trainer.experiment_name=exp"]))).trainer.default_local_dir == "checkpoints/exp"


# Keys of the original Search-R1 trainer that nothing here reads: accepted, and their help says so.
ACCEPTED_UNUSED = {
    "data.val_batch_size": "256",
    "data.max_start_length": "2048",
    "actor_rollout_ref.model.use_remove_padding": "false",
    "critic.model.use_remove_padding": "false",
    "actor_rollout_ref.ref.fsdp_config.optimizer_offload": "true",
    "actor_rollout_ref.ref.fsdp_config.unsharded_accumulation": "true",
}   # the original's reranker.url and reranker.topk: in the search package's table (tests/search_r1/test_compat.py)


@pytest.mark.parametrize("dotted, value", sorted(ACCEPTED_UNUSED.items()))
def test_unused_original_keys_are_accepted_and_say_so(dotted, value):
    assert "accepted and unused" in HELP[dotted]
    with initialize_config_dir(config_dir=str(CONFIG.parent), version_base=None):
        cfg = load_config(compose("ppo_trainer", overrides=REQUIRED + [f"{dotted}={value}"]))
    assert str(OmegaConf.select(OmegaConf.structured(cfg), dotted)).lower() == value.lower()


def test_help_of_keys_with_one_accepted_value_says_the_truth():
    assert "accepted and unused" not in HELP["actor_rollout_ref.ref.fsdp_config.param_offload"]
    assert "only param_offload is read" in HELP["actor_rollout_ref.ref.fsdp_config"]
    # the reference's grad_offload is unused, but true without param_offload still stops the run
    assert "needs param_offload=true" in HELP["actor_rollout_ref.ref.fsdp_config.grad_offload"]
    # rollout.n is not an alias of n_agent: only 1 is accepted (test_original_keys checks the refusal)
    assert "only 1 is accepted" in HELP["actor_rollout_ref.rollout.n"]
    assert "no alias" in HELP["actor_rollout_ref.rollout.n"]
    assert "only false is accepted" in HELP["algorithm.no_think_rl"]
    assert "only null" in HELP["trainer.default_hdfs_dir"]
    # the reference follows the actor's precision: asking it alone for fp32 is refused
    assert "false alone is refused" in HELP["actor_rollout_ref.ref.fsdp_config.mixed_precision"]
    with initialize_config_dir(config_dir=str(CONFIG.parent), version_base=None):
        with pytest.raises(ConfigError, match="actor.fsdp_config.mixed_precision=false instead"):
            load_config(compose("ppo_trainer", overrides=REQUIRED + ["actor_rollout_ref.ref.fsdp_config.mixed_precision=false"]))
        cpu = ["actor_rollout_ref.actor.fsdp_config.mixed_precision=false"]  # the actor alone: fine
        load_config(compose("ppo_trainer", overrides=REQUIRED + cpu))
