"""The SFT loss (the masked NLL over the model's own tokens: observations, prompt and padding never
count) and the training loop, `run_sft`, in one process."""
from __future__ import annotations

import json
import logging
import math
import os
import random
from pathlib import Path

import torch

from search_r1.sft.trajectories import Example, check_train_split

log = logging.getLogger(__name__)

METRICS_FILE = "sft_metrics.jsonl"


def _pack(examples: list[Example], pad_id: int):
    from verl.batch import pack_trajectories
    return pack_trajectories([e.prompt_ids for e in examples], [e.response_ids for e in examples],
                             [e.loss_mask for e in examples], list(range(len(examples))), pad_id)


def masked_nll(model, examples: list[Example], pad_id: int, device="cpu") -> tuple[torch.Tensor, int]:
    """(sum of -log p over the model tokens, number of model tokens). Observations, prompt and
    padding never contribute."""
    from verl.workers.packing import TOKENS_PER_PACK, forward_packed, tokens_per_pack
    batch = _pack(examples, pad_id).to(device)
    logprobs_BR, _ = forward_packed(model, batch.input_ids_BT, batch.attention_mask_BT, batch.prompt_width,
                                    max_tokens_per_pack=tokens_per_pack(TOKENS_PER_PACK, batch.input_ids_BT.device),
                                    loss_mask_BR=batch.loss_mask_BR)
    return -(logprobs_BR * batch.loss_mask_BR).sum(), int(batch.loss_mask_BR.sum().item())


def _autocast(device: torch.device):
    # bf16 compute on GPUs; fp32 on the CPU. forward_packed takes the softmax in fp32 either way.
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


@torch.no_grad()
def mean_nll(model, examples: list[Example], pad_id: int, micro_batch_size: int = 8, device="cpu") -> float:
    """Mean NLL per model token over `examples` (for before/after comparisons)."""
    device = torch.device(device)
    total, tokens = 0.0, 0
    for lo in range(0, len(examples), micro_batch_size):
        with _autocast(device):
            nll, n = masked_nll(model, examples[lo:lo + micro_batch_size], pad_id, device)
        total, tokens = total + nll.item(), tokens + n
    return total / max(tokens, 1)


def _train_step(model, rows: list[Example], optimizer, scheduler, micro_batch_size: int, pad_id: int,
                device: torch.device, max_grad_norm: float) -> dict:
    # Every micro-batch divides by the whole batch's token count, so the accumulated gradient is
    # that of the mean over all model tokens of the batch, however it is split.
    tokens = sum(sum(e.loss_mask) for e in rows)
    lr = scheduler.get_last_lr()[0]
    optimizer.zero_grad(set_to_none=True)
    nll_sum = 0.0
    for lo in range(0, len(rows), micro_batch_size):
        with _autocast(device):
            nll, _ = masked_nll(model, rows[lo:lo + micro_batch_size], pad_id, device)
        (nll / tokens).backward()
        nll_sum += nll.item()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm).item()
    if math.isfinite(grad_norm):
        optimizer.step()
    else:
        log.warning("non-finite gradient norm: step skipped")
    scheduler.step()
    return {"loss": nll_sum / tokens, "tokens": tokens, "lr": lr, "grad_norm": grad_norm}


def run_sft(model, data: list[Example], out_dir: str | os.PathLike, epochs: int = 2, lr: float = 5e-5,
            batch_size: int = 16, micro_batch_size: int = 8, max_length: int = 2048, seed: int = 0,
            warmup_ratio: float = 0.05, device: str | None = None, tokenizer=None,
            weight_decay: float = 0.0, max_grad_norm: float = 1.0) -> dict:
    """Train `model` (a path, or a loaded causal LM with `tokenizer`) on `data`, one process.

    batch_size and micro_batch_size count trajectories; trajectories longer than max_length
    tokens are left out (cutting one would drop its answer). Writes per-step metrics to
    `<out_dir>/sft_metrics.jsonl` and the trained model and tokenizer to `<out_dir>`.
    Returns a summary (steps, first and last loss, examples used).
    """
    from tqdm import tqdm

    from verl.workers.modeling import build_causal_lm
    from verl.workers.update import build_lr_scheduler, build_optimizer

    if isinstance(model, (str, os.PathLike)):
        from transformers import AutoTokenizer
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(str(model))
        model = build_causal_lm(str(model))
    if tokenizer is None:
        raise ValueError("run_sft got a model object without its tokenizer: pass tokenizer=…")
    check_train_split([e.meta for e in data])
    if batch_size < 1 or micro_batch_size < 1:
        raise ValueError("batch_size and micro_batch_size must be at least 1")
    used = [e for e in data if len(e) <= max_length]
    if len(used) < len(data):
        log.warning("left out %d of %d trajectories longer than max_length=%d tokens",
                    len(data) - len(used), len(data), max_length)
    if not used:
        raise ValueError(f"no trajectory fits in max_length={max_length} tokens: raise --max-length")

    torch.manual_seed(seed)
    order_rng = random.Random(seed)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model.to(device).train()
    steps_per_epoch = math.ceil(len(used) / batch_size)
    total_steps = epochs * steps_per_epoch
    optimizer = build_optimizer(model, lr, weight_decay, (0.9, 0.999))
    scheduler = build_lr_scheduler(optimizer, round(warmup_ratio * total_steps), total_steps, "constant", 0.0)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    losses = []
    with open(out / METRICS_FILE, "w") as metrics_file, tqdm(total=total_steps, desc="sft") as bar:
        for epoch in range(epochs):
            order = list(range(len(used)))
            order_rng.shuffle(order)
            for lo in range(0, len(order), batch_size):
                rows = [used[i] for i in order[lo:lo + batch_size]]
                m = _train_step(model, rows, optimizer, scheduler, micro_batch_size, pad_id, device,
                                max_grad_norm)
                m = {"step": len(losses) + 1, "steps": total_steps, "epoch": epoch, **m}
                losses.append(m["loss"])
                metrics_file.write(json.dumps(m) + "\n")
                metrics_file.flush()
                bar.update()
                bar.set_postfix(loss=f"{m['loss']:.3f}")
    model.save_pretrained(out)   # safetensors
    tokenizer.save_pretrained(out)
    summary = {"steps": total_steps, "examples": len(used), "first_loss": losses[0], "last_loss": losses[-1],
               "out_dir": str(out)}
    log.info("SFT done: %d steps, loss %.3f -> %.3f, model saved to %s", total_steps, losses[0], losses[-1], out)
    return summary
