"""How the benchmarks report: every result row is one JSON line on stdout and, with --out, is also
appended to that file, so the rows of several runs (and machines) collect in one JSONL file."""
from __future__ import annotations

import json


def emit_row(row: dict, out: str | None) -> None:
    """Print `row` as one JSON line (flushed: a long run shows its rows as they come) and append it
    to the file `out`, if given."""
    line = json.dumps(row)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")
