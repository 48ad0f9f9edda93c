"""Reading what a run leaves in its directory: metric rows, the config, JSON files. A file missing or
half written (the run may still be going) stops no page."""
from __future__ import annotations

import json
import math
from pathlib import Path

import yaml


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


def read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):  # missing or unreadable config: the header says "unknown"
        return {}
    return data if isinstance(data, dict) else {}


def read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8")), None
    except (OSError, ValueError) as e:
        return None, f"could not read {path.name}: {e}"


def get_dotted(d: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(d, dict):
            return None
        d = d.get(part)
    return d


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
