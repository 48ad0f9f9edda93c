"""Loading the trainer config: a Hydra/OmegaConf tree checked against the schema, keys of other
trainers read in through the compatibility tables (verl.config.compat), and the checks no type can
express (ranges, keys of the original accepted with one value only, the agent loop's keys)."""
from __future__ import annotations

import functools
import logging
import math

from omegaconf import OmegaConf

from verl.config.compat import ENV_VAR, CompatError, apply_tables, compat_tables, unused_on_command_line
from verl.config.schema import (FILTER_METRICS, TOOL_LOOP, VLLM_ARGS_WITH_KEYS, VLLM_MAX_LORA_RANK, WEIGHT_TRANSPORTS,
                                ConfigError, HealthConfig, OverlongBufferConfig, TrainerConfig)

log = logging.getLogger(__name__)


def load_config(raw) -> TrainerConfig:
    """Check a Hydra/OmegaConf config against the schema and return typed objects. Keys of other
    trainers are read into the schema first, through the compatibility tables (verl.config.compat)."""
    config = OmegaConf.to_container(OmegaConf.create(raw), resolve=False)   # a copy: the tables change it
    try:
        schema = OmegaConf.to_container(OmegaConf.structured(TrainerConfig), resolve=False)
        notes = apply_tables(config, compat_tables(), schema)
    except CompatError as e:
        raise ConfigError(str(e)) from None
    for note in notes:
        log.info("%s", note)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(TrainerConfig), OmegaConf.create(config))
        cfg = OmegaConf.to_object(merged)
    except Exception as e:  # OmegaConf names the key and the expected type
        hint = (" A key of another trainer's command line is read through its compatibility table: install the "
                f"package that provides it (pip install -e .) or name the table in {ENV_VAR}"
                if "not in" in str(e) else "")
        raise ConfigError(f"invalid trainer config: {e}.{hint}") from None
    cfg.trainer.profile_steps = cfg.trainer.profile_steps or []   # verl's default is null
    _check_ranges(cfg)
    _check_original_keys(cfg)
    if cfg.algorithm.use_kl_in_reward is None:
        cfg.algorithm.use_kl_in_reward = not cfg.actor_rollout_ref.actor.use_kl_loss
    _check_dapo_keys(cfg)
    _check_rollout_ahead(cfg)
    _check_lora_keys(cfg)
    return cfg


def _check_rollout_ahead(cfg: TrainerConfig) -> None:
    """trainer.rollout_ahead_steps and the rollout workers' keys (rollout.*). Running ahead trains on
    samples of older weights, which the truncated importance weights correct: the engine's log-probs
    are switched on (null, the default, resolves here), and an explicit false is refused."""
    k, rollout, place = cfg.trainer.rollout_ahead_steps, cfg.actor_rollout_ref.rollout, cfg.rollout
    if k < 0:
        raise ConfigError(f"trainer.rollout_ahead_steps={k}: give how many steps the rollout may run ahead of the "
                          "update (0: synchronous)")
    if place.weight_transport not in ("auto", *WEIGHT_TRANSPORTS):
        raise ConfigError(f"rollout.weight_transport={place.weight_transport!r}: use auto or one of "
                          + ", ".join(f"{name} ({what})" for name, what in WEIGHT_TRANSPORTS.items()))
    if place.nnodes < 1 or place.n_gpus_per_node < 0:
        raise ConfigError(f"rollout.nnodes={place.nnodes}, rollout.n_gpus_per_node={place.n_gpus_per_node}: at least "
                          "1 node, and 0 GPUs of their own (beside the policy workers) or more")
    if k == 0:
        if place.n_gpus_per_node:
            raise ConfigError(f"rollout.n_gpus_per_node={place.n_gpus_per_node} gives rollout workers GPUs of their "
                              "own, which only trainer.rollout_ahead_steps >= 1 uses: set it (e.g. 1) or drop the key")
        rollout.calculate_log_probs = bool(rollout.calculate_log_probs)
        return
    if rollout.calculate_log_probs is False:
        raise ConfigError(f"actor_rollout_ref.rollout.calculate_log_probs=false with trainer.rollout_ahead_steps={k}: "
                          "a rollout that runs ahead samples from weights up to k updates older than the actor's, "
                          "and the engine's log-probs are what corrects for it (truncated importance weights); "
                          "drop the key or set trainer.rollout_ahead_steps=0")
    rollout.calculate_log_probs = True
    refused = {"trainer.single_process=true": cfg.trainer.single_process,
               "algorithm.filter_groups.enable=true": cfg.algorithm.filter_groups.enable,
               f"actor_rollout_ref.rollout.tensor_model_parallel_size={rollout.tensor_model_parallel_size}":
                   rollout.tensor_model_parallel_size != 1}
    for setting, on in refused.items():
        if on:
            raise ConfigError(f"{setting} cannot go with trainer.rollout_ahead_steps={k}: rollout workers are Ray "
                              "actors of one engine each, generating whole steps ahead (no single process, no "
                              "generation batches drawn during a step, no engine over several GPUs); set "
                              "trainer.rollout_ahead_steps=0 or change the key")
    if place.weight_transport == "ipc" and place.n_gpus_per_node:
        raise ConfigError("rollout.weight_transport=ipc hands CUDA IPC handles to a rollout worker on the same GPU, "
                          f"but rollout.n_gpus_per_node={place.n_gpus_per_node} gives the rollout workers GPUs of "
                          "their own: use broadcast or object_store (or auto)")


def _check_lora_keys(cfg: TrainerConfig) -> None:
    """verl's LoRA keys of the actor and the critic, and how the engine gets the adapters."""
    for section, model in (("actor_rollout_ref.model", cfg.actor_rollout_ref.model),
                           ("critic.model", cfg.critic.model)):
        if model.lora_rank < 0:
            raise ConfigError(f"{section}.lora_rank={model.lora_rank}: the adapters' rank, > 0 (e.g. 8, 16, 32, 64), "
                              "or 0 for full fine-tuning")
        if model.lora_rank and not model.lora_alpha > 0:
            raise ConfigError(f"{section}.lora_alpha={model.lora_alpha}: the adapters' scale numerator, > 0 (their "
                              "update is B·A·lora_alpha/lora_rank; verl's default is 16)")
        targets = model.target_modules
        if not (isinstance(targets, str) and targets) and not (
                isinstance(targets, list) and targets and all(isinstance(t, str) and t for t in targets)):
            raise ConfigError(f"{section}.target_modules={targets!r}: all-linear, or a list of module names "
                              "(e.g. [q_proj, v_proj])")
    rollout, rank = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model.lora_rank
    if rollout.lora_sync not in ("auto", "adapter", "merged"):
        raise ConfigError(f"actor_rollout_ref.rollout.lora_sync={rollout.lora_sync!r}: use auto, adapter or merged")
    if rank and rollout.lora_sync == "adapter" and rollout.name != "vllm":
        raise ConfigError(f"actor_rollout_ref.rollout.lora_sync=adapter: rollout.name={rollout.name} takes no "
                          "adapters; use lora_sync=merged (or auto)")
    if rank and rollout.lora_sync == "adapter" and cfg.trainer.rollout_ahead_steps:
        raise ConfigError(f"actor_rollout_ref.rollout.lora_sync=adapter with trainer.rollout_ahead_steps="
                          f"{cfg.trainer.rollout_ahead_steps}: the rollout workers take the merged weights; use "
                          "lora_sync=merged (or auto)")
    if rank > VLLM_MAX_LORA_RANK and rollout.lora_sync == "adapter":
        raise ConfigError(f"actor_rollout_ref.rollout.lora_sync=adapter: vLLM serves LoRA ranks up to "
                          f"{VLLM_MAX_LORA_RANK}, and actor_rollout_ref.model.lora_rank={rank}; use lora_sync=merged "
                          "(or auto)")


def _check_dapo_keys(cfg: TrainerConfig) -> None:
    """algorithm.filter_groups and the overlong buffer (reward.overlong_buffer, or verl's
    reward_model.overlong_buffer read into it)."""
    groups = cfg.algorithm.filter_groups
    if groups.enable and groups.metric not in FILTER_METRICS:
        raise ConfigError(f"algorithm.filter_groups.metric={groups.metric!r}: use one of "
                          + ", ".join(f"{k} ({v})" for k, v in FILTER_METRICS.items()))
    if groups.enable and groups.metric == "seq_final_reward" and cfg.algorithm.use_kl_in_reward:
        raise ConfigError("algorithm.filter_groups.metric=seq_final_reward with the KL in the reward: groups are "
                          "filtered before the KL is computed here; use seq_reward (the reward without the KL) or "
                          "set algorithm.use_kl_in_reward=false")
    default = OverlongBufferConfig()
    ours, verls = cfg.reward.overlong_buffer, cfg.reward_model.overlong_buffer
    if ours != default and verls != default and ours != verls:
        raise ConfigError("reward.overlong_buffer and reward_model.overlong_buffer (verl's name) are both set: "
                          "give one")
    buffer = cfg.reward.overlong_buffer = ours if ours != default else verls
    limit = cfg.data.max_response_length
    if buffer.enable and not 0 < buffer.len <= limit:
        raise ConfigError(f"reward.overlong_buffer.len={buffer.len}: the penalty starts len tokens before "
                          f"data.max_response_length={limit}; give len in (0, {limit}]")
    if buffer.penalty_factor < 0:
        raise ConfigError(f"reward.overlong_buffer.penalty_factor={buffer.penalty_factor}: the penalty at the length "
                          "limit, >= 0")


def _check_original_keys(cfg: TrainerConfig) -> None:
    """Keys of the original trainer that are accepted with one value only: any other would be read
    here with another meaning, so it stops the run at start-up, naming what to use instead."""
    for key, fsdp in (("actor_rollout_ref.actor", cfg.actor_rollout_ref.actor.fsdp_config),
                      ("actor_rollout_ref.ref", cfg.actor_rollout_ref.ref.fsdp_config),
                      ("critic.model", cfg.critic.model.fsdp_config)):
        if fsdp.grad_offload and not fsdp.param_offload:
            raise ConfigError(f"{key}.fsdp_config.grad_offload=true: FSDP2 offloads gradients together with "
                              f"the parameters; set {key}.fsdp_config.param_offload=true as well")
    if not cfg.actor_rollout_ref.ref.fsdp_config.mixed_precision and cfg.actor_rollout_ref.actor.fsdp_config.mixed_precision:
        raise ConfigError("actor_rollout_ref.ref.fsdp_config.mixed_precision=false: the reference computes in the "
                          "actor's precision; set actor_rollout_ref.actor.fsdp_config.mixed_precision=false instead")
    if cfg.actor_rollout_ref.rollout.n != 1:
        raise ConfigError(f"actor_rollout_ref.rollout.n={cfg.actor_rollout_ref.rollout.n}: samples per prompt are "
                          "set by actor_rollout_ref.rollout.n_agent (as in the original Search-R1 scripts)")
    if cfg.algorithm.no_think_rl:
        raise ConfigError("algorithm.no_think_rl=true is not supported (the original stopped at the first step "
                          "with it): remove the key or set it to false")
    if cfg.trainer.default_hdfs_dir:
        raise ConfigError(f"trainer.default_hdfs_dir={cfg.trainer.default_hdfs_dir!r}: checkpoints are written to "
                          "trainer.default_local_dir only; copy them from there (or set the key to null)")
    rate = cfg.actor_rollout_ref.rollout.max_tool_failure_rate
    if not 0.0 <= rate <= 1.0:
        raise ConfigError(f"actor_rollout_ref.rollout.max_tool_failure_rate={rate}: give the share of tool-calling "
                          "trajectories whose tool call may fail before the run stops, in [0, 1]")
    _check_reward_model(cfg)
    if cfg.trainer.critic_warmup < 0:
        raise ConfigError(f"trainer.critic_warmup={cfg.trainer.critic_warmup}: give the step from which the actor "
                          "is updated (0: from the first step)")


def _check_reward_model(cfg: TrainerConfig) -> None:
    if cfg.reward_model.enable:
        raise ConfigError("reward_model.enable=true: a model-based reward is not offered; the outcome reward is "
                          "reward.function, with its own terms in reward.reward_kwargs")


def agent_loop_spec(cfg: TrainerConfig) -> str | None:
    """The agent loop the run uses: multi_turn.enable selects the tool-calling loop."""
    rollout = cfg.actor_rollout_ref.rollout
    return TOOL_LOOP if rollout.multi_turn.enable else rollout.agent_loop


def check_agent_keys(cfg: TrainerConfig, overridden: set[str]) -> None:
    """verl's multi_turn keys: enable selects the tool-calling loop, which needs its tool config;
    its other keys without enable would be ignored."""
    rollout = cfg.actor_rollout_ref.rollout
    multi_turn = rollout.multi_turn
    if multi_turn.enable:
        # A preset's agent loop (train_grpo.sh's search agent) gives way; one named on the command line clashes.
        if "actor_rollout_ref.rollout.agent_loop" in overridden and rollout.agent_loop not in (None, TOOL_LOOP):
            raise ConfigError(f"actor_rollout_ref.rollout.multi_turn.enable=true selects the tool-calling loop, but "
                              f"actor_rollout_ref.rollout.agent_loop={rollout.agent_loop!r}: drop one of the two")
        if not multi_turn.tool_config_path:
            raise ConfigError("actor_rollout_ref.rollout.multi_turn.enable=true needs "
                              "actor_rollout_ref.rollout.multi_turn.tool_config_path (e.g. configs/tools/search.yaml)")
        # A preset's keys of another trainer step aside (dropped, logged); the same keys typed on the
        # command line were meant for this run, and it would not read them.
        unused = unused_on_command_line(overridden, lambda k: functools.reduce(getattr, k.split("."), cfg),
                                        compat_tables())
        if unused:
            raise ConfigError(unused[0])
        return
    if multi_turn.tool_config_path or multi_turn.max_assistant_turns is not None:
        raise ConfigError("actor_rollout_ref.rollout.multi_turn.tool_config_path/max_assistant_turns set but "
                          "actor_rollout_ref.rollout.multi_turn.enable=false: add "
                          "actor_rollout_ref.rollout.multi_turn.enable=true to call the tools")


def _check_ranges(cfg: TrainerConfig) -> None:
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.engine_kwargs and rollout.name != "vllm":
        raise ConfigError(f"actor_rollout_ref.rollout.engine_kwargs are vLLM's arguments; rollout.name="
                          f"{rollout.name!r} takes none: remove them or use rollout.name=vllm")
    clash = sorted(set(rollout.engine_kwargs or ()) & set(VLLM_ARGS_WITH_KEYS))
    if clash:
        raise ConfigError(f"actor_rollout_ref.rollout.engine_kwargs.{clash[0]} is set by "
                          f"{VLLM_ARGS_WITH_KEYS[clash[0]]}: use that instead")
    for key, ratio in (("actor_rollout_ref.model.gradient_checkpointing_ratio",
                        cfg.actor_rollout_ref.model.gradient_checkpointing_ratio),
                       ("critic.model.gradient_checkpointing_ratio", cfg.critic.model.gradient_checkpointing_ratio)):
        if ratio is not None and not 0.0 <= ratio <= 1.0:
            raise ConfigError(f"{key} = {ratio}: use the fraction of decoder layers recomputed in backward, "
                              f"in [0, 1] (1.0: all; 0 or enable_gradient_checkpointing=false: none; null: chosen at start-up)")
    if cfg.actor_rollout_ref.actor.old_log_probs not in ("auto", "recompute"):
        raise ConfigError(f"actor_rollout_ref.actor.old_log_probs={cfg.actor_rollout_ref.actor.old_log_probs!r}: "
                          "use auto or recompute")
    if cfg.actor_rollout_ref.actor.rollout_is_cap < 1.0:
        raise ConfigError(f"actor_rollout_ref.actor.rollout_is_cap={cfg.actor_rollout_ref.actor.rollout_is_cap}: "
                          "importance weights are truncated at a value of at least 1 (default 2)")
    bad = [s for s in cfg.trainer.profile_steps if not isinstance(s, int) or s < 1]
    if bad:
        raise ConfigError(f"trainer.profile_steps={cfg.trainer.profile_steps}: list training steps, counted from 1")
    health = cfg.trainer.health
    _check_health_signs(health)
    if health.action not in ("warn", "stop", "rollback"):
        raise ConfigError(f"trainer.health.action={health.action!r}: use warn, stop or rollback")
    if health.action == "rollback" and cfg.trainer.save_freq <= 0:
        raise ConfigError("trainer.health.action=rollback rolls back to a checkpoint: set trainer.save_freq > 0 "
                          "(steps between checkpoints)")
    if not 0.0 < health.lr_factor <= 1.0 or health.window < 3 or health.max_rollbacks < 0:
        raise ConfigError(f"trainer.health: lr_factor={health.lr_factor} must lie in (0, 1], window="
                          f"{health.window} be at least 3 and max_rollbacks={health.max_rollbacks} at least 0")


# What each sign's threshold means, as the range that gives it one. Outside it a sign fires on every
# healthy step (entropy_spike <= 1, max_kl <= 0, a negative rise or drop) or can never fire (a rise or
# drop of a share or EM of 1 or more, inf); nan compares false and would switch the sign off unseen.
# null is the one way to switch a sign off.
_HEALTH_SIGNS = {
    "entropy_spike": (lambda v: v > 1, "> 1 (a multiple of the median entropy)"),
    "max_kl": (lambda v: v > 0, "> 0 (the largest KL to the reference a healthy step shows)"),
    "val_drop": (lambda v: 0 < v < 1, "in (0, 1) (a drop of validation EM below its best)"),
    "no_action_rise": (lambda v: 0 < v < 1, "in (0, 1) (a rise of the share of trajectories that neither "
                                            "called a tool nor answered)"),
}


def _check_health_signs(health: HealthConfig) -> None:
    for name, (meaningful, meaning) in _HEALTH_SIGNS.items():
        value = getattr(health, name)
        if value is not None and not (math.isfinite(value) and meaningful(value)):
            raise ConfigError(f"trainer.health.{name} must be {meaning} or null to switch the check off; "
                              f"got {value}")
