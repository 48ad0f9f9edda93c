"""What every retriever returns, and the one method the server calls."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from search_r1.retrieval.corpus import Passage


@dataclass
class Hit:
    passage: Passage
    score: float

    def to_api(self, with_score: bool = True) -> dict:
        """One entry of the `/retrieve` answer (the published Search-R1 layout). The document is the
        corpus row, its extra fields (e.g. `url`) included, as the original server returned it:
        ASearcher's and RLinf's clients read `url` from it."""
        doc = {"id": self.passage.id, "contents": self.passage.contents, **(self.passage.extra or {})}
        return {"document": doc, "score": float(self.score)} if with_score else doc


class Retriever(ABC):
    """Maps a batch of queries to `topk` hits each, best first.

    The server calls `search` from a single worker thread, so implementations need not be
    thread-safe; they must return exactly one list per query, in order.
    """

    max_topk: int = 1000
    # A retriever whose work splits into encoding the queries and looking the encodings up sets this
    # and implements `encode` and `lookup` (`search` = lookup(encode(queries))): the server then, by
    # default, encodes one batch in one thread while another looks up the batch before it. Each half
    # is still called from one thread only.
    two_stage: bool = False
    # The server times one batch of made-up queries at start-up (so that it can refuse work that
    # would outlast its clients' wait from the first request on). Off for engines that bill each
    # query (the web engines).
    probe_at_startup: bool = True

    @abstractmethod
    def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        ...

    def encode(self, queries: list[str]):
        """First half of `search` (two-stage retrievers): one encoding per query, sliceable by rows."""
        raise NotImplementedError

    def lookup(self, encoded, topk: int) -> list[list[Hit]]:
        """Second half of `search` (two-stage retrievers): the hits of encodings made by `encode`."""
        raise NotImplementedError

    def stats(self) -> dict:
        """Cumulative counters shown by `/health` (e.g. seconds per phase). Default: none."""
        return {}

    def health_problem(self) -> str | None:
        """Why this retriever cannot answer now (an upstream that fails every call), or None."""
        return None

    def warmup(self) -> None:
        """Pay one-time costs (CUDA context, kernel selection) before serving. Default: nothing."""

    def close(self) -> None:
        """Release files, GPU memory and network sessions."""
