"""LoRA adapters on the actor and the critic (verl.workers.lora) on CPU: only the adapters train, the
reference is the frozen base, a resume continues bit for bit, the export writes the merged model and
PEFT's adapter, and the rollout engine (vLLM on CPU) computes what the trainer's model computes,
whether it gets the merged weights or the adapters. At world size 2 the adapters shard under FSDP2
and give the single-process update."""
from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from conftest import vllm_skip_reason
from test_actor import TEMPERATURE, _free_port, actor_config, make_batch, max_diff
from verl.checkpoint.export import export_hf
from verl.checkpoint.store import load_checkpoint, save_checkpoint
from verl.config.schema import CriticConfig, CriticModelConfig, FSDPConfig, ModelConfig, OptimConfig
from verl.workers.actor import Actor, Reference
from verl.workers.critic import Critic
from verl.workers.distributed import full_state_dict_iter
from verl.workers.lora import (WeightPush, adapter_config, add_adapters, lora_layers,
                               merged_state_dict_iter, vllm_lora_kwargs, weight_push, write_adapter)
from verl.workers.modeling import build_causal_lm
from verl.workers.packing import forward_packed

RANK, ALPHA = 4, 8


@pytest.fixture(scope="module")
def small_llama_dir(tmp_path_factory) -> str:
    """test_actor's tiny Llama: 2 layers, a vocabulary of 2,048, tied embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         tie_word_embeddings=True, initializer_range=0.3)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    out = tmp_path_factory.mktemp("small_llama")
    model.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def batch(small_llama_dir):
    return make_batch(small_llama_dir)


def lora_actor(model_dir: str, seed: int = 0, **overrides) -> Actor:
    model = ModelConfig(path=model_dir, enable_gradient_checkpointing=True, lora_rank=RANK, lora_alpha=ALPHA)
    return Actor(model, actor_config(**{"optim": OptimConfig(lr=1e-2, weight_decay=0.01), **overrides}),
                 micro_batch_size=2, temperature=TEMPERATURE, seed=seed)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: an in-process vLLM engine of an earlier test leaves a one-process group
    behind, under which the actors here are FSDP2-sharded (DTensor parameters)."""
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def split(model) -> tuple[dict, dict]:
    """(adapter weights, every other parameter), cloned."""
    adapters, frozen = {}, {}
    for name, p in model.named_parameters():
        (adapters if ".lora_" in name else frozen)[name] = full(p.detach()).clone()
    return adapters, frozen


@torch.no_grad()
def shift_adapters(model) -> None:
    for name, p in model.named_parameters():
        if ".lora_" in name:
            p.add_(1.0)


def hf_logits(model, ids_BT) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids_BT).logits


IDS_BT = torch.randint(5, 2000, (2, 12), generator=torch.Generator().manual_seed(3))

# ---------------------------------------------------------------------------------------------------


def test_only_the_adapters_get_gradients_and_move(small_llama_dir, batch):
    actor = lora_actor(small_llama_dir)
    full = Actor(ModelConfig(path=small_llama_dir), actor_config(), micro_batch_size=2, temperature=TEMPERATURE)
    # B starts at zero: the adapted model is the base model
    assert torch.equal(actor.compute_logprobs(batch), full.compute_logprobs(batch))
    adapters, frozen = split(actor.model)
    assert len(adapters) == 2 * 7 * 2   # A and B on q, k, v, o, gate, up, down of both layers (all-linear)
    assert all(not torch.any(t) for n, t in adapters.items() if "lora_B" in n)
    # the optimizer holds the adapters only
    optimized = {id(p) for group in actor.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for n, p in actor.model.named_parameters() if ".lora_" in n}

    micro = batch.select(list(range(4)))
    logprobs_BR, _ = forward_packed(actor.model, micro.input_ids_BT, micro.attention_mask_BT, micro.prompt_width,
                                    TEMPERATURE)
    (logprobs_BR * micro.loss_mask_BR).sum().backward()
    grads = {n: p.grad for n, p in actor.model.named_parameters()}
    assert all(grads[n] is None for n in frozen)
    assert all(grads[n] is not None and grads[n].abs().sum() > 0 for n in adapters if "lora_B" in n)
    actor.optimizer.zero_grad(set_to_none=True)

    metrics = actor.update(batch, mini_batch_size=8)
    after_adapters, after_frozen = split(actor.model)
    assert all(torch.equal(after_frozen[n], frozen[n]) for n in frozen)
    assert max_diff(after_adapters, adapters) > 1e-3 and metrics["grad_norm"] > 0
    assert {id(p) for p in actor.optimizer.state} == optimized


def test_the_reference_is_the_frozen_base_and_costs_no_copy(small_llama_dir, batch):
    actor = lora_actor(small_llama_dir)
    actor.update(batch, mini_batch_size=8)
    reference = Reference(ModelConfig(path=small_llama_dir), mixed_precision=False, micro_batch_size=2,
                          max_tokens_per_pack=40, temperature=TEMPERATURE)
    base_BR = actor.compute_base_logprobs(batch)
    torch.testing.assert_close(base_BR, reference.compute_logprobs(batch), atol=1e-6, rtol=0)
    assert (actor.compute_logprobs(batch) - base_BR).abs().max() > 1e-3   # the adapters moved the policy
    # switched on again, and still trainable: a second update moves them further
    assert all(p.requires_grad for n, p in actor.model.named_parameters() if ".lora_" in n)
    before, _ = split(actor.model)
    actor.update(batch, mini_batch_size=8)
    assert max_diff(split(actor.model)[0], before) > 1e-4


def test_the_merged_weights_are_the_trained_model(small_llama_dir, batch):
    """What the merged push streams, loaded into a plain model, computes what the trainer's model does;
    names and shapes are the Hugging Face model's."""
    actor = lora_actor(small_llama_dir)
    actor.update(batch, mini_batch_size=8)
    merged = dict(merged_state_dict_iter(actor.model))
    plain = build_causal_lm(small_llama_dir)
    assert {n: t.shape for n, t in merged.items()} == {n: t.shape for n, t in full_state_dict_iter(plain)}
    plain.load_state_dict(merged, strict=False)   # the tied lm_head comes with the embedding
    torch.testing.assert_close(hf_logits(plain, IDS_BT), hf_logits(actor.model, IDS_BT), atol=1e-4, rtol=1e-5)
    # peft's own merge, of an unsharded copy holding the same adapters, gives the same weights
    copied = add_adapters(build_causal_lm(small_llama_dir), RANK, ALPHA, "all-linear", seed=1, key="test")
    copied.load_state_dict({n: full(p.detach()) for n, p in actor.model.named_parameters()}, strict=False)   # lm_head: tied
    for layer in lora_layers(copied).values():
        layer.merge()
    peft_merged = {n.replace(".base_layer.", "."): p for n, p in copied.named_parameters() if ".lora_" not in n}
    assert max_diff(peft_merged, {n: merged[n] for n in peft_merged}) < 1e-6
    # in the engine's dtype: added in fp32, cast once
    bf16 = dict(merged_state_dict_iter(actor.model, dtype=torch.bfloat16))
    assert all(torch.equal(bf16[n], merged[n].to(torch.bfloat16)) for n in merged)


def test_the_critic_trains_its_backbones_adapters_and_its_value_head(small_llama_dir, batch):
    model = CriticModelConfig(path=small_llama_dir, enable_gradient_checkpointing=False, lora_rank=RANK,
                              fsdp_config=FSDPConfig(mixed_precision=False))
    critic = Critic(CriticConfig(model=model, optim=OptimConfig(lr=3e-3)), actor_config(ppo_epochs=1),
                    micro_batch_size=2)
    trainable = {n for n, p in critic.model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in critic.model.named_parameters() if ".lora_" in n or n.startswith("value_head")}
    _, frozen = split(critic.model)
    batch = replace(batch, values_BR=critic.compute_values(batch))
    critic.update(batch, mini_batch_size=8)
    after, after_frozen = split(critic.model)
    assert all(torch.equal(after_frozen[n], frozen[n]) for n in frozen if not n.startswith("value_head"))
    assert not torch.equal(after_frozen["value_head.weight"], frozen["value_head.weight"])
    config = adapter_config(critic.model, small_llama_dir)
    assert config["r"] == RANK and config["lora_alpha"] == 16 and "q_proj" in config["target_modules"]


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")   # peft's, before our refusal
def test_adapters_refuse_layers_they_cannot_serve(small_llama_dir):
    with pytest.raises(ValueError, match=r"actor_rollout_ref.model.target_modules=\['no_such_proj'\]"):
        add_adapters(build_causal_lm(small_llama_dir), RANK, ALPHA, ["no_such_proj"], 0, "actor_rollout_ref.model")
    with pytest.raises(ValueError, match="not nn.Linear.*embed_tokens"):
        add_adapters(build_causal_lm(small_llama_dir), RANK, ALPHA, ["embed_tokens", "q_proj"], 0, "critic.model")
    with pytest.raises(ValueError, match="output layer"):
        add_adapters(build_causal_lm(small_llama_dir), RANK, ALPHA, ["lm_head"], 0, "actor_rollout_ref.model")


def test_adapters_are_drawn_from_the_seed_alone(small_llama_dir):
    """Every rank draws the same adapters whatever its own random state (FSDP2 shards what each holds)."""
    drawn = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        model = add_adapters(build_causal_lm(small_llama_dir), RANK, ALPHA, "all-linear", 7, "x")
        drawn.append(split(model)[0])
    assert max_diff(*drawn) == 0


def test_the_weight_push_follows_the_engine_and_the_key():
    assert weight_push(0, "vllm", "auto")[0] == WeightPush.FULL
    assert weight_push(16, "vllm", "auto")[0] == WeightPush.ADAPTER
    assert weight_push(16, "hf", "auto") == (WeightPush.MERGED, "the rollout engine gets every weight, the adapted "
                                             "ones merged (rollout.lora_sync=auto: rollout.name=hf takes no adapters)")
    assert weight_push(1024, "vllm", "auto")[0] == WeightPush.MERGED
    assert weight_push(16, "vllm", "merged")[0] == WeightPush.MERGED
    assert vllm_lora_kwargs(4) == dict(enable_lora=True, max_loras=1, max_lora_rank=8)
    assert vllm_lora_kwargs(64)["max_lora_rank"] == 64 and vllm_lora_kwargs(300)["max_lora_rank"] == 320


# ---------------------------------------------------------------------------------------------------
# Checkpoints and the export


@pytest.fixture(scope="module")
def trained(small_llama_dir, batch, tmp_path_factory):
    """A LoRA actor updated once, saved (step 1), then updated again: (checkpoint root, the adapter
    weights after the second update, the logits of the model at step 1)."""
    root = tmp_path_factory.mktemp("lora_ckpt")
    actor = lora_actor(small_llama_dir)
    actor.update(batch, mini_batch_size=8)
    save_checkpoint(root, 1, {"actor": (actor.model, actor.optimizer, actor.scheduler)}, {"step": 1},
                    adapters={"actor": adapter_config(actor.model, small_llama_dir)})
    logits_at_1 = hf_logits(actor.model, IDS_BT)
    actor.update(make_batch(small_llama_dir, seed=1), mini_batch_size=4)
    return root, split(actor.model)[0], logits_at_1


def test_a_checkpoint_holds_the_adapters_and_their_optimizer_state_only(trained):
    import torch.distributed.checkpoint as dcp
    root, _, _ = trained
    step = Path(root) / "global_step_1" / "actor"
    for part in ("model", "optimizer"):
        keys = dcp.FileSystemReader(str(step / part)).read_metadata().state_dict_metadata
        tensors = [k for k in keys if not k.endswith(".step") and "param_groups" not in k]
        assert tensors and all(".lora_" in k for k in tensors), part
    config = json.loads((step / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (RANK, ALPHA, "LORA")


def test_a_resumed_lora_run_continues_bit_for_bit(trained, small_llama_dir):
    root, adapters_at_2, _ = trained
    actor = lora_actor(small_llama_dir)
    shift_adapters(actor.model)   # only the checkpoint can make them equal again
    assert load_checkpoint(root, 1, {"actor": (actor.model, actor.optimizer, actor.scheduler)}) == {"step": 1}
    assert actor.scheduler.last_epoch == 1 and actor.optimizer.state
    actor.update(make_batch(small_llama_dir, seed=1), mini_batch_size=4)
    resumed = split(actor.model)[0]
    assert all(torch.equal(resumed[n], adapters_at_2[n]) for n in adapters_at_2)


def test_the_export_writes_the_merged_model_and_the_peft_adapter(trained, small_llama_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    root, _, logits_at_1 = trained
    out = Path(export_hf(Path(root) / "global_step_1", "actor", tmp_path / "hf", small_llama_dir))
    merged = AutoModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(hf_logits(merged, IDS_BT), logits_at_1, atol=1e-4, rtol=1e-5)
    assert sorted(p.name for p in (out / "adapter").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(small_llama_dir), out / "adapter")
    torch.testing.assert_close(hf_logits(with_adapter, IDS_BT), logits_at_1, atol=1e-4, rtol=1e-5)
    # bf16 through the CLI, in several shards
    from verl.checkpoint.export import main
    main(["export", "--checkpoint", str(root), "--config-source", small_llama_dir, "--out", str(tmp_path / "bf16"),
          "--dtype", "bfloat16", "--max-shard-bytes", "100000"])
    assert len(list((tmp_path / "bf16").glob("model-*.safetensors"))) > 1
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------------
# The rollout engine: vLLM on CPU, given the merged weights or the adapters


@pytest.mark.e2e  # a vLLM engine
@pytest.mark.parametrize("push", [WeightPush.MERGED, WeightPush.ADAPTER])
def test_the_engine_computes_what_the_trainers_model_does(tiny_model_dir, push, tmp_path):
    if reason := vllm_skip_reason():
        pytest.skip(reason)
    from verl.workers.rollout.engine import SamplingConfig
    from verl.workers.rollout.vllm_engine import VLLMEngine
    model = ModelConfig(path=tiny_model_dir, enable_gradient_checkpointing=False, lora_rank=8, lora_alpha=16)
    actor = Actor(model, actor_config(ppo_epochs=1, optim=OptimConfig(lr=3e-2)), micro_batch_size=2,
                  temperature=TEMPERATURE)
    actor.update(make_batch(tiny_model_dir), mini_batch_size=8)
    engine = VLLMEngine(tiny_model_dir, seed=0, max_model_len=256, kv_cache_memory_bytes=64 << 20,
                        **(vllm_lora_kwargs(8) if push == WeightPush.ADAPTER else {}))
    prompts = [list(range(100, 116)), list(range(300, 309))]
    greedy = SamplingConfig(temperature=0, max_tokens=8, logprobs=True)
    before = [g.token_ids for g in engine.generate(prompts, greedy, stop=[])]
    if push == WeightPush.ADAPTER:
        engine.load_adapter(write_adapter(actor.model, str(tmp_path / "adapter"), tiny_model_dir))
        engine.load_adapter(write_adapter(actor.model, str(tmp_path / "adapter"), tiny_model_dir))  # a new id
        assert engine.llm.llm_engine.list_loras() == {2}
    else:
        engine.load_weights(merged_state_dict_iter(actor.model, dtype=engine.dtype))
    generations = engine.generate(prompts, greedy, stop=[])
    assert [g.token_ids for g in generations] != before   # the trained policy, not the base
    for prompt, g in zip(prompts, generations):
        ids_BT = torch.tensor([prompt + g.token_ids])
        logp_TV = hf_logits(actor.model, ids_BT)[0, len(prompt) - 1:-1].log_softmax(-1)
        assert logp_TV.argmax(-1).tolist() == g.token_ids
        trainer = logp_TV.gather(-1, torch.tensor(g.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(g.logprobs), trainer, atol=1e-4, rtol=0)
    engine.shutdown()


# ---------------------------------------------------------------------------------------------------
# World size 2: FSDP2 shards the adapted model (peft first, then fully_shard)


def _fsdp_rank(rank, world, port, model_dir, batch_path, out_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from verl.utils.process_group import init_distributed
    init_distributed(timeout_minutes=2)
    try:
        batches = torch.load(batch_path, weights_only=False)
        first, second = (b.split(world)[rank] for b in batches)
        torch.manual_seed(100 + rank)   # the ranks' own random states differ, as in the trainer
        actor = lora_actor(model_dir)
        actor.update(first, mini_batch_size=len(first))
        save_checkpoint(f"{out_dir}/ckpt", 1, {"actor": (actor.model, actor.optimizer, actor.scheduler)}, {},
                        adapters={"actor": adapter_config(actor.model, model_dir)})
        merged = {n: t.clone() for n, t in merged_state_dict_iter(actor.model)}   # a collective
        actor.update(second, mini_batch_size=len(second))
        continued = {n: t.clone() for n, t in full_state_dict_iter(actor.model) if ".lora_" in n}
        resumed_actor = lora_actor(model_dir)
        shift_adapters(resumed_actor.model)
        load_checkpoint(f"{out_dir}/ckpt", 1, {"actor": (resumed_actor.model, resumed_actor.optimizer,
                                                         resumed_actor.scheduler)})
        resumed_actor.update(second, mini_batch_size=len(second))
        resumed = {n: t.clone() for n, t in full_state_dict_iter(resumed_actor.model) if ".lora_" in n}
        torch.save(dict(merged=merged, continued=continued, resumed=resumed), f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.e2e  # two processes
def test_fsdp_world_size_2_trains_the_adapters_as_one_process_does(small_llama_dir, batch, tmp_path):
    second = make_batch(small_llama_dir, seed=1)
    torch.save((batch, second), tmp_path / "batches.pt")
    mp.spawn(_fsdp_rank, args=(2, _free_port(), small_llama_dir, str(tmp_path / "batches.pt"), str(tmp_path)),
             nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]

    actor = lora_actor(small_llama_dir)
    actor.update(batch, mini_batch_size=len(batch))
    merged = dict(merged_state_dict_iter(actor.model))
    actor.update(second, mini_batch_size=len(second))
    adapters = {n: t for n, t in split(actor.model)[0].items()}
    for r in ranks:
        assert max_diff(r["merged"], merged) < 1e-5
        assert max_diff(r["continued"], adapters) < 1e-5
        assert all(torch.equal(r["resumed"][n], r["continued"][n]) for n in adapters)   # bit for bit
