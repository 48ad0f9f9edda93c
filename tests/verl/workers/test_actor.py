"""Actor / Critic / FSDP helpers on CPU with a tiny random Llama (2 layers, vocabulary of 2,048 so
the lm_head does not dominate the run time; no tokenizer is needed).

The world-size-2 test spawns two gloo processes running FSDP2 and compares their update with the
same update on one unsharded process. Why it is exactly equivalent: both runs see one mini-batch of
the same 8 trajectories per optimizer step (8 on one process, 4 + 4 on two), and the loss of each
micro-batch is weighted by its share of the mini-batch's loss units summed over ranks (see
verl/workers/update.py), so the gradient is the same token-mean over the same tokens however the
trajectories are split — even though the two ranks' halves hold very different token counts (a
mean of per-rank token-means would differ). Only floating-point summation order differs.

Adam makes the parameter comparison insensitive to a global scale of the gradient (its first step
is about lr·sign(g)), so the tests compare the reported gradient norm as well.
"""
from __future__ import annotations

import os
import socket
from dataclasses import replace

import pytest
import torch
import torch.multiprocessing as mp

from verl.batch import RolloutBatch, pack_trajectories
from verl.config.schema import ActorConfig, CriticConfig, CriticModelConfig, FSDPConfig, ModelConfig, OptimConfig
from verl.workers.actor import Actor, Reference
from verl.workers.critic import Critic
from verl.workers.distributed import full_state_dict_iter
from verl.workers.update import micro_batches
from verl.workers.modeling import (VARLEN_ATTN, _enable_gradient_checkpointing, build_causal_lm, build_value_model,
                                   decoder_layers)
from verl.workers.packing import (forward_packed, forward_padded, plan_packs, tokens_per_pack, values_packed,
                                  values_padded)

# Response lengths (first half long, second half short: the two ranks get very different token
# counts) and prompt lengths, all different so that padding is on both sides of every row.
RESPONSE_LENS = [30, 22, 27, 19, 3, 1, 6, 2]
PROMPT_LENS = [4, 11, 1, 7, 9, 2, 13, 5]

TEMPERATURE = 0.9


def actor_config(unsharded: bool = False, **overrides) -> ActorConfig:
    """The actor's keys of these tests: two epochs, asymmetric and dual clipping, entropy and KL terms."""
    return ActorConfig(**{**dict(
        optim=OptimConfig(lr=1e-3, weight_decay=0.01), grad_clip=1.0, max_tokens_per_pack=40, ppo_epochs=2,
        clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode="token-mean", entropy_coeff=0.01,
        use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl",
        fsdp_config=FSDPConfig(mixed_precision=False, unsharded_accumulation=unsharded)), **overrides})


def make_actor(model_dir: str, micro_batch_size: int = 2, unsharded: bool = False, log_prob_budget=(None, None),
               **overrides) -> Actor:
    return Actor(ModelConfig(path=model_dir, enable_gradient_checkpointing=True),
                 actor_config(unsharded, **overrides), micro_batch_size=micro_batch_size, temperature=TEMPERATURE,
                 log_prob_budget=log_prob_budget)


def make_critic(model_dir: str, lr: float = 1e-3, unsharded: bool = False, max_tokens: int | None = None) -> Critic:
    model = CriticModelConfig(path=model_dir, enable_gradient_checkpointing=False,
                              fsdp_config=FSDPConfig(mixed_precision=False, unsharded_accumulation=unsharded))
    return Critic(CriticConfig(model=model, optim=OptimConfig(lr=lr), cliprange_value=0.5,
                               ppo_max_token_len_per_gpu=max_tokens, forward_max_token_len_per_gpu=max_tokens),
                  ActorConfig(grad_clip=1.0, max_tokens_per_pack=40), micro_batch_size=2)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         tie_word_embeddings=True, initializer_range=0.3)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    out = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(out)
    return str(out)


def make_batch(model_dir: str, seed: int = 0) -> RolloutBatch:
    """8 trajectories with observation spans (loss mask 0 inside the response), old log-probs a
    little off the model's (so that ratios differ from 1 and clipping is active), random advantages,
    reference log-probs, returns."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses, loss_masks = [], [], []
    for p, r in zip(PROMPT_LENS, RESPONSE_LENS):
        prompts.append(torch.randint(5, 2000, (p,), generator=g).tolist())
        responses.append(torch.randint(5, 2000, (r,), generator=g).tolist())
        mask = [1] * r
        if r >= 6:  # an observation in the middle: model tokens, retrieved tokens, model tokens
            mask[r // 3: r // 3 + r // 3] = [0] * (r // 3)
        loss_masks.append(mask)
    batch = pack_trajectories(prompts, responses, loss_masks, list(range(len(prompts))), pad_id=0)
    model = build_causal_lm(model_dir)
    with torch.no_grad():
        logprobs_BR, _ = forward_padded(model, batch.input_ids_BT, batch.attention_mask_BT, batch.prompt_width,
                                        temperature=TEMPERATURE)
    B, R = batch.loss_mask_BR.shape
    real_BR = batch.response_mask_BR
    batch.old_logprobs_BR = (logprobs_BR + 0.3 * torch.randn(B, R, generator=g)) * real_BR
    batch.ref_logprobs_BR = (logprobs_BR + 0.2 * torch.randn(B, R, generator=g)) * real_BR
    batch.advantages_BR = torch.randn(B, 1, generator=g) * batch.loss_mask_BR
    batch.values_BR = torch.zeros(B, R)
    batch.returns_BR = (1.0 + torch.randn(B, 1, generator=g)) * batch.loss_mask_BR
    return batch


@pytest.fixture(scope="module")
def batch(tiny_model_dir) -> RolloutBatch:
    return make_batch(tiny_model_dir)


def params_of(model) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in full_state_dict_iter(model)}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


# ---------------------------------------------------------------------------------------------------


def test_plan_packs_bounds_tokens_and_reaches_min_count():
    assert plan_packs([10, 10, 10, 50, 5], 25) == [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]
    assert plan_packs([10, 10, 10], None) == [range(0, 3)]
    packs = plan_packs([1, 1, 1, 1, 1], 100, min_packs=4)
    assert len(packs) == 4 and [i for r in packs for i in r] == list(range(5))


def test_on_the_cpu_every_sequence_is_a_pack_of_its_own():
    # a pack's mask makes attention quadratic in its length; the GPU keeps the configured size
    assert tokens_per_pack(16384, torch.device("cpu")) == 1
    assert tokens_per_pack(16384, torch.device("cuda")) == 16384
    assert plan_packs([300, 500, 200], tokens_per_pack(16384, torch.device("cpu"))) == [range(0, 1), range(1, 2),
                                                                                         range(2, 3)]


def _four_layer_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1, initializer_range=0.3)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(config)


def test_partial_gradient_checkpointing_spreads_layers_and_keeps_gradients():
    for ratio, expected in ((1.0, [True] * 4), (0.5, [True, False, True, False]), (0.25, [True, False, False, False]),
                            (0.0, [False] * 4), (True, [True] * 4), (False, [False] * 4)):
        model = _four_layer_llama()
        _enable_gradient_checkpointing(model, ratio)
        assert [layer.gradient_checkpointing for layer in decoder_layers(model)] == expected, ratio

    plain, partial = _four_layer_llama(), _four_layer_llama()
    _enable_gradient_checkpointing(partial, 0.5)
    # A checkpointed layer starts its forward again in backward: counts [2, 1, 2, 1] show that the
    # flags are what the layers obey (a pre-hook: the recompute stops early, before forward hooks).
    calls = [0] * 4
    for i, layer in enumerate(decoder_layers(partial)):
        layer.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    ids_BT = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    for model in (plain, partial):
        model.train()
        model(input_ids=ids_BT, labels=ids_BT).loss.backward()
    assert calls == [2, 1, 2, 1]
    for (name, a), b in zip(plain.named_parameters(), partial.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name


def test_gradient_checkpointing_ratio_out_of_range_raises():
    for ratio in (-0.1, 1.5):
        with pytest.raises(ValueError, match=str(ratio)):
            _enable_gradient_checkpointing(_four_layer_llama(), ratio)


def test_packed_equals_padded(tiny_model_dir, batch):
    model = build_causal_lm(tiny_model_dir)
    args = (batch.input_ids_BT, batch.attention_mask_BT, batch.prompt_width)
    # 40 tokens per pack: several packs, and the longest row alone in one.
    packed_BR, packed_ent_BR = forward_packed(model, *args, temperature=0.7, compute_entropy=True, max_tokens_per_pack=40)
    padded_BR, padded_ent_BR = forward_padded(model, *args, temperature=0.7, compute_entropy=True)
    real_BR = batch.response_mask_BR.bool()
    assert (packed_BR[~real_BR] == 0).all() and (packed_BR[real_BR] < 0).all()
    torch.testing.assert_close(packed_BR, padded_BR, atol=1e-4, rtol=0)
    torch.testing.assert_close(packed_ent_BR, padded_ent_BR, atol=1e-4, rtol=0)

    # Same gradients through both paths (one pack for the whole batch this time).
    weights_BR = torch.randn(real_BR.shape, generator=torch.Generator().manual_seed(1)) * real_BR
    grads = []
    for fn, kw in ((forward_packed, dict(max_tokens_per_pack=None)), (forward_padded, {})):
        model.zero_grad()
        logprobs_BR, entropy_BR = fn(model, *args, temperature=0.7, compute_entropy=True, **kw)
        ((logprobs_BR + entropy_BR) * weights_BR).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, g in grads[0].items():  # gradients reach ~10: compare relative to each tensor's scale
        assert (g - grads[1][name]).abs().max() <= 1e-5 * g.abs().max(), name

    value_model = build_value_model(tiny_model_dir)
    torch.nn.init.normal_(value_model.value_head.weight, std=0.1)  # zero-initialised: make it say something
    with torch.no_grad():
        torch.testing.assert_close(values_packed(value_model, *args, max_tokens_per_pack=40),
                                   values_padded(value_model, *args), atol=1e-4, rtol=0)


def test_with_the_loss_mask_only_the_model_tokens_are_scored_with_the_same_values_and_gradients(tiny_model_dir, batch):
    """forward_packed(loss_mask_BR=…) runs lm_head only where the loss reads: observations (and
    padding) give 0, the model's tokens the log-probs, entropies and gradients of the full pass."""
    model = build_causal_lm(tiny_model_dir)
    args = (batch.input_ids_BT, batch.attention_mask_BT, batch.prompt_width)
    mask_BR = batch.loss_mask_BR
    scored_BR = mask_BR.bool()
    assert scored_BR.sum() < batch.response_mask_BR.sum()   # the batch has observation tokens
    weights_BR = torch.randn(mask_BR.shape, generator=torch.Generator().manual_seed(2)) * mask_BR
    outs, grads, logits_rows = [], [], []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: logits_rows.append(o.shape[-2]))
    for kw in ({}, {"loss_mask_BR": mask_BR}):
        model.zero_grad()
        logprobs_BR, entropy_BR = forward_packed(model, *args, temperature=0.7, compute_entropy=True,
                                                 max_tokens_per_pack=40, **kw)
        ((logprobs_BR + entropy_BR) * weights_BR).sum().backward()
        outs.append((logprobs_BR.detach(), entropy_BR.detach()))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    hook.remove()
    (full, full_ent), (masked, masked_ent) = outs
    assert (masked[~scored_BR] == 0).all() and (masked_ent[~scored_BR] == 0).all()
    torch.testing.assert_close(masked[scored_BR], full[scored_BR], atol=1e-5, rtol=0)
    torch.testing.assert_close(masked_ent[scored_BR], full_ent[scored_BR], atol=1e-5, rtol=0)
    half = len(logits_rows) // 2
    assert sum(logits_rows[half:]) == int(scored_BR.sum()) < sum(logits_rows[:half])   # lm_head's rows
    for name, g in grads[0].items():
        assert (g - grads[1][name]).abs().max() <= 1e-5 * g.abs().max(), name


def test_varlen_attention_equals_padded(tiny_model_dir, batch):
    # The CPU branch of the mask-free varlen attention (SDPA row by row): same log-probs, entropies,
    # gradients and values as the padded forward, with every row of the batch in ONE pack.
    model = build_causal_lm(tiny_model_dir, attn_implementation=VARLEN_ATTN)
    reference = build_causal_lm(tiny_model_dir)
    assert model.config._attn_implementation == VARLEN_ATTN
    args = (batch.input_ids_BT, batch.attention_mask_BT, batch.prompt_width)
    weights_BR = torch.randn(batch.response_mask_BR.shape, generator=torch.Generator().manual_seed(2))
    grads = []
    for m, fn, kw in ((model, forward_packed, dict(max_tokens_per_pack=40)), (reference, forward_padded, {})):
        logprobs_BR, entropy_BR = fn(m, *args, temperature=0.7, compute_entropy=True, **kw)
        ((logprobs_BR + entropy_BR) * weights_BR * batch.response_mask_BR).sum().backward()
        grads.append(({n: p.grad for n, p in m.named_parameters()}, logprobs_BR.detach(), entropy_BR.detach()))
    (g_var, lp_var, ent_var), (g_pad, lp_pad, ent_pad) = grads
    torch.testing.assert_close(lp_var, lp_pad, atol=1e-4, rtol=0)
    torch.testing.assert_close(ent_var, ent_pad, atol=1e-4, rtol=0)
    for name, g in g_var.items():
        assert (g - g_pad[name]).abs().max() <= 1e-5 * g.abs().max(), name

    value_model = build_value_model(tiny_model_dir, attn_implementation=VARLEN_ATTN)
    torch.nn.init.normal_(value_model.value_head.weight, std=0.1)
    plain = build_value_model(tiny_model_dir)
    plain.load_state_dict(value_model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(values_packed(value_model, *args, max_tokens_per_pack=40),
                                   values_padded(plain, *args), atol=1e-4, rtol=0)


def test_varlen_attention_refuses_a_call_without_row_boundaries(tiny_model_dir):
    model = build_causal_lm(tiny_model_dir, attn_implementation=VARLEN_ATTN)
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        model(input_ids=torch.tensor([[5, 6, 7]]))


def test_compute_logprobs_matches_plain_hf_forward(tiny_model_dir, batch):
    actor = make_actor(tiny_model_dir)
    logprobs_BR, entropy_BR = actor.compute_logprobs_and_entropy(batch)
    reference = Reference(ModelConfig(path=tiny_model_dir), mixed_precision=False, micro_batch_size=3,
                          max_tokens_per_pack=40, temperature=TEMPERATURE)
    torch.testing.assert_close(reference.compute_logprobs(batch), logprobs_BR, atol=1e-5, rtol=0)

    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    P = batch.prompt_width
    for i in range(len(batch)):  # each row alone, without any padding
        ids = batch.input_ids_BT[i][batch.attention_mask_BT[i].bool()]
        n_prompt = int(batch.attention_mask_BT[i, :P].sum())
        with torch.no_grad():
            logits = hf(ids[None]).logits[0].float() / TEMPERATURE
        logp = torch.log_softmax(logits[n_prompt - 1:-1], -1)
        expected = logp.gather(-1, ids[n_prompt:, None])[:, 0]
        expected_entropy = -(logp.exp() * logp).sum(-1)
        n = len(expected)
        scored = batch.loss_mask_BR[i, :n].bool()   # the model's own tokens; observations come back as 0
        torch.testing.assert_close(logprobs_BR[i, :n][scored], expected[scored], atol=1e-4, rtol=0)
        torch.testing.assert_close(entropy_BR[i, :n][scored], expected_entropy[scored], atol=1e-4, rtol=0)
        assert (logprobs_BR[i, :n][~scored] == 0).all() and (logprobs_BR[i, n:] == 0).all()


@pytest.mark.parametrize("split", [dict(micro_batch_size=2, use_dynamic_bsz=False),   # trajectories
                                   dict(ppo_max_token_len_per_gpu=40)])               # tokens
def test_gradient_accumulation_equals_one_big_micro_batch(tiny_model_dir, batch, split):
    """The same update whether a mini-batch runs as one micro-batch or several, cut by trajectories
    or by a token budget (the loss is scaled by tokens either way)."""
    assert len(micro_batches(batch, 40, 0)) >= 4   # the budget does split the batch
    results = []
    for kwargs in (split, dict(micro_batch_size=8, use_dynamic_bsz=False)):
        actor = make_actor(tiny_model_dir, **kwargs)
        before = params_of(actor.model)
        metrics = actor.update(batch, mini_batch_size=8)
        results.append((params_of(actor.model), metrics))
    (p_small, m_small), (p_big, m_big) = results
    assert max_diff(p_small, before) > 1e-4  # the update did something
    assert max_diff(p_small, p_big) < 1e-5
    assert m_small["grad_norm"] == pytest.approx(m_big["grad_norm"], rel=1e-5)
    assert m_small["clipfrac"] > 0  # the perturbed old log-probs make clipping active
    for key in ("pg_loss", "clipfrac", "approx_kl", "entropy", "kl_loss", "grad_norm", "lr"):
        assert isinstance(m_small[key], float)


def test_log_probs_by_token_budget_come_back_in_row_order(tiny_model_dir, batch):
    by_rows = make_actor(tiny_model_dir, micro_batch_size=8, use_dynamic_bsz=False).compute_logprobs_and_entropy(batch)
    parts = micro_batches(batch, 40, 0)
    assert [i for part in parts for i in part] != list(range(len(batch)))   # the parts mix the rows
    by_tokens = make_actor(tiny_model_dir, log_prob_budget=(True, 40)).compute_logprobs_and_entropy(batch)
    for a, b in zip(by_rows, by_tokens):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    critic = make_critic(tiny_model_dir, max_tokens=40)
    with torch.no_grad():
        critic.model.value_head.bias.fill_(0.5)   # values of 0.5 wherever a response token is
    values_BR = critic.compute_values(batch)
    assert torch.equal(values_BR != 0, batch.response_mask_BR.bool())


# Exact on the CPU (one sequence a pack). On a GPU the separate pass and the update pack different
# rows together, fp32 kernels then differ in the last bits, and Adam's first step magnifies that where
# a gradient is near 0: on an H200 the parameters differed by 1e-5 to 1.5e-4, one mini-batch included.
@pytest.mark.skipif(torch.cuda.is_available(), reason="exact only on the CPU (see the comment)")
@pytest.mark.parametrize("mini_batch_size", [8, 4, 2])
def test_an_update_without_old_log_probs_equals_the_one_after_the_separate_pass(tiny_model_dir, batch,
                                                                                mini_batch_size):
    """actor.old_log_probs=auto: one epoch without old log-probs (the first mini-batch takes them from
    its own forward, the update computes the later ones' before its first step) equals the update
    after the separate pass, with one optimizer step (8) or several (4, 2: the later mini-batches
    train off-policy, so log-probs taken after the first step would change the result)."""
    results = []
    for separate in (True, False):
        actor = make_actor(tiny_model_dir, ppo_epochs=1)
        before = params_of(actor.model)
        step = replace(batch, old_logprobs_BR=actor.compute_logprobs(batch) if separate else None)
        metrics = actor.update(step, mini_batch_size=mini_batch_size)
        results.append((params_of(actor.model), metrics))
        assert actor.model.training
    (p_pass, m_pass), (p_own, m_own) = results
    assert max_diff(p_pass, before) > 1e-4   # the update did something
    assert max_diff(p_pass, p_own) < 1e-6
    for key in ("pg_loss", "clipfrac", "approx_kl", "kl_loss"):
        assert m_own[key] == pytest.approx(m_pass[key], abs=1e-6), key
    assert m_own["grad_norm"] == pytest.approx(m_pass["grad_norm"], rel=1e-5)
    if mini_batch_size < len(batch):
        assert m_own["clipfrac"] > 0   # the later mini-batches did train off-policy


def test_later_mini_batches_need_the_log_probs_from_before_the_first_step(tiny_model_dir, batch):
    """The counter-check: old log-probs taken after the first optimizer step (what a forward of the
    later mini-batches would give) change the update, so the test above can tell the two apart."""
    actor = make_actor(tiny_model_dir, ppo_epochs=1)
    reference = make_actor(tiny_model_dir, ppo_epochs=1)
    reference.update(replace(batch, old_logprobs_BR=reference.compute_logprobs(batch)), mini_batch_size=4)
    moved = make_actor(tiny_model_dir, ppo_epochs=1)
    moved.update(replace(batch, old_logprobs_BR=None), mini_batch_size=8)   # one step: the weights move
    late = replace(batch, old_logprobs_BR=moved.compute_logprobs(batch))
    actor.update(late, mini_batch_size=4)
    assert max_diff(params_of(actor.model), params_of(reference.model)) > 1e-5


def test_two_epochs_need_the_old_log_probs(tiny_model_dir, batch):
    with pytest.raises(ValueError, match="ppo_epochs=2"):
        make_actor(tiny_model_dir, ppo_epochs=2).update(replace(batch, old_logprobs_BR=None), mini_batch_size=8)


def test_masked_positions_have_no_influence(tiny_model_dir, batch):
    """Advantages, old and reference log-probs on retrieved tokens and padding must not matter with
    state masking; without it (the ablation) advantages on retrieved tokens do matter."""
    masked_BR = batch.loss_mask_BR == 0
    assert (masked_BR & (batch.response_mask_BR == 1)).any()  # there are observation tokens
    noise_BR = 5.0 * torch.randn(masked_BR.shape, generator=torch.Generator().manual_seed(2))
    other_advantages = RolloutBatch(**{**batch.__dict__})
    other_advantages.advantages_BR = torch.where(masked_BR, noise_BR, batch.advantages_BR)
    everything_else = RolloutBatch(**{**other_advantages.__dict__})
    everything_else.old_logprobs_BR = torch.where(masked_BR, batch.old_logprobs_BR - 3.0, batch.old_logprobs_BR)
    everything_else.ref_logprobs_BR = torch.where(masked_BR, batch.ref_logprobs_BR + 3.0, batch.ref_logprobs_BR)

    def run(b, state_masking):
        actor = make_actor(tiny_model_dir, state_masking=state_masking, ppo_epochs=1)
        metrics = actor.update(b, mini_batch_size=4)
        return params_of(actor.model), metrics["grad_norm"]

    (p_a, norm_a), (p_b, norm_b) = run(batch, True), run(everything_else, True)
    assert max_diff(p_a, p_b) < 1e-6 and norm_a == pytest.approx(norm_b, rel=1e-6)
    (p_c, norm_c), (p_d, norm_d) = run(batch, False), run(other_advantages, False)
    assert max_diff(p_c, p_d) > 1e-4 and norm_c != pytest.approx(norm_d, rel=1e-3)


def test_critic_update_reduces_value_loss(tiny_model_dir, batch):
    batch = RolloutBatch(**{**batch.__dict__})  # values_BR is rewritten below
    critic = make_critic(tiny_model_dir, lr=3e-3)
    assert critic.compute_values(batch).abs().max() == 0  # zero-initialised head
    losses = []
    for _ in range(6):
        batch.values_BR = critic.compute_values(batch)  # fresh old values: clipping is around them
        metrics = critic.update(batch, mini_batch_size=4)
        losses.append(metrics["vf_loss"])
    assert losses[-1] < 0.5 * losses[0], losses
    assert set(metrics) >= {"vf_loss", "vf_clipfrac", "grad_norm", "lr"}


# ---------------------------------------------------------------------------------------------------
# World size 2 (FSDP2 + gloo) against world size 1 (no sharding)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fsdp_rank(rank, world, port, model_dir, batch_path, out_dir, unsharded):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from verl.utils.process_group import init_distributed
    init_distributed(timeout_minutes=2)  # a collective mismatch fails the test instead of hanging it
    try:
        part = torch.load(batch_path, weights_only=False).split(world)[rank]
        # token budgets of 40: the rank with the long rows needs more micro-batches, and both run as many
        actor = make_actor(model_dir, unsharded=unsharded, ppo_max_token_len_per_gpu=40, log_prob_budget=(True, 40))
        logprobs_BR = actor.compute_logprobs(part)
        actor_metrics = actor.update(part, mini_batch_size=len(part))
        actor_params = params_of(actor.model)  # a collective: every rank iterates
        # as the weight push gathers them: shards cast to bf16 first
        actor_params_bf16 = {n: t.clone() for n, t in full_state_dict_iter(actor.model, dtype=torch.bfloat16)}
        critic = make_critic(model_dir, unsharded=unsharded, max_tokens=40)
        critic_metrics = critic.update(part, mini_batch_size=len(part))
        critic_params = params_of(critic.model)
        # Two mini-batches with the old log-probs left to the update (actor.old_log_probs=auto): its
        # extra forwards must pair up across ranks, and give the update after the separate pass.
        two_minis = []
        for separate in (True, False):
            a = make_actor(model_dir, unsharded=unsharded, ppo_epochs=1)
            a.update(replace(part, old_logprobs_BR=a.compute_logprobs(part) if separate else None),
                     mini_batch_size=len(part) // 2)
            two_minis.append(params_of(a.model))
        torch.save(dict(logprobs_BR=logprobs_BR, actor_metrics=actor_metrics, actor_params=actor_params,
                        actor_params_bf16=actor_params_bf16, critic_metrics=critic_metrics, critic_params=critic_params,
                        two_minis_diff=max_diff(*two_minis)), f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


# unsharded: full weights and gradients kept across micro-batches (distributed.accumulation_steps), the same update
@pytest.mark.e2e  # two processes
@pytest.mark.parametrize("unsharded", [False, True])
def test_fsdp_world_size_2_matches_single_process(tiny_model_dir, batch, tmp_path, unsharded):
    torch.save(batch, tmp_path / "batch.pt")
    mp.spawn(_fsdp_rank, args=(2, _free_port(), tiny_model_dir, str(tmp_path / "batch.pt"), str(tmp_path), unsharded),
             nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]

    actor = make_actor(tiny_model_dir)
    logprobs_BR = actor.compute_logprobs(batch)
    before = params_of(actor.model)
    actor_metrics = actor.update(batch, mini_batch_size=len(batch))
    critic = make_critic(tiny_model_dir)
    critic_metrics = critic.update(batch, mini_batch_size=len(batch))

    torch.testing.assert_close(torch.cat([r["logprobs_BR"] for r in ranks]), logprobs_BR, atol=1e-5, rtol=0)
    for r in ranks:
        assert max_diff(r["actor_params"], params_of(actor.model)) < 1e-5
        assert max_diff(r["critic_params"], params_of(critic.model)) < 1e-5
        # cast before the gather: the same values as casting the gathered fp32 tensors
        assert {n: t.dtype for n, t in r["actor_params_bf16"].items()} == {n: torch.bfloat16 for n in before}
        assert max_diff({n: t.float() for n, t in r["actor_params_bf16"].items()},
                        {n: t.to(torch.bfloat16).float() for n, t in r["actor_params"].items()}) == 0
    assert max_diff(params_of(actor.model), before) > 1e-4
    assert all(r["two_minis_diff"] < 1e-6 for r in ranks)
    # The gradient norm is global: both ranks report the single-process value.
    for r in ranks:
        assert r["actor_metrics"]["grad_norm"] == pytest.approx(actor_metrics["grad_norm"], rel=1e-5)
        assert r["critic_metrics"]["grad_norm"] == pytest.approx(critic_metrics["grad_norm"], rel=1e-5)
