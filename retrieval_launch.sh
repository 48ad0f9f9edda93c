#!/usr/bin/env bash
# Start the retrieval server. Defaults: the published wiki-18 corpus with the e5 flat index, as
# fetched by `python scripts/download.py --save-path $SAVE_PATH`, served exactly on the GPUs
# present (CPU otherwise) at http://127.0.0.1:8000/retrieve.
# Override with environment variables, or append any `search-r1 serve` flag:
#   RETRIEVER_NAME=bm25 INDEX_PATH=data/wiki18/bm25 bash retrieval_launch.sh --port 8001
set -euo pipefail
SAVE_PATH=${SAVE_PATH:-data/wiki18}
INDEX_PATH=${INDEX_PATH:-$SAVE_PATH/e5_Flat.index}
CORPUS_PATH=${CORPUS_PATH:-$SAVE_PATH/wiki-18.jsonl}
RETRIEVER_NAME=${RETRIEVER_NAME:-e5}
RETRIEVER_MODEL=${RETRIEVER_MODEL:-intfloat/e5-base-v2}
TOPK=${TOPK:-3}
exec "${PYTHON:-python3}" -m search_r1.cli serve \
    --index_path "$INDEX_PATH" --corpus_path "$CORPUS_PATH" --topk "$TOPK" \
    --retriever_name "$RETRIEVER_NAME" --retriever_model "$RETRIEVER_MODEL" "$@"
