"""`search-r1 report RUN_DIR [RUN_DIR ...]`: the command that writes a run's page, or compares runs."""
from __future__ import annotations

from search_r1.report.compare import write_comparison
from search_r1.report.run_page import write_report


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
