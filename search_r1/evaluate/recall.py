"""`search-r1 eval-retrieval`: answer recall@k of a retrieval server; and `retrieve`, many queries
asked of it in chunks (the rag mode's passages too)."""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from statistics import fmean

from search_r1.evaluate.questions import load_questions
from search_r1.evaluate.scoring import paper_table
from search_r1.rewards import substring_match


def retrieve(queries: list[str], url: str, topk: int, chunk: int = 1024) -> list[list[dict]]:
    from tqdm import tqdm

    from search_r1.retrieval.client import RetrievalClient, RetrieverConfig

    with RetrievalClient(RetrieverConfig(url=url, topk=topk)) as client:
        hits = []
        for lo in tqdm(range(0, len(queries), chunk), desc="retrieving", unit="batch",
                       disable=len(queries) <= chunk):
            hits += client.retrieve(queries[lo:lo + chunk], topk)
    return hits


def run_retrieval_eval(data: list[str], retriever_url: str, topks: list[int], out: str,
                       limit: int | None = None, label: str = "retriever") -> dict:
    """Answer recall@k per data source (macro-averaged too); writes eval_retrieval.json/.md."""
    if not topks or min(topks) < 1:
        raise ValueError(f"--topk {topks}: give positive integers, e.g. 1,3,5")
    topks = sorted(set(topks))
    questions = load_questions(data, limit)
    hits = retrieve([q.question for q in questions], retriever_url, topks[-1])
    found: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for q, passages in zip(questions, hits):
        # The rank of the first passage holding a gold answer (inf when none does).
        first = next((rank for rank, h in enumerate(passages, 1)
                      if substring_match(h.get("document", h)["contents"], q.golds)), float("inf"))
        for k in topks:
            found[q.data_source][k].append(float(first <= k))
    per_source = {source: {"n": len(by_k[topks[0]]), **{f"recall@{k}": fmean(by_k[k]) for k in topks}}
                  for source, by_k in found.items()}
    macro = {f"recall@{k}": fmean(s[f"recall@{k}"] for s in per_source.values()) for k in topks}
    result = {"retriever": label, "retriever_url": retriever_url, "data": data, "limit": limit,
              "topk": topks, "n": len(questions), "per_source": per_source, "macro": macro}
    Path(out).mkdir(parents=True, exist_ok=True)
    Path(out, "eval_retrieval.json").write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    table = paper_table([(label, f"recall@{k}", {s: m[f"recall@{k}"] for s, m in per_source.items()})
                         for k in topks])
    Path(out, "eval_retrieval.md").write_text(table)
    print(table)
    return result
