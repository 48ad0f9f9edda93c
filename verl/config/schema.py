"""Typed trainer configuration: the one source of every trainer key, its default and its help.

configs/ppo_trainer.yaml (Hydra's primary config) is generated from these dataclasses:
`python -m verl.config --write configs/ppo_trainer.yaml` after changing a field, its default or its
help; tests/verl/config/test_config_yaml.py fails while the two differ. Every field carries its help
(unit and meaning) in `metadata["help"]`, written next to the key in the YAML (verl.config.render).

Unknown keys and wrong types fail at load time (OmegaConf structured merge, verl.config.load), and
so do values out of range; batch sizes are checked against each other once, in
verl.config.sizes.derive_sizes, with errors that name the keys to change.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from omegaconf import MISSING


class ConfigError(ValueError):
    pass


def key(default: Any, help: str) -> Any:
    """A config field: its default and its help (unit and meaning), written into the YAML."""
    return field(default=default, metadata={"help": help})


def key_factory(factory: Callable[[], Any], help: str) -> Any:
    """A config field whose default is built per instance (nested configs, lists, dicts)."""
    return field(default_factory=factory, metadata={"help": help})


# Help shared by the actor's and the critic's model keys.
_CHECKPOINTING_HELP = ("recompute activations in the backward pass instead of keeping them (less memory); how many "
                       "layers: gradient_checkpointing_ratio")
_CHECKPOINTING_RATIO_HELP = ("share of the decoder layers recomputed in backward when enable_gradient_checkpointing, "
                             "spread over the depth, in [0, 1]; lower: faster, more memory. null: on a GPU with "
                             "use_dynamic_bsz, the fewest layers with which a micro-batch of 8,192 tokens fits, "
                             "measured at start-up (verl.workers.memory); otherwise 1")
_DYNAMIC_BSZ_HELP = ("cut micro-batches by tokens (prompt and response) instead of trajectories: what bounds memory "
                     "is the tokens, whose count the policy decides. Every GPU runs the same number of micro-batches, "
                     "each nearly even; the loss is scaled by tokens as with trajectory micro-batches")
_TOKEN_BUDGET_HELP = ("tokens per {what} on one GPU with {switch}; null: the most that fit, measured at start-up once "
                      "the engine sleeps (verl.workers.memory; 2,048 on the CPU)")
_REMOVE_PADDING_HELP = "the original's padding-free switch: accepted and unused (the forward is always padding-free)"
_LORA_RANK_HELP = ("verl's: rank of the LoRA adapters trained on the {what} (peft; only they and their optimizer state "
                   "train and are checkpointed){more}; 0: full fine-tuning")
_LORA_ALPHA_HELP = "verl's: the adapters' scale numerator: their update is B·A·lora_alpha/lora_rank"
_TARGET_MODULES_HELP = ("verl's: the layers that get adapters: all-linear (every linear layer but the output layer) "
                        "or a list of module names, e.g. [q_proj, k_proj, v_proj, o_proj]")


@dataclass
class DataConfig:
    train_files: Any = key(MISSING, "training data: a .parquet, .jsonl or .json file or a list of them; rows "
                                    "with data_source, prompt (chat messages), reward_model.ground_truth, "
                                    "extra_info, or RLinf's prompt and solutions")
    val_files: Any = key(None, "validation data, as train_files; null: no validation")
    train_data_num: int | None = key(None, "keep only the first N training prompts (of those within "
                                           "max_prompt_length); null: all")
    val_data_num: int | None = key(None, "keep only the first N validation prompts; null: all")
    train_batch_size: int = key(512, "prompts per training step (each sampled rollout.n_agent times); an "
                                     "epoch's last partial batch is dropped")
    val_batch_size: int = key(256, "the original's prompts per validation batch: accepted and unused (validation "
                                   "generates all validation prompts in one call, split over the workers)")
    max_prompt_length: int = key(4096, "tokens per prompt (after the chat template); longer prompts are dropped "
                                       "with a warning")
    max_response_length: int = key(500, "tokens the model may generate per turn (the engine's max_tokens); with "
                                        "rollout.multi_turn.enable, as in verl: the whole response, every turn "
                                        "and tool message")
    max_obs_length: int = key(500, "tokens per tool observation (e.g. retrieved passages); longer ones are cut, "
                                   "keeping the observation's closing tag")
    max_start_length: int | None = key(None, "the original's cap on the first prompt's tokens: accepted and unused "
                                             "(max_prompt_length caps prompts here)")
    shuffle_train_dataloader: bool = key(True, "training prompts in a new seeded order each epoch; false: file order")
    apply_chat_template: bool = key(True, "format the prompt messages with the tokenizer's chat template; false: "
                                          "their text as it is (base models)")
    apply_chat_template_kwargs: dict[str, Any] | None = key(None, "verl's: more keyword arguments of the chat "
                                                        "template, for prompts and tool messages alike, e.g. "
                                                        "{enable_thinking: false} for Qwen3; null: none")
    seed: int = key(1, "seed of the training prompts' order (with shuffle_train_dataloader)")


@dataclass
class ModelConfig:
    path: str = key(MISSING, "the policy: a Hugging Face model name or local directory (actor, reference and "
                             "rollout engine all load it)")
    enable_gradient_checkpointing: bool = key(True, _CHECKPOINTING_HELP)
    gradient_checkpointing_ratio: float | None = key(None, _CHECKPOINTING_RATIO_HELP)
    use_remove_padding: bool = key(True, _REMOVE_PADDING_HELP)
    attn_implementation: str | None = key(None, "attention of actor and reference; null: flash_attention_2 if "
                                                "installed, else torch's varlen flash kernel (CUDA, bf16), else sdpa")
    use_torch_compile: bool | None = key(None, "torch.compile each decoder layer of the actor and the reference; "
                                               "null: on a GPU")
    lora_rank: int = key(0, _LORA_RANK_HELP.format(
        what="actor", more=". The reference is then the base model with the adapters switched off (no second "
                           "copy); the rollout engine gets them as rollout.lora_sync says"))
    lora_alpha: float = key(16, _LORA_ALPHA_HELP)
    target_modules: Any = key("all-linear", _TARGET_MODULES_HELP)


@dataclass
class OptimConfig:
    lr: float = key(1e-6, "AdamW learning rate (after warm-up)")
    lr_warmup_steps_ratio: float = key(0.0, "share of the total training steps spent in linear warm-up, in [0, 1]")
    lr_schedule: str = key("constant", "after warm-up: constant | cosine (down to min_lr_ratio × lr at the last step)")
    min_lr_ratio: float = key(0.0, "cosine schedule: the last step's learning rate as a share of lr")
    weight_decay: float = key(0.01, "AdamW weight decay")
    betas: list = key_factory(lambda: [0.9, 0.999], "AdamW (beta1, beta2)")


@dataclass
class FSDPConfig:
    param_offload: bool = key(False, "keep the parameter shards and their gradients in CPU memory, so the "
                                     "optimizer step runs there (CUDA only)")
    grad_offload: bool = key(False, "the original's gradient offload: FSDP2 offloads gradients together with the "
                                    "parameters, so true needs param_offload=true and adds nothing to it")
    optimizer_offload: bool = key(False, "keep the optimizer state in CPU memory between updates (CUDA only; with "
                                         "param_offload it is there already)")
    mixed_precision: bool = key(True, "compute in bf16 with fp32 master weights and fp32 gradient reduction "
                                      "(CUDA only; CPU computes in fp32)")
    # several GPUs: keep full weights and gradients across micro-batches (fsdp.accumulation_steps)
    unsharded_accumulation: bool = key(False, "several GPUs: keep each layer's full weights and sum gradients "
                                              "unsharded over a mini-batch's micro-batches (one all-gather and one "
                                              "reduce-scatter per optimizer step); costs the model's unsharded bf16 "
                                              "weights and fp32 gradients on every GPU")


@dataclass
class ActorConfig:
    optim: OptimConfig = key_factory(OptimConfig, "the actor's optimizer")
    ppo_mini_batch_size: int = key(256, "trajectories per optimizer step, summed over all GPUs (as in the "
                                        "original); data.train_batch_size × rollout.n_agent must be a multiple")
    ppo_micro_batch_size: int = key(64, "trajectories per forward/backward of the actor (also per forward of the "
                                        "old log-probs), summed over all GPUs, when use_dynamic_bsz is false")
    use_dynamic_bsz: bool = key(True, _DYNAMIC_BSZ_HELP)
    ppo_max_token_len_per_gpu: int | None = key(None, _TOKEN_BUDGET_HELP.format(
        what="forward/backward of the actor", switch="use_dynamic_bsz"))
    ppo_epochs: int = key(1, "passes over each step's trajectories (the critic's too)")
    old_log_probs: str = key("auto", "auto: where a training step is one epoch (ppo_epochs 1) and the reward has "
                                     "no KL, the separate pass over the batch is skipped: the first mini-batch's "
                                     "own forward gives the log-probs the ratio starts from, and each worker "
                                     "computes the later mini-batches' ones before its first optimizer step | "
                                     "recompute: always that pass")
    rollout_is_cap: float = key(2.0, "with rollout.calculate_log_probs: each model token's loss is weighted by "
                                     "pi_old / pi_rollout, the importance weight of the policy being trained over "
                                     "the engine that sampled it, truncated at this value (>= 1)")
    grad_clip: float = key(1.0, "largest global gradient norm, clipped above it (the critic's too)")
    clip_ratio_low: float = key(0.2, "PPO clip: the probability ratio is clipped below at 1 - clip_ratio_low")
    clip_ratio_high: float = key(0.2, "PPO clip: the probability ratio is clipped above at 1 + clip_ratio_high")
    clip_ratio_c: float | None = key(None, "dual-clip constant (> 1, e.g. 3.0) bounding the loss of negative-"
                                           "advantage tokens; null: off")
    loss_agg_mode: str = key("token-mean", "token losses to one loss (the critic's too): token-mean | "
                                           "seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm "
                                           "(Dr.GRPO)")
    entropy_coeff: float = key(0.001, "weight of the entropy bonus in the actor loss")
    use_kl_loss: bool = key(False, "KL to the reference as a loss term (GRPO style); loads the reference model")
    kl_loss_coef: float = key(0.001, "weight of the KL loss term (use_kl_loss)")
    kl_loss_type: str = key("low_var_kl", "KL estimator of the loss term: kl (k1) | abs | mse (k2) | low_var_kl (k3)")
    state_masking: bool = key(True, "keep tool observations (e.g. retrieved passages) out of the loss, entropy "
                                    "and KL; false: every response token counts")
    max_tokens_per_pack: int = key(16384, "tokens per padding-free forward where attention needs a mask (fp32, "
                                          "no varlen kernel): a micro-batch's sequences are packed into rows of at "
                                          "most this many (actor, reference and critic). On a GPU in bf16 a "
                                          "micro-batch is one pack whatever its length; on the CPU one sequence a row")
    fsdp_config: FSDPConfig = key_factory(FSDPConfig, "FSDP2 sharding, offload and precision of the actor")


@dataclass
class RefFSDPConfig:
    """The reference is frozen (no gradients, no optimizer) and computes in the actor's precision:
    of the original's fsdp_config it reads param_offload only; the other keys are accepted."""
    param_offload: bool = key(False, "keep the reference's shards in CPU memory between its calls (CUDA only)")
    grad_offload: bool = key(False, "accepted and unused (the reference has no gradients); true still needs "
                                    "param_offload=true, as for the actor")
    optimizer_offload: bool = key(False, "accepted and unused (the reference has no optimizer)")
    mixed_precision: bool = key(True, "the reference computes in the actor's precision "
                                      "(actor.fsdp_config.mixed_precision); false alone is refused")
    unsharded_accumulation: bool = key(False, "accepted and unused (the reference accumulates no gradients)")


@dataclass
class RefConfig:
    log_prob_micro_batch_size: int = key(128, "trajectories per forward of the reference log-probs, summed over "
                                              "all GPUs, when log_prob_use_dynamic_bsz is false")
    log_prob_use_dynamic_bsz: bool | None = key(None, "reference micro-batches by tokens; null: as "
                                                      "actor.use_dynamic_bsz")
    log_prob_max_token_len_per_gpu: int | None = key(None, _TOKEN_BUDGET_HELP.format(
        what="forward of the reference", switch="log_prob_use_dynamic_bsz"))
    fsdp_config: RefFSDPConfig = key_factory(RefFSDPConfig, "the reference's FSDP2 settings: only param_offload "
                                                            "is read")


TOOL_LOOP = "verl.workers.rollout.tool_loop:ToolAgentLoop"
VLLM_MAX_LORA_RANK = 512   # the largest rank vLLM serves as a LoRA adapter (its max_lora_rank)


@dataclass
class MultiTurnConfig:
    enable: bool = key(False, "the tool-calling protocol (verl's keys): tools listed by the chat template, calls as "
                              "<tool_call> JSON, answers as tool messages; the agent loop is " + TOOL_LOOP)
    tool_config_path: str | None = key(None, "the tools as verl's YAML: tools: [{class_name, config, tool_schema}] "
                                             "(search: configs/tools/search.yaml)")
    max_assistant_turns: int | None = key(None, "model messages per trajectory, so one fewer tool round; null: 2 "
                                                "(one tool round, then the answer)")
    format: str = key("hermes", "how calls are written: hermes (<tool_call> JSON, as Qwen2.5 writes it) is the only "
                                "one")


@dataclass
class RolloutConfig:
    name: str = key("vllm", "generation engine: vllm | hf (transformers generate: CPU and tests)")
    n_agent: int = key(1, "samples per prompt: the group of GRPO/RLOO (as in the original scripts)")
    n: int = key(1, "the original's vLLM samples per generate call: only 1 is accepted (any other value stops the "
                    "run); samples per prompt are n_agent, of which this is no alias")
    temperature: float = key(1.0, "sampling temperature of training rollouts (validation is greedy); the actor's "
                                  "and reference's log-probs divide the logits by it too")
    top_p: float = key(0.95, "nucleus sampling: the probability mass sampled from in training rollouts")
    gpu_memory_utilization: float = key(0.6, "vLLM: share of the GPU's memory the engine may take for weights and "
                                             "KV cache (on CPU: of RAM)")
    tensor_model_parallel_size: int = key(1, "vLLM's tensor_parallel_size: GPUs one engine spans")
    enforce_eager: bool | None = key(None, "vLLM: true runs without CUDA graphs; null: eager on CPU, CUDA graphs on "
                                           "a GPU")
    enable_sleep: bool = key(True, "vLLM on a GPU: free the engine's memory (KV cache, weights) while the actor "
                                   "trains")
    calculate_log_probs: bool | None = key(None, "keep the engine's log-prob of every sampled token and weight the "
                                                  "actor's loss by truncated importance ratios against them "
                                                  "(actor.rollout_is_cap), correcting for the engine's numerics "
                                                  "differing from the trainer's and for samples of older weights; "
                                                  "logged as rollout_is_*. null: on with trainer.rollout_ahead_steps "
                                                  ">= 1 (where false is refused), else off")
    log_prob_micro_batch_size: int = key(128, "the original's micro-batch of the old log-probs: checked to be a "
                                              "positive multiple of the workers, otherwise unused (old log-probs "
                                              "run in actor.ppo_micro_batch_size micro-batches)")
    log_prob_use_dynamic_bsz: bool | None = key(None, "old log-prob micro-batches by tokens; null: as "
                                                      "actor.use_dynamic_bsz")
    log_prob_max_token_len_per_gpu: int | None = key(None, _TOKEN_BUDGET_HELP.format(
        what="forward of the old log-probs", switch="log_prob_use_dynamic_bsz"))
    max_model_len: int | None = key(None, "tokens one sequence may hold in the engine; null: max_prompt_length + "
                                          "the longest response the agent loop allows (its max_response_tokens)")
    agent_loop: str | None = key(None, "the agent loop as module:Class; null: single-turn generation (keys of "
                                       "another trainer may name one: docs/TRAINING.md, compatibility tables)")
    multi_turn: MultiTurnConfig = key_factory(MultiTurnConfig, "verl's multi-turn tool calling (the agent loop "
                                                               "it selects reads these keys)")
    agent_kwargs: dict[str, Any] | None = key(None, "the agent loop's own options, {key: value}: checked at "
                                                    "start-up against the options dataclass its class declares "
                                                    "(Options); an unknown key or a wrong type stops the run")
    max_tool_failure_rate: float = key(0.5, "share of a step's tool-calling trajectories whose tool call may fail "
                                            "(those are masked out of the loss), in [0, 1]; above it the run stops")
    schedule: str = key("auto", "how the agent loop drives the engine: sync | async | continuous (vLLM only) | "
                                "auto: continuous with vLLM on a GPU, else sync (benchmarks/RESULTS.md)")
    request_seeds: bool = key(True, "each rollout request samples from a seed of its own (from the step's, the "
                                    "trajectory's and the turn's), so its draws do not depend on the batch "
                                    "around it. false: the step's seed re-seeds each engine once and the "
                                    "requests draw from its streams, so a resumed step repeats its samples only "
                                    "where its requests arrive in the same order (and, with vLLM's first model "
                                    "runner, form the same batches). vLLM's GPU default for dense models draws "
                                    "every request's noise in one kernel either way (benchmarks/RESULTS.md)")
    admit_every_steps: int = key(32, "continuous schedule: engine steps between admissions, when the turns that "
                                     "are ready join the running batch together")
    max_cudagraph_capture_size: int | None = key(2048, "vLLM: tokens of the largest engine step run as a CUDA "
                                                       "graph (larger steps launch kernels one by one); null: "
                                                       "vLLM's default")
    # A child core steps as soon as the first request of a turn reaches it, while the rest are still
    # on their way: which requests share a step is up to timing (vLLM gives no way to hold it).
    engine_core: str = key("auto", "vLLM: in_process | separate (the engine's scheduler and model in a child "
                                   "process; not reproducible: batches form as requests arrive, so two runs, "
                                   "or a run and its resume, sample differently) | auto: separate on a GPU, "
                                   "in_process on CPU")
    # token id -> added to its logit before sampling, in training and validation rollouts alike. The
    # actor's log-probs do not see it: biased samples are off-policy by the bias (benchmarks, bans).
    logit_bias: dict[int, float] | None = key(None, "{token_id: bias} added to those tokens' logits when sampling, "
                                                    "in training and validation; not in the actor's log-probs, so "
                                                    "biased samples are off-policy; null: none")
    # vLLM only: more keyword arguments of vllm.LLM (e.g. max_num_seqs, max_num_batched_tokens,
    # prefix_caching_hash_algo); the settings above that have keys of their own are set there.
    engine_kwargs: dict[str, Any] | None = key(None, "vLLM only: more vllm.LLM arguments, e.g. {max_num_seqs: 512}; "
                                                     "arguments that have keys of their own are refused")
    lora_sync: str = key("auto", "with model.lora_rank > 0, how the engine gets the policy after each update: "
                                 "adapter (the adapter weights only, served as vLLM's LoRA adapter) | merged (every "
                                 "weight, the adapted ones as base + B·A·alpha/r: no LoRA kernels in decoding) | "
                                 "auto: adapter with vLLM up to rank " + str(VLLM_MAX_LORA_RANK) + ", else merged")


# vllm.LLM arguments that rollout keys set: engine_kwargs must not set them a second time.
VLLM_ARGS_WITH_KEYS = {
    "enable_lora": "actor_rollout_ref.model.lora_rank with rollout.lora_sync",
    "max_lora_rank": "actor_rollout_ref.model.lora_rank", "max_loras": "actor_rollout_ref.model.lora_rank",
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
    model: ModelConfig = key_factory(ModelConfig, "the policy model, shared by actor, reference and rollout")
    actor: ActorConfig = key_factory(ActorConfig, "the trained policy: PPO/GRPO update")
    ref: RefConfig = key_factory(RefConfig, "the frozen initial policy, loaded when a KL term needs it "
                                            "(actor.use_kl_loss or algorithm.use_kl_in_reward)")
    rollout: RolloutConfig = key_factory(RolloutConfig, "generation: engine, sampling and the agent loop")


@dataclass
class CriticModelConfig:
    path: str | None = key(None, "the critic's model: a Hugging Face name or local directory; null: "
                                 "actor_rollout_ref.model.path")
    enable_gradient_checkpointing: bool = key(True, _CHECKPOINTING_HELP)
    gradient_checkpointing_ratio: float | None = key(None, _CHECKPOINTING_RATIO_HELP)
    use_remove_padding: bool = key(True, _REMOVE_PADDING_HELP)
    lora_rank: int = key(0, _LORA_RANK_HELP.format(what="critic's backbone", more=", its value head in full"))
    lora_alpha: float = key(16, _LORA_ALPHA_HELP)
    target_modules: Any = key("all-linear", _TARGET_MODULES_HELP)
    fsdp_config: FSDPConfig = key_factory(FSDPConfig, "FSDP2 sharding, offload and precision of the critic")


@dataclass
class CriticConfig:
    model: CriticModelConfig = key_factory(CriticModelConfig, "the value model")
    optim: OptimConfig = key_factory(lambda: OptimConfig(lr=1e-5), "the critic's optimizer")
    ppo_micro_batch_size: int = key(64, "trajectories per forward/backward of the critic (values and update), "
                                        "summed over all GPUs, when use_dynamic_bsz is false")
    use_dynamic_bsz: bool | None = key(None, "critic micro-batches by tokens; null: as actor.use_dynamic_bsz")
    ppo_max_token_len_per_gpu: int | None = key(None, _TOKEN_BUDGET_HELP.format(
        what="forward/backward of the critic's update", switch="use_dynamic_bsz"))
    forward_max_token_len_per_gpu: int | None = key(None, _TOKEN_BUDGET_HELP.format(
        what="forward of the critic's values", switch="use_dynamic_bsz"))
    cliprange_value: float = key(0.5, "value clip: in the loss, new values are kept within this distance of the "
                                      "old ones")


@dataclass
class KLCtrlConfig:
    type: str = key("fixed", "coefficient of the KL in the reward: fixed | adaptive (steered toward target_kl)")
    kl_coef: float = key(0.001, "coefficient of the KL in the reward (adaptive: its starting value)")
    target_kl: float = key(0.1, "adaptive: the KL to the reference that the coefficient is steered toward")
    horizon: int = key(10000, "adaptive: trajectories over which the coefficient adapts (larger: slower)")


# -- DAPO's dynamic sampling and overlong buffer, under verl's keys ------------------------------

# algorithm.filter_groups.metric: verl's names → what decides here that a group is flat. With the KL
# in the reward, verl's seq_final_reward includes it; here the KL is applied after the filter, so
# that name is refused then (_check_dapo_keys).
FILTER_METRICS = {
    "acc": "the reward's .em (exact match) where the reward function gives it, else its score",
    "score": "the reward function's score, before the overlong penalty",
    "seq_reward": "the reward trained on (the score with the overlong penalty)",
    "seq_final_reward": "the same as seq_reward (without the KL in the reward only)",
}


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling: groups whose metric is the same for every sample are dropped and
    more prompts generated until data.train_batch_size groups vary."""
    enable: bool = key(False, "verl's: drop the groups whose metric is equal across their samples (no GRPO signal) "
                              "and generate more prompts until data.train_batch_size groups are kept")
    metric: str | None = key(None, "verl's: the per-trajectory value that decides a group is flat: "
                                   + "; ".join(f"{k}: {v}" for k, v in FILTER_METRICS.items())
                                   + "; needed with enable")
    max_num_gen_batches: int = key(0, "verl's: the most generation batches (of data.train_batch_size prompts) per "
                                      "step; past it the run stops with an error; <= 0: no limit")


@dataclass
class OverlongBufferConfig:
    """DAPO's overlong reward shaping: a linear penalty on responses near the length limit."""
    enable: bool = key(False, "verl's: subtract a penalty from the reward of a response within len tokens of "
                              "data.max_response_length")
    len: int = key(0, "verl's: tokens before data.max_response_length where the penalty starts, in "
                      "(0, data.max_response_length] with enable")
    penalty_factor: float = key(0.0, "verl's: the penalty at the limit (and past it), rising linearly from 0 over "
                                     "the last len tokens; >= 0")
    log: bool = key(False, "verl's switch for logging the penalty: accepted; reward/overlong_penalty and "
                           "reward/overlong_share are logged either way")


@dataclass
class AlgorithmConfig:
    adv_estimator: str = key("gae", "gae (PPO: trains a critic) | grpo | rloo | reinforce_plus_plus | "
                                    "reinforce_plus_plus_baseline")
    gamma: float = key(1.0, "discount per token (GAE, REINFORCE++)")
    lam: float = key(1.0, "GAE lambda")
    norm_adv_by_std_in_grpo: bool = key(True, "grpo: divide advantages by the group's reward std; false: Dr.GRPO")
    # None: as the original, the KL penalty goes into the reward only when actor.use_kl_loss is off
    # (never both unless both are set true).
    use_kl_in_reward: bool | None = key(None, "subtract the KL to the reference from the token rewards; null: only "
                                              "when actor.use_kl_loss is false (as the original)")
    no_think_rl: bool = key(False, "the original's key: only false is accepted (true stopped the original at its "
                                   "first step)")
    kl_penalty: str = key("kl", "KL estimator in the reward: kl (k1) | abs | mse (k2) | low_var_kl (k3)")
    kl_ctrl: KLCtrlConfig = key_factory(KLCtrlConfig, "coefficient of the KL in the reward (use_kl_in_reward)")
    filter_groups: FilterGroupsConfig = key_factory(FilterGroupsConfig, "DAPO's dynamic sampling (verl's keys)")


@dataclass
class RewardConfig:
    function: str | None = key(None, "the outcome reward as module:function(data_source, response_text, "
                                     "ground_truth) -> float or an object with .score, e.g. "
                                     "search_r1.rewards:score_for; null stops the run at start-up")
    # verl's custom_reward_function.reward_kwargs, under the name a verl user looks for: the function's
    # own terms stay out of this schema, the function declares them (verl.trainer.metrics).
    reward_kwargs: dict[str, Any] | None = key(None, "keyword arguments of reward.function, {name: value} (verl's "
                                                     "name: custom_reward_function.reward_kwargs): checked at "
                                                     "start-up against the options dataclass the function declares "
                                                     "(its attribute Options); an unknown name, a wrong type or a "
                                                     "value it refuses stops the run; null: its defaults")
    overlong_buffer: OverlongBufferConfig = key_factory(OverlongBufferConfig, "DAPO's overlong reward shaping, on "
                                                        "the response's tokens (the model's and the tools'); "
                                                        "verl's reward_model.overlong_buffer is read into it")


@dataclass
class RewardModelConfig:
    """The original's and verl's reward_model section: a model-based reward is not offered
    (reward.function is the outcome reward). Keys of a reward function's own under it are read into
    reward.reward_kwargs by the compatibility table of the package that owns the function."""
    enable: bool = key(False, "only false is accepted: the outcome reward is reward.function")
    overlong_buffer: OverlongBufferConfig = key_factory(OverlongBufferConfig, "verl's name of reward.overlong_buffer")


@dataclass
class HealthConfig:
    """Signs that a run is collapsing, watched every step, and what to do when one shows. A loss or
    gradient norm that is not finite always counts; the others are watched when their key is set."""
    action: str = key("warn", "when a sign shows: warn (log it, count it in health/alarms, train on; a non-finite "
                              "loss stops the run) | stop | rollback (to the newest checkpoint saved while healthy, "
                              "with the learning rate times lr_factor and a fresh sampling seed)")
    entropy_spike: float | None = key(3.0, "sign: the policy's entropy above this multiple of its median over the "
                                           "previous `window` steps, or below its median divided by it; > 1; null: "
                                           "not watched")
    max_kl: float | None = key(None, "sign: the KL to the reference (actor kl_loss or kl/reward_kl) above this; "
                                     "> 0; null: not watched")
    val_drop: float | None = key(0.2, "sign: validation reward/em below its best so far by more than this; in "
                                      "(0, 1); null: not watched")
    no_action_rise: float | None = key(0.5, "sign: the share of trajectories that took no action (agent/no_action, "
                                            "as the agent loop counts it: e.g. neither called a tool nor answered) "
                                            "above its lowest over the previous `window` steps by more than "
                                            "this; in (0, 1); null: not watched")
    window: int = key(10, "steps of history the entropy and no-action signs compare with (the entropy sign "
                          "needs 3 of them, the no-action sign 1)")
    max_rollbacks: int = key(3, "rollbacks allowed in a run; one more sign after them stops it")
    lr_factor: float = key(0.5, "rollback: the learning rate is multiplied by this, in (0, 1]")


@dataclass
class RunConfig:
    total_epochs: int = key(1, "passes over the training prompts (when total_training_steps is null)")
    total_training_steps: int | None = key(None, "training steps (learning-rate schedules span them); null: "
                                                 "total_epochs × steps per epoch")
    time_limit_minutes: float | None = key(None, "minutes of wall clock for this run from the start of training "
                                                 "(resume and validation count); the step running when they are "
                                                 "spent is the last; null: no limit")
    project_name: str = key("search_r1", "the wandb project, MLflow experiment and TensorBoard directory's parent")
    experiment_name: str = key("run", "the wandb and MLflow run name; also names default_local_dir and the "
                                      "TensorBoard directory by default")
    logger: list = key_factory(lambda: ["console", "jsonl"], "metric backends: console | jsonl "
                               "(<default_local_dir>/metrics.jsonl) | wandb (WANDB_MODE=offline needs no account) | "
                               "tensorboard ($TENSORBOARD_DIR, else tensorboard_log/<project_name>/<experiment_name>) "
                               "| mlflow ($MLFLOW_TRACKING_URI, else the SQLite database ./mlflow.db); a backend's missing "
                               "package stops the run at start-up")
    nnodes: int = key(1, "nodes")
    n_gpus_per_node: int = key(1, "worker processes per node: one per GPU (on CPU: processes)")
    device: str = key("auto", "auto (cuda if available) | cuda | cpu")
    save_freq: int = key(-1, "steps between checkpoints (the last step is saved too); -1: never")
    test_freq: int = key(-1, "steps between validations (the last step is validated too); -1: never")
    val_before_train: bool = key(True, "validate once before the first training step")
    val_only: bool = key(False, "validate once and stop (no training)")
    critic_warmup: int = key(0, "steps: the actor is updated from this step on, the critic from the first")
    default_hdfs_dir: str | None = key(None, "the original's HDFS copy of checkpoints: only null (checkpoints stay "
                                             "in default_local_dir)")
    keep_last_checkpoints: int = key(2, "checkpoints kept; older ones are deleted once a newer one is complete")
    profile_steps: list | None = key_factory(list, "training steps (1 = the first) recorded by torch.profiler in "
                                             "every worker: each writes <default_local_dir>/profile/"
                                             "step<N>_<role><rank>.json.gz (a Chrome trace of its CPU operators and "
                                             "GPU kernels) and .txt (on a GPU, how each worker call split into "
                                             "compute, communication alone and idle; then operators by device "
                                             "time); a vLLM engine core in a process of its own is recorded by "
                                             "vLLM's profiler (step<N>_policy<rank>_engine.json.gz, summed up "
                                             "per rollout call in the table); those steps run slower for it. [] "
                                             "or null: none")
    balance_batch: bool = key(True, "several workers: reorder each step's trajectories so that every worker gets "
                                    "the same number and nearly the same number of tokens (verl's key); the "
                                    "update's result does not depend on the split")
    resume_mode: str = key("auto", "auto: resume from the newest checkpoint in default_local_dir that verifies | "
                                   "disable: start fresh")
    allow_unverified_checkpoint: bool = key(False, "load a checkpoint that has no manifest.json (written before "
                                                   "checksums existed) without checking its files, on resume and "
                                                   "rollback; false: such a checkpoint is corrupt, as a partial "
                                                   "copy is, and resume falls back to the one before it")
    # An interpolation, resolved by load_config (OmegaConf); a RunConfig built in Python keeps it as text.
    default_local_dir: str = key("checkpoints/${trainer.experiment_name}",
                                 "the run's directory: checkpoints, metrics.jsonl, samples, hf_actor, config.yaml; "
                                 "by default it follows experiment_name")
    export_hf_on_save: bool = key(True, "with each checkpoint, write the actor in Hugging Face format to "
                                        "<default_local_dir>/hf_actor")
    ray_address: str | None = key(None, "null: start a local Ray; auto or host:port: join a running cluster")
    single_process: bool = key(False, "one worker inside the driver, no Ray (one GPU or CPU)")
    seed: int = key(1, "seed of torch and of the rollout engines' sampling (plus the worker's rank)")
    rollout_ahead_steps: int = key(0, "k: how many training steps the rollout may run ahead of the update. 0: "
                                      "synchronous (each policy worker's colocated engine generates, then sleeps "
                                      "while the actor trains). >= 1: rollout workers in processes of their own "
                                      "(placed by the top-level rollout.* keys) generate the next steps' batches "
                                      "while the trainer updates, each batch from weights at most k actor updates "
                                      "old (rollout/staleness), corrected by truncated importance weights "
                                      "(actor_rollout_ref.rollout.calculate_log_probs)")
    health: HealthConfig = key_factory(HealthConfig, "collapse signs watched every step and the response to them")


WEIGHT_TRANSPORTS = {
    "object_store": "the first policy worker puts the full weights (CPU, the engine's dtype) into Ray's object "
                    "store and each rollout worker reads them; works anywhere",
    "ipc": "each policy worker hands the rollout worker on its GPU CUDA IPC handles of a full copy of the weights "
           "(shared GPUs only)",
    "broadcast": "a process group of the first policy worker and the rollout workers (NCCL on GPUs, Gloo on CPU) "
                 "broadcasts the weights tensor by tensor",
}


@dataclass
class RolloutPlacementConfig:
    """Where the rollout workers of trainer.rollout_ahead_steps >= 1 run (verl's one-step-off keys for their
    GPUs) and how the actor's weights reach them."""
    nnodes: int = key(1, "verl's: nodes of the rollout workers' own GPUs (with n_gpus_per_node > 0)")
    n_gpus_per_node: int = key(0, "verl's: GPUs of the rollout workers' own per node (on CPU: processes), one "
                                  "worker each; 0: no GPUs of their own, one rollout worker beside each policy "
                                  "worker on its GPU (the engine then keeps its memory while the actor trains)")
    weight_transport: str = key("auto", "how the weights pushed after each update reach the rollout workers: "
                                        + "; ".join(f"{k}: {v}" for k, v in WEIGHT_TRANSPORTS.items())
                                        + "; auto: ipc on shared GPUs, broadcast across GPUs, object_store on CPU")


@dataclass
class TrainerConfig:
    data: DataConfig = key_factory(DataConfig, "training and validation prompts")
    actor_rollout_ref: ActorRolloutRefConfig = key_factory(ActorRolloutRefConfig, "the policy workers: model, "
                                                           "actor, reference and rollout on every GPU")
    critic: CriticConfig = key_factory(CriticConfig, "the value model, trained only with algorithm.adv_estimator=gae")
    algorithm: AlgorithmConfig = key_factory(AlgorithmConfig, "advantage estimator and the KL in the reward")
    reward: RewardConfig = key_factory(RewardConfig, "the outcome reward of a trajectory")
    reward_model: RewardModelConfig = key_factory(RewardModelConfig, "the original's and verl's reward_model keys: "
                                                 "enable (false only) and overlong_buffer")
    trainer: RunConfig = key_factory(RunConfig, "run length, workers, logging and checkpoints")
    rollout: RolloutPlacementConfig = key_factory(RolloutPlacementConfig, "the rollout workers of "
                                                  "trainer.rollout_ahead_steps >= 1: their GPUs and weight transport")
