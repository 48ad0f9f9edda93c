"""trainer.profile_steps: torch.profiler over each worker's part of chosen training steps.

The driver starts every worker's profiler before such a step and stops it after; each worker then
writes two files under `<default_local_dir>/profile/`, named `step<N>_<role><rank>`:
- `.json.gz`: the Chrome trace (open it in Perfetto or chrome://tracing): CPU operators of the
  process and, on a GPU, every kernel, copy and NCCL collective it launched, on one timeline;
- `.txt`: operators by their own time on the device (on the CPU: by their own CPU time).
Only the worker's own process is seen: with `rollout.engine_core=separate` the engine's kernels run
in another process and show up as the waits of the rollout.
"""
from __future__ import annotations

import gzip
import os
import shutil

import torch
from torch.profiler import ProfilerActivity, profile

TABLE_ROWS = 60


class StepProfiler:
    def __init__(self):
        self.prof: profile | None = None

    def start(self) -> None:
        if self.prof is not None:
            raise RuntimeError("the profiler is already recording")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self.prof = profile(activities=activities)
        self.prof.start()

    def stop(self, path_prefix: str) -> list[str]:
        """Stop recording and write `<path_prefix>.json.gz` and `<path_prefix>.txt`; returns their paths."""
        if self.prof is None:
            raise RuntimeError("the profiler was not started")
        prof, self.prof = self.prof, None
        prof.stop()
        os.makedirs(os.path.dirname(path_prefix) or ".", exist_ok=True)
        trace, table = path_prefix + ".json.gz", path_prefix + ".txt"
        prof.export_chrome_trace(path_prefix + ".json")
        with open(path_prefix + ".json", "rb") as src, gzip.open(trace, "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(path_prefix + ".json")
        sort = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        with open(table, "w") as f:
            f.write(prof.key_averages().table(sort_by=sort, row_limit=TABLE_ROWS) + "\n")
        return [trace, table]
