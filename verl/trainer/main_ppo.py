"""Entry point: `python -m verl.trainer.main_ppo key=value ...` (Hydra, configs/ppo_trainer.yaml).

The driver checks the config, starts Ray, builds the worker groups (policy: actor + rollout +
reference per GPU; critic when the estimator needs values), loads the data and runs the trainer.
"""
from __future__ import annotations

import inspect
import logging
import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "configs")

log = logging.getLogger("verl")


def run(raw: DictConfig) -> None:
    import torch
    from transformers import AutoTokenizer

    from verl.config.load import agent_loop_spec, check_agent_keys, load_config
    from verl.config.schema import ConfigError
    from verl.config.sizes import derive_sizes
    from verl.core_algos import AdvEstimator
    from verl.single_controller.ray_group import LocalWorkerGroup, WorkerGroup, start_ray
    from verl.single_controller.rollout_group import RolloutGroup, rollout_placement
    from verl.trainer.metrics import load_reward_fn, reward_kwargs_for, update_flops_per_token
    from verl.trainer.ppo_trainer import PPOTrainer
    from verl.utils.dataset import PromptSampler, load_examples
    from verl.utils.tracking import Tracker, check_backends
    from verl.workers.critic_worker import CriticWorker
    from verl.workers.policy_worker import PolicyWorker
    from verl.workers.rollout.loop_from_config import agent_loop_settings, load_agent_loop
    from verl.workers.rollout_worker import RolloutWorker

    cfg = load_config(raw)
    try:  # a tracker whose package is missing stops the run now, not after the workers have loaded
        check_backends(cfg.trainer.logger)
    except (ValueError, ImportError) as e:
        raise ConfigError(str(e)) from None
    check_agent_keys(cfg, _overridden_keys())
    multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
    if multi_turn.tool_config_path:  # the workers read it too, from whatever directory they start in
        multi_turn.tool_config_path = os.path.abspath(multi_turn.tool_config_path)
    try:  # a missing or wrong reward function stops the run here, before Ray and the workers start
        reward_fn = load_reward_fn(cfg.reward.function)
    except (ValueError, ImportError, AttributeError) as e:
        raise ConfigError(f"reward.function={cfg.reward.function!r}: {e}") from None
    reward_kwargs = reward_kwargs_for(reward_fn, cfg.reward.reward_kwargs)   # checked against its Options
    try:
        inspect.signature(reward_fn).bind("data_source", "response", "ground_truth", **reward_kwargs)
    except TypeError as e:
        raise ConfigError(f"reward.function={cfg.reward.function!r} does not take the keyword arguments its "
                          f"Options declare ({', '.join(reward_kwargs)}): {e}") from None
    sizes = derive_sizes(cfg)
    run_cfg = cfg.trainer
    device = run_cfg.device if run_cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    # The agent loop's options are checked against its Options dataclass (ConfigError naming the key),
    # and its tools (the retriever) answer, before any worker is started for them.
    agent_cls, agent_settings = load_agent_loop(agent_loop_spec(cfg)), agent_loop_settings(cfg, device)
    agent_cls.preflight(agent_settings)
    AdvEstimator(cfg.algorithm.adv_estimator)  # fails early on an unknown estimator

    tokenizer = AutoTokenizer.from_pretrained(cfg.actor_rollout_ref.model.path)
    if unknown := [t for t in cfg.actor_rollout_ref.rollout.logit_bias or {} if not 0 <= t < len(tokenizer)]:
        raise ConfigError(f"actor_rollout_ref.rollout.logit_bias: token ids {unknown} are not in the tokenizer "
                          f"of {cfg.actor_rollout_ref.model.path} ({len(tokenizer)} tokens)")
    data = cfg.data
    chat = tool_chat_format(cfg, tokenizer)
    train = load_examples(data.train_files, tokenizer, data.max_prompt_length, data.apply_chat_template,
                          data.train_data_num, chat, dict(data.apply_chat_template_kwargs or {}))
    val = (load_examples(data.val_files, tokenizer, data.max_prompt_length, data.apply_chat_template,
                         data.val_data_num, chat, dict(data.apply_chat_template_kwargs or {})) if data.val_files else None)
    check_prompts(agent_cls, agent_settings, train, tokenizer)
    sampler = PromptSampler(train, data.train_batch_size, data.shuffle_train_dataloader, data.seed)
    total_steps = run_cfg.total_training_steps or sampler.steps_per_epoch * run_cfg.total_epochs
    log.info("%d training prompts, %d steps of %d prompts × %d samples on %d %s workers",
             len(train), total_steps, sizes.prompts_per_step, cfg.actor_rollout_ref.rollout.n_agent,
             sizes.world, device)

    needs_critic = cfg.algorithm.adv_estimator == AdvEstimator.GAE
    # trainer.rollout_ahead_steps >= 1: rollout workers of their own, beside the policy's or on GPUs of their own
    placement = (rollout_placement(cfg.rollout, device, sizes.world, needs_critic)
                 if run_cfg.rollout_ahead_steps else None)
    share = placement.training_share if placement else 0.5 if needs_critic else 1.0
    log_lora(cfg, needs_critic)
    args = (cfg, sizes, total_steps, device)
    if run_cfg.single_process:
        group_cls = LocalWorkerGroup
    else:
        start_ray(run_cfg.ray_address, device)
        group_cls = WorkerGroup
    policy = group_cls(PolicyWorker, sizes.world, device, share, "policy", *args)
    critic = group_cls(CriticWorker, sizes.world, device, share, "critic", *args) if needs_critic else None
    rollout = RolloutGroup(RolloutWorker, placement, cfg, device) if placement else None
    n_params, n_active = _param_counts(cfg.actor_rollout_ref.model.path)
    if rollout is not None:
        rollout.connect(policy)
    # after the rollout workers' engines took their memory: beside the policy's they do not sleep
    plan_memory(policy, critic, rollout.held_weight_bytes(n_params) if rollout else 0.0)
    device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    os.makedirs(run_cfg.default_local_dir, exist_ok=True)
    OmegaConf.save(raw, os.path.join(run_cfg.default_local_dir, "config.yaml"))
    tracker = Tracker(run_cfg.logger, run_cfg.default_local_dir, run_cfg.project_name,
                      run_cfg.experiment_name, OmegaConf.to_container(raw, resolve=True))
    flops = update_flops_per_token(n_active, lora=cfg.actor_rollout_ref.model.lora_rank > 0)
    trainer = PPOTrainer(cfg, sizes, policy, critic, sampler, val, tracker, total_steps, device_name,
                         flops, rollout)
    trainer.fit()
    if rollout is not None:
        rollout.shutdown(policy)
    policy.get([w.shutdown.remote() for w in policy.workers], "shutdown")


def log_lora(cfg, needs_critic: bool) -> None:
    """With LoRA adapters (model.lora_rank): what trains, and how the rollout engine gets them."""
    from verl.workers.lora import weight_push
    model, rollout = cfg.actor_rollout_ref.model, cfg.actor_rollout_ref.rollout
    if model.lora_rank:
        _, why = weight_push(model.lora_rank, rollout.name, rollout.lora_sync)
        if cfg.trainer.rollout_ahead_steps:
            why = "the rollout workers get the merged weights (trainer.rollout_ahead_steps)"
        log.info("LoRA on the actor: rank %d, alpha %g, target_modules %s; the reference is the base model with "
                 "the adapters off; %s", model.lora_rank, model.lora_alpha, model.target_modules, why)
    if needs_critic and cfg.critic.model.lora_rank:
        c = cfg.critic.model
        log.info("LoRA on the critic: rank %d, alpha %g, target_modules %s (its value head in full)",
                 c.lora_rank, c.lora_alpha, c.target_modules)


def plan_memory(policy, critic, held_weights: float = 0.0) -> None:
    """Each role measures its token budgets now that every role on the GPUs holds its weights and the
    engines sleep (verl.workers.memory), told what the other role will still allocate. `held_weights`:
    what each policy worker holds for weight pushes not yet loaded (trainer.rollout_ahead_steps)."""
    def pending(group):
        return max(group.get([w.pending_bytes.remote() for w in group.workers], "memory plan")) if group else 0.0
    critic_pending, policy_pending = pending(critic), pending(policy) + held_weights
    notes = policy.get([w.plan_memory.remote(critic_pending + held_weights) for w in policy.workers],
                       "memory plan")[0]
    if critic is not None:
        notes += critic.get([w.plan_memory.remote(policy_pending) for w in critic.workers], "memory plan")[0]
    for note in notes:   # rank 0's: the others agree on the budgets
        log.info("memory plan: %s", note)


def check_prompts(agent_cls, settings, examples, tokenizer, first: int = 8) -> None:
    """The agent loop's look at the first training prompts, where it has one (`check_prompts`): e.g.
    that they teach the protocol it reads. A refusal stops the run at start-up."""
    check = getattr(agent_cls, "check_prompts", None)
    if check is None:
        return
    from verl.config.schema import ConfigError
    texts = tokenizer.batch_decode([e.prompt_ids for e in examples[:first]])
    try:
        check(settings, texts)
    except ValueError as e:
        raise ConfigError(f"data.train_files: {e}") from None


def tool_chat_format(cfg, tokenizer):
    """With the tool protocol, prompts are rendered with the tools of the tool YAML; else None."""
    multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
    if not multi_turn.enable:
        return None
    from verl.config.schema import ConfigError
    from verl.tools.base import read_tool_config, tool_schemas
    from verl.tools.chat import ChatFormat
    if not cfg.data.apply_chat_template:
        raise ConfigError("actor_rollout_ref.rollout.multi_turn.enable=true renders the tools with the chat template: "
                          "data.apply_chat_template=false cannot go with it")
    try:
        return ChatFormat(tokenizer, tool_schemas(read_tool_config(multi_turn.tool_config_path)),
                          dict(cfg.data.apply_chat_template_kwargs or {}))
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(f"actor_rollout_ref.rollout.multi_turn: {e}") from None


def _param_counts(path) -> tuple[int, int]:
    """(all, active per token) parameters of the policy, from the config alone (no weights loaded in
    the driver): memory takes all of them, the MFU estimate the active ones (`active_param_count`)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from verl.trainer.metrics import active_param_count
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return sum(p.numel() for p in model.parameters()), active_param_count(model)


def _overridden_keys() -> set[str]:
    """The keys given on the command line (empty when not run through Hydra)."""
    from hydra.core.hydra_config import HydraConfig
    if not HydraConfig.initialized():
        return set()
    return {o.split("=", 1)[0].lstrip("+~") for o in HydraConfig.get().overrides.task}


def accept_plus_on_existing_keys(argv: list[str]) -> list[str]:
    """The original scripts add keys with `+trainer.val_before_train=true`; Hydra refuses `+` for a key
    the config already has. Such an override means "set it", so it is passed on as `++` (add or set).
    A key of a compatibility table (verl.config.compat: e.g. the original's `max_turns`), which the
    config does not hold, is passed on as `++` too, for the table to read it into the schema."""
    from verl.config.compat import compat_tables, hydra_overrides
    known = _dotted_keys(OmegaConf.to_container(OmegaConf.load(os.path.join(CONFIG_DIR, "ppo_trainer.yaml"))))
    argv = ["+" + arg if arg.startswith("+") and not arg.startswith("++") and "=" in arg
            and arg[1:].split("=", 1)[0] in known else arg for arg in argv]
    return hydra_overrides(argv, known, compat_tables())


def _dotted_keys(node: dict, prefix: str = "") -> set[str]:
    """Every key of a nested dict, sections included, as dotted names."""
    out = set()
    for k, v in node.items():
        out.add(prefix + k)
        if isinstance(v, dict):
            out |= _dotted_keys(v, f"{prefix}{k}.")
    return out


@hydra.main(config_path=CONFIG_DIR, config_name="ppo_trainer", version_base=None)
def main(raw: DictConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from verl.config.schema import ConfigError
    from verl.workers.rollout.agent_loop import PreflightError
    try:
        run(raw)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    except PreflightError as e:
        print(f"start-up check failed: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    sys.argv[1:] = accept_plus_on_existing_keys(sys.argv[1:])
    main()
