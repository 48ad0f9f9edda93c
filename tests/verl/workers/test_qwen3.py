"""The Qwen3 family, dense and mixture-of-experts (tiny random models of conftest's `tiny_qwen3_dir`),
through the trainer's path: the FSDP2 actor (a process group of one, gloo) with activation
checkpointing and packed forwards, one update, then the weight push into vLLM on CPU.

What MoE adds: routed experts stored as one 3D tensor per projection (transformers' fused layout,
which is what the actor's state dict and so the push carry) and a router whose gradient only flows
through the routing weights of the chosen experts. The checks: every expert and the router receive
a gradient, and after the push the engine scores tokens as the trainer does.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from conftest import vllm_skip_reason
from verl.batch import RolloutBatch, pack_trajectories
from verl.config.schema import ActorConfig, FSDPConfig, ModelConfig, OptimConfig
from verl.workers.actor import Actor
from verl.workers.distributed import full_state_dict_iter
from verl.workers.modeling import VARLEN_ATTN, build_causal_lm, decoder_layers
from verl.workers.packing import forward_packed

PROMPT_LENS = [5, 9, 2, 7, 4, 11, 3, 6]
RESPONSE_LENS = [12, 3, 17, 8, 1, 10, 6, 14]
LR = 1e-2


@dataclass
class Trained:
    """One update of the FSDP2 actor, with what it started from."""
    actor: Actor
    batch: RolloutBatch
    logprobs_before_BR: torch.Tensor
    params_before: dict[str, torch.Tensor]
    metrics: dict[str, float]


def make_batch(seed: int = 0) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(5, 2000, (n,), generator=g).tolist() for n in PROMPT_LENS]
    responses = [torch.randint(5, 2000, (n,), generator=g).tolist() for n in RESPONSE_LENS]
    batch = pack_trajectories(prompts, responses, [[1] * n for n in RESPONSE_LENS], list(range(len(prompts))),
                              pad_id=0)
    batch.advantages_BR = torch.randn(len(prompts), 1, generator=g) * batch.loss_mask_BR
    return batch


def full_params(model) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in full_state_dict_iter(model)}


@pytest.fixture(scope="module")
def trained(tiny_qwen3_dir):
    """The actor as the trainer builds it, FSDP2-sharded over a process group of one (the one left by an
    in-process vLLM engine of an earlier test, or one made here and removed after), with every decoder
    layer checkpointed; then one update (one epoch, two micro-batches; no weight decay, so that a
    parameter moves exactly where its gradient is not zero)."""
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        config = ActorConfig(optim=OptimConfig(lr=LR, weight_decay=0.0), ppo_epochs=1, entropy_coeff=0.0,
                             use_dynamic_bsz=False, fsdp_config=FSDPConfig(mixed_precision=False))
        actor = Actor(ModelConfig(path=tiny_qwen3_dir, enable_gradient_checkpointing=True), config,
                      micro_batch_size=4)
        batch = make_batch()
        logprobs_before_BR = actor.compute_logprobs(batch)
        before = full_params(actor.model)
        metrics = actor.update(batch, mini_batch_size=len(batch))
        yield Trained(actor, batch, logprobs_before_BR, before, metrics)
    finally:
        if made and dist.is_initialized():   # an engine's shutdown takes the group down with it
            dist.destroy_process_group()


def test_qwen3_trains_through_the_fsdp2_actor_with_gradients_reaching_every_expert_and_the_router(
        tiny_qwen3_dir, trained):
    from torch.distributed.fsdp import FSDPModule
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer
    moe = tiny_qwen3_dir.endswith("moe")
    model, batch, P = trained.actor.model, trained.batch, trained.batch.prompt_width
    layers = decoder_layers(model)
    # one FSDP2 unit per decoder layer (FSDP2 subclasses the module's class), each checkpointed
    layer_cls = Qwen3MoeDecoderLayer if moe else Qwen3DecoderLayer
    assert all(isinstance(layer, FSDPModule) and isinstance(layer, layer_cls) and layer.gradient_checkpointing
               for layer in layers)

    # The actor's log-probs (before the update) are transformers' of each row alone, without padding.
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32)
    expected_BR = torch.zeros_like(trained.logprobs_before_BR)
    for i in range(len(batch)):
        ids = batch.input_ids_BT[i][batch.attention_mask_BT[i].bool()]
        n_prompt = int(batch.attention_mask_BT[i, :P].sum())
        with torch.no_grad():
            logp_TV = hf(ids[None]).logits[0, n_prompt - 1:-1].log_softmax(-1)
        expected_BR[i, :len(ids) - n_prompt] = logp_TV.gather(-1, ids[n_prompt:, None])[:, 0]
    torch.testing.assert_close(trained.logprobs_before_BR, expected_BR, atol=1e-4, rtol=0)
    # On the CPU the actor packs one row at a time: all rows in one pack (position ids restarting per
    # row, a block-diagonal mask), and the varlen attention's row boundaries, give the same.
    args = (batch.input_ids_BT, batch.attention_mask_BT, P)
    varlen = build_causal_lm(tiny_qwen3_dir, attn_implementation=VARLEN_ATTN)
    with torch.no_grad():
        for m in (hf, varlen):
            torch.testing.assert_close(forward_packed(m, *args, max_tokens_per_pack=None)[0], expected_BR,
                                       atol=1e-4, rtol=0)

    # Adam's first step moves a parameter by about the learning rate wherever its gradient is non-zero
    # (and finite: a non-finite norm skips the step): every tensor moved, every expert of every layer too.
    assert 0 < trained.metrics["grad_norm"] < float("inf")
    after = full_params(model)
    assert after.keys() == trained.params_before.keys()
    moved = {name: (after[name] - before).abs() for name, before in trained.params_before.items()}
    assert all(torch.isfinite(after[name]).all() and d.max() > LR / 2 for name, d in moved.items()), \
        {name: d.max().item() for name, d in moved.items()}
    experts = {name: d for name, d in moved.items() if ".experts." in name}
    routers = [name for name in moved if name.endswith("mlp.gate.weight")]
    if moe:   # fused: [experts, 2·moe_intermediate, hidden] and [experts, hidden, moe_intermediate]
        assert len(experts) == 2 * len(layers) and len(routers) == len(layers)
        assert all((d.flatten(1).amax(1) > LR / 2).all() for d in experts.values())
    else:
        assert not experts and not routers


@pytest.mark.e2e  # a vLLM engine
def test_vllm_scores_as_the_trainer_after_a_push_of_the_updated_qwen3_weights(tiny_qwen3_dir, trained):
    """The push the policy worker makes (full tensors gathered from the FSDP2 shards, in the engine's
    dtype, experts as fused 3D tensors): the engine's greedy tokens change, and their log-probs are the
    actor's. vLLM's CPU MoE kernel computes from packed copies of the expert weights, which the push
    must renew (`SharedWeightsReceiver.repack_cpu_experts`)."""
    if reason := vllm_skip_reason():
        pytest.skip(reason)
    from verl.workers.rollout.engine import SamplingConfig
    from verl.workers.rollout.vllm_engine import VLLMEngine
    engine = VLLMEngine(tiny_qwen3_dir, seed=0, max_model_len=256, kv_cache_memory_bytes=64 << 20)
    try:
        prompts = [list(range(100, 116)), list(range(300, 309))]
        greedy = SamplingConfig(temperature=0, max_tokens=8, logprobs=True)
        before = [g.token_ids for g in engine.generate(prompts, greedy, stop=[])]
        engine.load_weights(full_state_dict_iter(trained.actor.model, dtype=engine.dtype))
        generations = engine.generate(prompts, greedy, stop=[])
        assert [g.token_ids for g in generations] != before   # the updated policy, not the initial one
        responses = [g.token_ids for g in generations]
        batch = pack_trajectories(prompts, responses, [[1] * len(r) for r in responses], [0, 1], pad_id=0)
        trainer_BR = trained.actor.compute_logprobs(batch)
        for i, g in enumerate(generations):
            torch.testing.assert_close(torch.tensor(g.logprobs), trainer_BR[i, :len(g.token_ids)], atol=1e-4, rtol=0)
    finally:
        engine.shutdown()
