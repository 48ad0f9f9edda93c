import json

import pytest
import torch

from search_r1.retrieval.bm25 import BM25Retriever, build_bm25
from search_r1.retrieval.corpus import Corpus
from search_r1.retrieval.models import resolve_model
from search_r1.retrieval.rerank import CrossEncoderReranker, RerankRetriever, passage_text

PASSAGES = [
    ("Paris", "Paris is the capital of France and its largest city, on the Seine."),
    ("Berlin", "Berlin is the capital of Germany and lies on the Spree river."),
    ("Madrid", "Madrid is the capital of Spain, at the centre of the Iberian peninsula."),
    ("Rome", "Rome is the capital of Italy; the Colosseum stands in its centre."),
    ("Lisbon", "Lisbon is the capital of Portugal, on the estuary of the Tagus river."),
    ("Vienna", "Vienna is the capital of Austria, on the river Danube."),
    ("Oslo", "Oslo is the capital of Norway, at the head of the Oslofjord."),
    ("Tokyo", "Tokyo is the capital of Japan and the most populous metropolitan area."),
    ("Nile", "The Nile is a major river of northeastern Africa flowing into the Mediterranean."),
    ("Amazon River", "The Amazon River in South America carries more water than any other river."),
    ("Danube", "The Danube river flows through Vienna, Budapest and Belgrade to the Black Sea."),
    ("Thames", "The Thames is the river that flows through London, capital of England."),
    ("Saturn", "Saturn is the sixth planet from the Sun and has prominent rings."),
    ("Jupiter", "Jupiter is the largest planet in the Solar System, a gas giant."),
    ("Mars", "Mars is the fourth planet, called the Red Planet for its iron oxide dust."),
    ("Venus", "Venus is the second planet from the Sun and the hottest planet."),
    ("Mercury", "Mercury is the smallest planet and the closest planet to the Sun."),
    ("Neptune", "Neptune is the farthest known planet from the Sun, an ice giant."),
    ("Chess", "Chess is a board game for two players on a checkered board of 64 squares."),
    ("Coffee", "Coffee is brewed from roasted beans of the Coffea plant."),
]
# Each query shares words with at least 8 passages, so every query gets a full candidate list.
QUERIES = ["capital city on a river", "planet or capital closest to the Sun",
           "which river flows through a capital to the sea"]


@pytest.fixture(scope="module")
def first_stage(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    with open(root / "corpus.jsonl", "w") as f:
        for i, (title, text) in enumerate(PASSAGES):
            f.write(json.dumps({"id": str(i), "contents": f'"{title}"\n{text}'}) + "\n")
    corpus = Corpus(root / "corpus.jsonl")
    return BM25Retriever(build_bm25(corpus, root / "bm25", progress=False), corpus)


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    # No trained cross-encoder ships with any pip package we can install offline, so the model is
    # a tiny random BERT with one output: it checks the plumbing (pairing, batching, ordering),
    # not ranking quality. The tokenizer is the bundled MiniLM one, a real BERT word-piece vocab.
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("all-MiniLM-L6-v2"))
    torch.manual_seed(0)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, num_labels=1,
                        max_position_embeddings=128, initializer_range=0.5)
    path = tmp_path_factory.mktemp("cross_encoder")
    BertForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return CrossEncoderReranker(str(path), device="cpu", batch_size=7)


def test_hits_are_each_querys_own_candidates_best_first(first_stage, reranker):
    topk, topk_retrieval = 3, 8
    results = RerankRetriever(first_stage, reranker, topk_retrieval).search(QUERIES, topk)
    candidates = first_stage.search(QUERIES, topk_retrieval)
    for query, hits, cands in zip(QUERIES, results, candidates):
        assert len(cands) == topk_retrieval and len(hits) == topk
        # Scored one pair at a time, with this query only: batching must not mix queries up.
        alone = {c.passage.id: reranker.score(query, [passage_text(c.passage)])[0] for c in cands}
        for h in hits:
            assert h.score == pytest.approx(alone[h.passage.id], abs=1e-4)
        scores = [h.score for h in hits]
        assert scores == sorted(scores, reverse=True)
        dropped = [s for pid, s in alone.items() if pid not in {h.passage.id for h in hits}]
        assert min(scores) >= max(dropped) - 1e-4


def test_scores_differ_between_passages(reranker):
    # Guards the test above against a degenerate model that scores every pair the same.
    scores = reranker.score(QUERIES[0], [f"{title}\n{text}" for title, text in PASSAGES[:5]])
    assert max(scores) - min(scores) > 1e-2


def test_overlong_query_is_clipped_not_an_error(reranker):
    scores = reranker.score("river " * 500, ["short passage", "another short passage"])
    assert len(scores) == 2


def test_topk_above_topk_retrieval_is_refused(first_stage, reranker):
    with pytest.raises(ValueError, match="topk=5 .* 4 candidates.*topk_retrieval"):
        RerankRetriever(first_stage, reranker, topk_retrieval=4).search(QUERIES, topk=5)
