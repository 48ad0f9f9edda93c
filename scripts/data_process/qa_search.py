"""Build Search-R1 parquet files from QA datasets; the logic lives in search_r1/data/preprocess.py.

    python scripts/data_process/qa_search.py --sources nq,hotpotqa --split train \
        --out data/train.parquet
    python scripts/data_process/qa_search.py --bundled --split test --template base \
        --out data/geo_test.parquet
    # your own prompt, e.g. that of runs made with the original scripts ({question} is filled in)
    python scripts/data_process/qa_search.py --sources nq --split train \
        --template-file my_prompt.txt --out data/train.parquet
"""
import sys
from pathlib import Path

# Lets the script run from a plain checkout, before `pip install -e .`.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from search_r1.data.preprocess import main  # noqa: E402

if __name__ == "__main__":
    main()
