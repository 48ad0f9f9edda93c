"""What a busy Python thread does to a stream of short tensor ops in the same process.

    python benchmarks/bench_thread_convoy.py [--ops 3000] [--intervals 0.005,0.001,0.0002] [--out FILE]

`trainer.overlap_rollout` runs the next step's agent loop in a thread of the worker's process while the
same process runs the reference pass and the update. Each tensor op gives up the GIL while it runs and
must take it back to return; a thread that holds the GIL for Python work keeps it for up to the
interpreter's switch interval (`sys.setswitchinterval`, 5 ms by default) before handing it over. A
stream of short ops, such as the kernel launches of a forward pass, then waits about one interval per
op. This script measures that effect alone: the same chain of small matmuls on the CPU, alone and
beside a thread that only runs Python, at several switch intervals. One row per measurement.
On a GPU a shorter interval for the rollout thread did not shorten the passes beside it
(benchmarks/RESULTS.md, "Overlapping the next rollout with training"), so the worker keeps Python's.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import torch


def chain_s(n_ops: int, size: int = 64) -> float:
    """Seconds for `n_ops` small matmuls (each followed by tanh, so values stay bounded)."""
    x = torch.randn(size, size)
    y = x
    start = time.perf_counter()
    for _ in range(n_ops // 2):
        y = torch.tanh(y @ x)
    return time.perf_counter() - start


def beside_busy_thread(n_ops: int, interval: float) -> float:
    stop = threading.Event()

    def python_work():
        while not stop.is_set():
            sum(range(2000))

    before = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    thread = threading.Thread(target=python_work, daemon=True)
    thread.start()
    try:
        return chain_s(n_ops)
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(before)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", type=int, default=3000, help="tensor ops in the chain")
    p.add_argument("--intervals", default="0.005,0.001,0.0002", help="switch intervals in seconds (0.005: Python's)")
    p.add_argument("--quick", action="store_true", help="300 ops, one interval (1 ms)")
    p.add_argument("--out", help="append the rows to this JSONL file")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    n_ops, intervals = (300, [0.001]) if a.quick else (a.ops, [float(s) for s in a.intervals.split(",")])
    chain_s(n_ops)   # warm-up
    alone = chain_s(n_ops)
    rows = [{"ops": n_ops, "busy_thread": False, "switch_interval_s": sys.getswitchinterval(), "s": alone}]
    for interval in intervals:
        t = beside_busy_thread(n_ops, interval)
        rows.append({"ops": n_ops, "busy_thread": True, "switch_interval_s": interval, "s": t,
                     "slowdown": t / alone})
    for row in rows:
        print(json.dumps(row))
    if a.out:
        with open(a.out, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
