"""A rollout worker: the engine, the agent loop and the tokenizer in a process of their own
(trainer.rollout_ahead_steps >= 1), so that generation runs beside the actor's update instead of
taking turns with it, and its Python (the agent loop, the engine's scheduler) shares no interpreter
with the update's.

Ray runs an actor's calls one at a time, in the order they were made: a weight push that the driver
makes while a generation runs waits for it, and the generations made after the push use the pushed
weights. Every generation reports the weights it used (`version`: the actor updates in them), from
which the trainer logs how stale each step's batch is.

The engine never sleeps here: on a GPU shared with a policy worker it keeps its memory (weights and
KV cache, rollout.gpu_memory_utilization) while the actor trains, which the policy worker's memory
plan sees as taken.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from verl.batch import RolloutBatch
from verl.config.load import agent_loop_spec
from verl.config.schema import TrainerConfig
from verl.utils.profiling import phase
from verl.workers.generation import sample_trajectories, trajectories_batch
from verl.workers.policy_worker import separate_engine_core, vllm_engine_kwargs
from verl.workers.rollout.loop_from_config import agent_loop_settings, load_agent_loop
from verl.workers.weight_transfer import load_shared, received_weights, weight_group


@dataclass
class StepRollout:
    """A training step's part of the rollout, as one rollout worker generated it."""
    batch: RolloutBatch
    version: int      # actor updates in the weights that generated it (the pushes loaded before)
    seconds: float    # the generation's wall time on the worker


class RolloutWorker:
    def __init__(self, rank: int, cfg: TrainerConfig, device: str):
        self.rank, self.cfg, self.device = rank, cfg, device
        self.version = 0   # the engine starts from the model the actor starts from
        self._weight_group = None

    def setup(self) -> None:
        from verl.workers.rollout.engine_by_name import create_engine
        cfg, rollout = self.cfg, self.cfg.actor_rollout_ref.rollout
        agent_cls, settings = load_agent_loop(agent_loop_spec(cfg)), agent_loop_settings(cfg, self.device)
        vllm_kw = {}
        if rollout.name == "vllm":
            separate = separate_engine_core(rollout, self.device)
            budget = cfg.data.max_prompt_length + agent_cls.max_response_tokens(settings)
            # one engine of one GPU per worker (tensor parallelism is refused at start-up), awake throughout
            vllm_kw = dict(gpu_memory_utilization=rollout.gpu_memory_utilization,
                           max_model_len=rollout.max_model_len or budget, enable_sleep_mode=False,
                           enforce_eager=rollout.enforce_eager, separate_core=separate,
                           **vllm_engine_kwargs(rollout, 1, separate, self.device))
        # Seeded as the policy worker of the same rank seeds its colocated engine: the same rows and
        # step seed give the same tokens in either mode.
        self.engine = create_engine(rollout.name, cfg.actor_rollout_ref.model.path, device=self.device,
                                    seed=cfg.trainer.seed + self.rank, key="actor_rollout_ref.rollout.name", **vllm_kw)
        self.tokenizer = self.engine.tokenizer
        self.agent = agent_cls(self.engine, settings)

    def engine_dtype(self) -> str:
        """The dtype of the engine's weights, in which pushes arrive."""
        return str(self.engine.dtype)

    @phase
    def generate(self, prompts: list[list[int]], group_ids: list[int], temperature: float,
                 top_p: float, max_tokens: int, seed: int | None = None, logprobs: bool = False) -> RolloutBatch:
        """The agent loop over `prompts`, as the policy worker's `generate` runs it (validation)."""
        trajectories = sample_trajectories(self.agent, self.engine, self.cfg.actor_rollout_ref.rollout, prompts,
                                           temperature, top_p, max_tokens, seed, logprobs)
        return trajectories_batch(trajectories, prompts, group_ids, self.tokenizer, logprobs, type(self.agent))

    def generate_for_step(self, *args) -> StepRollout:
        """A training step's rollout (`generate`'s arguments), with the weights it used and its time."""
        t = time.perf_counter()
        batch = self.generate(*args)
        return StepRollout(batch, self.version, time.perf_counter() - t)

    # -- weight pushes (verl.workers.weight_transfer): each runs after the calls made before it --

    @phase
    def load_weights(self, weights: dict[str, torch.Tensor], version: int) -> int:
        """object_store: the full weights, read from Ray's object store (Ray resolves the ref the
        driver passed before this call runs)."""
        self.engine.load_weights(iter(weights.items()))
        self.version = version
        return version

    @phase
    def load_shared_weights(self, payload: bytes, version: int) -> int:
        """ipc: weights on this GPU, as CUDA IPC handles of the policy worker's copy."""
        load_shared(self.engine, payload)
        self.version = version
        return version

    def join_weight_group(self, addr: str, port: int, world: int) -> None:
        """broadcast: join the first policy worker's group, as rank 1 + this worker's rank."""
        self._weight_group = weight_group(addr, port, 1 + self.rank, world, self.device)

    @phase
    def receive_weights(self, meta: list[tuple[str, tuple, str]], version: int) -> int:
        """broadcast: the weights as the first policy worker sends them, streamed into the engine."""
        weights = received_weights(self._weight_group, meta, self.device)
        self.engine.load_weights(weights)
        for _ in weights:   # whatever the engine left unread: the sender broadcasts every tensor
            pass
        self.version = version
        return version

    def shutdown(self) -> None:
        """End of training: stop the engine while this process is still whole."""
        if self.cfg.actor_rollout_ref.rollout.name == "vllm":
            self.engine.shutdown()
