"""Checks of `load_config` (a value out of range fails at load time, naming its key) and of the
trainer's start-up checks that need the tokenizer."""
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from verl.config.load import load_config
from verl.config.schema import ConfigError

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "ppo_trainer.yaml"


@pytest.mark.parametrize("key", ["actor_rollout_ref.model.gradient_checkpointing_ratio",
                                 "critic.model.gradient_checkpointing_ratio"])
def test_gradient_checkpointing_ratio_in_range(key):
    base = ["data.train_files=t.parquet", "actor_rollout_ref.model.path=m"]
    cfg = load_config(OmegaConf.merge(OmegaConf.load(CONFIG), OmegaConf.from_dotlist(base + [f"{key}=0.5"])))
    assert OmegaConf.select(OmegaConf.structured(cfg), key) == 0.5
    with pytest.raises(ConfigError, match=key):
        load_config(OmegaConf.merge(OmegaConf.load(CONFIG), OmegaConf.from_dotlist(base + [f"{key}=1.5"])))


def test_profile_steps_count_from_one():
    def config(steps):
        base = ["data.train_files=t.parquet", "actor_rollout_ref.model.path=m", f"trainer.profile_steps={steps}"]
        return load_config(OmegaConf.merge(OmegaConf.load(CONFIG), OmegaConf.from_dotlist(base)))
    assert config("[1,3]").trainer.profile_steps == [1, 3]
    assert config("null").trainer.profile_steps == []   # verl's default
    with pytest.raises(ConfigError, match="trainer.profile_steps"):
        config("[0]")


def test_logit_bias_takes_token_ids_from_the_command_line():
    from hydra import compose, initialize_config_dir
    base = ["data.train_files=t.parquet", "actor_rollout_ref.model.path=m"]
    with initialize_config_dir(config_dir=str(CONFIG.parent), version_base=None):
        cfg = load_config(compose("ppo_trainer", overrides=base))
        assert cfg.actor_rollout_ref.rollout.logit_bias is None
        raw = compose("ppo_trainer", overrides=base + ["actor_rollout_ref.rollout.logit_bias={49152:2.5,7:-100}"])
        assert load_config(raw).actor_rollout_ref.rollout.logit_bias == {49152: 2.5, 7: -100.0}
        raw = compose("ppo_trainer", overrides=base + ["actor_rollout_ref.rollout.logit_bias={search:2.5}"])
        with pytest.raises(ConfigError, match="actor_rollout_ref.rollout.logit_bias"):
            load_config(raw)


def test_engine_kwargs_reach_vllm_unless_a_key_of_their_own_sets_them():
    from hydra import compose, initialize_config_dir
    base = ["data.train_files=t.parquet", "actor_rollout_ref.model.path=m"]
    with initialize_config_dir(config_dir=str(CONFIG.parent), version_base=None):
        assert load_config(compose("ppo_trainer", overrides=base)).actor_rollout_ref.rollout.engine_kwargs is None
        raw = compose("ppo_trainer", overrides=base + [
            "actor_rollout_ref.rollout.engine_kwargs={max_num_seqs:512,prefix_caching_hash_algo:xxhash}"])
        assert load_config(raw).actor_rollout_ref.rollout.engine_kwargs == {
            "max_num_seqs": 512, "prefix_caching_hash_algo": "xxhash"}
        raw = compose("ppo_trainer", overrides=base + [
            "actor_rollout_ref.rollout.engine_kwargs={gpu_memory_utilization:0.3}"])
        with pytest.raises(ConfigError, match="engine_kwargs.gpu_memory_utilization is set by "
                                              "actor_rollout_ref.rollout.gpu_memory_utilization"):
            load_config(raw)
        raw = compose("ppo_trainer", overrides=base + [
            "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.engine_kwargs={max_num_seqs:8}"])
        with pytest.raises(ConfigError, match="rollout.name='hf' takes none"):
            load_config(raw)


@pytest.mark.e2e  # launches the trainer
def test_logit_bias_outside_the_vocabulary_stops_the_trainer(tiny_model_dir, tmp_path):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", f"data.train_files={tmp_path / 't.parquet'}",
                        f"actor_rollout_ref.model.path={tiny_model_dir}", "actor_rollout_ref.rollout.logit_bias={10000000:1}",
                        "reward.function=search_r1.rewards:score_for",
                        f"hydra.run.dir={tmp_path}"], cwd=CONFIG.parents[1], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert "actor_rollout_ref.rollout.logit_bias: token ids [10000000] are not in the tokenizer" in r.stderr


def test_multi_turn_keys_select_the_tool_loop_and_refuse_what_it_does_not_read():
    """verl's multi_turn keys: enable selects the tool-calling loop (a preset's agent loop named
    elsewhere gives way, one named on the command line clashes), needs a tool config, and the search
    agent's options are refused with it, the original's search keys too where the command line gives
    them (a preset's step aside): the tool YAML holds the tool's settings; tool keys without enable
    are refused too."""
    from hydra import compose, initialize_config_dir
    from verl.config.load import agent_loop_spec, check_agent_keys
    from verl.config.schema import TOOL_LOOP
    from verl.trainer.main_ppo import accept_plus_on_existing_keys
    from verl.workers.rollout.loop_from_config import agent_loop_settings
    base = ["data.train_files=t.parquet", "actor_rollout_ref.model.path=m"]
    on = ["actor_rollout_ref.rollout.multi_turn.enable=true",
          "actor_rollout_ref.rollout.multi_turn.tool_config_path=configs/tools/search.yaml"]

    def check(overrides, preset="ppo_trainer"):
        cfg = load_config(compose(preset, overrides=accept_plus_on_existing_keys(base + overrides)))
        check_agent_keys(cfg, {o.split("=", 1)[0] for o in overrides})
        agent_loop_settings(cfg, "cpu")   # the loop's options, checked against its Options
        return agent_loop_spec(cfg)

    with initialize_config_dir(config_dir=str(CONFIG.parent), version_base=None):
        assert check(on) == TOOL_LOOP
        assert check(on + ["actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3"]) == TOOL_LOOP
        # train_grpo.sh's search agent and its options (max_turns, retriever.*) are the preset's: they
        # give way to the tool loop (docs/TRAINING.md runs train_grpo.sh so)
        assert check(on, "search_r1_grpo") == TOOL_LOOP
        # a search-loop option given to the tool loop is refused, naming it
        with pytest.raises(ConfigError, match=r"agent_kwargs.max_turns: the agent loop .*ToolAgentLoop has no such"):
            check(on + ["actor_rollout_ref.rollout.agent_kwargs={max_turns: 2}"])
        with pytest.raises(ConfigError, match="drop one of the two"):
            check(on + ["actor_rollout_ref.rollout.agent_loop=search_r1.agent.loop:SearchAgentLoop"])
        with pytest.raises(ConfigError, match="needs actor_rollout_ref.rollout.multi_turn.tool_config_path"):
            check(on[:1])
        # the original's keys typed on the command line were meant for this run: refused, not dropped
        with pytest.raises(ConfigError, match=r"retriever.url: a key of the original Search-R1, unused with "
                                              r"actor_rollout_ref.rollout.multi_turn.enable=true"):
            check(on + ["retriever.url=http://x:1/retrieve"])
        assert check(on + ["retriever.max_failure_rate=0.5"]) == TOOL_LOOP   # the trainer's own check
        with pytest.raises(ConfigError, match="multi_turn.enable=false"):
            check(on[1:])


def test_the_importance_weight_cap_is_checked_at_start_up():
    base = ["data.train_files=t.parquet", "actor_rollout_ref.model.path=m",
            "actor_rollout_ref.rollout.calculate_log_probs=true"]
    with pytest.raises(ConfigError, match="rollout_is_cap"):
        load_config(OmegaConf.merge(OmegaConf.load(CONFIG), OmegaConf.from_dotlist(
            base + ["actor_rollout_ref.actor.rollout_is_cap=0.5"])))


def test_batch_sizes_that_do_not_split_are_refused_at_start_up_naming_the_keys():
    from verl.config.sizes import derive_sizes
    base = ["data.train_files=t.parquet", "actor_rollout_ref.model.path=m", "data.train_batch_size=160",
            "actor_rollout_ref.rollout.n_agent=1", "actor_rollout_ref.actor.ppo_mini_batch_size=160",
            "actor_rollout_ref.actor.ppo_micro_batch_size=32", "critic.ppo_micro_batch_size=64",
            "actor_rollout_ref.actor.use_dynamic_bsz=false"]   # micro-batches of trajectories

    def sizes(*extra):
        return derive_sizes(load_config(OmegaConf.merge(OmegaConf.load(CONFIG), OmegaConf.from_dotlist(
            base + list(extra)))))
    assert sizes("algorithm.adv_estimator=grpo").mini_batch_trajectories_per_worker == 160  # no critic
    # the critic steps through the actor's mini-batches: 160 does not split into micro-batches of 64
    with pytest.raises(ConfigError, match="critic.ppo_micro_batch_size / workers = 64"):
        sizes("algorithm.adv_estimator=gae")
    fitting = sizes("algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size=32")
    assert fitting.critic_micro_trajectories_per_worker == 32
    with pytest.raises(ConfigError, match="actor.ppo_micro_batch_size / workers = 64"):
        sizes("algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.ppo_micro_batch_size=64")
    # micro-batches by tokens: the trajectory sizes need not divide the mini-batch
    assert sizes("algorithm.adv_estimator=gae", "actor_rollout_ref.actor.ppo_micro_batch_size=64",
                 "actor_rollout_ref.actor.use_dynamic_bsz=true").mini_batch_trajectories_per_worker == 160


def _dapo_config(*keys):
    base = ["data.train_files=t.parquet", "actor_rollout_ref.model.path=m", "data.max_response_length=100"]
    return load_config(OmegaConf.merge(OmegaConf.load(CONFIG), OmegaConf.from_dotlist(base + list(keys))))


def test_filter_groups_is_off_by_default_and_its_metric_is_checked_at_start_up():
    assert not _dapo_config().algorithm.filter_groups.enable
    for metric in ("acc", "score", "seq_reward"):
        cfg = _dapo_config("algorithm.filter_groups.enable=true", f"algorithm.filter_groups.metric={metric}",
                           "algorithm.filter_groups.max_num_gen_batches=10")
        assert (cfg.algorithm.filter_groups.metric, cfg.algorithm.filter_groups.max_num_gen_batches) == (metric, 10)
    for metric in ("null", "accuracy"):   # verl's default null, and a name it would not know either
        with pytest.raises(ConfigError, match=r"algorithm.filter_groups.metric=.*acc.*score.*seq_reward.*seq_final_reward"):
            _dapo_config("algorithm.filter_groups.enable=true", f"algorithm.filter_groups.metric={metric}")


def test_seq_final_reward_is_refused_with_the_kl_in_the_reward_which_comes_after_the_filter():
    keys = ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_final_reward"]
    assert _dapo_config(*keys, "algorithm.use_kl_in_reward=false").algorithm.filter_groups.enable
    with pytest.raises(ConfigError, match="seq_reward"):
        _dapo_config(*keys, "algorithm.use_kl_in_reward=true")


@pytest.mark.parametrize("section", ["reward", "reward_model"])   # ours, and verl's name
def test_overlong_buffer_is_read_from_either_name_and_checked_against_the_length_limit(section):
    cfg = _dapo_config(f"{section}.overlong_buffer.enable=true", f"{section}.overlong_buffer.len=20",
                       f"{section}.overlong_buffer.penalty_factor=1.0")
    buffer = cfg.reward.overlong_buffer
    assert (buffer.enable, buffer.len, buffer.penalty_factor) == (True, 20, 1.0)
    for bad in ("len=0", "len=101", "penalty_factor=-1"):
        with pytest.raises(ConfigError, match="reward.overlong_buffer"):
            _dapo_config(f"{section}.overlong_buffer.enable=true", f"{section}.overlong_buffer.len=20",
                         f"{section}.overlong_buffer.{bad}")
    assert not _dapo_config().reward.overlong_buffer.enable


def test_overlong_buffer_set_under_both_names_differently_is_refused():
    with pytest.raises(ConfigError, match="both set"):
        _dapo_config("reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=20",
                     "reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=10")


def _ahead(*keys):
    base = ["data.train_files=t.parquet", "actor_rollout_ref.model.path=m"]
    return load_config(OmegaConf.merge(OmegaConf.load(CONFIG), OmegaConf.from_dotlist(base + list(keys))))


def test_running_ahead_switches_the_engines_log_probs_on_and_refuses_them_off():
    assert _ahead().actor_rollout_ref.rollout.calculate_log_probs is False
    assert _ahead("actor_rollout_ref.rollout.calculate_log_probs=true").actor_rollout_ref.rollout.calculate_log_probs
    assert _ahead("trainer.rollout_ahead_steps=2").actor_rollout_ref.rollout.calculate_log_probs is True
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.rollout.calculate_log_probs=false with "
                                          r"trainer.rollout_ahead_steps=1"):
        _ahead("trainer.rollout_ahead_steps=1", "actor_rollout_ref.rollout.calculate_log_probs=false")


@pytest.mark.parametrize("keys, named", [
    (["trainer.rollout_ahead_steps=-1"], "trainer.rollout_ahead_steps=-1"),
    (["trainer.rollout_ahead_steps=1", "trainer.single_process=true"], "trainer.single_process=true"),
    (["trainer.rollout_ahead_steps=1", "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc"],
     "algorithm.filter_groups.enable=true"),
    (["trainer.rollout_ahead_steps=1", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
     "tensor_model_parallel_size=2"),
    (["rollout.n_gpus_per_node=2"], "rollout.n_gpus_per_node=2"),   # GPUs of their own, nothing running ahead
    (["trainer.rollout_ahead_steps=1", "rollout.weight_transport=nccl"], "rollout.weight_transport='nccl'"),
    (["trainer.rollout_ahead_steps=1", "rollout.n_gpus_per_node=2", "rollout.weight_transport=ipc"],
     "rollout.weight_transport=ipc"),
])
def test_rollout_ahead_settings_that_cannot_work_are_refused_naming_the_key(keys, named):
    with pytest.raises(ConfigError, match=named.replace("[", r"\[").replace(".", r"\.")):
        _ahead(*keys)

def test_loras_keys_are_verls_and_checked_at_start_up():
    from hydra import compose, initialize_config_dir
    base = ["data.train_files=t.parquet", "actor_rollout_ref.model.path=m"]
    with initialize_config_dir(config_dir=str(CONFIG.parent), version_base=None):
        def config(*keys):
            return load_config(compose("ppo_trainer", overrides=base + list(keys)))
        model = config().actor_rollout_ref.model   # verl's defaults: full fine-tuning
        assert (model.lora_rank, model.lora_alpha, model.target_modules) == (0, 16, "all-linear")
        cfg = config("actor_rollout_ref.model.lora_rank=32", "actor_rollout_ref.model.lora_alpha=64",
                     "actor_rollout_ref.model.target_modules=[q_proj,v_proj]", "critic.model.lora_rank=8")
        assert cfg.actor_rollout_ref.model.target_modules == ["q_proj", "v_proj"] and cfg.critic.model.lora_rank == 8
        for keys, named in ((["actor_rollout_ref.model.lora_rank=-1"], "actor_rollout_ref.model.lora_rank"),
                            (["critic.model.lora_rank=8", "critic.model.lora_alpha=0"], "critic.model.lora_alpha"),
                            (["actor_rollout_ref.model.target_modules=[]"], "actor_rollout_ref.model.target_modules"),
                            (["actor_rollout_ref.rollout.lora_sync=lazy"], "actor_rollout_ref.rollout.lora_sync"),
                            (["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.rollout.name=hf",
                              "actor_rollout_ref.rollout.lora_sync=adapter"], "rollout.name=hf takes no adapters"),
                            (["actor_rollout_ref.model.lora_rank=1024", "actor_rollout_ref.rollout.lora_sync=adapter"],
                             "up to 512"),
                            (["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.rollout.lora_sync=adapter",
                              "trainer.rollout_ahead_steps=1"], "rollout workers take the merged weights"),
                            (["actor_rollout_ref.rollout.engine_kwargs={enable_lora:true}"],
                             "actor_rollout_ref.model.lora_rank")):
            with pytest.raises(ConfigError, match=named):
                config(*keys)
