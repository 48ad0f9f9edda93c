"""`write_report`: the page of one run: its header, the stages' EM, the training curves, the evaluation
tables, the time per phase and the sample trajectories."""
from __future__ import annotations

import math
import time
from html import escape
from pathlib import Path

from search_r1.report.charts import PALETTE, bar_cell, cycle, fmt, legend_html, line_chart, nice_step
from search_r1.report.read import get_dotted, is_number, read_json, read_metrics, read_yaml, series
from search_r1.report.style import CSS, JS
from search_r1.report.trajectories import samples_section

MAX_BARS = 150             # more steps than this are averaged in buckets in the timing chart

# Each chart: title and the metric keys it draws; a key ending in "*" takes every key with that prefix.
CHARTS = [
    ("Reward", ["reward/mean", "reward/em", "val/reward/em"]),
    ("Training EM by data source", ["reward/em/*"]),
    ("Validation EM by data source", ["val/reward/em/*"]),
    ("Response length (tokens)", ["response/length", "response/model_tokens", "response/observation_tokens"]),
    ("Searches and turns per trajectory", ["agent/searches", "agent/turns", "val/agent/searches"]),
    ("Validation by hop count: EM and searches", ["val/em_by_hops/*", "val/searches_by_hops/*"]),
    ("How trajectories end (fraction)", ["agent/finish_*"]),
    ("KL", ["kl_loss", "kl/reward_kl", "approx_kl"]),
    ("Entropy", ["entropy"]),
    ("Policy loss", ["pg_loss"]),
    ("Gradient norm", ["grad_norm"]),
    ("Learning rate", ["lr"]),
    ("Throughput (tokens/s)", ["throughput/generated_tokens_per_s", "throughput/train_tokens_per_s"]),
]
# Training phases in the order they run (ppo_trainer.train_step); "other" is step time they leave over.
PHASES = ["rollout", "reward", "old_log_probs", "ref_log_probs", "values", "advantages",
          "update_critic", "update_actor", "weight_sync", "other", "validation"]
PHASE_COLOURS = ["#30638e", "#edae49", "#00798c", "#66a182", "#8e6c8a", "#c9a227", "#e07a5f",
                 "#d1495b", "#3d405b", "#bdbdbd", "#9bc53d"]

# Metric columns of the evaluation tables, in this order; others follow.
EVAL_METRICS = ["em", "f1", "cover_em", "answer_rate", "valid_format", "searches", "turns", "response_tokens"]


def write_report(run_dir, out=None) -> Path:
    """Write the report of `run_dir` to `out` (default `<run_dir>/report.html`) and return its path."""
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise FileNotFoundError(f"{metrics_path} does not exist: give the trainer's output directory "
                                f"(trainer.default_local_dir), with trainer.logger including jsonl")
    rows = read_metrics(metrics_path)
    config = read_yaml(run_dir / "config.yaml")
    body = [_header(run_dir, config, rows), _stages_section(run_dir), _charts_section(rows),
            _eval_section(run_dir), _timing_section(rows), samples_section(run_dir / "samples")]
    title = escape(f"Search-R1 report: {get_dotted(config, 'trainer.experiment_name') or run_dir.name}")
    page = (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{title}</title>"
            f"<style>{CSS}</style></head>\n<body>\n{''.join(body)}<script>{JS}</script>\n</body></html>\n")
    out = Path(out) if out else run_dir / "report.html"
    out.write_text(page, encoding="utf-8")
    return out


# -- header ----------------------------------------------------------------------------------------

def _header(run_dir: Path, config: dict, rows: list[dict]) -> str:
    def when(t):
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(t)) if isinstance(t, (int, float)) else "unknown"

    times = [r["time"] for r in rows if isinstance(r.get("time"), (int, float))]
    last_step = rows[-1]["step"] if rows else 0
    total = get_dotted(config, "trainer.total_training_steps")
    facts = [
        ("experiment", get_dotted(config, "trainer.experiment_name") or run_dir.name),
        ("project", get_dotted(config, "trainer.project_name") or "unknown"),
        ("model", get_dotted(config, "actor_rollout_ref.model.path") or "unknown (no config.yaml)"),
        ("estimator", get_dotted(config, "algorithm.adv_estimator") or "unknown"),
        ("prompts per step × samples", f"{get_dotted(config, 'data.train_batch_size') or '?'} × "
                                       f"{get_dotted(config, 'actor_rollout_ref.rollout.n_agent') or '?'}"),
        ("steps", f"{last_step}" + (f" of {total}" if total else "")),
        ("run", f"{when(min(times)) if times else 'unknown'} – {when(max(times)) if times else 'unknown'}"),
        ("report written", when(time.time())),
    ]
    out = [f"<header><h1>{escape(str(facts[0][1]))}</h1><dl>"]
    out += [f"<dt>{escape(k)}</dt><dd>{escape(str(v))}</dd>" for k, v in facts[1:]]
    out.append("</dl>")
    if not rows:
        out.append('<p class="note">metrics.jsonl has no rows yet: the run has not finished a step.</p>')
    else:
        latest = []
        stages, _ = _stages(run_dir)
        if len(stages) > 1 and all(is_number(s.get("em")) for s in stages):
            questions = stages[0].get("questions")
            latest.append("EM " + " → ".join(f"{s.get('stage', '?')} {s['em']:.3f}" for s in stages) +
                          (f" on {questions} test questions" if questions else ""))
        for key, label in [("val/reward/em", "validation EM"), ("reward/mean", "training reward (sampled)"),
                           ("reward/em", "training EM (sampled)")]:
            s = series(rows, key)
            if s:
                best = max(s, key=lambda p: p[1])
                latest.append(f"{label} {s[-1][1]:.3f} at step {s[-1][0]} (best {best[1]:.3f} at step {best[0]})")
        steps = [v for _, v in series(rows, "timing_s/step")]
        if steps:
            latest.append(f"{sum(steps) / len(steps):.1f} s per step")
        if latest:
            out.append("".join(f'<p class="latest">{escape(line)}</p>' for line in latest))
    return "".join(out) + "</header>\n"


# -- charts ----------------------------------------------------------------------------------------

def _charts_section(rows: list[dict]) -> str:
    all_keys = sorted({k for r in rows for k in r})
    figures = []
    for title, wanted in CHARTS:
        keys = [k for w in wanted for k in (
            [k for k in all_keys if k.startswith(w[:-1])] if w.endswith("*") else [w])]
        lines = {k: s for k in keys if (s := series(rows, k))}
        if not lines:
            continue
        legend = legend_html([(f"{k} (last {fmt(s[-1][1])})", c) for (k, s), c in zip(lines.items(), cycle(PALETTE))])
        figures.append(f"<figure><figcaption>{escape(title)}</figcaption>{line_chart(lines)}{legend}</figure>")
    if not figures:
        return '<section><h2>Training curves</h2><p class="note">No metrics logged yet.</p></section>\n'
    return f'<section><h2>Training curves</h2><div class="grid">{"".join(figures)}</div></section>\n'


def _timing_section(rows: list[dict]) -> str:
    steps = []
    for r in rows:
        t = {k[len("timing_s/"):]: float(v) for k, v in r.items()
             if k.startswith("timing_s/") and isinstance(v, (int, float)) and math.isfinite(v)}
        total = t.pop("step", None)
        if total is not None:  # driver time the named phases do not cover
            t["other"] = max(0.0, total - sum(v for k, v in t.items() if k != "validation"))
        if t:
            steps.append((r["step"], t))
    head = "<section><h2>Time per phase</h2>"
    if not steps:
        return head + '<p class="note">No timing metrics logged yet.</p></section>\n'
    phases = [p for p in PHASES if any(p in t for _, t in steps)]
    phases += sorted({p for _, t in steps for p in t} - set(phases))
    extra = cycle(PALETTE)  # phases a newer trainer may add
    colours = {p: PHASE_COLOURS[PHASES.index(p)] if p in PHASES else next(extra) for p in phases}

    per_bar = math.ceil(len(steps) / MAX_BARS)
    bars = []
    for i in range(0, len(steps), per_bar):
        chunk = steps[i:i + per_bar]
        bars.append((chunk[0][0], chunk[-1][0],
                     {p: sum(t.get(p, 0.0) for _, t in chunk) / len(chunk) for p in phases}))
    width, height, left, bottom, top = 820, 220, 50, 22, 8
    ymax = max(sum(b.values()) for _, _, b in bars) or 1.0
    ystep = nice_step(ymax)
    ymax = math.ceil(ymax / ystep) * ystep
    pw, ph = width - left - 10, height - top - bottom
    bw = min(pw / len(bars), 60)   # a few steps must not make wall-wide bars
    parts = [f'<svg class="chart" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">']
    for i in range(round(ymax / ystep) + 1):
        y = top + ph - i * ystep / ymax * ph
        parts.append(f'<line class="grid" x1="{left}" x2="{width - 10}" y1="{y:.1f}" y2="{y:.1f}"/>'
                     f'<text class="ylab" x="{left - 4}" y="{y + 3:.1f}">{fmt(i * ystep)} s</text>')
    label_every = max(1, len(bars) // 10)
    for i, (first, last, seconds) in enumerate(bars):
        x, base = left + i * bw, top + ph
        for p in phases:
            h = seconds[p] / ymax * ph
            if h > 0:
                span = f"step {first}" if first == last else f"steps {first}–{last} (mean)"
                parts.append(f'<rect class="bar" data-phase="{escape(p)}" x="{x + 0.1 * bw:.1f}" y="{base - h:.1f}" '
                             f'width="{0.8 * bw:.1f}" height="{h:.1f}" fill="{colours[p]}">'
                             f"<title>{escape(span)}: {escape(p)} {seconds[p]:.2f} s</title></rect>")
                base -= h
        if i % label_every == 0:
            parts.append(f'<text class="xlab" x="{x + bw / 2:.1f}" y="{height - 6}">{first}</text>')
    parts.append("</svg>")
    note = f"<p class=\"note\">Each bar is the mean of {per_bar} steps.</p>" if per_bar > 1 else ""

    # Validation runs only every few steps (and alone at step 0), so every mean is over the steps where
    # the phase ran, and shares are of a training step without validation.
    train = [sum(v for k, v in t.items() if k != "validation") for _, t in steps]
    train = [v for v in train if v > 0]
    mean_step = sum(train) / len(train) if train else 0.0
    table = ["<table><tr><th>phase</th><th>mean s (when it ran)</th><th>steps</th><th>share of a step</th></tr>"]
    for p in phases:
        vals = [t[p] for _, t in steps if p in t]
        mean = sum(vals) / len(vals)
        share = "" if p == "validation" or not mean_step else bar_cell(mean / mean_step, colours[p])
        table.append(f"<tr><td><i class=\"sw\" style=\"background:{colours[p]}\"></i>{escape(p)}</td>"
                     f"<td class=\"num\">{mean:.2f}</td><td class=\"num\">{len(vals)}</td><td>{share}</td></tr>")
    table.append("</table>")
    return head + "".join(parts) + note + "".join(table) + "</section>\n"


# -- stages and evaluation tables --------------------------------------------------------------------

def _stages(run_dir: Path) -> tuple[list[dict], str | None]:
    """The stages of stages.json (the demo writes it: EM before, after SFT, after GRPO) and the error
    reading it; ([], None) without the file."""
    path = run_dir / "stages.json"
    if not path.is_file():
        return [], None
    data, error = read_json(path)
    if isinstance(data, dict):
        data = data.get("stages")
    return ([s for s in data if isinstance(s, dict)] if isinstance(data, list) else []), error


def _stages_section(run_dir: Path) -> str:
    if not (run_dir / "stages.json").is_file():
        return ""
    head = "<section><h2>EM after each stage</h2>"
    stages, error = _stages(run_dir)
    if error or not stages:
        return head + f'<p class="note">{escape(error or "stages.json holds no stages.")}</p></section>\n'
    columns = ["stage", "em"] + [k for k in dict.fromkeys(k for s in stages for k in s) if k not in ("stage", "em")]
    out = [head, "<table><tr>" + "".join(f"<th>{escape(str(c))}</th>" for c in columns) + "</tr>"]
    for s in stages:
        cells = []
        for c in columns:
            v = s.get(c)
            if c == "em" and is_number(v):
                cells.append(f"<td>{bar_cell(v, PALETTE[0]) if 0 <= v <= 1 else fmt(v)}</td>")
            else:
                cells.append(f'<td class="num">{fmt(v)}</td>' if is_number(v) else
                             f"<td>{escape('' if v is None else str(v))}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    return "".join(out) + "</table></section>\n"


def _numeric_leaves(data, path=()):
    """(path, value) of every number in nested dicts; lists (per-example results) are left out."""
    if isinstance(data, dict):
        for k, v in data.items():
            yield from _numeric_leaves(v, path + (str(k),))
    elif is_number(data):
        yield path, data


def _eval_section(run_dir: Path) -> str:
    # In the order they were written (the demo copies before, after SFT, after GRPO), not by name.
    files = sorted(run_dir.glob("eval_*.json"), key=lambda f: (f.stat().st_mtime_ns, f.name))
    if not files:
        return ""
    out = ["<section><h2>Evaluation</h2>"]
    for f in files:
        data, error = read_json(f)
        out.append(f"<h3>{escape(f.name)}</h3>")
        # One row per dict of numbers, e.g. per_source/nq or macro; columns are the metric names.
        table: dict[str, dict[str, float]] = {}
        for path, v in _numeric_leaves(data):
            table.setdefault("/".join(path[:-1]) or "(top level)", {})[path[-1]] = v
        if error or not table:
            out.append(f'<p class="note">{escape(error or "no numeric fields in this file.")}</p>')
            continue
        # Rows of metrics (macro, per_source/…) in a table, metric columns in EVAL_METRICS order; the
        # run's settings and speed (the file's top-level numbers) folded below it.
        settings = table.pop("(top level)", {})
        if table:
            found = list(dict.fromkeys(c for row in table.values() for c in row))
            columns = [c for c in EVAL_METRICS if c in found] + [c for c in found if c not in EVAL_METRICS]
            out.append('<table class="eval"><tr><th></th>' + "".join(f"<th>{escape(c)}</th>" for c in columns) +
                       "</tr>")
            for name, row in table.items():
                out.append(f"<tr><td>{escape(name)}</td>" + "".join(
                    f'<td class="num">{fmt(row[c]) if c in row else ""}</td>' for c in columns) + "</tr>")
            out.append("</table>")
        if settings:
            out.append("<details><summary>settings and speed</summary><table>" + "".join(
                f'<tr><td>{escape(k)}</td><td class="num">{fmt(v)}</td></tr>' for k, v in settings.items()) +
                "</table></details>")
    return "".join(out) + "</section>\n"
