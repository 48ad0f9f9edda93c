"""What the demo says on the console while it runs: its own lines (`say`), each stage's minutes so
far with what an earlier run took from there (`Progress`), and a training stage's step and time
left, read from the metrics file it writes (`StepWatch`)."""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path


def say(message: str):
    print(f"\n\033[1m[demo {time.strftime('%H:%M:%S')}] {message}\033[0m" if sys.stdout.isatty()
          else f"\n[demo {time.strftime('%H:%M:%S')}] {message}", flush=True)


class StepWatch:
    """How far a training stage is, from the metrics file it writes a row to per step: "step k/N,
    about M min left in this stage". The time per step is measured from the rows' arrival, so the
    estimate is this machine's, and a time limit caps it. `then_s`: what the stages after this one
    will take (measured earlier in the same run), for the time left in the whole demo."""

    def __init__(self, name: str, rows: Path, total: int, first_step: int = 1, limit_s: float | None = None,
                 then_s: float | None = None):
        self.name, self.rows, self.total, self.first_step, self.limit_s = name, rows, total, first_step, limit_s
        self.then_s = then_s
        self.seen: list[float] = []   # when each step's row was first seen

    def __call__(self) -> str | None:
        try:
            rows = [json.loads(line) for line in self.rows.read_text().splitlines() if line.strip()]
        except (OSError, ValueError):   # not written yet, or a row half written
            return None
        done = sum(1 for row in rows if row.get("step", 0) >= self.first_step)
        if planned := [row["steps"] for row in rows if "steps" in row]:   # the stage's own count wins
            self.total = planned[-1]
        self.seen += [time.time()] * (done - len(self.seen))
        if len(self.seen) < 2:
            return f"{self.name} step {done}/{self.total}" if done else None
        per_step = (self.seen[-1] - self.seen[0]) / (len(self.seen) - 1)
        left = (self.total - done) * per_step
        if self.limit_s is not None:
            left = min(left, max(0.0, self.limit_s - (time.time() - self.seen[0])))
        line = f"{self.name} step {done}/{self.total}, {per_step:.0f} s a step: about {math.ceil(left / 60)} min left " \
               "in this stage"
        if self.then_s is not None:
            line += f", about {math.ceil((left + self.then_s) / 60)} min in the demo"
        return line


class Progress:
    """Stage lines with the minutes spent so far and, where an earlier run of the same preset into
    the same `--out` left its stage times (timings.json), the minutes it took from there to the end."""

    def __init__(self, out: Path, preset: str):
        self.path, self.preset, self.t0, self.marks = out / "timings.json", preset, time.time(), {}
        earlier = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.earlier = earlier.get("marks") if earlier.get("preset") == preset else None

    def stage(self, n: int, message: str) -> None:
        spent = time.time() - self.t0
        self.marks[str(n)] = spent
        left = ""
        if self.earlier and str(n) in self.earlier and "end" in self.earlier:
            left = f"; the last run here took {(self.earlier['end'] - self.earlier[str(n)]) / 60:.0f} min more"
        say(f"{n}/7 {message} ({spent / 60:.1f} min so far{left})")

    def finish(self) -> None:
        self.marks["end"] = time.time() - self.t0
        self.path.write_text(json.dumps({"preset": self.preset, "marks": self.marks}, indent=1))
