"""Download the Search-R1 wiki-18 corpus and indexes; see search_r1/retrieval/download.py.

    python scripts/download.py --save-path DIR [--assets corpus,e5_flat,e5_hnsw,bm25]
                               [--source-dir LOCAL_MIRROR] [--keep-parts]
"""
import sys
from pathlib import Path

# Let the script run from a plain checkout, without `pip install -e .`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from search_r1.retrieval.download import main  # noqa: E402

if __name__ == "__main__":
    main()
