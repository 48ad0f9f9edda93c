"""The reward function's keyword arguments (reward.reward_kwargs): checked against the options
dataclass the function declares, every field passed, and a key it does not take refused naming it."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from verl.config.schema import ConfigError
from verl.trainer.metrics import reward_kwargs_for


@dataclass
class LengthOptions:
    target_chars: int = 100     # the response length that scores 1
    penalty: float = 0.5        # taken off per target_chars of distance

    def __post_init__(self):
        if self.target_chars <= 0:
            raise ValueError(f"target_chars = {self.target_chars} must be > 0")


def length_reward(data_source, response, ground_truth, *, target_chars=100, penalty=0.5):
    return 1.0 - penalty * abs(len(response) - target_chars) / target_chars


length_reward.Options = LengthOptions


def plain_reward(data_source, response, ground_truth):
    return float(response == ground_truth)


def test_the_function_gets_every_option_with_the_given_ones_over_the_defaults():
    assert reward_kwargs_for(length_reward, None) == {"target_chars": 100, "penalty": 0.5}
    kwargs = reward_kwargs_for(length_reward, {"penalty": 1})
    assert kwargs == {"target_chars": 100, "penalty": 1.0} and isinstance(kwargs["penalty"], float)
    assert length_reward("s", "x" * 50, "", **kwargs) == 0.5


@pytest.mark.parametrize("given, message", [
    ({"penalti": 1.0}, r"reward.reward_kwargs.penalti: the reward function .*length_reward has no such option; "
                       r"its options here: penalty, target_chars"),
    ({"target_chars": "long"}, r"reward.reward_kwargs.target_chars: Value 'long'"),
    ({"target_chars": 0}, r"reward.reward_kwargs: target_chars = 0 must be > 0"),
])
def test_an_unknown_mistyped_or_refused_kwarg_names_the_key(given, message):
    with pytest.raises(ConfigError, match=message):
        reward_kwargs_for(length_reward, given)


def test_a_function_without_options_takes_no_kwargs():
    assert reward_kwargs_for(plain_reward, {}) == {}
    with pytest.raises(ConfigError, match=r"reward.reward_kwargs.scale: the reward function .*plain_reward declares "
                                          r"no options dataclass"):
        reward_kwargs_for(plain_reward, {"scale": 2})


def test_the_mfu_counts_the_experts_a_token_runs_through_not_all_of_them():
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    from verl.trainer.metrics import active_param_count
    shape = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=32, intermediate_size=128)
    with torch.device("meta"):
        dense = AutoModelForCausalLM.from_config(Qwen3Config(**shape))
        moe = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**shape, moe_intermediate_size=32, num_experts=8,
                                                              num_experts_per_tok=2))
    assert active_param_count(dense) == sum(p.numel() for p in dense.parameters())
    total = sum(p.numel() for p in moe.parameters())
    experts = 2 * 8 * 3 * 32 * 64   # layers × experts × (gate, up, down) × moe_intermediate × hidden
    assert active_param_count(moe) == total - experts + experts // 4


def test_the_mfu_of_a_lora_update_counts_no_weight_gradients_of_the_frozen_base():
    """Full fine-tuning: 6 FLOPs a parameter a token (forward, the activations' and the weights'
    gradients); LoRA: 4, the frozen base weights get no gradient. The MFU follows."""
    from types import SimpleNamespace

    import torch

    from verl.trainer.metrics import throughput_metrics, update_flops_per_token
    assert update_flops_per_token(1000, lora=False) == 6000 and update_flops_per_token(1000, lora=True) == 4000
    batch = SimpleNamespace(attention_mask_BT=torch.ones(2, 50), info={"stats": []})
    seconds = {"rollout": 1.0, "update_actor": 2.0}
    mfu = {lora: throughput_metrics(batch, seconds, update_flops_per_token(10**9, lora), 1e15, 1, 1, generated=10)
           ["throughput/mfu_actor_update"] for lora in (False, True)}
    assert mfu[False] == pytest.approx(6e9 * 100 / 2e15) and mfu[True] == pytest.approx(mfu[False] * 2 / 3)
