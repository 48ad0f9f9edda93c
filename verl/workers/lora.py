"""LoRA adapters on the trained models: `actor_rollout_ref.model.lora_rank` (and `critic.model.*`),
with `lora_alpha` and `target_modules`, verl's keys and defaults. Rank 0 is full fine-tuning.

- `add_adapters`: peft's LoRA layers put into the Hugging Face model in place, before FSDP2 shards
  it (`verl.workers.distributed.shard`): the model keeps its class, its parameter names gain
  `.base_layer.` and `.lora_A.default.`/`.lora_B.default.`, and only the adapters require gradients.
  The optimizer, the gradient clip and the checkpoints see the trainable parameters only
  (`verl.workers.update.build_optimizer`, `verl.checkpoint.store`).
- `adapters_disabled`: the base model, for the reference log-probs: no second copy of the weights.
- `merged_state_dict_iter`: the weights the engine needs when it cannot take adapters: each adapted
  weight is W + B·A·alpha/r, computed in fp32 while the full tensors stream past, one at a time;
  the trained model is never merged.
- `adapter_state_iter`, `write_adapter`: the adapters alone, in PEFT's format (the file vLLM's LoRA
  and `peft.PeftModel.from_pretrained` read).
- `WeightPush`, `weight_push`: how the rollout engine gets the policy after each update.

Only `nn.Linear` layers take adapters here (the linear layers of the decoder: attention and MLP
projections); an output layer tied to the input embedding does not, since its weight is the
embedding's. A value model's head is trained in full beside the adapters of its backbone.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from enum import StrEnum
from typing import Any

import torch
from torch import nn

from verl.config.schema import VLLM_MAX_LORA_RANK
from verl.workers.distributed import full_tensor, persistent_buffers

logger = logging.getLogger(__name__)

ADAPTER = "default"                 # peft's name of the one adapter of a model
PEFT_PREFIX = "base_model.model."   # PEFT's files name tensors as seen from a PeftModel
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# The ranks vLLM can be built for (its max_lora_rank takes one of these): the engine is built for the
# smallest that holds the trained rank.
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, VLLM_MAX_LORA_RANK)


class WeightPush(StrEnum):
    """How the rollout engine gets the policy after an update."""
    FULL = "full"          # full fine-tuning: every weight, gathered in the engine's dtype
    MERGED = "merged"      # LoRA, an engine without adapters: W + B·A·alpha/r per adapted weight
    ADAPTER = "adapter"    # LoRA, vLLM's adapters: the adapter weights only, loaded as a LoRARequest


def weight_push(lora_rank: int, engine: str, choice: str) -> tuple[WeightPush, str]:
    """The push a run uses and why, for the start-up log: `lora_rank` (actor_rollout_ref.model),
    `engine` (rollout.name) and `choice` (rollout.lora_sync: auto | adapter | merged, checked by
    verl.config.load)."""
    if lora_rank == 0:
        return WeightPush.FULL, "full fine-tuning: every weight is pushed to the rollout engine"
    if choice == "adapter" or (choice == "auto" and engine == "vllm" and lora_rank <= VLLM_MAX_LORA_RANK):
        return WeightPush.ADAPTER, ("the rollout engine gets the adapter weights only, served as a vLLM LoRA adapter "
                                    f"(rollout.lora_sync={choice})")
    if choice == "merged":
        why = "rollout.lora_sync=merged"
    elif engine != "vllm":
        why = f"rollout.lora_sync=auto: rollout.name={engine} takes no adapters"
    else:
        why = f"rollout.lora_sync=auto: vLLM serves ranks up to {VLLM_MAX_LORA_RANK}"
    return WeightPush.MERGED, f"the rollout engine gets every weight, the adapted ones merged ({why})"


def vllm_lora_kwargs(lora_rank: int) -> dict:
    """vllm.LLM's arguments for one adapter of `lora_rank`."""
    return dict(enable_lora=True, max_loras=1,
                max_lora_rank=next(r for r in VLLM_MAX_LORA_RANKS if r >= lora_rank))


# ---------------------------------------------------------------------------------------------------
# Adapters on the model


def add_adapters(model: nn.Module, rank: int, alpha: float, target_modules: str | list[str], seed: int,
                 key: str) -> nn.Module:
    """Put LoRA layers of `rank` (scale alpha/rank) on the `target_modules` of `model` ("all-linear":
    every linear layer but the output layer; or module names, e.g. [q_proj, v_proj]) and freeze
    everything else. B starts at zero, so the model computes what it did. A is drawn from `seed`,
    the same on every rank (FSDP2 shards what each rank holds: ranks must hold the same weights).
    `key`: the config section, for errors (actor_rollout_ref.model, critic.model)."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.lora import LoraLayer

    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    alpha = int(alpha) if float(alpha).is_integer() else alpha   # as PEFT's configs write it
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, bias="none")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            inject_adapter_in_model(config, model)
        except ValueError as error:   # peft names the modules it did not find
            raise ValueError(f"{key}.target_modules={target_modules!r}: {error}") from None
    layers = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    if not layers:
        raise ValueError(f"{key}.target_modules={target_modules!r} matched no layer of {type(model).__name__}")
    other = sorted(name for name, m in layers.items() if not isinstance(m.get_base_layer(), nn.Linear))
    if other:
        raise ValueError(f"{key}.target_modules={target_modules!r} reaches layers that are not nn.Linear, e.g. "
                         f"{other[0]} ({type(layers[other[0]].get_base_layer()).__name__}): adapters go on linear "
                         "layers only; name those (e.g. [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
                         "down_proj]) or use all-linear")
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if output is not None and isinstance(output, LoraLayer) and getattr(model.config, "tie_word_embeddings", False):
        raise ValueError(f"{key}.target_modules={target_modules!r} reaches the output layer, whose weight is the "
                         "input embedding's (tie_word_embeddings): leave it out")
    return model


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """name -> peft LoRA layer, in the model's order."""
    from peft.tuners.lora import LoraLayer
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """The base model inside the block (peft's switch on every LoRA layer). The adapters stay
    trainable: switching them on again marks them as requiring gradients, as they did."""
    layers = list(lora_layers(model).values())
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def adapter_config(model: nn.Module, base_model: str) -> dict[str, Any]:
    """PEFT's adapter_config.json of the model's adapters: rank, alpha, and the adapted modules by
    their last name (q_proj, …), as PEFT writes them; `base_model`: the model the adapters are for."""
    layers = lora_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no LoRA adapters")
    first = next(iter(layers.values()))
    from peft import LoraConfig
    config = LoraConfig(r=first.r[ADAPTER], lora_alpha=first.lora_alpha[ADAPTER],
                        target_modules=sorted({name.rsplit(".", 1)[-1] for name in layers}), lora_dropout=0.0,
                        bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base_model, inference_mode=True)
    # PEFT's own save_pretrained turns sets into lists; enums are strings already
    return json.loads(json.dumps(config.to_dict(), default=lambda v: sorted(v) if isinstance(v, set) else str(v)))


# ---------------------------------------------------------------------------------------------------
# What the rollout engine gets


def _parts(name: str) -> tuple[str, str] | None:
    """(layer, part) of a LoRA layer's parameter name: part is "base.<weight|bias>", "A" or "B"; None
    for a parameter outside the LoRA layers."""
    for marker, part in ((f".lora_A.{ADAPTER}.weight", "A"), (f".lora_B.{ADAPTER}.weight", "B")):
        if name.endswith(marker):
            return name[: -len(marker)], part
    if ".base_layer." in name:
        layer, leaf = name.rsplit(".base_layer.", 1)
        return layer, "base." + leaf
    return None


def merged_state_dict_iter(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, full tensor) of the model with its adapters merged: W + B·A·alpha/r for
    each adapted weight (added in fp32, then cast to `dtype` once, as full fine-tuning's fp32 masters
    are), every other tensor as `verl.workers.distributed.full_state_dict_iter` gives it. A
    collective, one full tensor at a time beside its A and B; the model is left as it is."""
    layers = lora_layers(model)

    def gathered(t, exact=False):  # cast the shard before the gather where nothing is added to it
        return full_tensor(t.detach() if exact or dtype is None else t.detach().to(dtype))

    pending: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        parts = _parts(name)
        if parts is None:
            yield name, gathered(param)
            continue
        layer, part = parts
        if part == "base.bias":
            yield f"{layer}.bias", gathered(param)
        elif part == "base.weight":
            pending[layer] = gathered(param, exact=True)
        elif part == "A":
            pending[layer + ".A"] = gathered(param, exact=True)
        else:  # B comes after its base weight and A (the order peft registers them in)
            weight, a_RI = pending.pop(layer), pending.pop(layer + ".A")
            scale = layers[layer].scaling[ADAPTER]
            merged = weight.float() + scale * (gathered(param, exact=True).float() @ a_RI.float())
            yield f"{layer}.weight", merged.to(dtype or weight.dtype)
    for name, buf in persistent_buffers(model):
        yield name, gathered(buf)


def adapter_state_iter(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(PEFT's name, full tensor) of every adapter weight: `base_model.model.<layer>.lora_A.weight`
    and `lora_B`. A collective, as full_state_dict_iter."""
    for name, param in model.named_parameters():
        parts = _parts(name)
        if parts is not None and parts[1] in ("A", "B"):
            t = param.detach() if dtype is None else param.detach().to(dtype)
            yield f"{PEFT_PREFIX}{parts[0]}.lora_{parts[1]}.weight", full_tensor(t)


def write_adapter(model: nn.Module, out_dir: str, base_model: str, dtype: torch.dtype | None = None,
                  write: bool = True) -> str:
    """The adapters as a PEFT adapter directory (adapter_config.json, adapter_model.safetensors),
    replacing what `out_dir` held. A collective: every rank calls it; only those with `write` write."""
    from safetensors.torch import save_file

    tensors = {name: t.contiguous() for name, t in adapter_state_iter(model, dtype)}
    if write:
        os.makedirs(out_dir, exist_ok=True)
        tmp = os.path.join(out_dir, ADAPTER_WEIGHTS + ".tmp")
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.replace(tmp, os.path.join(out_dir, ADAPTER_WEIGHTS))
        with open(os.path.join(out_dir, ADAPTER_CONFIG), "w") as f:
            json.dump(adapter_config(model, base_model), f, indent=2)
    return out_dir
