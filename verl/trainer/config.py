"""Typed trainer configuration: configs/ppo_trainer.yaml checked against these dataclasses.

Unknown keys and wrong types fail at load time (OmegaConf structured merge), and so do values out
of range (`_check_ranges`); batch sizes are checked against each other once, in `derive_sizes`, with
errors that name the keys to change.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING, OmegaConf


class ConfigError(ValueError):
    pass


@dataclass
class DataConfig:
    train_files: Any = MISSING
    val_files: Any = None
    train_data_num: int | None = None
    val_data_num: int | None = None
    train_batch_size: int = 512
    val_batch_size: int = 256
    max_prompt_length: int = 4096
    max_response_length: int = 500
    max_obs_length: int = 500
    # The original capped the first prompt's tokens with it; here data.max_prompt_length does (longer
    # prompts are dropped with a warning), so it is accepted and read by nothing.
    max_start_length: int | None = None
    shuffle_train_dataloader: bool = True
    apply_chat_template: bool = True
    seed: int = 1


@dataclass
class ModelConfig:
    path: str = MISSING
    enable_gradient_checkpointing: bool = True
    gradient_checkpointing_ratio: float = 1.0  # of the decoder layers, when enable_gradient_checkpointing
    use_remove_padding: bool = True
    attn_implementation: str | None = None  # None: flash-attn-2 > torch varlen (CUDA, bf16) > sdpa
    use_torch_compile: bool = False         # torch.compile each decoder layer (actor and reference)


@dataclass
class OptimConfig:
    lr: float = 1e-6
    lr_warmup_steps_ratio: float = 0.0
    lr_schedule: str = "constant"
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.01
    betas: list = field(default_factory=lambda: [0.9, 0.999])


@dataclass
class FSDPConfig:
    param_offload: bool = False
    # FSDP2 offloads gradients together with the parameters: true needs param_offload=true too.
    grad_offload: bool = False
    optimizer_offload: bool = False
    mixed_precision: bool = True
    # several GPUs: keep full weights and gradients across micro-batches (fsdp.accumulation_steps)
    unsharded_accumulation: bool = False


@dataclass
class ActorConfig:
    optim: OptimConfig = field(default_factory=OptimConfig)
    ppo_mini_batch_size: int = 256   # trajectories per optimizer step, over all GPUs (as the original)
    ppo_micro_batch_size: int = 64
    ppo_epochs: int = 1
    grad_clip: float = 1.0
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float | None = None
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.001
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    state_masking: bool = True
    max_tokens_per_pack: int = 16384
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class RefConfig:
    log_prob_micro_batch_size: int = 128
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class RolloutConfig:
    name: str = "vllm"
    n_agent: int = 1
    # The original's vLLM `n` (samples per prompt inside one generate call); its search agent samples
    # through n_agent, so only 1 is accepted.
    n: int = 1
    temperature: float = 1.0
    top_p: float = 0.95
    gpu_memory_utilization: float = 0.6
    tensor_model_parallel_size: int = 1
    enforce_eager: bool | None = None
    enable_sleep: bool = True
    log_prob_micro_batch_size: int = 128
    max_model_len: int | None = None
    agent_loop: str | None = None
    # sync | async | continuous | auto: continuous with vLLM on a GPU (3B, one H100: the rollout 1.16x,
    # the GRPO step 1.07x faster than sync), sync otherwise (the HF engine cannot step; CPU as measured)
    schedule: str = "auto"
    admit_every_steps: int = 32  # continuous schedule: ready turns join the running batch together
    max_cudagraph_capture_size: int | None = 2048  # vLLM: largest step (tokens) run as a CUDA graph; None: vLLM's
    # in_process | separate (vLLM's scheduler + model in a child process) | auto: separate on a GPU
    engine_core: str = "auto"
    # token id -> added to its logit before sampling, in training and validation rollouts alike. The
    # actor's log-probs do not see it: biased samples are off-policy by the bias (benchmarks, bans).
    logit_bias: dict[int, float] | None = None
    # vLLM only: more keyword arguments of vllm.LLM (e.g. max_num_seqs, max_num_batched_tokens,
    # prefix_caching_hash_algo); the settings above that have keys of their own are set there.
    engine_kwargs: dict[str, Any] | None = None


# vllm.LLM arguments that rollout keys set: engine_kwargs must not set them a second time.
VLLM_ARGS_WITH_KEYS = {
    "model": "actor_rollout_ref.model.path", "seed": "trainer.seed",
    "gpu_memory_utilization": "actor_rollout_ref.rollout.gpu_memory_utilization",
    "max_model_len": "actor_rollout_ref.rollout.max_model_len",
    "enable_sleep_mode": "actor_rollout_ref.rollout.enable_sleep",
    "enforce_eager": "actor_rollout_ref.rollout.enforce_eager",
    "tensor_parallel_size": "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "separate_core": "actor_rollout_ref.rollout.engine_core",
    "worker_extension_cls": "the trainer (it pushes weights through it)",
}


@dataclass
class ActorRolloutRefConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


@dataclass
class CriticModelConfig:
    path: str | None = None
    enable_gradient_checkpointing: bool = True
    gradient_checkpointing_ratio: float = 1.0  # of the decoder layers, when enable_gradient_checkpointing
    use_remove_padding: bool = True  # accepted for compatibility: the forward is always padding-free
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class CriticConfig:
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    ppo_micro_batch_size: int = 64
    cliprange_value: float = 0.5


@dataclass
class KLCtrlConfig:
    type: str = "fixed"
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    # None: as the original, the KL penalty goes into the reward only when actor.use_kl_loss is off
    # (never both unless both are set true).
    use_kl_in_reward: bool | None = None
    no_think_rl: bool = False  # the original's key; it raised at the first step when true, so only false
    kl_penalty: str = "kl"
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)


@dataclass
class RewardConfig:
    function: str | None = None


@dataclass
class RetrieverConfig:
    url: str = "http://127.0.0.1:8000/retrieve"
    topk: int = 3


@dataclass
class RerankerConfig:
    """The original trainer called a separate re-ranking service; here the retrieval server re-ranks
    (`search-r1 serve --reranker_model …`), so only do_rerank=false is accepted."""
    do_rerank: bool = False
    url: str | None = None
    topk: int = 3


@dataclass
class RunConfig:
    total_epochs: int = 1
    total_training_steps: int | None = None
    time_limit_minutes: float | None = None   # wall clock from the start of fit; None: no limit
    project_name: str = "search_r1"
    experiment_name: str = "run"
    logger: list = field(default_factory=lambda: ["console", "jsonl"])
    nnodes: int = 1
    n_gpus_per_node: int = 1
    device: str = "auto"
    save_freq: int = -1
    test_freq: int = -1
    val_before_train: bool = True
    val_only: bool = False           # validate once and stop (no training)
    critic_warmup: int = 0           # steps: the actor is updated from this step on, the critic from step 1
    default_hdfs_dir: str | None = None  # the original's HDFS copy; only null (checkpoints stay local)
    keep_last_checkpoints: int = 2
    resume_mode: str = "auto"
    default_local_dir: str = "checkpoints/run"
    export_hf_on_save: bool = True
    ray_address: str | None = None
    single_process: bool = False
    seed: int = 1


@dataclass
class TrainerConfig:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    max_turns: int = 1
    retriever: RetrieverConfig = field(default_factory=RetrieverConfig)
    reranker: RerankerConfig = field(default_factory=RerankerConfig)
    trainer: RunConfig = field(default_factory=RunConfig)


def load_config(raw) -> TrainerConfig:
    """Check a Hydra/OmegaConf config against the schema and return typed objects."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(TrainerConfig), raw)
        cfg = OmegaConf.to_object(merged)
    except Exception as e:  # OmegaConf names the key and the expected type
        raise ConfigError(f"invalid trainer config: {e}") from None
    _check_ranges(cfg)
    _check_original_keys(cfg)
    if cfg.algorithm.use_kl_in_reward is None:
        cfg.algorithm.use_kl_in_reward = not cfg.actor_rollout_ref.actor.use_kl_loss
    return cfg


def _check_original_keys(cfg: TrainerConfig) -> None:
    """Keys of the original trainer that are accepted with one value only: any other would be read
    here with another meaning, so it stops the run at start-up, naming what to use instead."""
    for key, fsdp in (("actor_rollout_ref.actor", cfg.actor_rollout_ref.actor.fsdp_config),
                      ("actor_rollout_ref.ref", cfg.actor_rollout_ref.ref.fsdp_config),
                      ("critic.model", cfg.critic.model.fsdp_config)):
        if fsdp.grad_offload and not fsdp.param_offload:
            raise ConfigError(f"{key}.fsdp_config.grad_offload=true: FSDP2 offloads gradients together with "
                              f"the parameters; set {key}.fsdp_config.param_offload=true as well")
    if cfg.actor_rollout_ref.rollout.n != 1:
        raise ConfigError(f"actor_rollout_ref.rollout.n={cfg.actor_rollout_ref.rollout.n}: samples per prompt are "
                          "set by actor_rollout_ref.rollout.n_agent (as in the original Search-R1 scripts)")
    if cfg.algorithm.no_think_rl:
        raise ConfigError("algorithm.no_think_rl=true is not supported (the original stopped at the first step "
                          "with it): remove the key or set it to false")
    if cfg.reranker.do_rerank:
        raise ConfigError("reranker.do_rerank=true: re-ranking runs inside the retrieval server here; start it "
                          "with `search-r1 serve --reranker_model MODEL --topk_retrieval N` and drop reranker.*")
    if cfg.trainer.default_hdfs_dir:
        raise ConfigError(f"trainer.default_hdfs_dir={cfg.trainer.default_hdfs_dir!r}: checkpoints are written to "
                          "trainer.default_local_dir only; copy them from there (or set the key to null)")
    if cfg.trainer.critic_warmup < 0:
        raise ConfigError(f"trainer.critic_warmup={cfg.trainer.critic_warmup}: give the step from which the actor "
                          "is updated (0: from the first step)")


def check_agent_keys(cfg: TrainerConfig, overridden: set[str]) -> None:
    """Retriever and turn settings are read by a multi-turn agent loop only; given without one, the
    run would train single-turn generation and ignore them."""
    if cfg.actor_rollout_ref.rollout.agent_loop is None:
        given = sorted(k for k in overridden if k == "max_turns" or k.startswith("retriever."))
        if given:
            raise ConfigError(f"{', '.join(given)} set but actor_rollout_ref.rollout.agent_loop is null (single-turn "
                              "generation, no search): add actor_rollout_ref.rollout.agent_loop="
                              "search_r1.agent.loop:SearchAgentLoop")


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
        if not 0.0 <= ratio <= 1.0:
            raise ConfigError(f"{key} = {ratio}: use the fraction of decoder layers recomputed in backward, "
                              f"in [0, 1] (1.0: all; 0 or enable_gradient_checkpointing=false: none)")


@dataclass
class Sizes:
    """Batch sizes derived once; every unit is in the name."""
    world: int                           # worker processes (GPUs)
    prompts_per_step: int
    trajectories_per_step: int
    trajectories_per_worker: int
    mini_batch_trajectories_per_worker: int
    micro_batch_trajectories_per_worker: int
    logprob_micro_trajectories_per_worker: int
    critic_micro_trajectories_per_worker: int


def derive_sizes(cfg: TrainerConfig) -> Sizes:
    world = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    n = cfg.actor_rollout_ref.rollout.n_agent
    actor = cfg.actor_rollout_ref.actor
    per_step = cfg.data.train_batch_size * n
    mini = actor.ppo_mini_batch_size

    def need(cond, message):
        if not cond:
            raise ConfigError(message)

    need(per_step % world == 0,
         f"data.train_batch_size × rollout.n_agent = {per_step} trajectories per step is not divisible "
         f"by trainer.nnodes × trainer.n_gpus_per_node = {world} workers")
    need(per_step % mini == 0,
         f"data.train_batch_size × rollout.n_agent = {per_step} trajectories per step is not divisible "
         f"actor.ppo_mini_batch_size = {mini} trajectories")
    need(mini % world == 0,
         f"actor.ppo_mini_batch_size = {mini} trajectories is not divisible by {world} workers")
    for key, value in (("actor_rollout_ref.actor.ppo_micro_batch_size", actor.ppo_micro_batch_size),
                       ("actor_rollout_ref.rollout.log_prob_micro_batch_size",
                        cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size),
                       ("critic.ppo_micro_batch_size", cfg.critic.ppo_micro_batch_size)):
        need(value % world == 0 and value >= world,
             f"{key} = {value} trajectories must be a positive multiple of the {world} workers")
    micro = actor.ppo_micro_batch_size // world
    need((mini // world) % micro == 0,
         f"actor.ppo_mini_batch_size / workers = {mini // world} trajectories is not divisible "
         f"by actor.ppo_micro_batch_size / workers = {micro}")
    return Sizes(world, cfg.data.train_batch_size, per_step, per_step // world, mini // world, micro,
                 cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size // world,
                 cfg.critic.ppo_micro_batch_size // world)
