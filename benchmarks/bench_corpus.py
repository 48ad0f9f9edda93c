"""Corpus conversion and serving readiness at wiki-18 scale (21M passages).

Writes a synthetic JSONL corpus with wiki-18's row count and passage length (~100 words), converts
it once to the memory-mapped Arrow form, then measures what a server start pays: the time to
open it and the resident memory it adds, and the latency of fetching rows by position.

    python benchmarks/bench_corpus.py --rows 21015324 --workdir /big/disk
    python benchmarks/bench_corpus.py --quick
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

WORDS = ("the of and in to was is for as on by with he at from that his it an were are which this "
         "also be first new has had one their after its who but her two been other when there all "
         "during into school time may years more most only over city some world would where later up "
         "such used many can state about national out known university united then made").split()

PROBE = r"""
import json, os, sys, time
import numpy as np
def rss(kind="RssAnon"):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(kind)) / 1024
base = rss()
t = time.perf_counter()
from search_r1.retrieval.corpus import Corpus
c = Corpus(sys.argv[1])
opened = time.perf_counter() - t
rng = np.random.default_rng(0)
t = time.perf_counter()
for _ in range(100):
    c.get_many(rng.integers(0, len(c), 1536))
fetch = (time.perf_counter() - t) / 100
# Anonymous memory is what the process owns; file-backed pages of the map are page cache the
# kernel can drop at any time.
print(json.dumps({"rows": len(c), "open_s": round(opened, 3), "anon_rss_added_mb": round(rss() - base, 1),
                  "mapped_file_resident_mb": round(rss("RssFile"), 1),
                  "fetch_1536_rows_ms": round(fetch * 1e3, 3)}))
"""


def write_jsonl(path, rows, seed=0):
    import random
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(rows):
            text = " ".join(rng.choices(WORDS, k=100))
            f.write(json.dumps({"id": str(i), "contents": f'"Article {i % 5_000_000}"\n{text}'}) + "\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=21_015_324)
    p.add_argument("--workdir", default="outputs/bench_corpus")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out")
    a = p.parse_args(argv)
    if a.quick:
        a.rows = 20_000
    os.makedirs(a.workdir, exist_ok=True)
    jsonl = os.path.join(a.workdir, f"corpus_{a.rows}.jsonl")
    if not os.path.exists(jsonl):
        t = time.perf_counter()
        write_jsonl(jsonl + ".tmp", a.rows)
        os.replace(jsonl + ".tmp", jsonl)
        print(f"wrote {jsonl} in {time.perf_counter() - t:.0f} s", flush=True)
    from search_r1.retrieval.corpus import convert_jsonl
    t = time.perf_counter()
    arrow = convert_jsonl(jsonl, progress=False)
    convert_s = time.perf_counter() - t
    probe = subprocess.run([sys.executable, "-c", PROBE, str(arrow)], capture_output=True, text=True,
                           check=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    row = {"rows": a.rows, "jsonl_gb": round(os.path.getsize(jsonl) / 1e9, 2),
           "arrow_gb": round(os.path.getsize(arrow) / 1e9, 2), "convert_s": round(convert_s, 1),
           **json.loads(probe.stdout)}
    print(json.dumps(row))
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
