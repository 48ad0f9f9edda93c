"""Scoring: pure functions of prediction records, and the Markdown tables in the paper's layout."""
from __future__ import annotations

from collections import defaultdict
from statistics import fmean

from search_r1.rewards import check_format, exact_match, substring_match, token_f1

# data_source -> column header of the paper's main table, in its order.
PAPER_COLUMNS = {"nq": "NQ", "triviaqa": "TriviaQA", "popqa": "PopQA", "hotpotqa": "HotpotQA",
                 "2wikimultihopqa": "2wiki", "musique": "Musique", "bamboogle": "Bamboogle"}
# valid_format: the share of responses in the Search-R1 tag format (think first, answer last,
# search and information in between; search_r1.rewards.check_format), which the original's format
# and retrieval rewards require: a model that never writes it earns none of them.
METRICS = ("em", "cover_em", "f1", "answer_rate", "valid_format", "searches", "turns", "response_tokens")


def score_record(record: dict) -> dict:
    pred, golds = record["prediction"], record["golds"]
    return {"em": exact_match(pred, golds), "cover_em": substring_match(pred, golds),
            "f1": token_f1(pred, golds), "answer_rate": float(pred is not None),
            "valid_format": float(check_format(record["response"]).valid)}


def score_predictions(records: list[dict]) -> dict:
    """Per data source means of METRICS (plus `n`), and their macro average over sources.

    Records hold data_source, golds, response, prediction (None: no answer extracted),
    searches, turns and response_tokens.
    """
    if not records:
        raise ValueError("no predictions to score: is the test data empty, or --limit 0?")
    by_source: dict[str, list[dict]] = defaultdict(list)
    by_group: dict[str, list[dict]] = defaultdict(list)   # by question kind and hop count, where recorded
    for r in records:
        row = {**score_record(r), "searches": r["searches"], "turns": r["turns"],
               "response_tokens": r["response_tokens"]}
        by_source[r["data_source"]].append(row)
        for key in ("hops", "type"):
            if r.get(key) is not None:
                by_group[f"{key}={r[key]}"].append(row)
    per_source = {source: {"n": len(rows), **{m: fmean(row[m] for row in rows) for m in METRICS}}
                  for source, rows in by_source.items()}
    macro = {m: fmean(s[m] for s in per_source.values()) for m in METRICS}
    per_group = {group: {"n": len(rows), **{m: fmean(row[m] for row in rows) for m in METRICS}}
                 for group, rows in sorted(by_group.items())}
    return {"n": len(records), "per_source": per_source, "macro": macro,
            **({"per_group": per_group} if per_group else {})}


def group_table(per_group: dict[str, dict]) -> str:
    """Markdown: EM, F1 and searches per question for each hop count and question kind."""
    lines = ["| group | n | EM | F1 | searches per question |", "|---|---:|---:|---:|---:|"]
    for group, m in per_group.items():
        lines.append(f"| {group} | {m['n']} | {m['em']:.3f} | {m['f1']:.3f} | {m['searches']:.2f} |")
    return "\n".join(lines) + "\n"


def paper_table(rows: list[tuple[str, str, dict[str, float]]]) -> str:
    """Markdown table in the layout of the paper's main table.

    Rows are (method, metric, {data_source: value}). The seven paper columns always appear ("–"
    when missing); other sources follow in order of appearance; Avg. is the mean over the sources
    the row has.
    """
    extra = [s for _, _, values in rows for s in values if s not in PAPER_COLUMNS]
    sources = list(PAPER_COLUMNS) + list(dict.fromkeys(extra))
    header = ["Method", "Metric", *[PAPER_COLUMNS.get(s, s) for s in sources], "Avg."]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method, metric, values in rows:
        cells = [f"{values[s]:.3f}" if s in values else "–" for s in sources]
        avg = f"{fmean(values.values()):.3f}" if values else "–"
        lines.append("| " + " | ".join([method.replace("|", "\\|"), metric, *cells, avg]) + " |")
    return "\n".join(lines) + "\n"
