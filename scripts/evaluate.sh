#!/usr/bin/env bash
# Evaluate a model on QA test sets with the search agent (or all three modes).
#
#   bash scripts/evaluate.sh MODEL DATA [more `search-r1 eval` flags]
#   MODES="search no-search rag" bash scripts/evaluate.sh MODEL DATA --retriever-url URL
#
# MODEL: a Hugging Face model directory or hub id, or a training run directory (its newest
# checkpoint is exported first). DATA: test parquet file(s), comma-separated. Results go to
# OUT (default: eval/<model name>): eval_<mode>.json, eval_<mode>.md, predictions_<mode>.jsonl.
set -euo pipefail

if [ $# -lt 2 ]; then
    echo "usage: [MODES='search no-search rag'] [OUT=dir] bash $0 MODEL DATA [search-r1 eval flags]" >&2
    exit 2
fi
MODEL=$1
DATA=$2
shift 2
MODES=${MODES:-search}
OUT=${OUT:-eval/$(basename "${MODEL%/}")}

# Run from anywhere, installed or not.
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
PYTHON=${PYTHON:-python}

for mode in $MODES; do
    "$PYTHON" -m search_r1.evaluate eval --model "$MODEL" --data "$DATA" --mode "$mode" --out "$OUT" "$@"
done
