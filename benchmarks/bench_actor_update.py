"""Actor update throughput: tokens/s, MFU and memory peak of one PPO/GRPO update with FSDP2.

Builds a random-weight model of a Qwen2.5 shape (Qwen2 architecture, 151,936-token vocabulary, tied
embeddings), a batch of search-agent-like trajectories (prompts of 150–350 tokens, responses of
600–1,200 tokens of which two or three retrieved spans are masked out of the loss), and times
`verl.workers.actor.Actor`: the old-log-prob pass (no grad) and `update` (forward + backward with
activation checkpointing, padding-free packing, AdamW step), for each attention implementation and
each fraction of checkpointed decoder layers asked for. On several GPUs the script starts itself
under torchrun (one FSDP2 shard per GPU).

Model FLOPs per token (the usual MFU convention: no recomputation counted):
    6 · (parameters of the decoder layers) + 6 · hidden · vocab (lm_head, response positions only)
    + attention 6 · layers · hidden · Σ_rows L² / T (causal: half of 12·layers·hidden·L²)
The log-prob pass counts a third of that (forward only). HFU adds the forward that activation
checkpointing recomputes: the decoder layers' matmuls and attention, × the fraction of layers
checkpointed (the lm_head is not recomputed). Peak: the dense bf16 tensor peak of the GPU
(989.4 TFLOP/s on H100/H200 SXM), or `--peak-tflops`.

    python benchmarks/bench_actor_update.py --shape 3b --trajectories 64 --micro 4            # one GPU
    python benchmarks/bench_actor_update.py --shape 3b --trajectories 64 --micro 4 --gpus 2   # FSDP2 on 2
    python benchmarks/bench_actor_update.py --shape 3b --attn varlen --checkpoint-ratios 1,0.5,0  # all, half, none
    python benchmarks/bench_actor_update.py --shape 3b --logprobs chunked,naive  # vs the unchunked composition
    python benchmarks/bench_actor_update.py --shape 3b --gpus 2 --accumulation sharded,unsharded
    python benchmarks/bench_actor_update.py --quick                                           # CPU (CI)
"""
from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# hidden, layers, heads, kv heads, intermediate, vocab (Qwen2.5 shapes)
SHAPES = {"tiny": (64, 2, 2, 1, 128, 1000), "0.5b": (896, 24, 14, 2, 4864, 151936),
          "3b": (2048, 36, 16, 2, 11008, 151936), "7b": (3584, 28, 28, 4, 18944, 152064)}
PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "H800": 989.4, "A100": 312.0}


def make_model(path: Path, shape: str) -> Path:
    """A random Qwen2 model of the shape, written once (bf16) and reused."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if (path / "config.json").exists():
        return path
    hidden, layers, heads, kv, inter, vocab = SHAPES[shape]
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, intermediate_size=inter, max_position_embeddings=8192,
                         tie_word_embeddings=True, initializer_range=0.02)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    tmp.rename(path)
    return path


def make_batch(n: int, vocab: int, seed: int):
    """Trajectories shaped like multi-turn search rollouts: observations (masked) between model turns."""
    from verl.batch import pack_trajectories

    g = torch.Generator().manual_seed(seed)
    prompts, responses, masks = [], [], []
    for _ in range(n):
        p = int(torch.randint(150, 351, (1,), generator=g))
        r = int(torch.randint(600, 1201, (1,), generator=g))
        mask = [1] * r
        for _ in range(int(torch.randint(2, 4, (1,), generator=g))):  # retrieved passages, ~150 tokens each
            start = int(torch.randint(0, r - 160, (1,), generator=g))
            mask[start:start + 150] = [0] * 150
        prompts.append(torch.randint(10, vocab, (p,), generator=g).tolist())
        responses.append(torch.randint(10, vocab, (r,), generator=g).tolist())
        masks.append(mask)
    batch = pack_trajectories(prompts, responses, masks, [i // 5 for i in range(n)], pad_id=0)
    batch.advantages_BR = torch.randn(n, 1, generator=g) * batch.loss_mask_BR
    return batch


def model_flops_per_update(shape: str, batch, world: int, checkpoint_ratio: float = 1.0) -> tuple[float, float]:
    """(model FLOPs of one forward+backward over the whole batch on all ranks, recomputed forward FLOPs:
    the decoder-layer forward of the round(checkpoint_ratio × layers) checkpointed layers)."""
    hidden, layers, heads, kv, inter, vocab = SHAPES[shape]
    head = hidden // heads
    layer_params = hidden * (heads * head) * 2 + hidden * (kv * head) * 2 + 3 * hidden * inter
    lengths = batch.attention_mask_BT.sum(1).double()
    tokens = float(lengths.sum()) * world
    response_tokens = float(batch.response_mask_BR.sum()) * world
    attn_pairs = float((lengths ** 2).sum()) * world  # causal: L²/2 pairs per row, 4·head·heads FLOPs each
    layers_fwd = 2 * layers * layer_params * tokens + 2 * layers * hidden * attn_pairs
    fwd = layers_fwd + 2 * hidden * vocab * response_tokens
    return 3 * fwd, layers_fwd * round(checkpoint_ratio * layers) / layers  # as modeling._enable_gradient_checkpointing


def peak_flops(override: float | None) -> float | None:
    if override:
        return override * 1e12
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v * 1e12 for k, v in PEAK_TFLOPS.items() if k in name), None)


def profile_update(actor, batch, mini_batch_size: int, path: str, title: str) -> None:
    """One more update under torch.profiler; appends the operators that took the most device (or,
    on the CPU, host) time to `path`."""
    from torch.profiler import ProfilerActivity, profile

    gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=activities) as prof:
        actor.update(batch, mini_batch_size=mini_batch_size)
        if gpu:
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cuda_time_total" if gpu else "self_cpu_time_total",
                                      row_limit=30, max_name_column_width=70)
    with open(path, "a") as f:
        f.write(f"\n=== {title} ===\n{table}\n")


def naive_logprobs_and_entropy(logits_NV, labels_N, temperature=1.0, with_entropy=False, entropy_grad=True):
    """The plain composition that `core_algos.logprobs_and_entropy` replaces (the baseline of
    `--logprobs naive`): whole fp32 copies of the logits, kept by autograd for backward."""
    z_NV = logits_NV.float() / temperature
    logprobs_N = z_NV.log_softmax(-1).gather(-1, labels_N[..., None]).squeeze(-1)
    if not with_entropy:
        return logprobs_N, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy_N = torch.logsumexp(z_NV, -1) - (torch.softmax(z_NV, -1) * z_NV).sum(-1)
    return logprobs_N, entropy_N


def time_updates(actor, batch, mini_batch_size: int, warmup: int, steps: int, gpu: bool):
    """Seconds of the log-prob pass and of `update`, and the graphs torch.compile built in this process
    during each (a recompilation is one cause of an outlier), for each of `steps` steps after `warmup`."""
    from torch._dynamo.utils import counters

    times_lp, times_up, compiles = [], [], []
    for i in range(warmup + steps):
        graphs = counters["stats"]["unique_graphs"]
        if gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        batch.old_logprobs_BR = actor.compute_logprobs(batch)
        if gpu:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        metrics = actor.update(batch, mini_batch_size=mini_batch_size)
        if gpu:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i >= warmup:
            times_lp.append(t1 - t0)
            times_up.append(t2 - t1)
            compiles.append(counters["stats"]["unique_graphs"] - graphs)
    return times_lp, times_up, compiles, metrics


def run(a) -> list[dict]:
    import torch.distributed as dist

    from verl import core_algos
    from verl.config.schema import ActorConfig, FSDPConfig, ModelConfig, OptimConfig
    from verl.utils.process_group import init_distributed, world_size
    from verl.workers import packing
    from verl.workers.actor import Actor

    distributed = "RANK" in os.environ
    rank = init_distributed()[0] if distributed else 0
    world = world_size()
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / f"model_{a.shape}"
    if rank == 0:
        make_model(model_dir, a.shape)
    if distributed:
        dist.barrier()
    if a.trajectories % world:
        raise SystemExit(f"--trajectories {a.trajectories} must be divisible by the {world} GPUs")
    n_local = a.trajectories // world
    batch = make_batch(a.trajectories, SHAPES[a.shape][5], seed=0).select(slice(rank * n_local, (rank + 1) * n_local))
    tokens = float(batch.attention_mask_BT.sum()) * world
    peak = peak_flops(a.peak_tflops)
    gpu = torch.cuda.is_available()
    rows = []
    for variant, ratio, logprobs_impl, accumulation in itertools.product(
            a.attn.split(","), a.ratios, a.logprobs.split(","), a.accumulation.split(",")):
        attn, _, compiled = variant.partition("+")  # e.g. "varlen+compile"
        packing.logprobs_and_entropy = {"chunked": core_algos.logprobs_and_entropy,
                                     "naive": naive_logprobs_and_entropy}[logprobs_impl]
        flops, recompute = model_flops_per_update(a.shape, batch, world, ratio)
        fwd_flops = flops / 3
        if gpu:
            gc.collect()  # the previous variant's model, also after an out-of-memory error
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        base = {"bench": "actor_update", "shape": a.shape, "attn": variant, "gpus": world,
                "device": torch.cuda.get_device_name() if gpu else "cpu", "trajectories": a.trajectories,
                "micro_batch": a.micro, "tokens_per_update": int(tokens), "checkpointing": ratio > 0,
                "checkpoint_ratio": ratio, "logprobs": logprobs_impl, "accumulation": accumulation}
        try:
            model = ModelConfig(path=str(model_dir), enable_gradient_checkpointing=ratio > 0,
                                gradient_checkpointing_ratio=ratio, attn_implementation=attn,
                                use_torch_compile=compiled == "compile")
            # the trainer's actor keys without the entropy bonus, so rows stay comparable with earlier runs
            cfg = ActorConfig(optim=OptimConfig(lr=1e-6), max_tokens_per_pack=a.max_tokens_per_pack, entropy_coeff=0.0,
                              fsdp_config=FSDPConfig(mixed_precision=gpu,
                                                     unsharded_accumulation=accumulation == "unsharded"))
            actor = Actor(model, cfg, micro_batch_size=a.micro)
            times_lp, times_up, compiles, metrics = time_updates(actor, batch, n_local, a.warmup, a.steps, gpu)
        except torch.OutOfMemoryError:
            if distributed:
                raise  # another rank may be waiting in a collective: stop everything
            # one process: record that this variant does not fit and go on with the next
            peak_gib = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            row = {**base, "error": "out of memory", "peak_memory_gib": peak_gib}
            actor = None
            rows.append(row)
            print(json.dumps(row), flush=True)
            continue
        mem = torch.cuda.max_memory_allocated() / 2**30 if gpu else None
        if a.profile and rank == 0:
            profile_update(actor, batch, n_local, a.profile, f"{a.shape} {variant} checkpoint ratio {ratio:g}")
        elif a.profile:
            actor.update(batch, mini_batch_size=n_local)  # every rank takes part
        if distributed:  # the largest over the ranks
            mem_t = torch.tensor([mem or 0.0], device="cuda" if gpu else "cpu")
            dist.all_reduce(mem_t, op=dist.ReduceOp.MAX)
            mem = float(mem_t) if gpu else None
            compiles_t = torch.tensor(compiles, device="cuda" if gpu else "cpu")
            dist.all_reduce(compiles_t, op=dist.ReduceOp.MAX)
            compiles = compiles_t.tolist()
        up, lp = min(times_up), min(times_lp)
        row = {**base, "update_s": round(up, 3), "update_s_all": [round(t, 3) for t in times_up],
               "graphs_compiled_all": compiles,  # per timed step (log-probs + update), most on any rank
               "update_tokens_per_s": round(tokens / up), "update_tokens_per_s_per_gpu": round(tokens / up / world),
               "logprob_s": round(lp, 3), "logprob_tokens_per_s": round(tokens / lp),
               "peak_memory_gib": round(mem, 2) if mem is not None else None,
               "grad_norm": metrics["grad_norm"]}
        if peak:
            row["update_mfu"] = round(flops / up / (peak * world), 4)
            row["update_hfu"] = round((flops + recompute) / up / (peak * world), 4)
            row["logprob_mfu"] = round(fwd_flops / lp / (peak * world), 4)
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
        del actor
    if distributed:
        dist.destroy_process_group()
    return rows if rank == 0 else []


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="3b")
    p.add_argument("--trajectories", type=int, default=64, help="trajectories per update (all GPUs together)")
    p.add_argument("--micro", type=int, default=4, help="trajectories per forward/backward, per GPU")
    p.add_argument("--max-tokens-per-pack", type=int, default=16384, help="cap for the masked (sdpa) path")
    p.add_argument("--attn", default="varlen,sdpa",
                   help="comma-separated attention implementations to time; '+compile' compiles the decoder layers")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--no-checkpointing", action="store_true", help="same as --checkpoint-ratios 0")
    p.add_argument("--checkpoint-ratios", default="1.0",
                   help="comma-separated fractions of decoder layers checkpointed (recomputed in backward), each timed")
    p.add_argument("--logprobs", default="chunked",
                   help="comma-separated: 'chunked' (the workers' own) and/or 'naive' (whole fp32 logits), each timed")
    p.add_argument("--accumulation", default="sharded",
                   help="comma-separated: 'sharded' (FSDP2's default: all-gather and reduce-scatter per micro-batch) "
                        "and/or 'unsharded' (once per optimizer step; Actor(unsharded_accumulation=True)), each timed")
    p.add_argument("--peak-tflops", type=float, help="dense bf16 peak of one GPU (default: from its name)")
    p.add_argument("--workdir", default="outputs/bench_actor")
    p.add_argument("--quick", action="store_true", help="tiny model on the CPU (CI)")
    p.add_argument("--out", help="append JSON rows to this file")
    p.add_argument("--profile", help="after timing, profile one more update and append its busiest operators here")
    a = p.parse_args(argv)
    a.ratios = [0.0] if a.no_checkpointing else [float(r) for r in a.checkpoint_ratios.split(",")]
    if set(a.accumulation.split(",")) - {"sharded", "unsharded"}:
        p.error(f"--accumulation {a.accumulation}: use sharded and/or unsharded")
    if set(a.logprobs.split(",")) - {"chunked", "naive"}:
        p.error(f"--logprobs {a.logprobs}: use chunked and/or naive")
    if not all(0 <= r <= 1 for r in a.ratios):
        p.error(f"--checkpoint-ratios {a.checkpoint_ratios}: each must be in [0, 1]")
    if a.quick:
        a.shape, a.trajectories, a.micro, a.gpus, a.steps, a.warmup = "tiny", 4, 2, 1, 1, 0
    if a.gpus > 1 and "RANK" not in os.environ:
        # one process per GPU; rank 0 writes the results
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={a.gpus}",
               __file__, *(argv if argv is not None else sys.argv[1:])]
        raise SystemExit(subprocess.call(cmd))
    rows = run(a)
    if rows and a.out:
        with open(a.out, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    for row in rows:
        label = (f"{row['shape']} {row['attn']:>14} ckpt {row['checkpoint_ratio']:g} {row['logprobs']} "
                 f"{row['accumulation']} ×{row['gpus']}")
        if "error" in row:
            print(f"{label}: {row['error']}")
            continue
        mfu = f"  MFU {row['update_mfu']:.1%} (HFU {row['update_hfu']:.1%})" if "update_mfu" in row else ""
        print(f"{label}: update {row['update_s']:.2f} s = {row['update_tokens_per_s']:,} tokens/s{mfu}; "
              f"log-probs {row['logprob_tokens_per_s']:,} tokens/s; peak {row['peak_memory_gib']} GiB")


if __name__ == "__main__":
    main()
