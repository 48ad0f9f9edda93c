"""`write_comparison`: several runs on one page, their curves side by side; runs named SETTING-s1,
SETTING-s2, … are seeds of one setting."""
from __future__ import annotations

import math
import re
import statistics
from html import escape
from pathlib import Path

from search_r1.report.charts import PALETTE, cycle, legend_html, line_chart
from search_r1.report.read import read_json, read_metrics, series
from search_r1.report.style import CSS


# The comparison of several runs: one chart per metric, one line per run.
COMPARE = [("Validation EM", "val/reward/em"), ("Training reward (sampled)", "reward/mean"),
           ("Groups with all-equal rewards (no GRPO signal)", "reward/flat_groups"),
           ("Searches per trajectory", "agent/searches"),
           ("Searches per two-hop question (validation)", "val/searches_by_hops/2"),
           ("Answer rate", "agent/finish_answer"),
           ("Entropy", "entropy"), ("KL to the reference", "kl_loss"), ("Response length (tokens)", "response/length")]


def write_comparison(run_dirs, out=None) -> Path:
    """One page with the runs' curves side by side (each run's name is its directory's) and a table
    of where each ended; runs named SETTING-s1, SETTING-s2, … are seeds of one setting: one colour, and
    a table of the setting's mean ± standard error. The default `out` is compare.html next to the
    first run."""
    runs = {}
    for d in map(Path, run_dirs):
        if not (d / "metrics.jsonl").is_file():
            raise FileNotFoundError(f"{d / 'metrics.jsonl'} does not exist: give trainer output directories")
        runs[d.name] = (d, read_metrics(d / "metrics.jsonl"))
    if len(runs) < len(run_dirs):
        raise ValueError("two of the runs have the same directory name: the comparison names runs by it")
    settings = {name: setting_and_seed(name)[0] for name in runs}
    by_setting = {setting: [n for n in runs if settings[n] == setting] for setting in dict.fromkeys(settings.values())}
    setting_colours = dict(zip(by_setting, cycle(PALETTE)))   # seeds of one setting share its colour
    colours = {name: setting_colours[settings[name]] for name in runs}
    rows = ["<tr><th>run</th><th>steps</th><th>validation EM: first → last (best)</th><th>final evaluation EM</th>"
            "<th>rollbacks</th></tr>"]
    for name, (d, metrics) in runs.items():
        val = series(metrics, "val/reward/em")
        trained = [r for r in metrics if "reward/mean" in r]
        evaluation, _ = read_json(d / "eval" / "eval_search.json")   # where bench_learning.py puts it
        final = (f"{evaluation['macro']['em']:.3f} on {evaluation.get('n', '?')}"
                 if isinstance(evaluation, dict) and "macro" in evaluation else "–")
        curve = (f"{val[0][1]:.3f} → {val[-1][1]:.3f} ({max(v for _, v in val):.3f})" if val else "–")
        rollbacks = max((r.get("health/rollbacks", 0) for r in metrics), default=0)
        rows.append(f'<tr><td><i class="sw" style="background:{colours[name]}"></i>{escape(name)}</td>'
                    f'<td class="num">{len(trained)}</td><td class="num">{curve}</td><td class="num">{final}</td>'
                    f'<td class="num">{rollbacks:g}</td></tr>')
    figures = []
    for title, key in COMPARE:
        lines = {name: s for name, (_, metrics) in runs.items() if (s := series(metrics, key))}
        if lines:
            figures.append(f"<figure><figcaption>{escape(title)} <code>{escape(key)}</code></figcaption>"
                           f"{line_chart(lines, colours=colours)}</figure>")
    legend = legend_html([(f"{setting} ({len(names)} runs)" if len(names) > 1 else names[0], setting_colours[setting])
                          for setting, names in by_setting.items()])
    settings_table = _settings_table(runs, by_setting) if len(by_setting) < len(runs) else ""
    page = (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>Search-R1: "
            f"{len(runs)} runs compared</title><style>{CSS}</style></head>\n<body>\n<header><h1>{len(runs)} runs "
            f"compared</h1></header>\n<section><h2>Where each run ended</h2><table>{''.join(rows)}</table></section>\n"
            f"{settings_table}"
            f'<section><h2>Curves</h2>{legend}<div class="grid">{"".join(figures)}</div></section>\n</body></html>\n')
    out = Path(out) if out else Path(run_dirs[0]).resolve().parent / "compare.html"
    out.write_text(page, encoding="utf-8")
    return out


def setting_and_seed(run_name: str) -> tuple[str, str | None]:
    """Runs named SETTING-s1, SETTING-s2, … are seeds of SETTING; any other name is a setting of its own."""
    m = re.fullmatch(r"(.+)-s(\d+)", run_name)
    return (m[1], m[2]) if m else (run_name, None)


def mean_se(values: list[float]) -> str:
    """Mean ± standard error of the mean ("0.739 ± 0.103"); a single value as it is."""
    if len(values) < 2:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values) / math.sqrt(len(values)):.3f}"


def _settings_table(runs: dict, by_setting: dict[str, list[str]]) -> str:
    """Seeds of a setting together: their last validation EM and final evaluation EM, mean ± s.e."""
    rows = ["<tr><th>setting</th><th>runs</th><th>last validation EM</th><th>final evaluation EM</th></tr>"]
    for setting, names in by_setting.items():
        last_val, final = [], []
        for name in names:
            d, metrics = runs[name]
            if val := series(metrics, "val/reward/em"):
                last_val.append(val[-1][1])
            evaluation, _ = read_json(d / "eval" / "eval_search.json")
            if isinstance(evaluation, dict) and "macro" in evaluation:
                final.append(float(evaluation["macro"]["em"]))
        rows.append(f"<tr><td>{escape(setting)}</td><td class=\"num\">{len(names)}</td>"
                    f"<td class=\"num\">{mean_se(last_val) if last_val else '–'} ({len(last_val)})</td>"
                    f"<td class=\"num\">{mean_se(final) if final else '–'} ({len(final)})</td></tr>")
    return (f"<section><h2>By setting (runs named SETTING-sN are its seeds; mean ± standard error)</h2>"
            f"<table>{''.join(rows)}</table></section>\n")
