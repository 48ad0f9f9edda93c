"""The demo's sizes (`Preset`, `PRESETS`) and what a preset makes each stage run with: the
`search-r1 eval` flags, the SFT stage's step count, and the trainer keys of the GRPO stage."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

TEST_QUESTIONS = 375  # in the bundled test split


@dataclass(frozen=True)
class Preset:
    """One demo size. Evaluation and GRPO (rollout and validation) use the same turn settings, so
    their exact matches compare: 3 searches, `response_length` tokens per turn, 256 per observation."""
    eval_questions: int           # first bundled test questions evaluated after each stage
    sft_questions: int            # training questions turned into gold SFT trajectories
    sft_epochs: int
    grpo_steps: int               # planned GRPO steps (trainer.total_training_steps)
    grpo_prompts: int             # prompts per step
    grpo_n: int                   # samples per prompt (the GRPO group)
    lr: float
    response_length: int          # tokens the model may write per turn
    grpo_minutes: float | None = None  # trainer.time_limit_minutes: may end GRPO before grpo_steps
    val_questions: int = 0        # first test questions validated during GRPO (0: eval_questions)
    # validate before training, every N steps and after the last; -1: never, since the evaluations
    # before and after GRPO already measure the same questions with the same settings
    test_freq: int = -1
    micro_batch: int = 4          # trajectories per forward/backward in SFT and GRPO
    sft_batch: int = 16           # trajectories per SFT optimizer step
    ram_gb: int = 16              # memory the largest stage may take, said up front
    disk_gb: int = 4              # what the run writes: model copies, index, checkpoint
    sft: bool = True              # False: GRPO starts from the bundled model itself
    template: str = "instruct"    # the prompt template of the tags protocol's rows
    grpo_keys: tuple[str, ...] = ()   # trainer keys of the GRPO stage: reward terms (default: plain EM) and such
    # tags: written by the search agent after each observation, opening the model's next turn, in
    # training and every evaluation alike (AgentConfig.turn_prefix)
    turn_prefix: str = ""

    @property
    def validated_questions(self) -> int:
        """The validation set is the start of the evaluation set, never more."""
        return min(self.val_questions or self.eval_questions, self.eval_questions)


PRESETS = {
    # 2 CPU cores, where an SFT or GRPO step costs in proportion to the trajectories it runs through.
    # 64 tokens per turn are enough for the gold format (~40) and keep decoding cheap. SFT batches of 8:
    # what the warm start learns follows its optimizer steps more than its questions, so small batches
    # give it the steps at a fraction of the trajectories. GRPO: two steps of one group of 4, enough to
    # run the RL path (a weight push between them), not to move EM. 24 evaluated questions: each of the
    # three evaluations costs in proportion (benchmarks/RESULTS.md, "The demo").
    "cpu": Preset(eval_questions=24, sft_questions=40, sft_epochs=2, grpo_steps=2, grpo_prompts=1, grpo_n=4,
                   lr=5e-6, response_length=64, sft_batch=8),
    "small": Preset(eval_questions=2, sft_questions=8, sft_epochs=1, grpo_steps=1, grpo_prompts=2, grpo_n=2,
                    lr=5e-6, response_length=64),
    # One GPU, ~10 minutes of GRPO, on the order of 100 steps of 160 trajectories
    # (benchmarks/RESULTS.md, "Learning curve"). The small SFT leaves GRPO room to improve and enough
    # right answers to learn from.
    # lr 1e-5: the paper trains Qwen2.5-3B at 1e-6 for ~1,000 steps; Adam moves each weight by about
    # lr per step, so ~100 steps at 1e-5 give a 135M model the same total movement. 1,000 steps is a
    # ceiling (the time limit ends GRPO; the lr is constant, so the ceiling changes nothing else).
    # 128 tokens per turn leave room for reasoning longer than the gold format; on a GPU it is cheap.
    "gpu": Preset(eval_questions=TEST_QUESTIONS, sft_questions=64, sft_epochs=2, grpo_steps=1000,
                  grpo_prompts=32, grpo_n=5, lr=1e-5, response_length=128, grpo_minutes=10,
                  val_questions=100, test_freq=10, micro_batch=16),
}
# No SFT: reinforcement learning alone from the bundled model, which writes the tags in about 1 % of
# its samples, so under plain EM nearly every group is flat. Each setting below gives the first
# rewarded samples a shape worth learning:
# - the worked example (template example2_think) shows the format, its question and two searches,
#   the second made from what the first returned; the response begins with "<think>", without which
#   the model writes no valid trajectory;
# - the agent opens a "<think>" after each observation (turn_prefix), so a sample that searched can
#   still go on in the valid format;
# - the reward pays the valid format only after a search (its format_needs_search), so a wrong
#   answer given at once earns nothing, and adds a retrieval term for a valid answer whose passages
#   held the gold;
# - GRPO's advantages are not divided by the group's reward spread (Dr.GRPO): divided, a lone sample
#   that breaks the format weighs as much as a lone right answer, which holds the policy on a plateau.
# The evidence for each: benchmarks/RESULTS.md, "Reinforcement learning alone: the rl-only preset".
PRESETS["rl-only"] = dataclasses.replace(
    PRESETS["gpu"], sft=False, template="example2_think", grpo_minutes=15, turn_prefix="<think>",
    grpo_keys=("reward.reward_kwargs={format_score: 0.2, final_format_score: 0, retrieval_score: 0.3, "
               "format_needs_search: true}", "algorithm.norm_adv_by_std_in_grpo=false"))
GPU_PRESETS = ("gpu", "rl-only")


MAX_TURNS, MAX_OBS = 3, 256   # searches per question and tokens per observation, in every stage


def eval_args(model: Path, data: Path, url: str, out: Path, size: Preset, protocol: str = "tags") -> list:
    """`search-r1 eval`'s arguments for one evaluation stage, in the agent settings GRPO trains with."""
    return ["--model", model, "--data", data,
            "--retriever-url", url, "--limit", size.eval_questions, "--mode", "search", "--out", out,
            "--max-turns", MAX_TURNS, "--max-response-length", size.response_length, "--max-obs-length", MAX_OBS,
            "--protocol", protocol, *(["--turn-prefix", size.turn_prefix] if size.turn_prefix else []),
            "--enforce-eager"]  # a 135M model over a few hundred questions: start-up dominates


def sft_steps(size: Preset) -> int:
    """Optimizer steps of the SFT stage; questions whose evidence is not retrieved are dropped, so
    this is an upper bound."""
    return size.sft_epochs * math.ceil(size.sft_questions / size.sft_batch)


def agent_overrides(size: Preset, url: str, tool_config: Path | None) -> list[str]:
    """The agent's keys: the search agent with tags, or (tool_config given) verl's multi_turn keys with
    the search tool, whose data.max_response_length is the whole response (verl's meaning)."""
    if tool_config is None:
        return [f"data.max_response_length={size.response_length}", "data.max_prompt_length=512",
                "actor_rollout_ref.rollout.agent_loop=search_r1.agent.loop:SearchAgentLoop",
                f"max_turns={MAX_TURNS}", f"retriever.url={url}",
                *([f"actor_rollout_ref.rollout.agent_kwargs={{turn_prefix: '{size.turn_prefix}'}}"]
                  if size.turn_prefix else [])]
    from search_r1.agent.loop import response_budget
    return [f"data.max_response_length={response_budget(MAX_TURNS, size.response_length, MAX_OBS)}",
            "data.max_prompt_length=1024",   # the prompt lists the tool
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tool_config}",
            f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={MAX_TURNS + 1}"]


def write_tool_config(path: Path, url: str) -> Path:
    """The search tool's YAML (verl's layout) for the demo's server."""
    path.write_text("tools:\n  - class_name: search_r1.agent.search_tool.SearchTool\n"
                    f"    config: {{retrieval_service_url: {url}, topk: 3, num_workers: 64, rate_limit: 64, "
                    "timeout: 60}\n")
    return path


def grpo_overrides(size: Preset, train: Path, test: Path, model: Path, url: str, run_dir: Path,
                   tool_config: Path | None = None) -> list[str]:
    """`python -m verl.trainer.main_ppo` keys for the preset (tool_config: the tool-calling protocol)."""
    trajectories = size.grpo_prompts * size.grpo_n
    return [f"data.train_files={train}", f"data.val_files={test}",
            f"data.val_data_num={size.validated_questions}",
            f"data.train_batch_size={size.grpo_prompts}", f"data.max_obs_length={MAX_OBS}",
            *agent_overrides(size, url, tool_config),
            f"actor_rollout_ref.model.path={model}", f"actor_rollout_ref.rollout.n_agent={size.grpo_n}",
            # one optimizer step per training step: the update stays on-policy
            f"actor_rollout_ref.actor.ppo_mini_batch_size={trajectories}",
            # the sampling and entropy settings the demo's learning curve was measured with
            "actor_rollout_ref.rollout.top_p=1.0", "actor_rollout_ref.actor.entropy_coeff=0.0",
            # trajectories per backward, without activation checkpointing: their activations are what
            # the run's memory peaks on (the update's result does not depend on the split)
            f"actor_rollout_ref.actor.ppo_micro_batch_size={min(size.micro_batch, trajectories)}",
            f"actor_rollout_ref.actor.optim.lr={size.lr}", "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.model.enable_gradient_checkpointing=false",
            "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false",
            "reward.function=search_r1.rewards:score_for",
            f"trainer.total_training_steps={size.grpo_steps}",
            f"trainer.time_limit_minutes={size.grpo_minutes if size.grpo_minutes else 'null'}",
            # the last step (planned or cut by the time limit) is saved and exported to hf_actor
            f"trainer.save_freq={size.grpo_steps}", f"trainer.test_freq={size.test_freq}",
            f"trainer.val_before_train={str(size.test_freq > 0).lower()}", "trainer.single_process=true",
            "trainer.logger=[console,jsonl]", f"trainer.default_local_dir={run_dir}",
            "trainer.project_name=search_r1_demo", "trainer.experiment_name=demo-smollm2-135m-grpo",
            *size.grpo_keys, f"hydra.run.dir={run_dir / 'hydra'}"]
