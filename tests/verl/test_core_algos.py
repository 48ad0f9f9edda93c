"""Estimators and losses of verl.core_algos against naive per-token Python loops.

Masks mimic search trajectories: model tokens, a retrieved observation (mask 0) in the middle,
more model tokens, padding; plus edge rows (no model token, ending in an observation, all model).
"""
import math
import random

import pytest
import torch

from verl import core_algos as ca

B, R = 9, 24


def search_mask(B: int, R: int, seed: int) -> torch.Tensor:
    """[B, R] float loss mask with observation gaps; the first three rows are edge cases."""
    rng = random.Random(seed)
    mask = torch.zeros(B, R)
    # Row 0 stays empty (the model wrote nothing).
    mask[1, :R] = 1.0                 # all model tokens, no padding
    mask[2, :5] = 1.0                 # model tokens, then an observation cut at max length
    for i in range(3, B):
        row = []
        for _ in range(rng.randint(1, 3)):      # turns: model tokens then an observation
            row += [1.0] * rng.randint(1, 4) + [0.0] * rng.randint(1, 4)
        row += [1.0] * rng.randint(1, 3)        # final answer
        row = row[:R]
        mask[i, :len(row)] = torch.tensor(row)
    return mask


def naive_whiten(x, mask):
    vals = [x[i][t] for i in range(len(x)) for t in range(len(x[i])) if mask[i][t]]
    n = len(vals)
    mean = sum(vals) / n
    var = sum((v - mean) ** 2 for v in vals) / (n - 1)
    return [[(x[i][t] - mean) / math.sqrt(var + 1e-8) if mask[i][t] else 0.0
             for t in range(len(x[i]))] for i in range(len(x))]


def close(a, b, atol=1e-5):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float64),
                               torch.as_tensor(b, dtype=torch.float64), atol=atol, rtol=1e-5)


@pytest.fixture
def mask_BR():
    return search_mask(B, R, seed=0)


def group_setup():
    # Unequal, unsorted, non-contiguous group ids; id 42 is a singleton.
    group_ids_B = torch.tensor([7, 3, 7, 42, 3, 7, 3, 3, 9])
    rewards_B = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.5, 0.0, 0.3])
    return rewards_B, group_ids_B


# ----------------------------------------------------------------------------- masked statistics

def test_masked_stats():
    x = torch.tensor([[1.0, 2.0, float("inf")], [3.0, float("nan"), 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    close(ca.masked_mean(x, mask), (1 + 2 + 3 + 5) / 4)
    close(ca.masked_mean(x, mask, dim=-1), [1.5, 4.0])
    close(ca.masked_var(x, mask), torch.tensor([1.0, 2, 3, 5]).var())
    close(ca.masked_mean(x, torch.zeros_like(mask)), 0.0)
    close(ca.masked_mean(x, torch.tensor([[0.0, 0, 0], [1, 0, 1]]), dim=-1), [0.0, 4.0])
    close(ca.masked_var(x, torch.tensor([[1.0, 0, 0], [0, 0, 0]])), 0.0)
    w = ca.masked_whiten(x, mask)
    close(ca.masked_mean(w, mask), 0.0)
    close(ca.masked_var(w, mask), 1.0)
    w_keep = ca.masked_whiten(x, mask, shift_mean=False)
    close(ca.masked_mean(w_keep, mask), 2.75)


# ----------------------------------------------------------------------------- rewards

def test_token_level_rewards(mask_BR):
    rewards_B = torch.randn(B)
    out = ca.token_level_rewards(rewards_B, mask_BR)
    for i in range(B):
        model = [t for t in range(R) if mask_BR[i, t]]
        for t in range(R):
            expected = rewards_B[i].item() if model and t == model[-1] else 0.0
            assert out[i, t].item() == pytest.approx(expected)
    assert out[0].abs().sum() == 0          # no model token, no reward
    assert out[2, 4] == rewards_B[2]         # last model token, before the trailing observation


# ----------------------------------------------------------------------------- GAE

def naive_gae(rewards, values, mask, gamma, lam):
    adv, ret = [], []
    for r, v, m in zip(rewards, values, mask):
        steps = [t for t in range(len(m)) if m[t]]
        a_row, g_row = [0.0] * len(m), [0.0] * len(m)
        next_v = next_a = 0.0
        for t in reversed(steps):
            delta = r[t] + gamma * next_v - v[t]
            next_a = delta + gamma * lam * next_a
            next_v = v[t]
            a_row[t] = next_a
            g_row[t] = next_a + v[t]
        adv.append(a_row)
        ret.append(g_row)
    return naive_whiten(adv, mask), ret


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.8), (0.99, 0.0)])
def test_gae_matches_loop(mask_BR, gamma, lam):
    torch.manual_seed(1)
    rewards_BR = torch.randn(B, R) * mask_BR     # dense rewards, e.g. after a KL penalty
    values_BR = torch.randn(B, R)
    adv, ret = ca.gae_advantages(rewards_BR, values_BR, mask_BR, gamma, lam)
    exp_adv, exp_ret = naive_gae(rewards_BR.tolist(), values_BR.tolist(), mask_BR.tolist(), gamma, lam)
    close(adv, exp_adv)
    close(ret, exp_ret)
    assert (adv[mask_BR == 0] == 0).all() and (ret[mask_BR == 0] == 0).all()


def test_gae_ignores_masked_positions(mask_BR):
    torch.manual_seed(2)
    rewards_BR = ca.token_level_rewards(torch.randn(B), mask_BR)
    values_BR = torch.randn(B, R)
    adv, ret = ca.gae_advantages(rewards_BR, values_BR, mask_BR, 0.95, 0.9)
    noise = torch.randn(B, R) * 100 * (1 - mask_BR)
    adv2, ret2 = ca.gae_advantages(rewards_BR + noise, values_BR + noise, mask_BR, 0.95, 0.9)
    close(adv, adv2)
    close(ret, ret2)


def test_gae_jumps_over_observation():
    # 2 model tokens, 3 observation tokens, 2 model tokens, padding. Zero values, lam = 1: the raw
    # advantage is gamma^(model tokens after t) * reward; the observation adds no discount.
    mask = torch.tensor([[1.0, 1, 0, 0, 0, 1, 1, 0]])
    rewards = ca.token_level_rewards(torch.tensor([1.0]), mask)
    _, ret = ca.gae_advantages(rewards, torch.zeros_like(mask), mask, gamma=0.5, lam=1.0)
    close(ret, [[0.125, 0.25, 0, 0, 0, 0.5, 1.0, 0]])


# ----------------------------------------------------------------------------- group estimators

def naive_groups(rewards, groups):
    members = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(rewards[i])
    return members


def test_grpo_matches_loop(mask_BR):
    rewards_B, group_ids_B = group_setup()
    members = naive_groups(rewards_B.tolist(), group_ids_B.tolist())
    for normalize_std in (True, False):
        adv = ca.grpo_advantages(rewards_B, group_ids_B, mask_BR, normalize_std=normalize_std)
        for i in range(B):
            rs = members[group_ids_B[i].item()]
            n = len(rs)
            if n == 1:
                expected = 0.0
            else:
                mean = sum(rs) / n
                std = math.sqrt(sum((r - mean) ** 2 for r in rs) / (n - 1))
                expected = rewards_B[i].item() - mean
                if normalize_std:
                    expected /= std + 1e-6
            close(adv[i], [expected * m for m in mask_BR[i].tolist()])
    assert (adv[3] == 0).all()           # the singleton group


def test_grpo_equal_rewards_give_zero():
    mask = torch.ones(4, 3)
    adv = ca.grpo_advantages(torch.ones(4), torch.tensor([0, 0, 1, 1]), mask)
    assert torch.equal(adv, torch.zeros(4, 3))


def test_rloo_matches_loop_and_identity(mask_BR):
    rewards_B, group_ids_B = group_setup()
    adv = ca.rloo_advantages(rewards_B, group_ids_B, mask_BR)
    members = naive_groups(rewards_B.tolist(), group_ids_B.tolist())
    for i in range(B):
        rs = members[group_ids_B[i].item()]
        n = len(rs)
        r = rewards_B[i].item()
        expected = 0.0 if n == 1 else r - (sum(rs) - r) / (n - 1)
        close(adv[i], [expected * m for m in mask_BR[i].tolist()])
        if n > 1:   # RLOO = n / (n - 1) × the mean-centred reward (Dr.GRPO's advantage)
            close(expected, n / (n - 1) * (r - sum(rs) / n))
    assert (adv[3] == 0).all()


def test_reinforce_pp_baseline_matches_loop(mask_BR):
    rewards_B, group_ids_B = group_setup()
    members = naive_groups(rewards_B.tolist(), group_ids_B.tolist())
    centred = [[(rewards_B[i].item() - sum(members[group_ids_B[i].item()]) / len(members[group_ids_B[i].item()]))
                * m for m in mask_BR[i].tolist()] for i in range(B)]
    adv = ca.reinforce_pp_baseline_advantages(rewards_B, group_ids_B, mask_BR)
    close(adv, naive_whiten(centred, mask_BR.tolist()))


# ----------------------------------------------------------------------------- REINFORCE++

@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_matches_loop(mask_BR, gamma):
    torch.manual_seed(3)
    rewards_BR = torch.randn(B, R)
    adv, ret = ca.reinforce_pp_advantages(rewards_BR, mask_BR, gamma)
    exp_ret = []
    for r, m in zip(rewards_BR.tolist(), mask_BR.tolist()):
        row, g = [0.0] * R, 0.0
        for t in reversed([t for t in range(R) if m[t]]):
            g = r[t] + gamma * g
            row[t] = g
        exp_ret.append(row)
    close(ret, exp_ret)
    close(adv, naive_whiten(exp_ret, mask_BR.tolist()))
    # Rewards placed on observation tokens are ignored.
    adv2, ret2 = ca.reinforce_pp_advantages(rewards_BR + 50 * (1 - mask_BR), mask_BR, gamma)
    close(adv, adv2)
    close(ret, ret2)


# ----------------------------------------------------------------------------- dispatch

def test_compute_advantages_dispatch(mask_BR):
    rewards_B, group_ids_B = group_setup()
    values_BR = torch.randn(B, R)
    kw = dict(rewards_B=rewards_B, group_ids_B=group_ids_B, mask_BR=mask_BR)
    token_rewards_BR = ca.token_level_rewards(rewards_B, mask_BR)

    adv, ret = ca.compute_advantages("gae", values_BR=values_BR, gamma=0.9, lam=0.8, **kw)
    exp_adv, exp_ret = ca.gae_advantages(token_rewards_BR, values_BR, mask_BR, 0.9, 0.8)
    close(adv, exp_adv)
    close(ret, exp_ret)

    adv, ret = ca.compute_advantages(ca.AdvEstimator.GRPO, normalize_std=False, **kw)
    close(adv, ca.grpo_advantages(rewards_B, group_ids_B, mask_BR, normalize_std=False))
    assert ret is adv
    close(ca.compute_advantages("rloo", **kw)[0], ca.rloo_advantages(rewards_B, group_ids_B, mask_BR))
    close(ca.compute_advantages("reinforce_plus_plus_baseline", **kw)[0],
          ca.reinforce_pp_baseline_advantages(rewards_B, group_ids_B, mask_BR))

    dense_BR = torch.randn(B, R) * mask_BR
    adv, ret = ca.compute_advantages("reinforce_plus_plus", gamma=0.9, token_rewards_BR=dense_BR, **kw)
    exp_adv, exp_ret = ca.reinforce_pp_advantages(dense_BR, mask_BR, 0.9)
    close(adv, exp_adv)
    close(ret, exp_ret)

    with pytest.raises(ValueError, match="critic"):
        ca.compute_advantages("gae", **kw)
    with pytest.raises(ValueError, match="grpo"):
        ca.compute_advantages("ppo", **kw)


# ----------------------------------------------------------------------------- KL

def test_kl_penalty_formulas():
    torch.manual_seed(4)
    logp, ref = -torch.rand(5, 7) * 3, -torch.rand(5, 7) * 3
    d = logp - ref
    close(ca.kl_penalty(logp, ref, "k1"), d)
    close(ca.kl_penalty(logp, ref, "kl"), d)
    close(ca.kl_penalty(logp, ref, "abs"), d.abs())
    close(ca.kl_penalty(logp, ref, "k2"), 0.5 * d ** 2)
    close(ca.kl_penalty(logp, ref, "mse"), 0.5 * d ** 2)
    k3 = torch.exp(ref - logp) - (ref - logp) - 1
    close(ca.kl_penalty(logp, ref, "k3"), k3.clamp(-10, 10))
    close(ca.kl_penalty(logp, ref, ca.KLPenalty.K3), ca.kl_penalty(logp, ref, "low_var_kl"))
    with pytest.raises(ValueError, match="low_var_kl"):
        ca.kl_penalty(logp, ref, "full")


def test_k3_clamped_and_finite_gradient():
    logp = torch.tensor([-200.0, -1.0, -1.0, -0.5], requires_grad=True)
    ref = torch.tensor([-1.0, -200.0, -1.0, -1.0])
    kl = ca.kl_penalty(logp, ref, "k3")
    close(kl[:3], [10.0, 10.0, 0.0])
    kl.sum().backward()
    assert torch.isfinite(logp.grad).all()
    assert logp.grad[0] == 0 and logp.grad[1] == 0     # clamped: no gradient
    close(logp.grad[3], 1 - math.exp(-0.5))           # d/dlogp [e^(ref-logp) - (ref-logp) - 1]


def test_apply_kl_penalty(mask_BR):
    torch.manual_seed(5)
    rewards_BR = ca.token_level_rewards(torch.randn(B), mask_BR)
    kl_BR = torch.rand(B, R)
    kl_BR[mask_BR == 0] = float("nan")          # garbage on observations must not leak
    out, mean_kl = ca.apply_kl_penalty(rewards_BR, kl_BR, mask_BR, beta=0.1)
    per_seq = []
    for i in range(B):
        ks = [kl_BR[i, t].item() for t in range(R) if mask_BR[i, t]]
        if ks:
            per_seq.append(sum(ks) / len(ks))
        for t in range(R):
            expected = rewards_BR[i, t].item() - (0.1 * kl_BR[i, t].item() if mask_BR[i, t] else 0.0)
            assert out[i, t].item() == pytest.approx(expected, abs=1e-6)
    close(mean_kl, sum(per_seq) / len(per_seq))    # row 0 (no model token) is left out


def test_kl_controllers():
    fixed = ca.FixedKLController(0.05)
    fixed.update(10.0, 64)
    assert fixed.value == 0.05

    ctl = ca.AdaptiveKLController(init_kl_coef=0.1, target_kl=1.0, horizon=100)
    ctl.update(100.0, n_steps=10)                  # error clipped to +0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))
    ctl.update(0.0, n_steps=10)                    # error clipped to -0.2
    assert ctl.value == pytest.approx(0.1 * 1.02 * 0.98)
    ctl.update(1.5, n_steps=10)                    # unclipped error 0.5 → 0.2
    ctl.update(1.1, n_steps=10)
    assert ctl.value == pytest.approx(0.1 * 1.02 * 0.98 * 1.02 * (1 + 0.1 * 0.1))

    # In a toy world where KL = 0.2 / beta, the controller drives KL toward the target.
    ctl = ca.AdaptiveKLController(init_kl_coef=0.05, target_kl=1.0, horizon=50)
    gaps = []
    for _ in range(200):
        kl = 0.2 / ctl.value
        gaps.append(abs(kl - 1.0))
        ctl.update(kl, n_steps=10)
    assert gaps[-1] < 0.01 < gaps[0]
    assert all(b <= a + 1e-9 for a, b in zip(gaps, gaps[1:]))


# ----------------------------------------------------------------------------- loss aggregation

def naive_agg(loss, mask, mode, norm_length=None):
    rows = [[l for l, m in zip(lr, mr) if m] for lr, mr in zip(loss, mask)]
    tokens = [l for r in rows for l in r]
    rows = [r for r in rows if r]
    if mode == "token-mean":
        return sum(tokens) / len(tokens)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in rows) / len(rows)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    if mode == "seq-mean-token-sum-norm":
        return sum(sum(r) / norm_length for r in rows) / len(rows)
    raise ValueError(mode)


@pytest.mark.parametrize("mode", [m.value for m in ca.LossAgg])
def test_agg_loss_matches_loop(mask_BR, mode):
    torch.manual_seed(6)
    loss_BR = torch.randn(B, R)
    loss_BR[mask_BR == 0] = float("inf")
    expected = naive_agg(loss_BR.tolist(), mask_BR.tolist(), mode, norm_length=R)
    close(ca.agg_loss(loss_BR, mask_BR, mode), expected)
    if mode == "seq-mean-token-sum-norm":
        close(ca.agg_loss(loss_BR, mask_BR, mode, norm_length=100),
              naive_agg(loss_BR.tolist(), mask_BR.tolist(), mode, norm_length=100))
    close(ca.agg_loss(loss_BR, torch.zeros_like(mask_BR), mode), 0.0)


def test_agg_loss_unknown_mode(mask_BR):
    with pytest.raises(ValueError, match="token-mean"):
        ca.agg_loss(torch.zeros(B, R), mask_BR, "sum")


# ----------------------------------------------------------------------------- policy loss

def naive_ppo_tokens(logp, old, adv, cl, ch, c):
    loss = []
    for lr, orow, arow in zip(logp, old, adv):
        row = []
        for l, o, a in zip(lr, orow, arow):
            ratio = math.exp(l - o)
            val = max(-a * ratio, -a * min(max(ratio, 1 - cl), 1 + ch))
            if c is not None and a < 0:
                val = min(val, -c * a)
            row.append(val)
        loss.append(row)
    return loss


def naive_ppo(logp, old, adv, mask, cl, ch, c, mode):
    return naive_agg(naive_ppo_tokens(logp, old, adv, cl, ch, c), mask, mode, norm_length=len(mask[0]))


@pytest.mark.parametrize("mode", [m.value for m in ca.LossAgg])
@pytest.mark.parametrize("dual_clip_c", [None, 3.0])
def test_policy_loss_matches_loop(mask_BR, mode, dual_clip_c):
    torch.manual_seed(7)
    old = -torch.rand(B, R) * 3
    logp = old + torch.randn(B, R) * 0.8     # ratios well outside the clip range on both sides
    adv = torch.randn(B, R) * mask_BR
    loss, stats = ca.policy_loss(logp, old, adv, mask_BR, clip_low=0.2, clip_high=0.28,
                                 dual_clip_c=dual_clip_c, agg=mode)
    expected = naive_ppo(logp.tolist(), old.tolist(), adv.tolist(), mask_BR.tolist(), 0.2, 0.28,
                         dual_clip_c, mode)
    close(loss, expected)
    assert set(stats) == {"clipfrac", "approx_kl", "dual_clip_frac", "ratio_max"}
    assert all(isinstance(v, float) for v in stats.values())
    ratio = (logp - old).exp()
    keep = mask_BR.bool()
    close(stats["ratio_max"], ratio[keep].max())
    close(stats["approx_kl"], (ratio - 1 - (logp - old))[keep].mean())


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
def test_truncated_importance_weights_match_loop(mask_BR, mode):
    # Off-policy steps: each token's PPO term times min(pi_old / pi_rollout, cap); 1 off the model's tokens.
    torch.manual_seed(8)
    rollout = -torch.rand(B, R) * 3
    old = rollout + torch.randn(B, R) * 0.9       # some weights far above the cap, some far below 1
    logp = old + torch.randn(B, R) * 0.3
    adv = torch.randn(B, R)
    weights, stats = ca.truncated_importance_weights(old, rollout, mask_BR, cap=2.0)
    expected_w = [[min(math.exp(o - r), 2.0) if m else 1.0 for o, r, m in zip(orow, rrow, mrow)]
                  for orow, rrow, mrow in zip(old.tolist(), rollout.tolist(), mask_BR.tolist())]
    close(weights, torch.tensor(expected_w))
    keep = mask_BR.bool()
    raw = (old - rollout).exp()[keep]
    close(stats["mean"], raw.mean())
    close(stats["truncated"], (raw > 2.0).float().mean())
    assert 0 < stats["truncated"] < 1
    close(stats["kl"], (raw - 1 - (old - rollout)[keep]).mean())
    loss, _ = ca.policy_loss(logp, old, adv, mask_BR, 0.2, 0.28, agg=mode, weights_BR=weights)
    per_token = naive_ppo_tokens(logp.tolist(), old.tolist(), adv.tolist(), 0.2, 0.28, None)
    weighted = [[v * w for v, w in zip(vrow, wrow)] for vrow, wrow in zip(per_token, expected_w)]
    close(loss, naive_agg(weighted, mask_BR.tolist(), mode, norm_length=R))
    unweighted, _ = ca.policy_loss(logp, old, adv, mask_BR, 0.2, 0.28, agg=mode, weights_BR=torch.ones(B, R))
    close(unweighted, ca.policy_loss(logp, old, adv, mask_BR, 0.2, 0.28, agg=mode)[0])
    with pytest.raises(ValueError, match=">= 1"):
        ca.truncated_importance_weights(old, rollout, mask_BR, cap=0.5)


def test_policy_loss_clipping_cases():
    # Each column is one token; clip range [0.8, 1.28].
    ratio = torch.tensor([[1.5, 1.25, 0.5, 0.5, 1.5, 5.0, 2.0]])
    adv = torch.tensor([[1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0]])
    mask = torch.ones_like(ratio)
    old = torch.zeros_like(ratio)
    for c in (None, 3.0):
        logp = ratio.log().clone().requires_grad_(True)
        loss, stats = ca.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28,
                                     dual_clip_c=c, agg="seq-mean-token-sum")
        loss.backward()
        g = logp.grad[0]
        # d loss / d logp = -A * ratio where the unclipped term is active, 0 where clipped.
        assert g[0] == 0                                # A > 0, ratio above 1 + clip_high: clipped
        close(g[1], -1.25)                              # A > 0, 1.25 < 1.28: clip-higher lets it through
        close(g[2], -0.5)                               # A > 0, ratio low: never clipped
        assert g[3] == 0                                # A < 0, ratio below 1 - clip_low: clipped
        close(g[4], 1.5)                                # A < 0, ratio high: unclipped ...
        close(g[6], 2.0)                                # ... and below the dual-clip cap
        # Per-token losses: max(-A ratio, -A clip(ratio)), then min(., -c A) where A < 0.
        per_token = [-1.28, -1.25, -0.5, 0.8, 1.5, 5.0 if c is None else 3.0, 2.0]
        close(loss, sum(per_token))
        if c is None:
            close(g[5], 5.0)
            assert stats["dual_clip_frac"] == 0.0
        else:
            assert g[5] == 0                            # A < 0, ratio 5 > c: capped at -c * A = 3
            close(stats["dual_clip_frac"], 1 / 7)
        close(stats["clipfrac"], 2 / 7)
        close(stats["ratio_max"], 5.0)
    with pytest.raises(ValueError, match="dual_clip_c"):
        ca.policy_loss(logp, old, adv, mask, dual_clip_c=1.0)


def test_policy_loss_no_gradient_on_masked_tokens(mask_BR):
    torch.manual_seed(8)
    old = -torch.rand(B, R) * 3
    old[mask_BR == 0] = -1e4                    # stale / padding garbage: huge ratios if unmasked
    logp = (-torch.rand(B, R) * 3).requires_grad_(True)
    adv = torch.randn(B, 1).expand(B, R) * mask_BR
    for mode in ca.LossAgg:
        logp.grad = None
        loss, stats = ca.policy_loss(logp, old, adv, mask_BR, dual_clip_c=3.0, agg=mode)
        loss.backward()
        assert torch.isfinite(loss) and math.isfinite(stats["ratio_max"])
        assert torch.isfinite(logp.grad).all()
        assert (logp.grad[mask_BR == 0] == 0).all()
        assert (logp.grad[mask_BR == 1] != 0).any()


# ----------------------------------------------------------------------------- entropy, value, log-probs

def test_entropy_loss(mask_BR):
    ent = torch.rand(B, R)
    for mode in ca.LossAgg:
        close(ca.entropy_loss(ent, mask_BR, mode), ca.agg_loss(ent, mask_BR, mode))


def test_value_loss(mask_BR):
    torch.manual_seed(10)
    old = torch.randn(B, R)
    values = (old + torch.randn(B, R) * 0.5).requires_grad_(True)
    returns = torch.randn(B, R)
    loss, stats = ca.value_loss(values, old, returns, mask_BR, clip_range=0.2, agg="seq-mean-token-mean")
    per_token = []
    for v, o, r in zip(values.tolist(), old.tolist(), returns.tolist()):
        row = []
        for vt, ot, rt in zip(v, o, r):
            vc = ot + min(max(vt - ot, -0.2), 0.2)
            row.append(0.5 * max((vt - rt) ** 2, (vc - rt) ** 2))
        per_token.append(row)
    close(loss, naive_agg(per_token, mask_BR.tolist(), "seq-mean-token-mean"))
    loss.backward()
    assert (values.grad[mask_BR == 0] == 0).all()

    # Moved away from the return beyond the clip: the unclipped term is the larger, gradient v - R.
    # Moved toward the return beyond the clip: the clipped term wins, no gradient (trust region).
    old = torch.tensor([[0.0, 0.0]])
    values = torch.tensor([[-1.0, 0.9]], requires_grad=True)
    returns = torch.tensor([[1.0, 1.0]])
    loss, stats = ca.value_loss(values, old, returns, torch.ones(1, 2), clip_range=0.2,
                                agg="seq-mean-token-sum")
    close(loss, 0.5 * (2.0 ** 2 + 0.8 ** 2))
    loss.backward()
    close(values.grad, [[-2.0, 0.0]])
    assert stats["vf_clipfrac"] == 0.5


def _naive_logprobs_entropy(logits, labels, temperature):
    z = logits.double() / temperature
    logp = z.log_softmax(-1)
    return logp.gather(-1, labels[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk_elements", [1 << 27, 50, 7])  # one chunk; several, the last one short; a row each
def test_logprobs_and_entropy_match_log_softmax(chunk_elements):
    torch.manual_seed(11)
    logits = (torch.randn(4, 6, 23, dtype=torch.float64) * 3).requires_grad_(True)
    labels = torch.randint(0, 23, (4, 6))
    w_logp, w_ent = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    naive = logits.detach().clone().requires_grad_(True)
    exp_logp, exp_ent = _naive_logprobs_entropy(naive, labels, 0.7)
    ((exp_logp * w_logp).sum() + (exp_ent * w_ent).sum()).backward()

    logp, ent = ca.logprobs_and_entropy(logits, labels, 0.7, with_entropy=True, chunk_elements=chunk_elements)
    assert logp.shape == ent.shape == (4, 6)
    close(logp, exp_logp, atol=1e-12)
    close(ent, exp_ent, atol=1e-12)
    ((logp * w_logp).sum() + (ent * w_ent).sum()).backward()
    close(logits.grad, naive.grad, atol=1e-12)

    for use_logp in (True, False):  # gradients of one output alone: log-probs, then entropy
        logits.grad, naive.grad = None, None
        logp, ent = ca.logprobs_and_entropy(logits, labels, 0.7, with_entropy=True, chunk_elements=chunk_elements)
        exp_logp, exp_ent = _naive_logprobs_entropy(naive, labels, 0.7)
        ((logp * w_logp).sum() if use_logp else (ent * w_ent).sum()).backward()
        ((exp_logp * w_logp).sum() if use_logp else (exp_ent * w_ent).sum()).backward()
        close(logits.grad, naive.grad, atol=1e-12)


def test_logprobs_and_entropy_gradcheck():
    torch.manual_seed(12)
    logits = torch.randn(5, 9, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 9, (5,))
    assert torch.autograd.gradcheck(
        lambda x: ca.logprobs_and_entropy(x, labels, 1.3, with_entropy=True, chunk_elements=20), (logits,))


def test_logprobs_and_entropy_bf16_and_extremes():
    torch.manual_seed(13)
    logits = (torch.randn(3, 8, 50) * 5).bfloat16().requires_grad_(True)
    labels = torch.randint(0, 50, (3, 8))
    logp, ent = ca.logprobs_and_entropy(logits, labels, with_entropy=True, entropy_grad=False, chunk_elements=120)
    assert logp.dtype == ent.dtype == torch.float32
    exp_logp, exp_ent = _naive_logprobs_entropy(logits.detach(), labels, 1.0)  # from the same bf16 values
    close(logp, exp_logp.float(), atol=1e-5)
    close(ent, exp_ent.float(), atol=1e-5)
    assert not ent.requires_grad  # metrics only
    logp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16 and torch.isfinite(logits.grad).all()

    big = torch.tensor([[1000.0, -1000.0, 0.0], [50.0, 50.0, 50.0]], requires_grad=True)
    logp, ent = ca.logprobs_and_entropy(big, torch.tensor([1, 0]), with_entropy=True)
    close(ent, [0.0, math.log(3)])
    close(logp, [-2000.0, -math.log(3)])
    (logp.sum() + ent.sum()).backward()
    assert torch.isfinite(big.grad).all()
    assert ca.logprobs_and_entropy(big, torch.tensor([1, 0]))[1] is None


# ----------------------------------------------------------------------------- DAPO

def _naive_varied_groups(metric, gids):
    values = {}
    for g, m in zip(gids, metric):
        values.setdefault(g, []).append(m)
    return [len(values[g]) == 1 or len(set(values[g])) > 1 for g in gids]


def test_varied_groups_matches_loop():
    rng = random.Random(0)
    for _ in range(50):
        B = rng.randint(1, 24)
        gids = [rng.choice([3, 7, 100, 2**40, -5]) for _ in range(B)]    # arbitrary ids, interleaved
        metric = [rng.choice([0.0, 1.0, 0.2]) for _ in range(B)]
        got = ca.varied_groups(torch.tensor(metric), torch.tensor(gids))
        assert got.dtype == torch.bool and got.tolist() == _naive_varied_groups(metric, gids)


def test_varied_groups_equal_floats_are_flat():
    """Three samples of 0.1: np.std gives a rounding residue, max > min gives none."""
    keep = ca.varied_groups(torch.tensor([0.1, 0.1, 0.1, 0.1, 0.3, 0.1]), torch.tensor([0, 0, 0, 1, 1, 1]))
    assert keep.tolist() == [False] * 3 + [True] * 3


def test_overlong_penalty_matches_verls_formula_up_to_the_limit_and_stays_there_past_it():
    max_len, buffer, factor = 100, 20, 0.5
    lengths = list(range(0, 131))
    got = ca.overlong_penalty(torch.tensor(lengths), max_len, buffer, factor).tolist()
    for n, p in zip(lengths, got):
        verl = min(-(n - (max_len - buffer)) / buffer * factor, 0)     # verl's DAPO reward manager
        assert p == pytest.approx(verl if n <= max_len else -factor, abs=1e-6)
    assert got[80] == 0 and got[90] == pytest.approx(-0.25) and got[100] == pytest.approx(-0.5)
