"""`search-r1 report RUN_DIR`: one self-contained HTML page about a training run.

Reads what the trainer writes into its output directory (`metrics.jsonl`, `samples/*.jsonl`,
`config.yaml`) and, when present, `eval_*.json` and `stages.json` from the evaluation scripts and
demo driver. The page draws its charts as inline SVG and carries its own CSS and a few lines of
JavaScript (only to switch between sample steps), so it opens offline, can be mailed or attached
to an issue, and shows everything with scripts disabled too.

Trajectories are split at the agent's tags. `<information>` blocks are exactly the observation
tokens the environment appended (loss_mask 0), so they are shaded and labelled as not trained on.

One module per part:
- `run_page.py`: `write_report`, the page of one run (header, stages, curves, evaluation, time per phase);
- `trajectories.py`: the sample trajectories, split at the agent's tags;
- `compare.py`: `write_comparison`, several runs side by side (seeds of a setting together);
- `read.py`: reading the run's files (metrics, config, JSON);
- `charts.py`: the SVG line chart and the small drawing pieces both pages use;
- `style.py`: the pages' CSS and script;
- `cli.py`: the `search-r1 report` command.
"""
from search_r1.report.charts import PALETTE, line_chart
from search_r1.report.cli import add_parser
from search_r1.report.compare import COMPARE, mean_se, setting_and_seed, write_comparison
from search_r1.report.read import read_metrics, series
from search_r1.report.run_page import CHARTS, EVAL_METRICS, MAX_BARS, PHASE_COLOURS, PHASES, write_report
from search_r1.report.style import CSS, JS
from search_r1.report.trajectories import MAX_TRAJECTORIES, TAG_RE, split_segments

__all__ = ["CHARTS", "COMPARE", "CSS", "EVAL_METRICS", "JS", "MAX_BARS", "MAX_TRAJECTORIES", "PALETTE",
           "PHASES", "PHASE_COLOURS", "TAG_RE", "add_parser", "line_chart", "mean_se", "read_metrics", "series",
           "setting_and_seed", "split_segments", "write_comparison", "write_report"]
