"""Actor / Reference / Critic on CUDA: NCCL, bf16 mixed precision, parameter and optimizer offload.

Skipped without CUDA; the FSDP tests need two GPUs. The model is a small random Llama written from a
config (no tokenizer needed), so nothing has to be downloaded on the GPU node.
"""
from __future__ import annotations

import math
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from verl.batch import pack_trajectories
from verl.config.schema import ActorConfig, CriticConfig, CriticModelConfig, FSDPConfig, ModelConfig, OptimConfig
from verl.workers.actor import Actor, Reference
from verl.workers.critic import Critic
from verl.workers.distributed import full_state_dict_iter
from verl.workers.memory import MAX_TOKENS
from verl.workers.modeling import VARLEN_ATTN, build_causal_lm, decoder_layers, pick_attn_implementation
from verl.workers.packing import forward_packed, forward_padded

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")

VOCAB = 1000
RESPONSE_LENS = [60, 44, 54, 38, 6, 2, 12, 4]
PROMPT_LENS = [8, 22, 2, 14, 18, 4, 26, 10]


def make_actor(model_dir: str, mixed_precision: bool, max_tokens_per_pack: int = 16384, **fsdp) -> Actor:
    """Two epochs, asymmetric clipping, entropy and KL terms; `fsdp`: FSDPConfig keys (offloads)."""
    cfg = ActorConfig(optim=OptimConfig(lr=1e-3), ppo_epochs=2, clip_ratio_low=0.2, clip_ratio_high=0.28,
                      loss_agg_mode="token-mean", entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1,
                      max_tokens_per_pack=max_tokens_per_pack,
                      fsdp_config=FSDPConfig(mixed_precision=mixed_precision, **fsdp))
    return Actor(ModelConfig(path=model_dir, use_torch_compile=False), cfg, micro_batch_size=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False, initializer_range=0.1)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("gpu_model")
    LlamaForCausalLM(config).save_pretrained(out)
    return str(out)


def make_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, VOCAB, (p,), generator=g).tolist() for p in PROMPT_LENS]
    responses = [torch.randint(3, VOCAB, (r,), generator=g).tolist() for r in RESPONSE_LENS]
    masks = []
    for r in RESPONSE_LENS:
        m = [1] * r
        if r >= 6:
            m[r // 3: 2 * (r // 3)] = [0] * (r // 3)
        masks.append(m)
    batch = pack_trajectories(prompts, responses, masks, list(range(len(prompts))), pad_id=0)
    B, R = batch.loss_mask_BR.shape
    batch.advantages_BR = torch.randn(B, 1, generator=g) * batch.loss_mask_BR
    batch.values_BR = torch.zeros(B, R)
    batch.returns_BR = torch.randn(B, 1, generator=g) * batch.loss_mask_BR
    return batch


def with_old_logprobs(batch, logprobs_BR, seed=1):
    g = torch.Generator().manual_seed(seed)
    batch.old_logprobs_BR = (logprobs_BR + 0.2 * torch.randn(logprobs_BR.shape, generator=g)) * batch.response_mask_BR
    batch.ref_logprobs_BR = logprobs_BR.clone()
    return batch


def test_packed_equals_padded_on_gpu(model_dir):
    model = build_causal_lm(model_dir).cuda()
    b = make_batch().to("cuda")
    args = (b.input_ids_BT, b.attention_mask_BT, b.prompt_width)
    with torch.no_grad():
        packed, _ = forward_packed(model, *args, max_tokens_per_pack=100)
        padded, _ = forward_padded(model, *args)
        torch.testing.assert_close(packed, padded, atol=1e-4, rtol=0)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            packed_bf16, _ = forward_packed(model, *args, max_tokens_per_pack=100)
        assert (packed_bf16 - padded).abs().max() < 0.2


def test_varlen_flash_attention_on_gpu(model_dir):
    # torch's FlashAttention varlen kernel (the default attention on CUDA in bf16 without the
    # flash-attn package): one pack, no mask; same log-probs as SDPA on the padded batch in bf16,
    # and gradients that agree.
    assert pick_attn_implementation(True) in (VARLEN_ATTN, "flash_attention_2")
    varlen = build_causal_lm(model_dir, attn_implementation=VARLEN_ATTN).cuda()
    plain = build_causal_lm(model_dir).cuda()
    b = make_batch().to("cuda")
    args = (b.input_ids_BT, b.attention_mask_BT, b.prompt_width)
    outs = []
    for model, fn, kw in ((varlen, forward_packed, dict(max_tokens_per_pack=100)), (plain, forward_padded, {})):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logprobs_BR, _ = fn(model, *args, **kw)
        (logprobs_BR * b.response_mask_BR).sum().backward()
        outs.append((logprobs_BR.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    (lp_v, g_v), (lp_p, g_p) = outs
    assert (lp_v - lp_p).abs().max() < 0.1
    assert torch.nn.functional.cosine_similarity(g_v, g_p, dim=0) > 0.99


def test_the_defaults_measure_a_token_budget_and_update_within_it(model_dir):
    """The defaults on a GPU: compiled layers and micro-batches of a token budget measured at the first
    pass (verl.workers.memory), with as few layers recomputed as fit: none for this small model."""
    actor = Actor(ModelConfig(path=model_dir), ActorConfig(optim=OptimConfig(lr=1e-3)), micro_batch_size=2)
    batch = make_batch()
    batch = with_old_logprobs(batch, actor.compute_logprobs(batch))
    budgets = actor.budgets
    assert not (budgets.measure_update or budgets.measure_forward or budgets.choose_recompute)
    assert max(PROMPT_LENS) + max(RESPONSE_LENS) <= budgets.update <= MAX_TOKENS
    assert budgets.forward >= budgets.update   # no activations kept for backward
    assert not any(layer.gradient_checkpointing for layer in decoder_layers(actor.model))
    planned = budgets.update
    metrics = actor.update(batch, mini_batch_size=8)
    assert math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    # the first update checked its passes against the plan (not the AdamW state its step allocated):
    # within it, the budget stands
    assert actor._measured is None and actor.budgets.update == planned


def test_a_qwen3_moe_trains_with_the_one_gpu_defaults(tmp_path):
    """Qwen3-MoE as a one-GPU run trains it, which the CPU tests cannot reach: FSDP2 over a process group
    of one (NCCL) computing in bf16, the varlen attention, compiled decoder layers around the experts'
    grouped matrix products, a measured token budget. Log-probs near the fp32 forward; one update (no
    weight decay) moves every expert of every layer and the routers."""
    import torch.distributed as dist
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64, intermediate_size=512, moe_intermediate_size=128,
                            num_experts=8, num_experts_per_tok=2, max_position_embeddings=1024,
                            tie_word_embeddings=False, initializer_range=0.1)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(tmp_path)
    batch = make_batch()
    with torch.no_grad():
        fp32_BR, _ = forward_padded(build_causal_lm(str(tmp_path)).cuda(), batch.input_ids_BT.cuda(),
                                    batch.attention_mask_BT.cuda(), batch.prompt_width)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        actor = Actor(ModelConfig(path=str(tmp_path)), ActorConfig(optim=OptimConfig(lr=1e-2, weight_decay=0.0)),
                      micro_batch_size=2)
        assert actor.model.config._attn_implementation in (VARLEN_ATTN, "flash_attention_2")
        logprobs_BR = actor.compute_logprobs(batch)
        # bf16 compute of a random model: ~0.03 nats mean; a token whose router scores nearly tie can
        # take another expert in bf16, hence the wider bound on the largest error than a dense model's
        err_N = (logprobs_BR - fp32_BR.cpu())[batch.loss_mask_BR.bool()].abs()
        assert err_N.mean() < 0.05 and err_N.max() < 1.0, (err_N.mean(), err_N.max())
        before = {n: t.cpu() for n, t in full_state_dict_iter(actor.model)}
        metrics = actor.update(with_old_logprobs(batch, logprobs_BR), mini_batch_size=8)
        assert math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
        moved = {n: (t.cpu() - before[n]).abs() for n, t in full_state_dict_iter(actor.model)}
        experts = [d for n, d in moved.items() if ".experts." in n]
        assert len(experts) == 4 and all((d.flatten(1).amax(1) > 5e-3).all() for d in experts)
        assert all(d.max() > 5e-3 for n, d in moved.items() if n.endswith("mlp.gate.weight"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, world, port, model_dir, batch_path, out_dir):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch.distributed as dist

    from verl.utils.process_group import init_distributed
    init_distributed(timeout_minutes=3)
    try:
        part = torch.load(batch_path, weights_only=False).split(world)[rank]
        out = {}
        # fp32, compared with one unsharded GPU
        actor = make_actor(model_dir, mixed_precision=False, max_tokens_per_pack=100)
        out["logprobs_fp32"] = actor.compute_logprobs(part)
        out["metrics_fp32"] = actor.update(part, mini_batch_size=len(part))
        out["params_fp32"] = {n: t.cpu() for n, t in full_state_dict_iter(actor.model)}
        del actor
        # bf16 compute, sharded parameters on the CPU, two updates (optimizer state reused)
        actor = make_actor(model_dir, mixed_precision=True, max_tokens_per_pack=100, param_offload=True)
        out["logprobs_bf16"] = actor.compute_logprobs(part)
        out["metrics_offload"] = [actor.update(part, mini_batch_size=2) for _ in range(2)]
        names = [n for n, _ in full_state_dict_iter(actor.model, dtype=torch.bfloat16)]
        out["names"] = names
        del actor
        # optimizer state parked on the CPU between updates
        actor = make_actor(model_dir, mixed_precision=True, optimizer_offload=True)
        out["metrics_opt_offload"] = [actor.update(part, mini_batch_size=2) for _ in range(2)]
        state = next(iter(actor.optimizer.state.values()))
        out["opt_state_device"] = state["exp_avg"].to_local().device.type
        out["gpu_param_device"] = next(actor.model.parameters()).to_local().device.type
        del actor
        reference = Reference(ModelConfig(path=model_dir), param_offload=True, micro_batch_size=2, max_tokens_per_pack=100)
        out["ref_logprobs"] = reference.compute_logprobs(part)
        del reference
        critic = Critic(CriticConfig(model=CriticModelConfig(path=model_dir, fsdp_config=FSDPConfig(param_offload=True)),
                                     optim=OptimConfig(lr=1e-3), cliprange_value=10.0),
                        ActorConfig(), micro_batch_size=2)
        out["critic_metrics"] = [critic.update(part, mini_batch_size=4) for _ in range(4)]
        torch.save(out, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@two_gpus
def test_fsdp_nccl_two_gpus(model_dir, tmp_path):
    torch.manual_seed(0)
    batch = make_batch()
    single = make_actor(model_dir, mixed_precision=False, max_tokens_per_pack=100)
    logprobs_BR = single.compute_logprobs(batch)
    batch = with_old_logprobs(batch, logprobs_BR)
    torch.save(batch, tmp_path / "batch.pt")
    mp.spawn(_rank, args=(2, _free_port(), model_dir, str(tmp_path / "batch.pt"), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]

    metrics = single.update(batch, mini_batch_size=len(batch))
    params = {n: p.detach().cpu() for n, p in single.model.named_parameters()}
    torch.testing.assert_close(torch.cat([r["logprobs_fp32"] for r in ranks]), logprobs_BR, atol=1e-4, rtol=0)
    for r in ranks:
        assert r["params_fp32"].keys() == params.keys()
        # Adam turns gradient noise on near-zero gradients (GPU atomics in embedding and attention
        # backward) into steps of a fraction of lr = 1e-3, so the parameters match to ~1e-4 only; the
        # gradient norm is the sharp check.
        assert max((r["params_fp32"][k] - params[k]).abs().max().item() for k in params) < 5e-4
        assert r["metrics_fp32"]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-4)
    bf16_BR = torch.cat([r["logprobs_bf16"] for r in ranks])
    real_BR = batch.response_mask_BR.bool()
    err_N = (bf16_BR - logprobs_BR)[real_BR].abs()
    assert err_N.mean() < 0.05 and err_N.max() < 0.5  # bf16 compute of a random model: ~0.03 nats mean
    # Same packs as the bf16 actor (bf16 results depend on how rows are packed: up to ~0.03 nats).
    torch.testing.assert_close(torch.cat([r["ref_logprobs"] for r in ranks]), bf16_BR, atol=1e-5, rtol=0)
    for r in ranks:
        for m in r["metrics_offload"] + r["metrics_opt_offload"]:
            assert all(map(torch.isfinite, map(torch.tensor, m.values()))), m
        assert r["opt_state_device"] == "cpu" and r["gpu_param_device"] == "cuda"
        assert r["names"] == list(params)
        losses = [m["vf_loss"] for m in r["critic_metrics"]]
        assert losses[-1] < losses[0], losses
