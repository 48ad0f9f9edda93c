"""What the trainer measures of a step: the outcome reward (the reward function and the keyword
arguments it declares) and the metrics of the trajectories (scores), tokens per second and the
actor update's model FLOPs utilisation (throughput, MFU), the workers' metrics merged, and the
samples written for reading by eye."""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import os
import time
from collections import defaultdict
from contextlib import contextmanager

import numpy as np
import torch

from verl.batch import RolloutBatch
from verl.config.options import options_from_config
from verl.config.schema import ConfigError

# bf16 dense tensor-core peaks (data sheets), for the MFU estimate.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def load_reward_fn(spec: str | None):
    """'module:function' → callable(data_source, response_text, ground_truth[, extra_info=row's extra_info]),
    returning a float or an object with .score (optional: .em, and .metrics, a dict of floats logged
    by name as means over the trajectories that report them)."""
    if not spec:
        raise ValueError("reward.function is not set: give it as 'module:function', e.g. "
                         "search_r1.rewards:score_for")
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def reward_kwargs_for(reward_fn, given: dict | None, where: str = "reward.reward_kwargs") -> dict:
    """The keyword arguments `reward_fn` is called with: `given` (the config's `where`) checked against
    the options dataclass the function declares (its attribute `Options`), every field of it,
    defaults included. A function that declares none is called without; giving it some stops the run.
    Unknown names, wrong types and values the dataclass refuses raise ConfigError naming the key."""
    options_cls = getattr(reward_fn, "Options", None)
    name = f"{getattr(reward_fn, '__module__', '?')}:{getattr(reward_fn, '__name__', reward_fn)}"
    if options_cls is None or not dataclasses.is_dataclass(options_cls):
        if given:
            raise ConfigError(f"{where}.{next(iter(given))}: the reward function {name} declares no options "
                              "dataclass (its attribute Options), so it takes no keyword arguments")
        return {}
    options = options_from_config(options_cls, given, where, f"the reward function {name}")
    return {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}


def takes_extra_info(fn) -> bool:
    """Whether the reward function takes the row's `extra_info` (verl's keyword), by name."""
    return "extra_info" in inspect.signature(fn).parameters


class Timer:
    def __init__(self):
        self.seconds = {}

    @contextmanager
    def __call__(self, name):
        started = time.perf_counter()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started


def score_trajectories(batch: RolloutBatch, reward_fn, reward_kwargs: dict, with_extra_info: bool,
                       shaping=None) -> tuple[torch.Tensor, dict]:
    """Each trajectory's outcome reward (reward_fn on its response as the workers decoded it), and
    the step's reward, response and agent metrics; `batch.info["reward"]` gets the rewards, and
    `batch.info["score"]`, `["em"]` the reward function's own values before `shaping`
    (callable(scores, stats) -> (rewards, metrics), e.g. the overlong penalty)."""
    rewards, em, by_source, own = [], [], defaultdict(list), defaultdict(list)
    extra = batch.info.get("extra_info") or [None] * len(batch)
    for text, source, gt, info in zip(batch.info["response_text"], batch.info["data_source"],
                                      batch.info["ground_truth"], extra):
        kwargs = reward_kwargs | ({"extra_info": info} if with_extra_info else {})
        result = reward_fn(source, text, gt, **kwargs)
        score = float(getattr(result, "score", result))
        rewards.append(score)
        em.append(float(getattr(result, "em", score)))
        by_source[source].append(em[-1])
        for name, value in (getattr(result, "metrics", None) or {}).items():  # the reward's own, by name
            own[name].append(float(value))
    stats = batch.info["stats"]  # TrajectoryStats, one per trajectory
    batch.info["score"], batch.info["em"] = rewards, em   # for algorithm.filter_groups.metric
    rewards, shaped = shaping(rewards, stats) if shaping is not None else (rewards, {})
    metrics = shaped | {"reward/mean": float(np.mean(rewards)), "reward/em": float(np.mean(em)),
               "response/length": float(np.mean([s.response_tokens for s in stats])),
               "response/model_tokens": float(np.mean([s.model_tokens for s in stats])),
               # tool outputs (retrieved passages) in the response
               "response/observation_tokens": float(np.mean([s.response_tokens - s.model_tokens for s in stats]))}
    for name in {name for s in stats for name in s.metrics}:  # the agent loop's own
        metrics[f"agent/{name}"] = float(np.mean([s.metrics[name] for s in stats if name in s.metrics]))
    for reason in {s.finish for s in stats}:
        metrics[f"agent/finish_{reason}"] = float(np.mean([s.finish == reason for s in stats]))
    # When trajectories ended (each on its worker's clock): the step waits for the last one, so
    # max − p90 is what the slowest tenth costs the rollout.
    if done := [s.done_s for s in stats if s.done_s is not None]:
        for name, q in (("p50", 50), ("p90", 90), ("max", 100)):
            metrics[f"rollout/done_s_{name}"] = float(np.percentile(done, q))
    # Groups whose rewards are all equal give GRPO no signal (their advantages are 0).
    groups = defaultdict(set)
    for gid, r in zip(batch.group_ids_B.tolist(), rewards):
        groups[gid].add(r)
    metrics["reward/flat_groups"] = float(np.mean([len(v) == 1 for v in groups.values()]))
    for source, values in by_source.items():
        metrics[f"reward/em/{source}"] = float(np.mean(values))
    # Means over the trajectories whose reward reported them (e.g. the search reward's by hop count).
    metrics |= {name: float(np.mean(values)) for name, values in own.items()}
    batch.info["reward"] = rewards
    return torch.tensor(rewards, dtype=torch.float32), metrics


def active_param_count(model: torch.nn.Module) -> int:
    """The parameters a token runs through, which the update's FLOPs scale with (memory scales with
    all of them): all, except that a mixture of experts runs `num_experts_per_tok` of its routed
    experts (the parameters under `.experts.`), so only that share of theirs counts. Counting every
    expert would put a 30B-A3B model's MFU nine times too high."""
    total = experts = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if ".experts." in name:
            experts += p.numel()
    if not experts:
        return total
    config = model.config.get_text_config()
    n_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    per_token = getattr(config, "num_experts_per_tok", None)
    if not (n_experts and per_token):
        raise ValueError(f"{type(model).__name__} has expert parameters but its config names no num_experts (or "
                         "num_local_experts) and num_experts_per_tok: cannot tell how many of them a token runs through")
    return total - experts + experts * per_token // n_experts


def update_flops_per_token(active_params: int, lora: bool) -> float:
    """Model FLOPs of one token's forward and backward in the actor update (attention left out): 2 per
    parameter a token runs through (`active_param_count`) forward, 2 for the gradient of the activations
    and 2 for the gradient of the weights. With LoRA the base weights are frozen and get no gradient,
    so 4 (the adapters' own FLOPs are a rounding error beside the base model's)."""
    return (4 if lora else 6) * active_params


def throughput_metrics(batch: RolloutBatch, seconds: dict, flops_per_token: float | None, peak_flops: float | None,
                       ppo_epochs: int, world: int, generated: int | None = None) -> dict:
    """Tokens per second of the rollout and the actor update, and the update's model FLOPs utilisation
    (with `update_flops_per_token` and the GPU's peak). `generated`: the model tokens the rollout wrote,
    where it wrote more than the batch holds (groups dropped by algorithm.filter_groups)."""
    tokens = int(batch.attention_mask_BT.sum())
    if generated is None:
        generated = sum(s.model_tokens for s in batch.info["stats"])
    out = {"throughput/generated_tokens_per_s": generated / max(seconds["rollout"], 1e-9)}
    if "update_actor" not in seconds:  # a critic warm-up step
        return out
    out["throughput/train_tokens_per_s"] = tokens / max(seconds["update_actor"], 1e-9)
    if peak_flops and flops_per_token:
        out["throughput/mfu_actor_update"] = flops_per_token * tokens * ppo_epochs / (
            seconds["update_actor"] * peak_flops * world)
    return out


def merge_worker_metrics(dicts: list[dict], prefix: str = "") -> dict:
    """The workers' metrics under `prefix` + name: averaged over workers, except peak memory
    (`memory/…`), where the fullest worker is what meets the GPU's capacity."""
    keys = set().union(*dicts)
    return {prefix + k: float((np.max if k.startswith("memory/") else np.mean)([d[k] for d in dicts if k in d]))
            for k in keys}


def write_samples(batch: RolloutBatch, path: str, step: int, limit: int = 64) -> None:
    """Trajectories with their token masks, for the report and for reading by eye."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for i in range(min(limit, len(batch))):
            f.write(json.dumps({"step": step, "data_source": batch.info["data_source"][i],
                                "ground_truth": _jsonable(batch.info["ground_truth"][i]),
                                "response": batch.info["response_text"][i],
                                "response_ids": batch.info["response_ids"][i],
                                "loss_mask": batch.info["loss_mask"][i],
                                "reward": batch.info["reward"][i], **batch.info["stats"][i].as_row()}) + "\n")


def _jsonable(x):
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    return x
