"""Sparse retrieval: BM25 built with the pure-pip `bm25s` package, or the published Lucene index.

An index built here is a directory of bm25s files plus `search_r1_bm25.json`, which records how
text was tokenised (stemmer, stopwords, pattern) and how many corpus rows were indexed, so the
server can tokenise queries the same way and refuse a corpus the index was not built from.
Document `i` of the index is row `i` of the `Corpus`, as for the dense indexes.

Differences from the original (Lucene through pyserini): the formula is Lucene's BM25 with
Anserini's k1=0.9, b=0.4, but words are split by a regex, stemmed with Snowball English and
filtered by bm25s's stopword list rather than by Lucene's analyzer, and document lengths are
exact rather than Lucene's one-byte approximation, so scores and rare ties differ slightly.
As with Lucene, only passages sharing a word with the query are returned: a list may be shorter
than `topk`, and empty for a query with no indexed word.
"""
from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import numpy as np

from search_r1.retrieval.base import Hit, Retriever
from search_r1.retrieval.corpus import Corpus, Passage

log = logging.getLogger(__name__)

# bm25s imports JAX when it is installed, and JAX by default grabs 75% of every GPU's memory on
# import: a BM25 server would starve the trainer or the dense index on the same node. BM25 never
# needs a GPU, so keep JAX (if present) on the CPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

META_FILE = "search_r1_bm25.json"
TOKEN_PATTERN = r"(?u)\b\w\w+\b"      # words of two or more characters, as bm25s splits them
K1, B = 0.9, 0.4                      # Anserini's BM25 defaults, which the published index used


def _english_stemmer():
    """PyStemmer's English (Porter2) stemmer, or None where PyStemmer is not installed."""
    try:
        import Stemmer
    except ImportError:
        return None
    return Stemmer.Stemmer("english")


def _stopwords() -> frozenset[str]:
    from bm25s.tokenization import STOPWORDS_EN
    return frozenset(STOPWORDS_EN)


def build_bm25(corpus: Corpus, out_dir: str | os.PathLike, stemmer: bool = True,
               progress: bool = True, batch_rows: int = 65536) -> Path:
    """Index every corpus row with BM25 and save it to `out_dir` (bm25s files + meta JSON).

    Text is read and tokenised `batch_rows` at a time, so the corpus strings are never all in
    memory; bm25s still keeps every document's token ids (about 8 bytes a token) until it has
    built the score matrix, so wiki-18 wants a machine with tens of GB of RAM.
    """
    import bm25s
    from bm25s.tokenization import Tokenizer
    from tqdm import tqdm

    out_dir = Path(out_dir)
    stem = _english_stemmer() if stemmer else None
    if stemmer and stem is None:
        log.warning("PyStemmer is not installed: indexing without stemming "
                    "(`pip install PyStemmer` and rebuild for better recall)")
    tokenizer = Tokenizer(lower=True, splitter=TOKEN_PATTERN, stopwords=list(_stopwords()),
                          stemmer=stem)
    doc_ids: list[list[int]] = []
    with tqdm(total=len(corpus), unit="doc", desc="tokenizing", disable=not progress) as bar:
        for _, texts in corpus.iter_batches(batch_rows):
            # One shared vocabulary across batches; empty documents get the "" token.
            doc_ids.extend(tokenizer.streaming_tokenize(texts, update_vocab=True))
            bar.update(len(texts))
    vocab = tokenizer.stem_to_sid if stem is not None else tokenizer.word_to_id

    index = bm25s.BM25(k1=K1, b=B, method="lucene")
    index.index((doc_ids, vocab), show_progress=progress)
    del doc_ids
    out_dir.mkdir(parents=True, exist_ok=True)
    index.save(str(out_dir), show_progress=progress)
    # Written last: a directory without it is an interrupted build.
    meta = {"num_docs": len(corpus), "stemmer": "english" if stem is not None else None,
            "stopwords": "english", "token_pattern": TOKEN_PATTERN, "corpus": corpus.path.name}
    (out_dir / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    log.info("BM25 index of %s passages (stemmer: %s) saved to %s",
             f"{len(corpus):,}", meta["stemmer"], out_dir)
    return out_dir


class BM25Retriever(Retriever):
    """BM25 over an index made by `build_bm25`; the score matrix is memory-mapped."""

    def __init__(self, index_dir: str | os.PathLike, corpus: Corpus, threads: int = 0):
        import bm25s

        index_dir = Path(index_dir)
        meta_path = index_dir / META_FILE
        if not meta_path.exists():
            raise FileNotFoundError(
                f"{index_dir} is not a finished BM25 index (no {META_FILE}); build it with "
                f"`search-r1 index build --type bm25`")
        meta = json.loads(meta_path.read_text())
        self._index = bm25s.BM25.load(str(index_dir), mmap=True, show_progress=False)
        n_docs = int(self._index.scores["num_docs"])
        if n_docs != len(corpus):
            raise ValueError(
                f"Corpus {corpus.path} has {len(corpus):,} rows but BM25 index {index_dir} has "
                f"{n_docs:,} documents: they must come from the same corpus file (rebuild with "
                f"`search-r1 index build --type bm25`)")
        self._stemmer = None
        if meta.get("stemmer"):
            self._stemmer = _english_stemmer()
            if self._stemmer is None:
                raise ImportError(
                    f"BM25 index {index_dir} was built with the English stemmer; install it with "
                    f"`pip install PyStemmer` so queries are stemmed the same way")
        self._token_re = re.compile(meta.get("token_pattern", TOKEN_PATTERN))
        self._stopwords = _stopwords()
        self._vocab: dict[str, int] = self._index.vocab_dict
        self.corpus = corpus
        self.threads = threads

    def query_token_ids(self, query: str) -> list[int]:
        """The index's token ids for a query, split and stemmed as the documents were."""
        words = [w for w in self._token_re.findall(query.lower()) if w not in self._stopwords]
        if self._stemmer is not None:
            words = self._stemmer.stemWords(words)
        return [self._vocab[w] for w in words if w in self._vocab]

    def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        k = min(topk, len(self.corpus))
        token_ids = [self.query_token_ids(q) for q in queries]
        # A query with no indexed word matches nothing: it gets an empty list, as with Lucene.
        asked = [i for i, ids in enumerate(token_ids) if ids]
        results: list[list[Hit]] = [[] for _ in queries]
        if not asked or k <= 0:
            return results
        positions_QK, scores_QK = self._index.retrieve(
            [token_ids[i] for i in asked], k=k, show_progress=False, n_threads=self.threads)
        for i, positions_K, scores_K in zip(asked, positions_QK, scores_QK):
            # bm25s fills up to k with zero-score rows that share no term with the query.
            keep_K = scores_K > 0
            passages = self.corpus.get_many(np.asarray(positions_K)[keep_K])
            results[i] = [Hit(p, float(s)) for p, s in zip(passages, scores_K[keep_K])]
        return results


def is_lucene_index(path: str | os.PathLike) -> bool:
    """True for a Lucene index directory (such as the published wiki-18 BM25 index)."""
    path = Path(path)
    return path.is_dir() and any(p.name.startswith("segments_") for p in path.iterdir())


class PyseriniBM25Retriever(Retriever):
    """The published Lucene BM25 index, searched through pyserini (needs Java 21)."""

    def __init__(self, index_dir: str | os.PathLike, threads: int = 4):
        try:
            from pyserini.search.lucene import LuceneSearcher
        except ImportError as e:
            raise ImportError(
                f"{index_dir} is a Lucene index, which needs pyserini (`pip install pyserini`) "
                f"and Java 21; or build a pure-pip BM25 index from the corpus instead with "
                f"`search-r1 index build --type bm25`") from e
        self._searcher = LuceneSearcher(str(index_dir))
        self.threads = threads

    def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        qids = [str(i) for i in range(len(queries))]
        found = self._searcher.batch_search(queries, qids, k=topk, threads=self.threads)
        return [[Hit(self._passage(h.docid), float(h.score)) for h in found[q]] for q in qids]

    def _passage(self, docid: str) -> Passage:
        doc = self._searcher.doc(docid)
        raw = doc.raw()
        # The published index stores each corpus row as JSON in `raw`; others only `contents`.
        try:
            contents = json.loads(raw).get("contents") if raw else None
        except (ValueError, AttributeError):
            contents = None
        return Passage(docid, contents if contents is not None else doc.contents())
