"""Corpus rows keep every field through the JSONL → Arrow conversion; pages are found by URL."""
import json
import os

import pyarrow as pa
import pytest

from search_r1.retrieval.base import Hit
from search_r1.retrieval.corpus import SCHEMA, Corpus, Pages, arrow_path_for


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [
    {"id": "0", "contents": '"Paris"\nParis is the capital of France.', "url": "https://w/Paris",
     "title": "Paris"},
    {"id": 1, "title": "Rome", "text": "Rome is the capital of Italy."},
    {"id": "2", "contents": '"Lima"\nLima is the capital of Peru.'},
    {"id": "3", "contents": '"Oslo"\nOslo.', "meta": {"views": [1, 2]}, "url": None},
]


def test_extra_fields_survive_conversion_and_come_back_in_the_document(tmp_path):
    corpus = Corpus(write_jsonl(tmp_path / "c.jsonl", ROWS))
    paris, rome, lima, oslo = corpus.get_many([0, 1, 2, 3])
    assert paris.extra == {"url": "https://w/Paris", "title": "Paris"}
    assert rome.id == "1" and rome.contents == '"Rome"\nRome is the capital of Italy.'
    assert rome.extra == {"title": "Rome", "text": "Rome is the capital of Italy."}
    assert lima.extra is None
    assert oslo.extra == {"meta": {"views": [1, 2]}, "url": None}
    assert Hit(paris, 1.5).to_api() == {
        "document": {"id": "0", "contents": paris.contents, "url": "https://w/Paris", "title": "Paris"},
        "score": 1.5}
    assert Hit(lima, 1.0).to_api(with_score=False) == {"id": "2", "contents": lima.contents}


def test_a_conversion_that_dropped_extra_fields_is_redone(tmp_path):
    jsonl = write_jsonl(tmp_path / "c.jsonl", ROWS)
    arrow = arrow_path_for(jsonl)
    with pa.OSFile(str(arrow), "wb") as sink, pa.ipc.new_file(sink, SCHEMA) as writer:  # the old layout
        writer.write_batch(pa.record_batch([["0"], ["old"]], schema=SCHEMA))
    os.utime(arrow, (os.path.getmtime(jsonl) + 10,) * 2)  # newer than the JSONL
    assert Corpus(jsonl)[0].extra == {"url": "https://w/Paris", "title": "Paris"}
    # A file in the old layout opened directly still serves, without extra fields.
    old = tmp_path / "old.arrow"
    with pa.OSFile(str(old), "wb") as sink, pa.ipc.new_file(sink, SCHEMA) as writer:
        writer.write_batch(pa.record_batch([["0"], ["old"]], schema=SCHEMA))
    assert Corpus(old)[0].extra is None and Corpus(old)[0].contents == "old"


@pytest.mark.parametrize("line,problem", [('{"id": "0"}', "KeyError('contents')"),
                                          ('["0", "text"]', "not an object"),
                                          ('{"id": "0", "contents": 5}', "not a string")])
def test_bad_rows_name_their_line(tmp_path, line, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "a", "contents": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a corpus row") as e:
        Corpus(path)
    assert problem in str(e.value)


def test_pages_by_url_as_asearcher_finds_them(tmp_path):
    pages = Pages(write_jsonl(tmp_path / "pages.jsonl", [
        {"url": "https://en.wikipedia.org/w/index.php?title=Paris", "contents": "Paris page",
         "title": "Paris"},
        {"url": "https://w/dup", "contents": "first"},
        {"url": "https://w/dup", "contents": "second"},
    ]))
    assert len(pages) == 3
    # Agents write wiki links as index.php/Title; the file keys them as index.php?title=Title.
    assert pages.get("https://en.wikipedia.org/w/index.php/Paris") == {
        "url": "https://en.wikipedia.org/w/index.php?title=Paris", "contents": "Paris page", "title": "Paris"}
    assert pages.get("https://w/dup")["contents"] == "second"  # the later row wins, as in a dict
    assert pages.get("https://w/missing") is None
    assert (tmp_path / "pages.pages.arrow").exists()
    with pytest.raises(ValueError, match="not a page row"):
        Pages(write_jsonl(tmp_path / "bad_pages.jsonl", [{"contents": "no url"}]))
    with pytest.raises(FileNotFoundError, match="pages file .* does not exist"):
        Pages(tmp_path / "nope.jsonl")
