"""Full GRPO steps through the real entry point, with time per phase.

Builds a random-weight model of a given shape (random_models.py: the shapes bench_rollout.py times
too) with SmolLM2's tokenizer, the bundled geography task as parquet, and a BM25 retrieval server
over the bundled corpus; then runs `python -m verl.trainer.main_ppo` (search agent, vLLM rollout
with sleep/wake and in-memory weight sync, FSDP2 actor, reference) for a few steps and prints the
per-phase timings from its metrics.

    python benchmarks/bench_grpo_step.py --shape 0.5b --steps 2 --prompts 64 --n 5   # one GPU
    python benchmarks/bench_grpo_step.py --shape 0.5b --steps 4 --ahead 0 1           # synchronous vs one ahead
    python benchmarks/bench_grpo_step.py --quick                                     # CPU (CI)
    python benchmarks/bench_grpo_step.py --shape 3b --gpus 4 --prompts 256 --n 5 --dense-rows 21015324 …
    python benchmarks/bench_grpo_step.py --shape 0.5b actor_rollout_ref.model.lora_rank=16 \
        actor_rollout_ref.model.lora_alpha=32 actor_rollout_ref.actor.optim.lr=1e-4     # LoRA adapters

`--ahead 0 1` runs the same steps synchronously and with the rollout one step ahead of the update
(trainer.rollout_ahead_steps; `--rollout-gpus N`: on N GPUs of its own instead of beside the policy
workers), one row per step and mode, for a comparison in one call. `--variant` does the same for any
keys, e.g. full fine-tuning next to LoRA:

    python benchmarks/bench_grpo_step.py --shape 3b --variant full \
        --variant "lora actor_rollout_ref.model.lora_rank=64 actor_rollout_ref.model.lora_alpha=32"

`--gpu-gib 80` imitates a smaller GPU: a process of its own holds the rest of each GPU's memory for the
whole call, so the trainer's memory plan and the engine see what an 80 GB GPU would leave them; the
rollout's gpu_memory_utilization given in the overrides then counts in the imitated GPU.

A random policy never writes `<search>`. `--search-every N` makes it search as a trained one does:
`<search>` and `</search>` become single tokens of the model's tokenizer, and the trainer's
`actor_rollout_ref.rollout.logit_bias` raises both so that each comes about once every N tokens
(the bias that would give that rate if the logits were uniform; rows report the searches made).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the package first, then the test helpers

from random_models import SHAPES, TAGS, make_random_model, tag_bias, tagged_tokenizer  # noqa: E402
from result_rows import emit_row  # noqa: E402


def dense_server(rows: int, devices: list[str], tokenizer: str, workdir: Path):
    """bench_server.py's synthetic dense server (`--serve`) in a process of its own, as the original
    runs its retriever beside the trainer: the vectors sharded over `devices`, the encoder on the first."""
    from conftest import ServerProcess
    workdir.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    server = ServerProcess(["--n", str(rows), "--devices", ",".join(devices), "--tokenizer", tokenizer,
                            "--workdir", str(workdir)], workdir / "server.log",
                           env={"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))},
                           command=[sys.executable, str(ROOT / "benchmarks" / "bench_server.py"), "--serve"],
                           start_timeout_s=900)
    print(f"dense server over {rows:,} vectors on {devices} ready in {time.perf_counter() - t:.0f} s", flush=True)
    return server


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    p.add_argument("--tokenizer", help="a tokenizer dir (default: SmolLM2's, from the bundled GGUF)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--prompts", type=int, default=64, help="prompts per step")
    p.add_argument("--n", type=int, default=5, help="samples per prompt")
    p.add_argument("--mini-batches", type=int, default=1, help="optimizer steps per training step (the "
                   "original's recipe: 2, 512 prompts in mini-batches of 256)")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--max-turns", type=int, default=2)
    p.add_argument("--response-length", type=int, default=256, help="tokens per turn")
    p.add_argument("--search-every", type=float, help="steer the random policy to write a search tag about "
                   "once every this many tokens (default: it never searches)")
    p.add_argument("--retriever-url", help="use this running server (e.g. a dense one over 21M passages, "
                   "`search-r1 serve`) instead of a BM25 server over the bundled corpus")
    p.add_argument("--dense-rows", type=int, help="instead: start the synthetic dense server of bench_server.py "
                   "(random e5-shaped encoder, this many 768-dim vectors sharded over the run's GPUs, e.g. 21015324)")
    p.add_argument("--server-tokenizer", default="all-MiniLM-L6-v2",
                   help="a BERT-vocabulary tokenizer for --dense-rows' encoder")
    p.add_argument("--ahead", type=int, nargs="+", help="trainer.rollout_ahead_steps of each run, one run per "
                   "value in the same setting (0: synchronous); default: one run as the overrides say")
    p.add_argument("--variant", action="append", metavar="'NAME [KEY=VALUE ...]'",
                   help="one run per --variant in the same setting: one quoted argument, its name, then the keys it "
                        "adds to the overrides (quoted, so that the overrides after it stay the overrides of every run)")
    p.add_argument("--gpu-gib", type=float, help="imitate GPUs of this many GiB (a process holds the rest)")
    p.add_argument("--rollout-gpus", type=int, default=0, help="runs ahead: GPUs of the rollout workers' own "
                   "(rollout.n_gpus_per_node) beside the --gpus of the training; 0: beside the policy workers")
    p.add_argument("--workdir", default="outputs/bench_grpo")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out")
    p.add_argument("overrides", nargs="*", help="extra trainer keys, e.g. actor_rollout_ref.rollout.enable_sleep=false")
    a = p.parse_args(argv)
    if a.ahead and a.variant:
        p.error("--ahead and --variant each give the runs to compare: use one of them")
    if a.quick:
        a.shape, a.steps, a.prompts, a.n, a.gpus, a.response_length = "tiny", 1, 2, 2, 1, 16
        a.search_every = a.search_every or 4
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)

    from conftest import ServerProcess
    from search_r1.data import preprocess
    from search_r1.data.bundled import bundled_paths
    from search_r1.retrieval.build import build_bm25_index

    tokenizer, bias = a.tokenizer, {}
    if a.search_every:
        tokenizer = work / "tokenizer_with_tags"
        tok = tagged_tokenizer(a.tokenizer, tokenizer)
        bias = {tok.convert_tokens_to_ids(tag): round(tag_bias(len(tok), a.search_every), 3) for tag in TAGS}
    model = make_random_model(work / f"model_{a.shape}{'_tags' if bias else ''}", a.shape, tokenizer)
    for split in ("train", "test"):
        if not (work / f"{split}.parquet").exists():
            preprocess.main(["--bundled", "--split", split, "--out", str(work / f"{split}.parquet")])
    server = None
    if a.dense_rows:
        server = dense_server(a.dense_rows, [f"cuda:{i}" for i in range(a.gpus)], a.server_tokenizer,
                              work / "dense_server")
    elif a.retriever_url is None:
        corpus = bundled_paths()["corpus"]
        index = build_bm25_index(str(corpus), str(work / "bm25"), progress=False)
        server = ServerProcess(["--retriever_name", "bm25", "--index_path", str(index), "--corpus_path", str(corpus)],
                               work / "retrieval.log")
    retriever_url = a.retriever_url or f"{server.url}/retrieve"
    gpu = not a.quick
    if (a.prompts * a.n) % (a.mini_batches * a.gpus):
        raise SystemExit(f"--prompts × --n = {a.prompts * a.n} trajectories do not split into {a.mini_batches} "
                         f"mini-batches on {a.gpus} GPUs")
    mini = a.prompts * a.n // a.mini_batches  # trajectories per optimizer step
    args = [f"data.train_files={work / 'train.parquet'}", f"data.val_files={work / 'test.parquet'}",
            f"data.train_batch_size={a.prompts}", "data.val_data_num=8", "data.max_prompt_length=512",
            f"data.max_response_length={a.response_length}", "data.max_obs_length=256",
            f"actor_rollout_ref.model.path={model}", f"actor_rollout_ref.rollout.n_agent={a.n}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}",
            # Micro-batches of 16 (update) and 32 (log-probs) trajectories per GPU, whatever the number
            # of GPUs (the keys count over all of them), so runs on 1 and on N GPUs do the same work per GPU.
            f"actor_rollout_ref.actor.ppo_micro_batch_size={min(16 * a.gpus, mini)}",
            f"actor_rollout_ref.rollout.log_prob_micro_batch_size={min(32 * a.gpus, a.prompts * a.n)}",
            f"actor_rollout_ref.ref.log_prob_micro_batch_size={min(32 * a.gpus, a.prompts * a.n)}",
            "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false",
            # the settings of the earlier rows (RESULTS.md), whatever the trainer's defaults become
            "actor_rollout_ref.rollout.top_p=1.0", "actor_rollout_ref.actor.entropy_coeff=0.0",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.rollout.agent_loop=search_r1.agent.loop:SearchAgentLoop",
            f"actor_rollout_ref.rollout.gpu_memory_utilization={0.5 if gpu else 0.3}",
            # random weights never answer; a reward that varies keeps the updates non-zero
            "reward.function=rewards_for_tests:early_letter_reward",
            f"max_turns={a.max_turns}", f"retriever.url={retriever_url}",
            f"trainer.n_gpus_per_node={a.gpus}", f"trainer.device={'cuda' if gpu else 'cpu'}",
            f"trainer.total_training_steps={a.steps}", "trainer.val_before_train=false",
            "trainer.save_freq=-1", "trainer.logger=[console,jsonl]", *a.overrides]
    if bias:
        args.append("actor_rollout_ref.rollout.logit_bias={" + ",".join(f"{t}:{b}" for t, b in bias.items()) + "}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "verl" / "trainer"),
                                                        os.environ.get("PYTHONPATH", "")])}
    # one run per variant (an --ahead value is one), in the same setting, against the same retrieval server
    variants = {f"ahead{k}": [f"trainer.rollout_ahead_steps={k}"]
                + ([f"rollout.n_gpus_per_node={a.rollout_gpus}"] if k and a.rollout_gpus else []) for k in a.ahead or []}
    variants |= {name: keys for name, *keys in map(shlex.split, a.variant or [])}
    variants = variants or {None: []}   # neither: one run, as the overrides say
    t = time.perf_counter()
    runs, holder = {}, None
    try:
        if a.gpu_gib:
            holder = hold_gpu_memory(a.gpus + a.rollout_gpus, a.gpu_gib, args)
        for name, keys in variants.items():
            run_dir = work / f"run_{a.shape}{'' if name is None else f'_{name}'}_{int(time.time())}"
            r = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", *args, *keys,
                                f"trainer.default_local_dir={run_dir}", f"hydra.run.dir={run_dir / 'hydra'}"],
                               cwd=ROOT, env=env)
            if r.returncode:
                raise SystemExit(f"training failed (exit {r.returncode}); see the log above")
            runs[name] = run_dir
    finally:
        if server is not None:
            server.stop()
        if holder is not None:
            holder.kill()
    import torch
    device = torch.cuda.get_device_name() if gpu and torch.cuda.is_available() else "cpu"
    for name, run_dir in runs.items():
        emit_rows(a, device, bias, name, variants[name], run_dir)
    print(f"wall {time.perf_counter() - t:.0f} s")


def hold_gpu_memory(gpus: int, gib: float, args: list[str]) -> subprocess.Popen:
    """A process that holds all but `gib` GiB of each of the first `gpus` GPUs until it is killed; the
    rollout's gpu_memory_utilization in `args` (a share of the imitated GPU) becomes the same number of
    bytes as a share of the real one."""
    import torch
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    if gib >= total:
        raise SystemExit(f"--gpu-gib {gib} is not below this GPU's {total:.1f} GiB")
    key = "actor_rollout_ref.rollout.gpu_memory_utilization="
    i = max(i for i, arg in enumerate(args) if arg.startswith(key))   # the last one given wins, as in Hydra
    args[i] = f"{key}{float(args[i].removeprefix(key)) * gib / total:.4f}"
    code = ("import time, torch\n"
            f"held = [torch.empty(int(({total} - {gib}) * 2**30), dtype=torch.uint8, device=f'cuda:{{i}}') "
            f"for i in range({gpus})]\n"
            "print('held', flush=True)\ntime.sleep(1e9)\n")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    if holder.stdout.readline().strip() != "held":
        raise SystemExit("the process holding GPU memory for --gpu-gib failed; see the log above")
    print(f"imitating {gib} GiB GPUs: {total - gib:.1f} GiB of each held; {args[i]}", flush=True)
    return holder


def emit_rows(a, device: str, bias: dict, variant: str | None, keys: list[str], run_dir: Path) -> None:
    """One row per step of the run in `run_dir` (`variant`: its name, None without one; `keys`: its own)."""
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        phases = {k.removeprefix("timing_s/"): round(v, 3) for k, v in row.items() if k.startswith("timing_s/")}
        out = {"device": device, "shape": a.shape, "gpus": a.gpus, "prompts": a.prompts, "n": a.n,
               "mini_batches": a.mini_batches,
               "search_every": a.search_every, "tag_bias": bias or None, "overrides": a.overrides,
               **({} if variant is None else {"variant": variant, "variant_keys": keys}),
               **({} if a.gpu_gib is None else {"gpu_gib": a.gpu_gib}),
               **({"rollout_ahead_steps": int(variant.removeprefix("ahead")),
                   "rollout_gpus": a.rollout_gpus if variant != "ahead0" else 0} if a.ahead else {}),
               "step": row["step"], "phases_s": phases,
               **{k: round(row[k], 4) for k in ("reward/mean", "grad_norm", "kl_loss", "response/length",
                                                 "agent/searches", "agent/turns", "agent/retrieval_s",
                                                 "agent/finish_length", "rollout/done_s_p50", "rollout/done_s_p90",
                                                 "rollout/done_s_max",
                                                 "response/observation_tokens",
                                                 "throughput/generated_tokens_per_s",
                                                 "throughput/train_tokens_per_s", "throughput/mfu_actor_update",
                                                 "rollout_is_mean", "rollout_is_kl", "rollout_is_truncated",
                                                 "rollout/staleness", "rollout/generate_s")
                  if k in row},
               **{k: round(v, 2) for k, v in row.items() if k.startswith(("memory/", "critic/memory/"))}}
        emit_row(out, a.out)


if __name__ == "__main__":
    main()
