"""End to end through the real entry point on CPU: a tiny random Llama with a real tokenizer,
the vLLM CPU engine colocated with the FSDP2 actor in 2 Ray worker processes, the search agent
against a real BM25 retrieval server over the bundled corpus. Two GRPO steps with a checkpoint
each, one PPO step with a critic, and on the HF engine in one process: a resumed run that
continues from the saved step with the same data order and samples, DAPO's keys."""
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import vllm_skip_reason

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def bundled_data(tmp_path_factory):
    from search_r1.data import preprocess
    out = tmp_path_factory.mktemp("data")
    for split in ("train", "test"):
        preprocess.main(["--bundled", "--split", split, "--template", "instruct",
                         "--out", str(out / f"{split}.parquet")])
    return out


@pytest.fixture(scope="module")
def bm25_server(bundled_bm25_server):
    return bundled_bm25_server


def train(args, out_dir, timeout=900):
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *args,
           f"trainer.default_local_dir={out_dir}", "hydra.run.dir=" + str(out_dir / "hydra")]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "RAY_DEDUP_LOGS": "0", "PYTHONPATH": os.pathsep.join(
                           # the caller's own entries stay: a GPU node's packages may be found through them
                           filter(None, [str(ROOT), str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))})
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-6000:])
    return [json.loads(l) for l in (out_dir / "metrics.jsonl").read_text().splitlines()], r.stdout + r.stderr


def common(model, data, server):
    return [f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}",
            "data.train_data_num=16", "data.val_data_num=2", "data.train_batch_size=2",
            "data.max_prompt_length=512", "data.max_response_length=24", "data.max_obs_length=48",
            f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.rollout.n_agent=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size=2",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size=2",
            "actor_rollout_ref.ref.log_prob_micro_batch_size=2", "critic.ppo_micro_batch_size=2",
            "actor_rollout_ref.actor.optim.lr=1e-3",
            "actor_rollout_ref.model.enable_gradient_checkpointing=false",
            "actor_rollout_ref.rollout.agent_loop=search_r1.agent.loop:SearchAgentLoop",
            "reward.function=rewards_for_tests:early_letter_reward", "max_turns=1",
            f"retriever.url={server.url}/retrieve", "trainer.n_gpus_per_node=2", "trainer.device=cpu",
            "trainer.logger=[console,jsonl]", "trainer.val_before_train=true"]


def grpo_args(model, data, server):
    return common(model, data, server) + [
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false",
        "actor_rollout_ref.actor.use_kl_loss=true", "trainer.save_freq=1",
        "actor_rollout_ref.rollout.max_cudagraph_capture_size=64",  # accepted; vLLM-CPU runs eagerly
        "actor_rollout_ref.rollout.engine_core=separate"]  # weights cross into vLLM's own process


@pytest.fixture(scope="module")
def grpo_two_steps(tiny_model_dir, bundled_data, bm25_server, tmp_path_factory):
    """Two GRPO steps with a checkpoint each: (its directory, metric rows, log)."""
    if reason := vllm_skip_reason():
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("grpo")
    # step 2 profiled: the engine cores (processes of their own) are recorded by vLLM's profiler
    rows, log = train(grpo_args(tiny_model_dir, bundled_data, bm25_server)
                      + ["trainer.total_training_steps=2", "trainer.profile_steps=[2]"], out)
    return out, rows, log


def test_grpo_two_steps(grpo_two_steps):
    out, rows, log = grpo_two_steps
    # the engine cores are stopped before Ray ends the workers (left to Ray, vLLM logs "engine core
    # exited unexpectedly" and the workers' resource trackers fail on the cores' shared memory)
    assert "exited unexpectedly" not in log and "resource_tracker" not in log
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        for key in ("reward/mean", "pg_loss", "grad_norm", "kl_loss", "entropy", "clipfrac", "lr",
                    "timing_s/rollout", "timing_s/ref_log_probs",
                    "timing_s/update_actor", "timing_s/weight_sync", "agent/searches",
                    "throughput/generated_tokens_per_s", "balance/max_over_mean_tokens", "reward/flat_groups",
                    "agent/no_action", "health/alarms"):
            assert key in r, key
        # one optimizer step on the step's own samples: no separate old-log-prob pass (actor.old_log_probs=auto)
        assert "timing_s/old_log_probs" not in r and r["clipfrac"] == 0
        assert r["grad_norm"] > 0 and r["reward/mean"] > 0  # the policy really moved
        # when the trajectories ended, within the rollout that waited for them
        assert 0 < r["rollout/done_s_p50"] <= r["rollout/done_s_p90"] <= r["rollout/done_s_max"] < r["timing_s/rollout"]
    assert steps[1]["kl_loss"] > 0  # step 2 samples come from the updated policy, unlike the reference
    assert "val/reward/em" in rows[0]
    for rank in (0, 1):  # the engine core's own trace of the profiled step, summed up in the worker's table
        engine = json.loads(gzip.decompress((out / "profile" / f"step2_policy{rank}_engine.json.gz").read_bytes()))
        assert any(e.get("name", "").startswith("execute_context_") for e in engine["traceEvents"])
        table = (out / "profile" / f"step2_policy{rank}.txt").read_text()
        row = table.split("What the engine core did during each rollout call")[1].splitlines()[2].split()
        assert row[0] == "generate" and int(row[3]) > 0   # model steps inside the rollout call
        assert "vLLM's named parts (CPU s): " in table and "gpu_model_runner: forward" in table
    assert not (out / "profile" / "step1_policy0.txt").exists() and not list((out / "profile").glob("engine_*"))
    assert (out / "checkpoints" / "global_step_2").is_dir() and (out / "hf_actor" / "config.json").exists()
    # the exported actor is a loadable HF model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    AutoModelForCausalLM.from_pretrained(out / "hf_actor")
    # the workers decode their own responses; what was scored is the text of the tokens trained on
    tok = AutoTokenizer.from_pretrained(out / "hf_actor")
    samples = [json.loads(line) for path in (out / "samples").glob("*.jsonl") for line in path.read_text().splitlines()]
    assert samples and all(s["response"] == tok.decode(s["response_ids"], skip_special_tokens=True) for s in samples)


def test_ppo_with_critic_warmup(tiny_model_dir, bundled_data, bm25_server, tmp_path):
    if reason := vllm_skip_reason():
        pytest.skip(reason)
    # one PPO step: GAE with a critic, KL in the reward; FSDP2 accumulation with unsharded weights
    # (the original's trainer.critic_warmup: the critic alone in step 1, both from step 2)
    ppo = common(tiny_model_dir, bundled_data, bm25_server) + [
        "algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true",
        "actor_rollout_ref.rollout.n_agent=1", "data.train_batch_size=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "trainer.total_training_steps=2",
        "trainer.critic_warmup=2",
        "trainer.val_before_train=false", "actor_rollout_ref.actor.fsdp_config.unsharded_accumulation=true",
        "critic.model.fsdp_config.unsharded_accumulation=true", "trainer.profile_steps=[2]"]
    rows, _ = train(ppo, tmp_path / "ppo")
    first, second = [r for r in rows if r["step"] > 0]
    # step 2 recorded by every worker's profiler: the actor's and the critic's updates, with FSDP's
    # collectives, in its trace
    profile = tmp_path / "ppo" / "profile"
    assert sorted(p.name for p in profile.iterdir()) == [
        f"step2_{role}{rank}{ext}" for role in ("critic", "policy") for rank in (0, 1) for ext in (".json.gz", ".txt")]
    for role, update in (("critic", "worker.update_critic"), ("policy", "worker.update_actor")):
        events = json.loads(gzip.open(profile / f"step2_{role}0.json.gz").read())["traceEvents"]
        names = {e.get("name", "") for e in events}
        assert "Optimizer.step#AdamW.step" in names and any(n.startswith("FSDP::all_gather") for n in names)
        assert any("Backward0" in n for n in names) and update in names
        assert "aten::" in (profile / f"step2_{role}0.txt").read_text()
    assert "timing_s/update_critic" in first and first["critic/vf_loss"] > 0 and "critic/grad_norm" in first and "timing_s/update_actor" not in first
    assert "timing_s/update_actor" in second and second["grad_norm"] > 0
    assert "timing_s/old_log_probs" in second   # the KL in the reward reads them: the separate pass runs


def test_val_only_validates_once_and_trains_nothing(tiny_model_dir, bundled_data, bm25_server, tmp_path):
    if reason := vllm_skip_reason():
        pytest.skip(reason)
    args = common(tiny_model_dir, bundled_data, bm25_server) + [
        "algorithm.adv_estimator=grpo", "trainer.single_process=true", "trainer.n_gpus_per_node=1",
        "+trainer.val_only=true", "trainer.total_training_steps=3", "trainer.save_freq=1"]
    rows, _ = train(args, tmp_path / "val_only")
    assert [r["step"] for r in rows] == [0] and "val/reward/em" in rows[0]
    assert not (tmp_path / "val_only" / "checkpoints").exists()


def test_a_resumed_run_continues_the_data_order_and_samples_what_the_uninterrupted_run_sampled(
        tiny_model_dir, bundled_data, bm25_server, tmp_path):
    """A run of 1 step, then a longer one in the same directory: it resumes at step 2 with the data
    order an uninterrupted run has, and (sampling seeded per step, trajectory and turn: transformers
    honours the seeds, vLLM on CPU cannot) generates the tokens that step 2 of an uninterrupted run
    did. Its time limit (0.06 s) is spent by then, so step 2 of 5 is the last: validated (test_freq
    is 10) and saved. (Exact resume of sharded weights at world size 2: tests/verl/checkpoint.)"""
    args = common(tiny_model_dir, bundled_data, bm25_server) + [
        "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.name=hf", "trainer.single_process=true",
        "trainer.n_gpus_per_node=1", "trainer.val_before_train=false", "trainer.save_freq=1",
        "trainer.export_hf_on_save=false"]
    straight, _ = train(args + ["trainer.total_training_steps=2"], tmp_path / "straight")
    out = tmp_path / "resumed"
    train(args + ["trainer.total_training_steps=1"], out)
    resumed, _ = train(args + ["trainer.total_training_steps=5", "trainer.time_limit_minutes=0.001",
                               "trainer.test_freq=10"], out)
    assert [r["step"] for r in resumed] == [1, 2] and "val/reward/em" in resumed[-1]   # step 1: the first run's
    assert (out / "checkpoints" / "global_step_2").is_dir()
    keys = ["response/length", "response/model_tokens", "agent/searches", "reward/mean"]
    assert [resumed[-1][k] for k in keys] == [straight[-1][k] for k in keys]
    assert straight[0]["response/length"] != straight[1]["response/length"] or \
        straight[0]["reward/mean"] != straight[1]["reward/mean"]  # the steps sampled differently
    order = [json.loads(line) for line in (out / "data_order.jsonl").read_text().splitlines()]
    assert [o["step"] for o in order] == [1, 2]
    from transformers import AutoTokenizer
    from verl.utils.dataset import PromptSampler, load_examples
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    sampler = PromptSampler(load_examples(str(bundled_data / "train.parquet"), tok, 512, True, 16), 2, True, 1)
    assert [o["indices"] for o in order] == [[e.index for e in sampler.next_batch()] for _ in range(2)]


def test_grpo_with_dapos_filter_groups_and_overlong_buffer(tiny_model_dir, bundled_data, bm25_server, tmp_path):
    """algorithm.filter_groups and reward_model.overlong_buffer (verl's keys) through main_ppo: each
    step logs its generation batches and dropped groups, every draw is listed in data_order.jsonl,
    and the overlong penalty is logged. On rollout.name=hf end to end: transformers generates, and the
    updated weights are pushed into it after each update (this path once failed at the first weight
    push with a TypeError); two mini-batches a step, the update computing the second one's old
    log-probs itself; one process, whose profiler records step 1."""
    args = common(tiny_model_dir, bundled_data, bm25_server) + [
        "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.name=hf", "trainer.single_process=true",
        "trainer.n_gpus_per_node=1", "trainer.total_training_steps=2", "trainer.val_before_train=false",
        "actor_rollout_ref.actor.use_kl_loss=true", "algorithm.use_kl_in_reward=false",
        "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_reward",
        "algorithm.filter_groups.max_num_gen_batches=8", "reward_model.overlong_buffer.enable=true",
        "reward_model.overlong_buffer.len=8", "reward_model.overlong_buffer.penalty_factor=0.5",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "trainer.profile_steps=[1]"]
    rows, _ = train(args, tmp_path / "dapo")
    assert [r["step"] for r in rows] == [1, 2]
    assert sorted(p.name for p in (tmp_path / "dapo" / "profile").iterdir()) == ["step1_policy0.json.gz",
                                                                                  "step1_policy0.txt"]
    assert all("timing_s/weight_sync" in r and "timing_s/old_log_probs" not in r for r in rows)
    assert all(r["filter_groups/gen_batches"] >= 1 and "filter_groups/dropped_groups" in r
               and "reward/overlong_penalty" in r and r["grad_norm"] > 0 for r in rows)
    order = [json.loads(line) for line in (tmp_path / "dapo" / "data_order.jsonl").read_text().splitlines()]
    assert [(o["step"], o["gen_batch"]) for o in order] == [
        (step, g) for r, step in zip(rows, (1, 2)) for g in range(1, int(r["filter_groups/gen_batches"]) + 1)]


def test_grpo_with_lora_adapters(tiny_model_dir, bundled_data, bm25_server, tmp_path):
    """verl's LoRA keys end to end, on 2 FSDP2 workers: only the adapters train, the reference is the
    base model with them switched off (no Reference is built, so step 1's KL is exactly 0), vLLM serves
    them as a LoRA adapter pushed after each update, and the checkpoint holds them alone; its export
    is the merged model, with the adapters in PEFT's format beside it."""
    if reason := vllm_skip_reason():
        pytest.skip(reason)
    args = common(tiny_model_dir, bundled_data, bm25_server) + [
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false", "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
        "actor_rollout_ref.actor.optim.lr=1e-2", "trainer.total_training_steps=2", "trainer.save_freq=2",
        "trainer.val_before_train=false"]
    out = tmp_path / "lora"
    rows, log = train(args, out)
    assert "LoRA on the actor: rank 8, alpha 16" in log and "served as a vLLM LoRA adapter" in log
    first, second = rows
    assert first["kl_loss"] == 0 and second["kl_loss"] > 0   # step 2 samples the adapted policy
    assert all(r["grad_norm"] > 0 and "timing_s/weight_sync" in r and "timing_s/ref_log_probs" in r for r in rows)

    import torch
    import torch.distributed.checkpoint as dcp
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    actor = out / "checkpoints" / "global_step_2" / "actor"
    saved = dcp.FileSystemReader(str(actor / "model")).read_metadata().state_dict_metadata
    assert saved and all(".lora_" in k for k in saved) and (actor / "adapter_config.json").exists()
    ids_BT = torch.tensor([[1, 200, 300, 400, 500]])
    merged = AutoModelForCausalLM.from_pretrained(out / "hf_actor")
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                             out / "hf_actor" / "adapter")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        logits = [m(input_ids=ids_BT).logits for m in (merged, with_adapter, base)]
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-5)
    assert (logits[0] - logits[2]).abs().max() > 1e-3
