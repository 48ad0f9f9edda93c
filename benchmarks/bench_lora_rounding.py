"""What the rollout engine loses of a LoRA update with `rollout.lora_sync=merged`, on a real model.

The merged push sends each adapted weight as W + B·A·alpha/r, added in fp32 and cast to the engine's
bf16 (`verl.workers.lora.merged_state_dict_iter`). An update smaller than a weight's rounding step
does not survive the cast. The adapter push (`adapter`) sends B and A themselves: their rounding is
relative to the update, so the update reaches the engine in full. This script measures both against
the trainer's policy, for adapters that have moved as far as `t` optimizer steps of `lr` can move
them (Adam moves each element by about `lr` a step; B grows from zero while A stays near where it was
drawn). That is the most an update can grow in t steps, so the merged push loses the least here; a
real run's noisier updates lose more.

For each t, one row:
- `update_kept_merged`, `update_kept_adapter`: the share of B·A·alpha/r that reaches the engine
  (the projection of the engine's weight change on the update, over the update's squared norm);
- `kl_trainer_merged`, `kl_trainer_adapter`: KL(trainer ‖ engine) of the next-token distributions
  over bundled passages, nats a token, all computed in fp32 from the weights each side holds;
- `kl_trainer_base`: how far the trainer's policy has moved from the base model, for scale.

    python benchmarks/bench_lora_rounding.py --out rows.jsonl
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from search_r1.data.bundled import BUNDLED_DIR  # noqa: E402
from verl.workers.lora import add_adapters, lora_layers, merged_state_dict_iter  # noqa: E402


def passages(n: int) -> list[str]:
    with open(BUNDLED_DIR / "corpus.jsonl") as f:
        return [json.loads(next(f))["contents"] for _ in range(n)]


@torch.no_grad()
def log_probs(model, weights: dict[str, torch.Tensor], batch) -> torch.Tensor:
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:   # a tied output layer is the embedding itself
        raise RuntimeError(f"weights that do not match the model: {unexpected or missing}")
    return model(**batch).logits.float().log_softmax(-1)


def kl(p_BTV: torch.Tensor, q_BTV: torch.Tensor, mask_BT: torch.Tensor) -> float:
    return (p_BTV.exp() * (p_BTV - q_BTV)).sum(-1)[mask_BT].mean().item()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a Hugging Face model directory (default: the bundled SmolLM2-135M)")
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--alpha", type=float, default=32)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--steps", type=int, nargs="+", default=[1, 10, 100, 1000])
    p.add_argument("--passages", type=int, default=8)
    p.add_argument("--quick", action="store_true", help="two values of t, two passages")
    p.add_argument("--out", help="JSONL rows, one per value of t")
    a = p.parse_args(argv)
    if a.quick:
        a.steps, a.passages = [1, 1000], 2
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_name = Path(a.model).name if a.model else "SmolLM2-135M-Instruct"
    if a.model is None:
        from search_r1.local_models import materialize_smollm2
        a.model = materialize_smollm2(tempfile.mkdtemp(prefix="smollm2_"))
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    batch = tokenizer(passages(a.passages), return_tensors="pt", padding=True, truncation=True, max_length=256)
    mask_BT = batch["attention_mask"].bool()
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    with torch.no_grad():   # the base as a bf16 checkpoint holds it (the bundled GGUF is f16)
        for param in model.parameters():
            param.copy_(param.bfloat16().float())
    trained = add_adapters(model, a.rank, a.alpha, "all-linear", seed=0, key="bench")
    engine = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()   # no adapters
    base = {name: t.clone() for name, t in merged_state_dict_iter(trained)}   # B is zero: the base model
    lp_base = log_probs(engine, base, batch)
    layers = lora_layers(trained)
    signs = {name: torch.randint(0, 2, layer.lora_B["default"].weight.shape, generator=torch.Generator().manual_seed(1))
             .float() * 2 - 1 for name, layer in layers.items()}
    rows = []
    for t in a.steps:
        with torch.no_grad():
            for name, layer in layers.items():
                layer.lora_B["default"].weight.copy_(signs[name] * t * a.lr)
        exact = dict(merged_state_dict_iter(trained))                         # what the trainer computes
        merged = {n: w.float() for n, w in merged_state_dict_iter(trained, dtype=torch.bfloat16)}
        adapter = dict(base)                                                  # the engine's bf16 base ...
        dots = {"merged": 0.0, "adapter": 0.0}
        update_sq = weight_sq = 0.0
        for name, layer in layers.items():
            w = f"{name}.weight"
            a_RI = layer.lora_A["default"].weight.bfloat16().float()
            b_OR = layer.lora_B["default"].weight.bfloat16().float()
            adapter[w] = adapter[w] + layer.scaling["default"] * (b_OR @ a_RI)   # ... and bf16 B and A beside it
            update = exact[w] - base[w]
            for side, weights in (("merged", merged), ("adapter", adapter)):   # base: either engine at t = 0
                dots[side] += ((weights[w] - base[w]) * update).sum().item()
            update_sq += (update * update).sum().item()
            weight_sq += (base[w] * base[w]).sum().item()
        lp_exact = log_probs(engine, exact, batch)
        row = {"model": model_name, "rank": a.rank, "alpha": a.alpha, "lr": a.lr, "t": t,
               "update_norm_ratio": (update_sq / weight_sq) ** 0.5,
               "update_kept_merged": dots["merged"] / update_sq,
               "update_kept_adapter": dots["adapter"] / update_sq,
               "kl_trainer_base": kl(lp_exact, lp_base, mask_BT),
               "kl_trainer_merged": kl(lp_exact, log_probs(engine, merged, batch), mask_BT),
               "kl_trainer_adapter": kl(lp_exact, log_probs(engine, adapter, batch), mask_BT)}
        rows.append(row)
        print(json.dumps({k: (float(f"{v:.3g}") if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
