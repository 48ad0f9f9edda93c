"""The sample trajectories of a run's page: each response split at the agent's tags, observations shaded."""
from __future__ import annotations

import json
import re
from html import escape
from pathlib import Path

from search_r1.report.charts import fmt
from search_r1.report.read import is_number

MAX_TRAJECTORIES = 48      # over all sample files shown; more makes the page slow to scroll
TAG_RE = re.compile(r"<(think|search|information|answer)>")


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
               f"reward {fmt(reward)}" if is_number(reward) else "reward ?",
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
    ok = "good" if is_number(reward) and reward > 0 else "bad"
    return (f'<details class="traj"{" open" if open_ else ""}><summary><span class="{ok}">'
            f"{escape(' · '.join(summary))}</span><span class=\"gold\">gold: "
            f"{escape(_ground_truth(t.get('ground_truth')))}</span></summary>{warn}"
            f'<div class="response">{"".join(_render_segment(k, s) for k, s in segments)}</div></details>')


def _sample_files(samples_dir: Path) -> list[Path]:
    def key(p):  # by the step in the name (val_step_12), so 12 comes after 9; files without a step (the
        m = re.search(r"(\d+)$", p.stem)  # demo's evaluation of the final model) after every step
        return (0, int(m.group(1)), p.name) if m else (1, 0, p.name)
    return sorted(samples_dir.glob("*.jsonl"), key=key)


def samples_section(samples_dir: Path) -> str:
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
        rewards = [t["reward"] for t in trajectories if is_number(t.get("reward"))]
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
