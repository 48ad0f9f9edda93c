"""`search-r1 report RUN_DIR`: one self-contained HTML page about a training run.

Reads what the trainer writes into its output directory (`metrics.jsonl`, `samples/*.jsonl`,
`config.yaml`) and, when present, `eval_*.json` and `stages.json` from the evaluation scripts and
demo driver. The page draws its charts as inline SVG and carries its own CSS and a few lines of
JavaScript (only to switch between sample steps), so it opens offline, can be mailed or attached
to an issue, and shows everything with scripts disabled too.

Trajectories are split at the agent's tags. `<information>` blocks are exactly the observation
tokens the environment appended (loss_mask 0), so they are shaded and labelled as not trained on.
"""
from __future__ import annotations

import json
import math
import re
import statistics
import time
from html import escape
from pathlib import Path

import yaml

MAX_TRAJECTORIES = 48      # over all sample files shown; more makes the page slow to scroll
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
# Strong colours for lines; the first one is also what the browser test looks for.
PALETTE = ["#d1495b", "#00798c", "#edae49", "#30638e", "#66a182", "#8e6c8a", "#e07a5f", "#3d405b"]
# Training phases in the order they run (ppo_trainer.train_step); "other" is step time they leave over.
PHASES = ["rollout", "reward", "old_log_probs", "ref_log_probs", "values", "advantages",
          "update_critic", "update_actor", "weight_sync", "other", "validation"]
PHASE_COLOURS = ["#30638e", "#edae49", "#00798c", "#66a182", "#8e6c8a", "#c9a227", "#e07a5f",
                 "#d1495b", "#3d405b", "#bdbdbd", "#9bc53d"]
TAG_RE = re.compile(r"<(think|search|information|answer)>")


# The comparison of several runs: one chart per metric, one line per run.
COMPARE = [("Validation EM", "val/reward/em"), ("Training reward (sampled)", "reward/mean"),
           ("Groups with all-equal rewards (no GRPO signal)", "reward/flat_groups"),
           ("Searches per trajectory", "agent/searches"),
           ("Searches per two-hop question (validation)", "val/searches_by_hops/2"),
           ("Answer rate", "agent/finish_answer"),
           ("Entropy", "entropy"), ("KL to the reference", "kl_loss"), ("Response length (tokens)", "response/length")]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("report", help="write an HTML report of a training run, or compare several")
    p.add_argument("run_dir", nargs="+", help="the trainer's output directory (trainer.default_local_dir); several: "
                   "their curves side by side (directories named SETTING-s1, SETTING-s2, …: seeds of one "
                   "setting, drawn in one colour, with the setting's mean ± standard error)")
    p.add_argument("--out", help="HTML file to write (default: RUN_DIR/report.html; for several runs, compare.html "
                                 "in the first one's parent directory)")
    p.set_defaults(func=_cli)


def _cli(args) -> None:
    if len(args.run_dir) == 1:
        print(f"report written to {write_report(args.run_dir[0], args.out)}")
    else:
        print(f"comparison written to {write_comparison(args.run_dir, args.out)}")


def write_report(run_dir, out=None) -> Path:
    """Write the report of `run_dir` to `out` (default `<run_dir>/report.html`) and return its path."""
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise FileNotFoundError(f"{metrics_path} does not exist: give the trainer's output directory "
                                f"(trainer.default_local_dir), with trainer.logger including jsonl")
    rows = read_metrics(metrics_path)
    config = _read_yaml(run_dir / "config.yaml")
    body = [_header(run_dir, config, rows), _stages_section(run_dir), _charts_section(rows),
            _eval_section(run_dir), _timing_section(rows), _samples_section(run_dir / "samples")]
    title = escape(f"Search-R1 report: {_get(config, 'trainer.experiment_name') or run_dir.name}")
    page = (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{title}</title>"
            f"<style>{CSS}</style></head>\n<body>\n{''.join(body)}<script>{JS}</script>\n</body></html>\n")
    out = Path(out) if out else run_dir / "report.html"
    out.write_text(page, encoding="utf-8")
    return out


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
    setting_colours = dict(zip(by_setting, _cycle(PALETTE)))   # seeds of one setting share its colour
    colours = {name: setting_colours[settings[name]] for name in runs}
    rows = ["<tr><th>run</th><th>steps</th><th>validation EM: first → last (best)</th><th>final evaluation EM</th>"
            "<th>rollbacks</th></tr>"]
    for name, (d, metrics) in runs.items():
        val = series(metrics, "val/reward/em")
        trained = [r for r in metrics if "reward/mean" in r]
        evaluation, _ = _read_json(d / "eval" / "eval_search.json")   # where bench_learning.py puts it
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
    legend = _legend([(f"{setting} ({len(names)} runs)" if len(names) > 1 else names[0], setting_colours[setting])
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
            evaluation, _ = _read_json(d / "eval" / "eval_search.json")
            if isinstance(evaluation, dict) and "macro" in evaluation:
                final.append(float(evaluation["macro"]["em"]))
        rows.append(f"<tr><td>{escape(setting)}</td><td class=\"num\">{len(names)}</td>"
                    f"<td class=\"num\">{mean_se(last_val) if last_val else '–'} ({len(last_val)})</td>"
                    f"<td class=\"num\">{mean_se(final) if final else '–'} ({len(final)})</td></tr>")
    return (f"<section><h2>By setting (runs named SETTING-sN are its seeds; mean ± standard error)</h2>"
            f"<table>{''.join(rows)}</table></section>\n")


# -- reading ---------------------------------------------------------------------------------------

def read_metrics(path: Path) -> list[dict]:
    """Metric rows sorted by step. A line being written while we read (or cut by a crash) is skipped;
    a step logged twice (a resumed run) keeps its latest values."""
    by_step: dict[int, dict] = {}
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), (int, float)):
            row["step"] = int(row["step"])
            by_step.setdefault(row["step"], {}).update(row)
    return [by_step[s] for s in sorted(by_step)]


def series(rows: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of one metric. NaN and inf (a skipped optimizer step) are left out: one of them
    would flatten the rest of the chart."""
    return [(r["step"], float(r[key])) for r in rows
            if isinstance(r.get(key), (int, float)) and not isinstance(r[key], bool) and math.isfinite(r[key])]


def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):  # missing or unreadable config: the header says "unknown"
        return {}
    return data if isinstance(data, dict) else {}


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8")), None
    except (OSError, ValueError) as e:
        return None, f"could not read {path.name}: {e}"


def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(d, dict):
            return None
        d = d.get(part)
    return d


# -- header ----------------------------------------------------------------------------------------

def _header(run_dir: Path, config: dict, rows: list[dict]) -> str:
    def when(t):
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(t)) if isinstance(t, (int, float)) else "unknown"

    times = [r["time"] for r in rows if isinstance(r.get("time"), (int, float))]
    last_step = rows[-1]["step"] if rows else 0
    total = _get(config, "trainer.total_training_steps")
    facts = [
        ("experiment", _get(config, "trainer.experiment_name") or run_dir.name),
        ("project", _get(config, "trainer.project_name") or "unknown"),
        ("model", _get(config, "actor_rollout_ref.model.path") or "unknown (no config.yaml)"),
        ("estimator", _get(config, "algorithm.adv_estimator") or "unknown"),
        ("prompts per step × samples", f"{_get(config, 'data.train_batch_size') or '?'} × "
                                       f"{_get(config, 'actor_rollout_ref.rollout.n_agent') or '?'}"),
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
        if len(stages) > 1 and all(_is_number(s.get("em")) for s in stages):
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

def _nice_step(span: float, n: int = 4) -> float:
    raw = span / n
    mag = 10 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * (1 - 1e-9))


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def line_chart(lines: dict[str, list[tuple[int, float]]], width=380, height=160, colours: dict | None = None) -> str:
    """An SVG with one polyline per metric (points = its logged steps), axes with round ticks;
    `colours`: each line's colour by key (default: the palette in order)."""
    left, right, top, bottom = 50, 10, 8, 22
    xs = [x for pts in lines.values() for x, _ in pts]
    ys = [y for pts in lines.values() for _, y in pts]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if y1 - y0 < 1e-12 * max(1.0, abs(y0)):  # a flat line: give it room above and below
        pad = abs(y0) * 0.1 or 1.0
        y0, y1 = y0 - pad, y1 + pad
    ystep = _nice_step(y1 - y0)
    y0, y1 = math.floor(y0 / ystep) * ystep, math.ceil(y1 / ystep) * ystep
    xstep = max(1, round(_nice_step(max(x1 - x0, 1), 5)))
    pw, ph = width - left - right, height - top - bottom

    def px(x):
        return left + (pw / 2 if x1 == x0 else (x - x0) / (x1 - x0) * pw)

    def py(y):
        return top + ph - (y - y0) / (y1 - y0) * ph

    parts = [f'<svg class="chart" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">']
    for i in range(round((y1 - y0) / ystep) + 1):
        y = y0 + i * ystep
        parts.append(f'<line class="grid" x1="{left}" x2="{width - right}" y1="{py(y):.1f}" y2="{py(y):.1f}"/>'
                     f'<text class="ylab" x="{left - 4}" y="{py(y) + 3:.1f}">{_fmt(y)}</text>')
    for x in range(math.ceil(x0 / xstep) * xstep, x1 + 1, xstep):
        parts.append(f'<text class="xlab" x="{px(x):.1f}" y="{height - 6}">{x}</text>')
    for (key, pts), colour in zip(lines.items(), [colours[k] for k in lines] if colours else _cycle(PALETTE)):
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        parts.append(f'<polyline class="series" data-key="{escape(key)}" stroke="{colour}" points="{coords}">'
                     f"<title>{escape(key)}</title></polyline>")
        if len(pts) <= 60:  # dots show which steps were logged (validation runs only every few steps)
            parts += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{colour}">'
                      f"<title>{escape(key)} at step {x}: {_fmt(y)}</title></circle>" for x, y in pts]
    return "".join(parts) + "</svg>"


def _cycle(colours):
    while True:
        yield from colours


def _legend(items: list[tuple[str, str]]) -> str:
    return ('<div class="legend">' + "".join(f'<span><i style="background:{c}"></i>{escape(label)}</span>'
                                             for label, c in items) + "</div>")


def _charts_section(rows: list[dict]) -> str:
    all_keys = sorted({k for r in rows for k in r})
    figures = []
    for title, wanted in CHARTS:
        keys = [k for w in wanted for k in (
            [k for k in all_keys if k.startswith(w[:-1])] if w.endswith("*") else [w])]
        lines = {k: s for k in keys if (s := series(rows, k))}
        if not lines:
            continue
        legend = _legend([(f"{k} (last {_fmt(s[-1][1])})", c) for (k, s), c in zip(lines.items(), _cycle(PALETTE))])
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
    extra = _cycle(PALETTE)  # phases a newer trainer may add
    colours = {p: PHASE_COLOURS[PHASES.index(p)] if p in PHASES else next(extra) for p in phases}

    per_bar = math.ceil(len(steps) / MAX_BARS)
    bars = []
    for i in range(0, len(steps), per_bar):
        chunk = steps[i:i + per_bar]
        bars.append((chunk[0][0], chunk[-1][0],
                     {p: sum(t.get(p, 0.0) for _, t in chunk) / len(chunk) for p in phases}))
    width, height, left, bottom, top = 820, 220, 50, 22, 8
    ymax = max(sum(b.values()) for _, _, b in bars) or 1.0
    ystep = _nice_step(ymax)
    ymax = math.ceil(ymax / ystep) * ystep
    pw, ph = width - left - 10, height - top - bottom
    bw = min(pw / len(bars), 60)   # a few steps must not make wall-wide bars
    parts = [f'<svg class="chart" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">']
    for i in range(round(ymax / ystep) + 1):
        y = top + ph - i * ystep / ymax * ph
        parts.append(f'<line class="grid" x1="{left}" x2="{width - 10}" y1="{y:.1f}" y2="{y:.1f}"/>'
                     f'<text class="ylab" x="{left - 4}" y="{y + 3:.1f}">{_fmt(i * ystep)} s</text>')
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
        share = "" if p == "validation" or not mean_step else _bar_cell(mean / mean_step, colours[p])
        table.append(f"<tr><td><i class=\"sw\" style=\"background:{colours[p]}\"></i>{escape(p)}</td>"
                     f"<td class=\"num\">{mean:.2f}</td><td class=\"num\">{len(vals)}</td><td>{share}</td></tr>")
    table.append("</table>")
    return head + "".join(parts) + note + "".join(table) + "</section>\n"


def _bar_cell(fraction: float, colour: str) -> str:
    fraction = min(max(fraction, 0.0), 1.0)
    return (f'<span class="hbar"><i style="width:{100 * fraction:.1f}%;background:{colour}"></i></span> '
            f"{100 * fraction:.1f}%")


# -- stages and evaluation tables --------------------------------------------------------------------

def _stages(run_dir: Path) -> tuple[list[dict], str | None]:
    """The stages of stages.json (the demo writes it: EM before, after SFT, after GRPO) and the error
    reading it; ([], None) without the file."""
    path = run_dir / "stages.json"
    if not path.is_file():
        return [], None
    data, error = _read_json(path)
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
            if c == "em" and _is_number(v):
                cells.append(f"<td>{_bar_cell(v, PALETTE[0]) if 0 <= v <= 1 else _fmt(v)}</td>")
            else:
                cells.append(f'<td class="num">{_fmt(v)}</td>' if _is_number(v) else
                             f"<td>{escape('' if v is None else str(v))}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    return "".join(out) + "</table></section>\n"


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _numeric_leaves(data, path=()):
    """(path, value) of every number in nested dicts; lists (per-example results) are left out."""
    if isinstance(data, dict):
        for k, v in data.items():
            yield from _numeric_leaves(v, path + (str(k),))
    elif _is_number(data):
        yield path, data


def _eval_section(run_dir: Path) -> str:
    # In the order they were written (the demo copies before, after SFT, after GRPO), not by name.
    files = sorted(run_dir.glob("eval_*.json"), key=lambda f: (f.stat().st_mtime_ns, f.name))
    if not files:
        return ""
    out = ["<section><h2>Evaluation</h2>"]
    for f in files:
        data, error = _read_json(f)
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
                    f'<td class="num">{_fmt(row[c]) if c in row else ""}</td>' for c in columns) + "</tr>")
            out.append("</table>")
        if settings:
            out.append("<details><summary>settings and speed</summary><table>" + "".join(
                f'<tr><td>{escape(k)}</td><td class="num">{_fmt(v)}</td></tr>' for k, v in settings.items()) +
                "</table></details>")
    return "".join(out) + "</section>\n"


# -- trajectories ------------------------------------------------------------------------------------

def split_segments(text: str) -> list[tuple[str, str]]:
    """(kind, text) pieces of a response: kind is a tag name or "text" for anything between tags.
    A block runs to its own closing tag, so tags quoted inside an observation stay inside it; a block
    cut by the length limit runs to the end."""
    out, pos = [], 0
    while (m := TAG_RE.search(text, pos)) is not None:
        if m.start() > pos:
            out.append(("text", text[pos:m.start()]))
        close = f"</{m.group(1)}>"
        end = text.find(close, m.end())
        end = len(text) if end < 0 else end + len(close)
        out.append((m.group(1), text[m.start():end]))
        pos = end
    if pos < len(text):
        out.append(("text", text[pos:]))
    return out


def _masked_spans(loss_mask: list[int]) -> int:
    return sum(1 for i, m in enumerate(loss_mask) if m == 0 and (i == 0 or loss_mask[i - 1] != 0))


def _render_segment(kind: str, text: str) -> str:
    if kind == "text":
        return f'<span class="seg seg-text">{escape(text)}</span>'
    open_tag, close_tag = f"<{kind}>", f"</{kind}>"
    inner = text[len(open_tag):]
    closed = inner.endswith(close_tag)
    inner = inner[:-len(close_tag)] if closed else inner
    body = (f'<b class="tag">{escape(open_tag)}</b>{escape(inner)}'
            + (f'<b class="tag">{escape(close_tag)}</b>' if closed else '<b class="tag"> [cut]</b>'))
    if kind == "information":
        return ('<span class="seg seg-info" title="appended by the environment; loss_mask 0">'
                f'<span class="masked">observation · not trained on</span>{body}</span>')
    return f'<span class="seg seg-{kind}">{body}</span>'


def _ground_truth(gt) -> str:
    if isinstance(gt, dict) and "target" in gt:
        gt = gt["target"]
    if gt is None:
        return "?"
    if isinstance(gt, list):
        return " | ".join(str(g) for g in gt)
    return gt if isinstance(gt, str) else json.dumps(gt, ensure_ascii=False)


def _trajectory(i: int, t: dict, open_: bool) -> str:
    mask = t.get("loss_mask") or []
    model = sum(1 for m in mask if m)
    reward = t.get("reward")
    summary = [f"#{i}", str(t.get("data_source", "?")),
               f"reward {_fmt(reward)}" if _is_number(reward) else "reward ?",
               f"finish {t.get('finish', '?')}", f"searches {t.get('searches', '?')}",
               f"turns {t.get('turns', '?')}"]
    if mask:
        summary.append(f"{model} model / {len(mask) - model} observation tokens")
    segments = split_segments(str(t.get("response", "")))
    n_info = sum(kind == "information" for kind, _ in segments)
    warn = ""
    if mask and n_info != _masked_spans(mask):
        warn = (f'<p class="note">{n_info} &lt;information&gt; blocks but {_masked_spans(mask)} '
                "observation spans in loss_mask (did the model write the tag itself?): the shading "
                "follows the tags.</p>")
    ok = "good" if _is_number(reward) and reward > 0 else "bad"
    return (f'<details class="traj"{" open" if open_ else ""}><summary><span class="{ok}">'
            f"{escape(' · '.join(summary))}</span><span class=\"gold\">gold: "
            f"{escape(_ground_truth(t.get('ground_truth')))}</span></summary>{warn}"
            f'<div class="response">{"".join(_render_segment(k, s) for k, s in segments)}</div></details>')


def _sample_files(samples_dir: Path) -> list[Path]:
    def key(p):  # by the step in the name (val_step_12), so 12 comes after 9; files without a step (the
        m = re.search(r"(\d+)$", p.stem)  # demo's evaluation of the final model) after every step
        return (0, int(m.group(1)), p.name) if m else (1, 0, p.name)
    return sorted(samples_dir.glob("*.jsonl"), key=key)


def _samples_section(samples_dir: Path) -> str:
    head = "<section><h2>Sample trajectories</h2>"
    files = _sample_files(samples_dir) if samples_dir.is_dir() else []
    if not files:
        return head + ('<p class="note">No samples yet: they are written at each validation '
                       "(trainer.test_freq, with data.val_files set).</p></section>\n")
    shown = files if len(files) == 1 else [files[0], files[-1]]   # oldest and newest: before vs after
    per_file = MAX_TRAJECTORIES // len(shown)
    legend = "".join(f'<span class="swatch seg-{k}">{escape(label)}</span>' for k, label in [
        ("think", "<think>"), ("search", "<search>"), ("info", "<information> observation, not trained on"),
        ("answer", "<answer>")])
    out = [head, f'<p class="legend">{legend}</p>',
           '<p><label hidden id="step-picker">Show: <select id="sample-step">']
    out += [f'<option value="samples-{i}">{escape(f.stem.replace("_", " "))}</option>'
            for i, f in reversed(list(enumerate(shown)))]
    out.append("</select></label></p>")
    for i, f in enumerate(shown):
        trajectories = []
        for line in f.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                t = json.loads(line)
            except ValueError:
                continue
            if isinstance(t, dict):
                trajectories.append(t)
        out.append(f'<div class="samples" id="samples-{i}"><h3>{escape(f.stem.replace("_", " "))}</h3>')
        if not trajectories:
            out.append(f'<p class="note">{escape(f.name)} has no trajectories.</p></div>')
            continue
        rewards = [t["reward"] for t in trajectories if _is_number(t.get("reward"))]
        finishes: dict[str, int] = {}
        for t in trajectories:
            finishes[str(t.get("finish", "?"))] = finishes.get(str(t.get("finish", "?")), 0) + 1
        stats = [f"{len(trajectories)} trajectories (showing {min(per_file, len(trajectories))})"]
        if rewards:
            stats.append(f"mean reward {sum(rewards) / len(rewards):.3f}")
        stats.append("finish: " + ", ".join(f"{k} {v}" for k, v in sorted(finishes.items())))
        out.append(f'<p>{escape(" · ".join(stats))}</p>')
        # The first rows of every file: validation is greedy on the same questions, so the same
        # numbers in the oldest and newest step show one question before and after training.
        out += [_trajectory(j, t, j == 0) for j, t in enumerate(trajectories[:per_file])]
        out.append("</div>")
    return "".join(out) + "</section>\n"


# Metric columns of the evaluation tables, in this order; others follow.
EVAL_METRICS = ["em", "f1", "cover_em", "answer_rate", "valid_format", "searches", "turns", "response_tokens"]

CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:16px 24px;color:#222;background:#fff}
h1{margin:0 0 6px;font-size:22px} h2{font-size:17px;margin:18px 0 6px;border-bottom:1px solid #ddd}
h3{font-size:14px;margin:10px 0 4px}
header dl{display:grid;grid-template-columns:max-content 1fr;gap:0 12px;margin:0}
header dt{color:#666} header dd{margin:0}
.latest{font-weight:600} .note{color:#8a5a00;font-style:italic}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(380px,1fr));gap:6px 14px}
figure{margin:0} figcaption{font-weight:600}
.chart .grid{stroke:#e6e6e6} .chart text{font-size:10px;fill:#555}
.chart .ylab{text-anchor:end} .chart .xlab{text-anchor:middle}
.chart .series{fill:none;stroke-width:2.5;stroke-linejoin:round}
.legend{font-size:12px} .legend span{margin-right:10px;white-space:nowrap}
.legend i,i.sw{display:inline-block;width:12px;height:3px;margin-right:4px;vertical-align:middle}
table{border-collapse:collapse;margin:4px 0 8px} td,th{padding:2px 8px;border-bottom:1px solid #eee;text-align:left}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.hbar{display:inline-block;width:90px;height:9px;background:#f0f0f0;vertical-align:middle}
.hbar i{display:block;height:100%}
details.traj{border:1px solid #ddd;border-radius:4px;margin:4px 0;padding:2px 8px}
details.traj summary{cursor:pointer} .good{color:#1d6b2f} .bad{color:#a02020}
.gold{color:#666;margin-left:12px}
.response{white-space:pre-wrap;font:12px/1.5 ui-monospace,monospace;margin:6px 0}
.seg{border-radius:2px} .tag{font-weight:700;color:#444}
.seg-think{background:#fff0b3} .seg-search{background:#c9e4ff} .seg-answer{background:#c5f2cf}
.seg-info{background:#d9d4e7;color:#444}
.masked{font:italic 10px system-ui,sans-serif;background:#6b5b95;color:#fff;padding:0 4px;
  margin-right:4px;border-radius:2px}
.swatch{padding:1px 6px;margin-right:8px;font:12px ui-monospace,monospace}
"""

# Only switches which sample step is shown; without scripts every step is shown one after another.
JS = """
const pick = document.getElementById('sample-step');
if (pick) {
  const show = () => document.querySelectorAll('.samples').forEach(s => { s.hidden = s.id !== pick.value; });
  pick.addEventListener('change', show);
  document.getElementById('step-picker').hidden = false;
  show();
}
"""
