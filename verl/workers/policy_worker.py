"""The policy's worker process, one per GPU: the FSDP2 actor, the colocated rollout engine (with
trainer.rollout_ahead_steps = 0; else the rollout workers generate, verl.workers.rollout_worker) and
the reference model. The driver calls it through Ray (verl.single_controller.ray_group); every method
takes and returns plain data (RolloutBatch on CPU, dicts of floats)."""
from __future__ import annotations

import contextlib
import os
import tempfile
import time

import torch

from verl.batch import RolloutBatch
from verl.config.load import agent_loop_spec
from verl.config.schema import TrainerConfig
from verl.config.sizes import Sizes
from verl.utils.profiling import phase
from verl.workers.generation import sample_trajectories, trajectories_batch
from verl.workers.lora import WeightPush, vllm_lora_kwargs, weight_push
from verl.workers.rollout.loop_from_config import agent_loop_settings, load_agent_loop
from verl.workers.weight_transfer import WeightSender
from verl.workers.worker_process import (ProfiledWorker, expandable_segments, join_process_group, release_cached_memory,
                                         rendezvous)


def separate_engine_core(rollout, device: str) -> bool:
    """Whether vLLM's engine core gets a process of its own (rollout.engine_core; auto: on a GPU).
    There it keeps vLLM's CPU-bound scheduler away from the agent loop's Python, which made 3B
    rollouts and GRPO steps faster (benchmarks/RESULTS.md, "The engine core in its own process").
    On CPU its busy loop would take a core from the trainer."""
    if rollout.engine_core not in ("auto", "in_process", "separate"):
        raise ValueError(f"actor_rollout_ref.rollout.engine_core={rollout.engine_core!r}: use auto, in_process "
                         "or separate")
    return rollout.engine_core == "separate" or (rollout.engine_core == "auto" and device == "cuda")


def vllm_engine_kwargs(rollout, world: int, separate: bool, device: str) -> dict:
    """What `vllm.LLM` gets besides the settings that have keys of their own: the trainer's choices,
    then rollout.engine_kwargs over them (a compilation_config given there replaces the trainer's)."""
    kw = {}
    if world > 1 and not separate:  # each process is one data-parallel rank of vLLM
        kw["distributed_executor_backend"] = "external_launcher"
    if device == "cpu":  # a small fixed KV cache: no share-of-RAM probing on CPU
        kw["kv_cache_memory_bytes"] = 256 << 20
    if rollout.max_cudagraph_capture_size:
        kw["compilation_config"] = {"max_cudagraph_capture_size": rollout.max_cudagraph_capture_size}
    return kw | dict(rollout.engine_kwargs or {})


@contextlib.contextmanager
def explain_out_of_memory(what: str, rollout):
    """Re-raise a GPU out-of-memory error of `what` with the keys that make room. vLLM reports a
    failed allocation on wake-up as a plain RuntimeError (or Exception, from its child process)."""
    try:
        yield
    except Exception as error:
        if "out of memory" not in str(error).lower():
            raise
        gib = 1 << 30
        free, total = torch.cuda.mem_get_info() if torch.cuda.is_available() else (0, 0)
        held = torch.cuda.memory_reserved() if torch.cuda.is_available() else 0
        copy = (" With engine_core=separate a push holds a whole copy of the weights in the engine's dtype; "
                "in_process streams them one tensor at a time." if rollout.engine_core != "in_process" else "")
        raise RuntimeError(
            f"out of GPU memory {what}: the engine takes actor_rollout_ref.rollout.gpu_memory_utilization="
            f"{rollout.gpu_memory_utilization} of the GPU ({rollout.gpu_memory_utilization * total / gib:.1f} GiB) "
            f"while the actor, its optimizer state and the reference in this process hold {held / gib:.1f} GiB "
            f"({free / gib:.1f} of {total / gib:.1f} GiB free). Lower actor_rollout_ref.rollout.gpu_memory_utilization, "
            "set actor_rollout_ref.actor.fsdp_config.optimizer_offload=true, or shard over more GPUs "
            f"(trainer.n_gpus_per_node).{copy}") from error


def shared_gpu_error(error: Exception) -> Exception:
    """vLLM's sleep checks that the GPU's free memory grew; another process allocating on the same
    GPU at that moment fails the check, and vLLM's message does not say so."""
    if "memory usage increased after sleeping" not in str(error).lower():
        return error
    return RuntimeError(
        f"vLLM could not put the rollout engine to sleep ({error}): it checks that the GPU's free memory grew, "
        "and another process on the same GPU (a second run, an evaluation) allocated memory meanwhile. Give this "
        "run a GPU of its own (CUDA_VISIBLE_DEVICES), or set actor_rollout_ref.rollout.enable_sleep=false (the "
        "engine then keeps its memory while the actor trains: lower actor_rollout_ref.rollout."
        "gpu_memory_utilization to make room)")


class PolicyWorker(ProfiledWorker, WeightSender):
    _expandable = False   # allocator switching (expandable_segments), decided in setup
    push = WeightPush.FULL   # what sync_weights pushes into the engine, decided in setup (model.lora_rank)
    _adapter_tmp: tempfile.TemporaryDirectory | None = None   # LoRA adapter files for the engine

    def __init__(self, rank: int, cfg: TrainerConfig, sizes: Sizes, total_steps: int, device: str):
        self.rank, self.cfg, self.sizes, self.total_steps, self.device = rank, cfg, sizes, total_steps, device

    def start_profile(self) -> None:
        super().start_profile()
        if self._engine_profiled:
            self.engine.start_profile()

    def stop_profile(self, path_prefix: str) -> list[str]:
        engine = self.engine.stop_profile(path_prefix + "_engine") if self._engine_profiled else []
        return self.profiler.stop(path_prefix, engine_trace=engine[0] if engine else None) + engine

    @property
    def _engine_profiled(self) -> bool:
        """Whether vLLM's own profiler records the engine (its core in a process of its own)."""
        return bool(getattr(self.engine, "profile_dir", None))

    def rendezvous(self) -> tuple[str, int]:
        return rendezvous()

    def setup(self, master_addr: str, master_port: int) -> None:
        from verl.workers.actor import Actor, Reference
        from verl.workers.rollout.engine_by_name import create_engine

        cfg, arr = self.cfg, self.cfg.actor_rollout_ref
        torch.manual_seed(cfg.trainer.seed + self.rank)
        join_process_group(self.rank, self.sizes.world, master_addr, master_port, self.device)
        path = arr.model.path
        rollout = arr.rollout
        self.push, _ = weight_push(arr.model.lora_rank, rollout.name, rollout.lora_sync)
        agent_cls, settings = load_agent_loop(agent_loop_spec(cfg)), agent_loop_settings(cfg, self.device)
        budget = cfg.data.max_prompt_length + agent_cls.max_response_tokens(settings)
        vllm_kw = {}
        if rollout.name == "vllm":
            separate = separate_engine_core(rollout, self.device)
            vllm_kw = dict(gpu_memory_utilization=rollout.gpu_memory_utilization,
                           max_model_len=rollout.max_model_len or budget,
                           enable_sleep_mode=rollout.enable_sleep and self.device == "cuda",
                           enforce_eager=rollout.enforce_eager,
                           tensor_parallel_size=rollout.tensor_model_parallel_size, separate_core=separate,
                           **vllm_engine_kwargs(rollout, self.sizes.world, separate, self.device))
            if self.push == WeightPush.ADAPTER:
                vllm_kw |= vllm_lora_kwargs(arr.model.lora_rank)
            if cfg.trainer.profile_steps and separate:  # in process, this process's profiler sees the engine
                vllm_kw["profile_dir"] = os.path.join(cfg.trainer.default_local_dir, "profile",
                                                      f"engine_policy{self.rank}")
        self.engine = None   # trainer.rollout_ahead_steps >= 1: rollout workers of their own generate
        if not cfg.trainer.rollout_ahead_steps:
            self.engine = create_engine(rollout.name, path, device=self.device, seed=cfg.trainer.seed + self.rank,
                                        key="actor_rollout_ref.rollout.name", **vllm_kw)
            self.tokenizer = self.engine.tokenizer
            self.agent = agent_cls(self.engine, settings)
        a = arr.actor
        self.longest_row = budget
        self.actor = Actor(arr.model, a, micro_batch_size=self.sizes.micro_batch_trajectories_per_worker,
                           total_steps=self.total_steps, temperature=rollout.temperature,
                           seed=cfg.trainer.seed,
                           log_prob_budget=(rollout.log_prob_use_dynamic_bsz, rollout.log_prob_max_token_len_per_gpu))
        self.reference = None   # with LoRA the actor is its own reference, adapters off (compute_ref_log_probs)
        if (a.use_kl_loss or cfg.algorithm.use_kl_in_reward) and not arr.model.lora_rank:
            ref = arr.ref
            self.reference = Reference(arr.model, param_offload=ref.fsdp_config.param_offload,
                                       mixed_precision=a.fsdp_config.mixed_precision,
                                       micro_batch_size=ref.log_prob_micro_batch_size // self.sizes.world,
                                       max_tokens_per_pack=a.max_tokens_per_pack, temperature=rollout.temperature,
                                       budget=(a.use_dynamic_bsz if ref.log_prob_use_dynamic_bsz is None
                                               else ref.log_prob_use_dynamic_bsz, ref.log_prob_max_token_len_per_gpu),
                                       state_masking=a.state_masking)
        # Fixed allocator blocks for the engine, expandable ones for training (expandable_segments);
        # with the engine core in this process its allocator shares ours, which stays as it is.
        self._expandable = self.device == "cuda" and (self.engine is None or (
            rollout.name == "vllm" and separate_engine_core(rollout, self.device)))
        self._peaks: dict[str, float] = {}   # this step's log-prob passes (memory/…_peak_allocated_gib)
        self._asleep = self.engine is None
        self.sleep_rollout()

    # -- rollout -------------------------------------------------------------------------------

    def _allocator_for(self, training: bool) -> None:
        if self._expandable:
            expandable_segments(training)

    def pending_bytes(self) -> float:
        """GPU memory the actor will still allocate in a step (its optimizer state before the first)."""
        return self.actor.pending_bytes()

    def plan_memory(self, others_pending: float) -> list[str]:
        """Token budgets and recomputed layers measured now, with the engine asleep and every role
        built (verl.workers.memory); `others_pending`: what the critic on this GPU will still allocate.
        Returns the arithmetic, for the driver's log."""
        self._allocator_for(training=True)
        notes = self.actor.plan_memory(self.longest_row, others_pending)
        if self.reference is not None:
            adam = 0.0 if self.actor.optimizer_offload else self.actor.pending_bytes()
            notes += self.reference.plan_memory(self.longest_row, others_pending + adam)
        return notes

    def sleep_rollout(self):
        if not self._asleep:
            try:
                self.engine.sleep()
            except Exception as error:
                raise shared_gpu_error(error) from error
            self._asleep = True

    def wake_rollout(self):
        self._allocator_for(training=False)
        if self._asleep:
            with explain_out_of_memory("waking the rollout engine", self.cfg.actor_rollout_ref.rollout):
                self.engine.wake()
            self._asleep = False

    @phase
    def generate(self, prompts: list[list[int]], group_ids: list[int], temperature: float,
                 top_p: float, max_tokens: int, seed: int | None = None, logprobs: bool = False) -> RolloutBatch:
        """The agent loop over `prompts` (verl.workers.generation); `seed` (the step's, for this worker)
        makes its samples the same in a resumed run as in an uninterrupted one. `logprobs`: keep the
        engine's log-prob of every sampled token (batch.rollout_logprobs_BR)."""
        self.wake_rollout()
        trajectories = sample_trajectories(self.agent, self.engine, self.cfg.actor_rollout_ref.rollout, prompts,
                                           temperature, top_p, max_tokens, seed, logprobs)
        self.sleep_rollout()
        return trajectories_batch(trajectories, prompts, group_ids, self.tokenizer, logprobs, type(self.agent))

    @phase
    def sync_weights(self) -> float:
        """Push the actor's current weights into the rollout engine, in memory. The engine stays awake:
        what the trainer runs on it next is the rollout (or a validation), which would wake it again at
        once."""
        from verl.workers.distributed import full_state_dict_iter
        from verl.workers.lora import merged_state_dict_iter, write_adapter
        t0 = time.perf_counter()
        self.wake_rollout()
        rollout = self.cfg.actor_rollout_ref.rollout
        # Gathered in the engine's dtype (bf16 on GPU: half the bytes of the fp32 master weights).
        with explain_out_of_memory("pushing the actor's weights into the rollout engine", rollout):
            if self.push == WeightPush.ADAPTER:   # a few MB of adapter files, read by the engine
                self.engine.load_adapter(write_adapter(self.actor.model, self._adapter_dir(),
                                                       self.cfg.actor_rollout_ref.model.path))
            elif self.push == WeightPush.MERGED:
                self.engine.load_weights(merged_state_dict_iter(self.actor.model, dtype=self.engine.dtype))
            else:
                self.engine.load_weights(full_state_dict_iter(self.actor.model, dtype=self.engine.dtype))
        return time.perf_counter() - t0

    def _adapter_dir(self) -> str:
        """This worker's directory of the adapter the engine loads (its own: every worker has an engine)."""
        if self._adapter_tmp is None:
            self._adapter_tmp = tempfile.TemporaryDirectory(prefix=f"lora_policy{self.rank}_")
        return self._adapter_tmp.name

    def shutdown(self) -> None:
        """End of training: stop the rollout engine while this process is still whole."""
        if self.cfg.actor_rollout_ref.rollout.name == "vllm" and self.engine is not None:
            self.engine.shutdown()
        if self._adapter_tmp is not None:
            self._adapter_tmp.cleanup()

    # -- training ------------------------------------------------------------------------------

    @phase
    def compute_log_probs(self, batch: RolloutBatch) -> torch.Tensor:
        with self._peak_memory("old_log_probs"):
            return self.actor.compute_logprobs(batch).cpu()

    @phase
    def compute_ref_log_probs(self, batch: RolloutBatch) -> torch.Tensor:
        with self._peak_memory("ref_log_probs"):
            if self.reference is None:  # LoRA: the base model under the actor's adapters
                return self.actor.compute_base_logprobs(batch).cpu()
            return self.reference.compute_logprobs(batch).cpu()

    @contextlib.contextmanager
    def _peak_memory(self, name: str):
        """A training pass: the allocator for training, and its peak memory kept for the step's metrics
        (returned with the update's)."""
        self._allocator_for(training=True)
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        yield
        if self.device == "cuda":
            self._peaks[f"memory/{name}_peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30

    @phase
    def update_actor(self, batch: RolloutBatch) -> dict:
        # The update is where memory peaks (activations; the engine asleep): its peak is what decides
        # how many layers must be recomputed (gradient_checkpointing_ratio) and how large a micro-batch may be.
        cuda = self.device == "cuda"
        self._allocator_for(training=True)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        metrics = self.actor.update(batch, self.sizes.mini_batch_trajectories_per_worker)
        budgets = self.actor.budgets
        metrics |= {f"memory/{k}_tokens_per_micro_batch": v for k, v in (("update", budgets.update),
                                                                         ("log_prob", budgets.forward)) if v}
        if cuda:
            metrics |= {"memory/update_peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                        "memory/update_peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}
            metrics |= self._peaks
            self._peaks = {}
            metrics |= release_cached_memory()
        return metrics

    # -- checkpoints ---------------------------------------------------------------------------

    def save(self, root: str, step: int, trainer_state: dict, keep_last: int) -> None:
        from verl.checkpoint.store import save_checkpoint
        from verl.workers.lora import adapter_config
        model = self.cfg.actor_rollout_ref.model
        adapters = {"actor": adapter_config(self.actor.model, model.path)} if model.lora_rank else None
        save_checkpoint(root, step, {"actor": (self.actor.model, self.actor.optimizer, self.actor.scheduler)},
                        trainer_state, keep_last, adapters)

    def load(self, root: str, step: int) -> dict:
        from verl.checkpoint.store import load_checkpoint
        state = load_checkpoint(root, step, {"actor": (self.actor.model, self.actor.optimizer, self.actor.scheduler)},
                                self.cfg.trainer.allow_unverified_checkpoint)
        if self.engine is not None:   # else the driver pushes them to the rollout workers
            self.sync_weights()
        return state

    def set_lr_scale(self, scale: float) -> None:
        self.actor.set_lr_scale(scale)
