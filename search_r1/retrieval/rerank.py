"""Two-stage retrieval: a first-stage retriever proposes candidates, a cross-encoder re-orders them.

A cross-encoder reads query and passage together, so it ranks better than a bi-encoder or BM25 but
costs one forward pass per (query, passage) pair; it only ever sees the first stage's short list.
"""
from __future__ import annotations

import logging

import torch

from search_r1.retrieval.base import Hit, Retriever
from search_r1.retrieval.corpus import Passage
from search_r1.retrieval.encoders import default_device

log = logging.getLogger(__name__)


def passage_text(p: Passage) -> str:
    """Title and text as the cross-encoder reads them (the corpus wraps titles in quotes)."""
    return f"{p.title}\n{p.text}" if p.text else p.title


class CrossEncoderReranker:
    """Scores (query, passage) pairs with any Hugging Face sequence-classification model."""

    def __init__(self, model: str, device: str | None = None, dtype: str = "auto",
                 max_length: int = 512, batch_size: int = 128):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.device = device or default_device()
        if dtype == "auto":
            dtype = "float16" if self.device.startswith("cuda") else "float32"
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            model, dtype=getattr(torch, dtype)).to(self.device).eval()
        # Some tokenizers report a huge sentinel as their limit; the position table is the real one.
        self.max_length = min(max_length, self.tokenizer.model_max_length,
                              getattr(self.model.config, "max_position_embeddings", max_length))
        self.max_query_tokens = self.max_length // 2
        self.batch_size = batch_size
        log.info("cross-encoder %s on %s (%s, %d labels)", model, self.device, dtype,
                 self.model.config.num_labels)

    def score(self, query: str, passages: list[str]) -> list[float]:
        return self.score_pairs([query] * len(passages), passages)

    @torch.inference_mode()
    def score_pairs(self, queries: list[str], passages: list[str]) -> list[float]:
        """One score per pair: the single logit, or the last label's (the "relevant" one)."""
        clipped = {q: self._clip_query(q) for q in set(queries)}
        scores = [0.0] * len(queries)
        # Sorting by length keeps padding per batch small; scores go back in input order.
        order = sorted(range(len(queries)), key=lambda i: len(queries[i]) + len(passages[i]))
        for lo in range(0, len(order), self.batch_size):
            idx = order[lo:lo + self.batch_size]
            batch = self.tokenizer([clipped[queries[i]] for i in idx], [passages[i] for i in idx],
                                   padding=True, truncation="only_second",
                                   max_length=self.max_length, return_tensors="pt").to(self.device)
            logits_BL = self.model(**batch).logits
            for i, s in zip(idx, logits_BL[:, -1].float().tolist()):
                scores[i] = s
        return scores

    def _clip_query(self, query: str) -> str:
        # `only_second` truncation fails outright when the query alone fills the window, and an
        # agent can write such a query; keep its first half-window of tokens instead.
        tokens = self.tokenizer.tokenize(query)
        if len(tokens) <= self.max_query_tokens:
            return query
        return self.tokenizer.convert_tokens_to_string(tokens[:self.max_query_tokens])

    def close(self) -> None:
        del self.model
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()


class RerankRetriever(Retriever):
    """Takes `topk_retrieval` candidates per query from `first_stage`, keeps the reranker's best."""

    def __init__(self, first_stage: Retriever, reranker: CrossEncoderReranker,
                 topk_retrieval: int = 50):
        self.first_stage = first_stage
        self.reranker = reranker
        self.topk_retrieval = topk_retrieval
        self.max_topk = topk_retrieval
        self.probe_at_startup = first_stage.probe_at_startup  # a web first stage bills the probe

    def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        if topk > self.topk_retrieval:
            raise ValueError(
                f"topk={topk} is more than the {self.topk_retrieval} candidates the reranker "
                f"re-orders: ask for fewer or raise topk_retrieval")
        candidates = self.first_stage.search(queries, self.topk_retrieval)
        # All pairs of the request in one flat list, so small per-query lists still fill batches.
        flat_queries = [q for q, hits in zip(queries, candidates) for _ in hits]
        flat_texts = [passage_text(h.passage) for hits in candidates for h in hits]
        flat_scores = self.reranker.score_pairs(flat_queries, flat_texts)
        results, lo = [], 0
        for hits in candidates:
            scores = flat_scores[lo:lo + len(hits)]
            lo += len(hits)
            ranked = sorted(zip(scores, range(len(hits))), key=lambda t: -t[0])[:topk]
            results.append([Hit(hits[j].passage, s) for s, j in ranked])
        return results

    def close(self) -> None:
        self.first_stage.close()
        self.reranker.close()
