import json

import pytest

from search_r1.retrieval.bm25 import (META_FILE, BM25Retriever, PyseriniBM25Retriever,
                                      build_bm25, is_lucene_index)
from search_r1.retrieval.corpus import Corpus

PASSAGES = [
    ("Paris", "Paris is the capital of France and its largest city, on the Seine."),
    ("Berlin", "Berlin is the capital of Germany and lies on the Spree river."),
    ("Madrid", "Madrid is the capital of Spain, at the centre of the Iberian peninsula."),
    ("Rome", "Rome is the capital of Italy; the Colosseum stands in its centre."),
    ("Lisbon", "Lisbon is the capital of Portugal, on the estuary of the Tagus."),
    ("Vienna", "Vienna is the capital of Austria, known for its coffee houses and waltzes."),
    ("Oslo", "Oslo is the capital of Norway, at the head of the Oslofjord."),
    ("Tokyo", "Tokyo is the capital of Japan and the most populous metropolitan area."),
    ("Canberra", "Canberra is the capital of Australia, a planned city chosen in 1908."),
    ("Ottawa", "Ottawa is the capital of Canada, on the south bank of the Ottawa River."),
    ("Mount Everest", "Mount Everest is the highest mountain above sea level, in the Himalayas."),
    ("K2", "K2 is the second highest mountain on Earth, on the China–Pakistan border."),
    ("Nile", "The Nile is a major river of northeastern Africa flowing into the Mediterranean."),
    ("Amazon River", "The Amazon River in South America carries more water than any other river."),
    ("Danube", "The Danube flows through Vienna, Budapest and Belgrade to the Black Sea."),
    ("Photosynthesis", "Photosynthesis turns sunlight, water and carbon dioxide into sugar."),
    ("Mitochondrion", "The mitochondrion is the organelle making most of a cell's energy."),
    ("DNA", "DNA carries genetic instructions as a double helix of nucleotides."),
    ("Albert Einstein", "Albert Einstein developed relativity theory and won a Nobel Prize."),
    ("Marie Curie", "Marie Curie researched radioactivity and won two Nobel Prizes."),
    ("Isaac Newton", "Isaac Newton formulated the laws of motion and universal gravitation."),
    ("Charles Darwin", "Charles Darwin proposed evolution by natural selection in 1859."),
    ("Ada Lovelace", "Ada Lovelace wrote the first algorithm intended for Babbage's engine."),
    ("Alan Turing", "Alan Turing formalised computation with the Turing machine."),
    ("Python", "Python is a programming language created by Guido van Rossum."),
    ("Rust", "Rust is a systems programming language focused on memory safety."),
    ("Chess", "Chess is a board game for two players on a checkered board of 64 squares."),
    ("Go", "Go is an abstract strategy board game in which stones surround territory."),
    ("Basketball", "Basketball was invented by James Naismith in Springfield in 1891."),
    ("Cricket", "Cricket is a bat-and-ball game played between two teams of eleven."),
    ("Saturn", "Saturn is the sixth planet from the Sun and has prominent rings."),
    ("Jupiter", "Jupiter is the largest planet in the Solar System, a gas giant."),
    ("Mars", "Mars is the fourth planet, called the Red Planet for its iron oxide dust."),
    ("Moon", "The Moon is Earth's only natural satellite, first visited by humans in 1969."),
    ("Tea", "Tea is an aromatic beverage prepared by pouring hot water over cured leaves."),
    ("Coffee", "Coffee is brewed from roasted beans of the Coffea plant."),
]


def write_corpus(path, passages=PASSAGES):
    with open(path, "w") as f:
        for i, (title, text) in enumerate(passages):
            f.write(json.dumps({"id": str(i), "contents": f'"{title}"\n{text}'}) + "\n")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return Corpus(write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.jsonl"))


@pytest.fixture(scope="module")
def index_dir(corpus, tmp_path_factory):
    return build_bm25(corpus, tmp_path_factory.mktemp("bm25"), progress=False)


@pytest.fixture(scope="module")
def retriever(index_dir, corpus):
    return BM25Retriever(index_dir, corpus)


def titles(hits):
    return [h.passage.title for h in hits]


def test_rare_words_rank_first_and_scores_descend(retriever):
    results = retriever.search(["Which river flows through Budapest?",
                                "who invented basketball in Springfield",
                                "organelle producing cell energy"], topk=5)
    assert [titles(r)[0] for r in results] == ["Danube", "Basketball", "Mitochondrion"]
    for hits in results:
        scores = [h.score for h in hits]
        assert scores == sorted(scores, reverse=True) and all(s > 0 for s in scores)
    assert results[0][0].passage.contents.startswith('"Danube"\n')


def test_stemming_matches_inflected_forms(retriever, index_dir):
    pytest.importorskip("Stemmer")
    assert json.loads((index_dir / META_FILE).read_text())["stemmer"] == "english"
    # The corpus says "capital", "planet" and "rings": only stemming matches these forms.
    hits = retriever.search(["capitals"], topk=20)[0]
    assert len(hits) == 10 and all("capital" in h.passage.text for h in hits)
    assert titles(retriever.search(["ringed planets"], topk=1)[0]) == ["Saturn"]


def test_queries_without_known_words_do_not_crash(retriever):
    results = retriever.search(["zzyzx qwertyuiop", "", "the of and", "Saturn"], topk=3)
    assert results[:3] == [[], [], []]
    assert titles(results[3]) == ["Saturn"]


def test_topk_larger_than_corpus_is_clamped(retriever, corpus):
    hits = retriever.search(["the capital city"], topk=1000)[0]
    assert 0 < len(hits) <= len(corpus)
    assert len({h.passage.id for h in hits}) == len(hits)


def test_saved_index_reloads_to_identical_results(retriever, index_dir, corpus):
    queries = ["largest planet gas giant", "Nobel Prize radioactivity", "board game stones"]
    again = BM25Retriever(index_dir, Corpus(corpus.path))
    for a, b in zip(retriever.search(queries, 5), again.search(queries, 5)):
        assert [(h.passage.id, h.score) for h in a] == [(h.passage.id, h.score) for h in b]


def test_index_from_another_corpus_is_refused(index_dir, tmp_path):
    other = Corpus(write_corpus(tmp_path / "other.jsonl", PASSAGES[:-1]))
    with pytest.raises(ValueError, match="other.arrow.*35 rows.*36 documents"):
        BM25Retriever(index_dir, other)


def test_unfinished_index_dir_is_refused(corpus, tmp_path):
    with pytest.raises(FileNotFoundError, match="index build --type bm25"):
        BM25Retriever(tmp_path, corpus)


def test_lucene_index_without_pyserini_says_what_to_install(tmp_path):
    (tmp_path / "segments_3").write_bytes(b"")
    assert is_lucene_index(tmp_path) and not is_lucene_index(tmp_path / "segments_3")
    try:
        import pyserini  # noqa: F401
        pytest.skip("pyserini is installed")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="pyserini.*Java 21.*index build --type bm25"):
        PyseriniBM25Retriever(tmp_path)


def test_index_without_stemmer_matches_exact_words_only(corpus, tmp_path):
    build_bm25(corpus, tmp_path, stemmer=False, progress=False)
    assert json.loads((tmp_path / META_FILE).read_text())["stemmer"] is None
    plain = BM25Retriever(tmp_path, corpus)
    assert plain.search(["capitals"], topk=3) == [[]]
    assert titles(plain.search(["Seine capital"], topk=1)[0]) == ["Paris"]
