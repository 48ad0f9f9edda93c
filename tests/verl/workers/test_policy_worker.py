"""PolicyWorker's choices that depend on the device, how it seeds its rollouts, and its handling of a
rollout engine that runs out of GPU memory. The failing engine is a stand-in: running a real GPU out
of memory is outside what a CPU test can do."""
import pytest
import torch

from verl.config.schema import RolloutConfig, TrainerConfig
from verl.workers.policy_worker import PolicyWorker, separate_engine_core, vllm_engine_kwargs
from verl.workers.rollout.loop_from_config import agent_schedule


def test_auto_schedule_and_engine_core_follow_the_device():
    rollout = RolloutConfig()
    assert (rollout.schedule, rollout.engine_core) == ("auto", "auto")
    assert agent_schedule(rollout, "cuda") == "continuous" and separate_engine_core(rollout, "cuda")
    assert agent_schedule(rollout, "cpu") == "sync" and not separate_engine_core(rollout, "cpu")
    hf = RolloutConfig(name="hf")
    assert agent_schedule(hf, "cuda") == "sync"  # the HF engine cannot step
    explicit = RolloutConfig(schedule="async", engine_core="in_process")
    assert agent_schedule(explicit, "cuda") == "async" and not separate_engine_core(explicit, "cuda")
    assert separate_engine_core(RolloutConfig(engine_core="separate"), "cpu")
    with pytest.raises(ValueError, match="engine_core='child'"):
        separate_engine_core(RolloutConfig(engine_core="child"), "cuda")


def test_vllm_engine_kwargs_put_the_users_over_the_trainers():
    rollout = RolloutConfig()
    assert vllm_engine_kwargs(rollout, 1, True, "cuda") == {"compilation_config": {"max_cudagraph_capture_size": 2048}}
    assert vllm_engine_kwargs(RolloutConfig(max_cudagraph_capture_size=None), 2, False, "cuda") == {
        "distributed_executor_backend": "external_launcher"}  # one vLLM rank per process
    assert vllm_engine_kwargs(rollout, 1, False, "cpu")["kv_cache_memory_bytes"] == 256 << 20
    mine = RolloutConfig(engine_kwargs={"max_num_seqs": 512, "compilation_config": {"cudagraph_mode": "FULL"}})
    assert vllm_engine_kwargs(mine, 1, True, "cuda") == {"max_num_seqs": 512,
                                                        "compilation_config": {"cudagraph_mode": "FULL"}}


class SeedLog:
    """A real engine, with a log of how each call was seeded."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def reseed(self, seed):
        self.calls.append(("reseed", seed))
        self.engine.reseed(seed)

    def generate(self, prompts, sampling, stop):
        self.calls.append(("generate", sampling.seed))
        return self.engine.generate(prompts, sampling, stop)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def rollout_worker(engine, asleep: bool, max_tokens: int = 4, **rollout_keys) -> PolicyWorker:
    """A PolicyWorker with only the fields its generate reads (sync_weights also needs `actor`)."""
    from verl.workers.rollout.agent_loop import AgentLoopSettings
    from verl.workers.rollout.single_turn import SingleTurnLoop
    worker = object.__new__(PolicyWorker)
    worker.cfg = TrainerConfig()
    for name, value in rollout_keys.items():
        setattr(worker.cfg.actor_rollout_ref.rollout, name, value)
    worker.engine, worker.tokenizer, worker._asleep = engine, engine.tokenizer, asleep
    worker.agent = SingleTurnLoop(engine, AgentLoopSettings(max_tokens_per_turn=max_tokens))
    return worker


@pytest.mark.parametrize("request_seeds", [True, False])
def test_the_steps_seed_seeds_each_request_or_the_engine_once(tiny_model_dir, request_seeds):
    """rollout.request_seeds: the step's seed goes with every request, or (false) re-seeds the engine
    before the call and the requests go unseeded. Either way a seed repeats its samples, although
    other work moved torch's global stream in between, and another seed samples differently."""
    from verl.workers.rollout.hf_engine import HFEngine
    engine = SeedLog(HFEngine(tiny_model_dir))
    worker = rollout_worker(engine, asleep=False, max_tokens=12, request_seeds=request_seeds)
    prompts = [engine.tokenizer(q).input_ids for q in ("capital of France?", "who wrote Hamlet?")] * 2

    def sample(seed):
        torch.manual_seed(1_000 + len(engine.calls))  # training between rollouts draws from the stream
        return worker.generate(prompts, [0, 1, 0, 1], 1.0, 1.0, 12, seed=seed).info["response_ids"]

    first, again, other = sample(5), sample(5), sample(6)
    assert first == again and first != other
    if request_seeds:
        assert engine.calls == [("generate", 5), ("generate", 5), ("generate", 6)]
    else:
        assert engine.calls == [("reseed", 5), ("generate", None), ("reseed", 5), ("generate", None),
                                ("reseed", 6), ("generate", None)]


class CallLog(SeedLog):
    """A real engine, with a log of its sleeps, wakes, weight loads and generations."""

    def wake(self):
        self.calls.append("wake")

    def sleep(self):
        self.calls.append("sleep")

    def load_weights(self, named_tensors):
        self.calls.append("load")
        self.engine.load_weights(named_tensors)

    def generate(self, prompts, sampling, stop):
        self.calls.append("generate")
        return self.engine.generate(prompts, sampling, stop)


def test_the_engine_stays_awake_from_the_weight_sync_into_the_rollout(tiny_model_dir):
    """A weight sync leaves the engine awake for the rollout that follows (one wake and one sleep a
    step fewer); the rollout samples with the synced weights, and the engine sleeps while the actor
    trains."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from verl.workers.rollout.hf_engine import HFEngine
    engine = CallLog(HFEngine(tiny_model_dir))
    actor_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for param in actor_model.parameters():  # the actor's update
            param.add_(0.01)
    worker = rollout_worker(engine, asleep=True)  # asleep, as setup leaves it
    worker.actor = SimpleNamespace(model=actor_model)
    prompts = [engine.tokenizer("capital of France?").input_ids] * 2

    worker.generate(prompts, [0, 0], 1.0, 1.0, 4, seed=1)
    worker.sync_weights()
    worker.generate(prompts, [0, 0], 1.0, 1.0, 4, seed=2)
    assert engine.calls == ["wake", "generate", "sleep", "wake", "load", "generate", "sleep"]
    assert worker._asleep
    synced = dict(actor_model.named_parameters())
    assert all(torch.equal(p, synced[name]) for name, p in engine.engine.model.named_parameters())


class EngineOutOfMemory:
    def __init__(self, error: Exception):
        self.error = error

    def wake(self):
        raise self.error


def asleep_worker(engine, engine_core: str) -> PolicyWorker:
    worker = object.__new__(PolicyWorker)  # only the fields wake_rollout reads
    worker.cfg = TrainerConfig()
    worker.cfg.actor_rollout_ref.rollout.gpu_memory_utilization = 0.4
    worker.cfg.actor_rollout_ref.rollout.engine_core = engine_core
    worker.engine = engine
    worker._asleep = True
    return worker


@pytest.mark.parametrize("engine_core", ["in_process", "separate"])
def test_out_of_memory_on_wake_names_the_keys_to_change(engine_core):
    # The text vLLM's child-process core returns for a failed cuMemCreate on wake_up.
    oom = Exception("Call to wake_up method failed: CUDA Error: out of memory at cumem_allocator.cpp:163")
    worker = asleep_worker(EngineOutOfMemory(oom), engine_core)
    with pytest.raises(RuntimeError) as caught:
        worker.wake_rollout()
    message = str(caught.value)
    assert message.startswith("out of GPU memory waking the rollout engine")
    assert "gpu_memory_utilization=0.4" in message
    assert "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true" in message
    assert ("in_process streams them" in message) == (engine_core == "separate")
    assert caught.value.__cause__ is oom
    assert worker._asleep  # still asleep: nothing pretends the engine is up


def test_other_wake_errors_pass_through():
    error = ValueError("something else")
    worker = asleep_worker(EngineOutOfMemory(error), "auto")
    with pytest.raises(ValueError, match="something else"):
        worker.wake_rollout()


def test_a_failed_sleep_on_a_shared_gpu_says_why_and_what_to_do():
    from verl.workers.policy_worker import shared_gpu_error
    # vLLM's message when another process allocated on the GPU while this engine went to sleep
    error = shared_gpu_error(Exception("Call to sleep method failed: Memory usage increased after sleeping."))
    assert isinstance(error, RuntimeError)
    assert "another process on the same GPU" in str(error) and "actor_rollout_ref.rollout.enable_sleep=false" in str(error)
    other = ValueError("something else")
    assert shared_gpu_error(other) is other


def test_cached_memory_is_given_back_after_an_update():
    from verl.workers.worker_process import release_cached_memory
    # On the CPU there is nothing cached; the metric is still reported (GPU figures: test_worker_process_gpu.py).
    assert release_cached_memory() == {"memory/after_update_reserved_gib": 0.0}
