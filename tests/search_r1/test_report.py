"""The HTML run report: charts, trajectories split at tags, escaping, missing inputs, and a real
headless browser rendering the page (its screenshot must show the chart and segment colours)."""
from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import struct
import subprocess
import zlib
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from search_r1 import report
from search_r1.report import add_parser, split_segments, write_report

OBSERVATION = ('<information>Doc 1(Title: "Nairobi") Nairobi is the capital of Kenya. '
               '<script>alert("pwned")</script> https://example.org/nairobi</information>')
RESPONSE = ("<think>I need the capital of Kenya.</think>\n<search>capital of Kenya</search>\n\n"
            f"{OBSERVATION}\n\n<think>The passage says Nairobi.</think>\n<answer>Nairobi</answer>")
TRAIN_STEPS = list(range(1, 11))
VAL_STEPS = [0, 5, 10]


def trajectory(step: int, i: int) -> dict:
    mask = [1] * 12 + [0] * 30 + [1] * 9   # one observation span, like the one <information> block
    return {"step": step, "data_source": "nq" if i % 2 else "hotpotqa",
            "ground_truth": {"target": ["Nairobi", "Nairobi, Kenya"]}, "response": RESPONSE,
            "response_ids": list(range(len(mask))), "loss_mask": mask, "reward": float(i % 3 == 0),
            "turns": 2, "searches": 1, "finish": "answer", "response_tokens": len(mask), "model_tokens": 21}


def make_run(root: Path) -> Path:
    """A run directory as the trainer, the evaluation script and the demo driver leave it."""
    run = root / "run"
    (run / "samples").mkdir(parents=True)
    (run / "config.yaml").write_text(
        "trainer:\n  experiment_name: grpo-demo\n  project_name: search_r1\n  total_training_steps: 10\n"
        "actor_rollout_ref:\n  model:\n    path: Qwen/Qwen2.5-3B\n  rollout:\n    n_agent: 5\n"
        "algorithm:\n  adv_estimator: grpo\ndata:\n  train_batch_size: 8\n")
    rows = []
    for step in sorted(set(TRAIN_STEPS) | set(VAL_STEPS)):
        row = {"step": step, "time": 1.7e9 + 60 * step}
        if step in TRAIN_STEPS:
            row |= {"reward/mean": 0.1 + 0.05 * step, "reward/em": 0.08 + 0.05 * step,
                    "reward/em/nq": 0.1 + 0.04 * step, "reward/em/hotpotqa": 0.05 + 0.03 * step,
                    "response/length": 300 + 10 * step, "response/observation_tokens": 150.0,
                    "agent/searches": 1 + 0.1 * step, "agent/turns": 2 + 0.1 * step,
                    "agent/finish_answer": 0.9, "agent/finish_length": 0.1,
                    "pg_loss": -0.01 * step, "kl_loss": 0.001 * step, "entropy": 1.5 - 0.05 * step,
                    "grad_norm": math.nan if step == 3 else 0.5, "lr": 1e-6,
                    "timing_s/rollout": 30.0, "timing_s/reward": 0.5, "timing_s/old_log_probs": 4.0,
                    "timing_s/ref_log_probs": 4.0, "timing_s/advantages": 0.1, "timing_s/update_actor": 12.0,
                    "timing_s/weight_sync": 0.4, "timing_s/step": 53.0}
        if step in VAL_STEPS:
            row |= {"val/reward/em": 0.1 + 0.04 * step, "timing_s/validation": 20.0,
                    "val/em_by_hops/1": 0.5, "val/em_by_hops/2": 0.1, "val/searches_by_hops/2": 1.5}
        rows.append(json.dumps(row))
    (run / "metrics.jsonl").write_text("\n".join(rows) + '\n{"step": 11, "reward/me')  # cut while writing
    for step in VAL_STEPS:   # 10 must sort after 5 (by number, not by name)
        with open(run / "samples" / f"val_step_{step}.jsonl", "w") as f:
            f.writelines(json.dumps(trajectory(step, i)) + "\n" for i in range(30))
    (run / "eval_nq.json").write_text(json.dumps(
        {"model": "hf_actor", "gpu_memory_utilization": 0.8, "max_obs_length": 500, "generate_s": 12.5,
         "per_source": {"nq": {"n": 100, "searches": 1.2, "f1": 0.5, "em": 0.41},
                        "hotpotqa": {"n": 100, "searches": 1.9, "f1": 0.38, "em": 0.3}},
         "macro": {"em": 0.355}}))
    (run / "stages.json").write_text(json.dumps(
        [{"stage": "before", "em": 0.05}, {"stage": "after SFT", "em": 0.2},
         {"stage": "after GRPO", "em": 0.41, "steps": 10}]))
    return run


@pytest.fixture
def run_dir(tmp_path) -> Path:
    return make_run(tmp_path)


class Tags(HTMLParser):
    """Start tags with their attributes, and the text inside <script> elements."""

    def __init__(self):
        super().__init__()
        self.tags, self.scripts, self._in_script = [], [], False

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self._in_script = tag == "script"

    def handle_endtag(self, tag):
        self._in_script = False

    def handle_data(self, data):
        if self._in_script:
            self.scripts.append(data)


def parse(html: str) -> Tags:
    p = Tags()
    p.feed(html)
    return p


def polyline_points(tags: Tags, key: str) -> list[str]:
    [attrs] = [a for t, a in tags.tags if t == "polyline" and a.get("data-key") == key]
    return attrs["points"].split()


# -- content ---------------------------------------------------------------------------------------

def test_header_and_charts(run_dir):
    out = write_report(run_dir)
    assert out == run_dir / "report.html"
    html = out.read_text()
    tags = parse(html)
    assert "grpo-demo" in html and "Qwen/Qwen2.5-3B" in html and "10 of 10" in html
    # one point per logged step; NaN (grad_norm at step 3) and the half-written last line are skipped
    assert len(polyline_points(tags, "reward/mean")) == len(TRAIN_STEPS)
    assert len(polyline_points(tags, "val/reward/em")) == len(VAL_STEPS)
    for key in ["val/em_by_hops/1", "val/em_by_hops/2", "val/searches_by_hops/2"]:   # the hop-count chart
        assert len(polyline_points(tags, key)) == len(VAL_STEPS), key
    assert len(polyline_points(tags, "grad_norm")) == len(TRAIN_STEPS) - 1
    for key in ["reward/em", "reward/em/nq", "reward/em/hotpotqa", "response/length", "agent/searches",
                "agent/turns", "agent/finish_answer", "kl_loss", "entropy"]:
        assert len(polyline_points(tags, key)) == len(TRAIN_STEPS), key
    # later steps have higher reward: smaller SVG y
    ys = [float(p.split(",")[1]) for p in polyline_points(tags, "reward/mean")]
    assert ys == sorted(ys, reverse=True)
    # time per phase: one stacked bar per step, "other" = step time the phases leave over
    bars = [a for t, a in tags.tags if t == "rect" and a.get("class") == "bar"]
    assert sum(a["data-phase"] == "rollout" for a in bars) == len(TRAIN_STEPS)
    assert sum(a["data-phase"] == "validation" for a in bars) == len(VAL_STEPS)
    assert sum(a["data-phase"] == "other" for a in bars) == len(TRAIN_STEPS)
    assert "EM after each stage" in html and "after GRPO" in html
    assert "per_source/nq" in html and "macro" in html and "0.355" in html


def test_the_header_leads_with_stage_and_validation_em(run_dir):
    html = write_report(run_dir).read_text()
    lines = re.findall(r'<p class="latest">(.*?)</p>', html)
    assert lines[0] == "EM before 0.050 → after SFT 0.200 → after GRPO 0.410"
    assert lines[1].startswith("validation EM ") and "training reward (sampled)" in lines[2]


def test_evaluation_tables_show_metrics_first_and_fold_the_settings(run_dir):
    html = write_report(run_dir).read_text()
    table = re.search(r'<table class="eval">(.*?)</table>', html).group(1)
    headers = re.findall(r"<th>(.*?)</th>", table)
    assert headers[1:4] == ["em", "f1", "searches"] and "n" in headers  # the first names the rows
    assert "gpu_memory_utilization" not in table  # a setting, not a metric row or column
    folded = re.search(r"<details><summary>settings and speed</summary>(.*?)</details>", html).group(1)
    assert "gpu_memory_utilization" in folded and "generate_s" in folded


def test_the_final_models_evaluation_comes_after_every_step(run_dir):
    (run_dir / "samples" / "final_model_eval.jsonl").write_text(json.dumps(trajectory(10, 0)) + "\n")
    html = write_report(run_dir).read_text()
    options = re.findall(r'<option value="samples-\d+">(.*?)</option>', html)
    assert options[0] == "final model eval"  # the newest first, and shown


def test_trajectories_split_and_escaped(run_dir):
    html = write_report(run_dir).read_text()
    tags = parse(html)
    # oldest and newest samples only, 48 trajectories at most
    assert "val step 0" in html and "val step 10" in html and "val step 5" not in html
    assert sum(t == "details" and a.get("class") == "traj" for t, a in tags.tags) == report.MAX_TRAJECTORIES
    classes = [a.get("class") for t, a in tags.tags if t == "span"]
    for cls in ["seg seg-think", "seg seg-search", "seg seg-info", "seg seg-answer"]:
        assert classes.count(cls) >= report.MAX_TRAJECTORIES, cls
    assert classes.count("seg seg-think") == 2 * report.MAX_TRAJECTORIES
    assert "observation · not trained on" in html and "21 model / 30 observation tokens" in html
    # the observation's <script> is text, the only script element is ours, and it has no data in it
    assert "&lt;script&gt;alert(&quot;pwned&quot;)&lt;/script&gt;" in html
    assert "alert(" not in "".join(tags.scripts)
    assert sum(t == "script" for t, _ in tags.tags) == 1
    assert "gold: Nairobi | Nairobi, Kenya" in html
    # without scripts every shown step is visible; only the (useless) picker is hidden
    assert '<div class="samples" id="samples-0">' in html and '<div class="samples" id="samples-1">' in html
    assert '<label hidden id="step-picker">' in html


def test_self_contained(run_dir):
    html = write_report(run_dir).read_text()
    tags = parse(html)
    assert "https://example.org/nairobi" in html          # as text inside an observation
    for tag, attrs in tags.tags:
        assert tag not in ("link", "img", "iframe", "object", "embed"), tag
        for name, value in attrs.items():
            assert "://" not in (value or ""), (tag, name, value)
            assert name != "src", tag
    assert "@import" not in html and "url(" not in html


def test_split_segments():
    text = ("Let me check. <think>hmm</think><search>q</search>\n<information>Put a query between "
            "<search> and </search>.</information>\n<answer>cut in the middle")
    kinds = [k for k, _ in split_segments(text)]
    assert kinds == ["text", "think", "search", "text", "information", "text", "answer"]
    assert "".join(s for _, s in split_segments(text)) == text     # nothing lost, nothing added
    assert split_segments("") == []


def test_missing_pieces(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        write_report(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    html = write_report(tmp_path).read_text()
    assert "no rows yet" in html and "No metrics logged yet" in html and "No samples yet" in html
    assert "No timing metrics" in html and "<polyline" not in html
    # a run that trained but has not validated: curves, no validation line, an empty samples file
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    (tmp_path / "samples").mkdir()
    (tmp_path / "samples" / "val_step_1.jsonl").write_text("")
    (tmp_path / "eval_x.json").write_text("{not json")
    html = write_report(tmp_path, tmp_path / "other.html").read_text()
    assert len(polyline_points(parse(html), "reward/mean")) == 1
    assert 'data-key="val/reward/em"' not in html
    assert "has no trajectories" in html and "could not read eval_x.json" in html


def test_cli(run_dir, tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="search-r1")
    add_parser(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(["report", str(run_dir), "--out", str(tmp_path / "r.html")])
    args.func(args)
    assert (tmp_path / "r.html").is_file() and "r.html" in capsys.readouterr().out


def test_several_runs_are_compared_side_by_side(tmp_path, capsys):
    first = make_run(tmp_path / "a")
    second = first.parent.parent / "b" / "run-lr"
    second.mkdir(parents=True)
    rows = [{"step": 0, "val/reward/em": 0.4}, {"step": 1, "reward/mean": 0.2, "reward/flat_groups": 1.0},
            {"step": 2, "reward/mean": 0.3, "health/rollbacks": 1, "val/reward/em": 0.5}]
    (second / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (second / "eval").mkdir()
    (second / "eval" / "eval_search.json").write_text(json.dumps({"n": 375, "macro": {"em": 0.52}}))
    parser = argparse.ArgumentParser(prog="search-r1")
    add_parser(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(["report", str(first), str(second), "--out", str(tmp_path / "c.html")])
    args.func(args)
    assert "comparison written" in capsys.readouterr().out
    tags = parse((tmp_path / "c.html").read_text())
    # a line per run in each chart where the run has the metric, each run in one colour throughout
    lines = [(a["data-key"], a["stroke"], len(a["points"].split())) for t, a in tags.tags if t == "polyline"]
    assert ("run-lr", lines[0][1] if lines[0][0] == "run-lr" else lines[1][1], 2) in lines   # validation: steps 0, 2
    assert len({stroke for key, stroke, _ in lines if key == "run"}) == 1
    assert {stroke for key, stroke, _ in lines if key == "run"} != {stroke for key, stroke, _ in lines if key == "run-lr"}
    assert sum(key == "run-lr" for key, _, _ in lines) == 3   # validation EM, training reward, flat groups
    html = (tmp_path / "c.html").read_text()
    assert "0.400 → 0.500 (0.500)" in html and "0.520 on 375" in html
    with pytest.raises(ValueError, match="same directory name"):
        report.write_comparison([first, first])



def test_seeds_of_a_setting_share_a_colour_and_a_row_of_mean_and_standard_error(tmp_path):
    def run(name, val, final):
        d = tmp_path / name
        (d / "eval").mkdir(parents=True)
        rows = [{"step": 0, "val/reward/em": 0.4}, {"step": 1, "reward/mean": 0.2}, {"step": 2, "val/reward/em": val}]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (d / "eval" / "eval_search.json").write_text(json.dumps({"n": 375, "macro": {"em": final}}))
        return d
    dirs = [run("on-s1", 0.9, 0.9), run("off-s1", 0.4, 0.4), run("on-s2", 0.7, 0.6), run("on-s3", 0.5, 0.6)]
    out = report.write_comparison(dirs, tmp_path / "c.html")
    tags = parse(out.read_text())
    stroke = {}
    for t, a in tags.tags:
        if t == "polyline":
            stroke.setdefault(a["data-key"], set()).add(a["stroke"])
    assert stroke["on-s1"] == stroke["on-s2"] == stroke["on-s3"] != stroke["off-s1"]
    html = out.read_text()
    # on: validation 0.9, 0.7, 0.5 → 0.700 ± 0.115; final 0.9, 0.6, 0.6 → 0.700 ± 0.100
    assert '<td>on</td><td class="num">3</td><td class="num">0.700 ± 0.115 (3)</td><td class="num">0.700 ± 0.100 (3)</td>' in html
    assert '<td>off</td><td class="num">1</td><td class="num">0.400 (1)</td>' in html
    assert "on (3 runs)" in html
    assert report.setting_and_seed("top1-s12") == ("top1", "12") and report.setting_and_seed("ppo") == ("ppo", None)
    plain = report.write_comparison(dirs[:2][::-1][:1] + [run("other", 0.5, 0.5)], tmp_path / "p.html").read_text()
    assert "By setting" not in plain      # no setting with two runs: the page as before

# -- a real browser ----------------------------------------------------------------------------------

def read_png(path: Path) -> np.ndarray:
    """RGB pixels (H, W, 3) of an 8-bit, non-interlaced PNG, with zlib and numpy only (no PIL needed)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat = 8, b""
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and interlace == 0 and colour in (2, 6), (depth, colour, interlace)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    bpp = 3 if colour == 2 else 4
    raw = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(height, width * bpp + 1)
    out = np.zeros((height, width * bpp), np.uint8)
    prev = np.zeros(width * bpp, np.uint8)
    for y in range(height):
        kind, line = raw[y, 0], raw[y, 1:]
        if kind == 0:
            row = line.copy()
        elif kind == 1:    # Sub: a running sum per channel
            row = np.cumsum(line.reshape(width, bpp), axis=0, dtype=np.uint8).reshape(-1)
        elif kind == 2:    # Up
            row = line + prev
        else:              # Average and Paeth depend on the pixel just decoded: byte by byte
            row, cur, up = bytearray(line.tobytes()), line.tolist(), prev.tolist()
            for i in range(len(row)):
                a = row[i - bpp] if i >= bpp else 0
                if kind == 3:
                    row[i] = (cur[i] + (a + up[i]) // 2) & 255
                else:
                    c = up[i - bpp] if i >= bpp else 0
                    p = a + up[i] - c
                    pa, pb, pc = abs(p - a), abs(p - up[i]), abs(p - c)
                    pred = a if pa <= pb and pa <= pc else up[i] if pb <= pc else c
                    row[i] = (cur[i] + pred) & 255
            row = np.frombuffer(bytes(row), np.uint8)
        out[y] = prev = row
    return out.reshape(height, width, bpp)[:, :, :3]


def count_colour(pixels: np.ndarray, hex_colour: str, tolerance: int = 6) -> int:
    target = np.array([int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)], np.int16)
    return int((np.abs(pixels.astype(np.int16) - target).max(axis=2) <= tolerance).sum())


def css_colour(selector: str) -> str:
    return re.search(re.escape(selector) + r"\{background:(#[0-9a-f]{6})", report.CSS).group(1)


def colour_bands(pixels: np.ndarray, hex_colour: str, min_pixels: int = 20) -> int:
    """How many separate horizontal bands of the page show this colour (a legend swatch is one)."""
    rows = [count_colour(pixels[y:y + 1], hex_colour, tolerance=2) >= min_pixels for y in range(len(pixels))]
    return sum(1 for y, on in enumerate(rows) if on and (y == 0 or not rows[y - 1]))


# The open trajectory sits ~2,350 px down with this machine's fonts; other font sets wrap the header
# and tables differently, so the window leaves a generous margin below it.
SHOT_HEIGHT = 3600
SHOT_WIDTH = 1400  # a laptop's browser window


def run_chromium(chromium: str, tmp_path: Path, *flags: str, page: Path) -> str:
    return subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'profile'}", f"--window-size={SHOT_WIDTH},{SHOT_HEIGHT}", *flags, page.as_uri()],
        check=True, timeout=60, capture_output=True, text=True).stdout


@pytest.mark.e2e  # a Chromium process
def test_renders_in_headless_chromium(run_dir, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium); CI installs it")
    page = write_report(run_dir)
    shot = tmp_path / "report.png"
    run_chromium(chromium, tmp_path, f"--screenshot={shot}", page=page)
    pixels = read_png(shot)
    assert pixels.shape == (SHOT_HEIGHT, SHOT_WIDTH, 3)
    # The first series colour draws a line in every chart: far more pixels than its legend swatches.
    assert count_colour(pixels, report.PALETTE[0]) > 1000
    # The first trajectory of the shown step is open, so each kind of segment is on screen below the
    # legend's swatch: two bands at least (think: the legend and two thoughts).
    for selector, bands in [(".seg-think", 3), (".seg-search", 2), (".seg-info", 2), (".seg-answer", 2)]:
        assert colour_bands(pixels, css_colour(selector)) >= bands, selector
    # The script ran: the step picker is shown and only the newest step's samples are visible.
    dom = run_chromium(chromium, tmp_path, "--dump-dom", page=page)
    assert '<label id="step-picker">' in dom
    assert re.search(r'<div class="samples" id="samples-0" hidden', dom)
    assert re.search(r'<div class="samples" id="samples-1">', dom)


def test_tags_that_disagree_with_the_loss_mask_are_flagged():
    # The model wrote an <information> block itself: two blocks, one masked span.
    t = {"response": "<information>made up</information><search>q</search>\n<information>real</information>",
         "loss_mask": [1, 1, 1, 0, 0], "reward": 0.0}
    assert "did the model write the tag itself?" in report.trajectories._trajectory(0, t, open_=True)
    t["loss_mask"] = [0, 1, 1, 0, 0]
    assert "did the model write" not in report.trajectories._trajectory(0, t, open_=True)
