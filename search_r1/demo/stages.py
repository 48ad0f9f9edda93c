"""The stages, each run as its own process: `run` (a stage's output into its log, the demo stopped
with the log's end when it fails), the index, the retrieval server, an evaluation, and the files
the report reads after GRPO (the final model's samples, the learning curve)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from search_r1.compat import trainer_env
from search_r1.demo.presets import Preset, eval_args
from search_r1.demo.progress import StepWatch, say


def run(cmd: list, log: Path | None, watch: StepWatch | None = None, every_s: float = 60):
    """Run one stage, its output into `log` (None: streaming to ours); stop the demo if it fails,
    with the end of its log. `watch`: a progress line, printed at most every `every_s` seconds."""
    cmd = [str(c) for c in cmd]
    if log is None:
        print("$ " + " ".join(cmd), flush=True)
        out = None
    else:
        log.parent.mkdir(parents=True, exist_ok=True)
        out = open(log, "w")
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
    proc = None
    try:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None, env=trainer_env())
        last = time.time()
        while True:
            try:
                proc.wait(timeout=5)
                break
            except subprocess.TimeoutExpired:
                line = watch() if watch else None   # every poll, so steps are timed to the poll
                if line and time.time() - last >= every_s:
                    say(line)
                    last = time.time()
    except BaseException:   # Ctrl-C or the demo's own termination: the stage goes with it
        if proc is not None:
            proc.kill()
        raise
    finally:
        if out:
            out.close()
    if proc.returncode:
        if log is not None:
            print("".join(log.read_text(errors="replace").splitlines(keepends=True)[-40:]), file=sys.stderr)
        where = f"; its output is in {log}" if log is not None else ""
        raise SystemExit(f"demo stage failed (exit {proc.returncode}): {' '.join(cmd[:4])} …{where}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(retriever_args: list, log_path: Path) -> tuple[subprocess.Popen, str]:
    import httpx
    port = free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "search_r1.cli", "serve", *map(str, retriever_args),
                             "--port", str(port)],
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


def build_index(kind: str, corpus: Path, out: Path, log: Path | None) -> list:
    """Index the corpus once (a finished index is reused); return the server's retriever flags."""
    if kind == "bm25":
        from search_r1.retrieval.bm25 import META_FILE
        index = out / "bm25"
        if not (index / META_FILE).exists():  # written last: its absence means no or a cut build
            run([sys.executable, "-m", "search_r1.cli", "index", "build", "--type", "bm25",
                 "--corpus_path", corpus, "--out", index], log)
        return ["--retriever_name", "bm25", "--index_path", index, "--corpus_path", corpus]
    from search_r1.retrieval.models import resolve_model
    try:
        resolve_model("all-MiniLM-L6-v2")
    except FileNotFoundError as e:
        raise SystemExit(f"{e}, or run the demo with `--retriever bm25`") from None
    index = out / "index"
    meta = index / "index_meta.json"
    if not meta.exists() or '"complete": true' not in meta.read_text():
        run([sys.executable, "-m", "search_r1.cli", "index", "build", "--corpus_path", corpus,
             "--out", index, "--retriever_model", "all-MiniLM-L6-v2"], log)
    return ["--retriever_name", "minilm", "--retriever_model", "all-MiniLM-L6-v2", "--index_path", index,
            "--corpus_path", corpus]


def evaluate(model: Path, data: Path, url: str, out: Path, size: Preset, label: str, log: Path | None,
             protocol: str = "tags") -> dict:
    run([sys.executable, "-m", "search_r1.cli", "eval", *eval_args(model, data, url, out, size, protocol)], log)
    result = json.loads((out / "eval_search.json").read_text())
    em, n = float(result["macro"]["em"]), int(result["n"])
    # How the policy behaves beside how often it is right: a policy that searches and never answers
    # (a reward it learned to collect without answering) shows here, not in EM alone.
    answered, searches = float(result["macro"]["answer_rate"]), float(result["macro"]["searches"])
    say(f"{label}: exact match {em:.3f} on {n} test questions ({answered:.0%} answered, "
        f"{searches:.2f} searches a question)")
    return {"stage": label, "em": em, "questions": n, "answer_rate": answered, "searches": searches}


def final_samples(predictions: Path, dest: Path) -> None:
    """The final model's evaluation as trajectories for the report (the trainer's own samples are
    its validations, the last of which may come before the last step)."""
    rows = [json.loads(line) for line in predictions.read_text(encoding="utf-8").splitlines() if line.strip()]
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps({"data_source": r["data_source"], "ground_truth": {"target": r["golds"]},
                                "response": r["response"], "reward": r["em"], "finish": r["finish"],
                                "searches": r["searches"], "turns": r["turns"]}, ensure_ascii=False) + "\n")


def learning_curve(run_dir: Path) -> list[dict]:
    """Validation EM per validated step from the trainer's metrics.jsonl, with the training EM
    averaged over the steps since the previous point and the minutes since step 0 was logged."""
    from search_r1.report import read_metrics
    rows = read_metrics(run_dir / "metrics.jsonl")
    curve, train_em = [], []
    for r in rows:
        if "reward/em" in r:
            train_em.append(r["reward/em"])
        if "val/reward/em" in r:
            curve.append({"step": r["step"], "val_em": r["val/reward/em"],
                          "train_em": sum(train_em) / len(train_em) if train_em else None,
                          "minutes": (r["time"] - rows[0]["time"]) / 60})
            train_em = []
    return curve
