import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from search_r1.data import preprocess
from search_r1.data.templates import TEMPLATES, make_prompt, make_prompt_text


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def local_files(tmp_path):
    jsonl = write_jsonl(tmp_path / "a.jsonl", [
        {"question": "who wrote hamlet", "golden_answers": ["William Shakespeare", "Shakespeare"]},
        {"question": "capital of peru?", "golden_answers": "Lima"},
    ])
    parquet = tmp_path / "b.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"id": "x1", "question": "largest planet?", "golden_answers": ["Jupiter"]},
        {"id": "x2", "question": "highest mountain?",
         "golden_answers": ["Mount Everest", "Everest"]},
        {"id": "x3", "question": "red planet?", "golden_answers": ["Mars"]},
    ]), parquet)
    return jsonl, parquet


def test_templates_carry_the_tags():
    for name in TEMPLATES:
        text = make_prompt_text("Who painted the Mona Lisa", name)
        for tag in ("<think>", "</think>", "<search>", "</search>", "<information>",
                    "</information>", "<answer>", "</answer>"):
            assert tag in text, (name, tag)
        assert text.rstrip().endswith("Question: Who painted the Mona Lisa?")
        assert make_prompt("Who painted the Mona Lisa", name) == [{"role": "user", "content": text}]
    with pytest.raises(ValueError, match="instruct"):
        make_prompt("q", "chatml")


def test_local_sources_merge_with_global_index(local_files, tmp_path):
    jsonl, parquet = local_files
    out = preprocess.main(["--local", f"alpha={jsonl}", "--local", f"beta={parquet}", "--bundled",
                           "--split", "test", "--out", str(tmp_path / "out" / "test.parquet")])
    table = pq.read_table(out)
    assert table.schema.equals(preprocess.SCHEMA)
    rows = table.to_pylist()
    n_geo = len(rows) - 5
    assert 250 <= n_geo <= 400
    assert [r["data_source"] for r in rows[:5]] == ["alpha"] * 2 + ["beta"] * 3
    assert {r["data_source"] for r in rows[5:]} == {"geo_qa"}
    assert [r["extra_info"]["index"] for r in rows] == list(range(len(rows)))
    assert {r["extra_info"]["split"] for r in rows} == {"test"}

    first = rows[0]
    assert first == {
        "data_source": "alpha",
        "prompt": make_prompt("who wrote hamlet", "instruct"),
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule",
                         "ground_truth": {"target": ["William Shakespeare", "Shakespeare"]}},
        "extra_info": {"split": "test", "index": 0},
    }
    assert rows[1]["reward_model"]["ground_truth"]["target"] == ["Lima"]
    assert rows[3]["reward_model"]["ground_truth"]["target"] == ["Mount Everest", "Everest"]


def test_base_template_is_raw_text(local_files, tmp_path):
    jsonl, _ = local_files
    out = preprocess.main(["--local", f"alpha={jsonl}", "--template", "base",
                           "--out", str(tmp_path / "base.parquet")])
    prompt = pq.read_table(out).to_pylist()[0]["prompt"]
    assert prompt == [{"role": "user", "content": make_prompt_text("who wrote hamlet", "base")}]


class FakeHub:
    """Stands in for the hub: hotpotqa has only train/dev, like the real FlashRAG copy."""
    splits = {"nq": {"train", "dev", "test"}, "hotpotqa": {"train", "dev"}, "popqa": {"test"}}

    def __init__(self):
        self.calls = []

    def __call__(self, name, split):
        self.calls.append((name, split))
        if split not in self.splits[name]:
            raise preprocess.SplitNotFound(f"{name}/{split}")
        return [{"question": f"{name} {split} q{i}", "golden_answers": [f"a{i}"]} for i in range(3)]


def test_test_split_falls_back_to_dev(tmp_path):
    hub = FakeHub()
    out = preprocess.main(["--sources", "nq,hotpotqa", "--split", "test",
                           "--out", str(tmp_path / "t.parquet")], loader=hub)
    rows = pq.read_table(out).to_pylist()
    assert hub.calls == [("nq", "test"), ("hotpotqa", "test"), ("hotpotqa", "dev")]
    questions = [r["prompt"][0]["content"] for r in rows]
    assert "Question: nq test q0?" in questions[0] and "Question: hotpotqa dev q0?" in questions[3]
    assert [r["extra_info"]["index"] for r in rows] == list(range(6))
    assert all(r["extra_info"]["split"] == "test" for r in rows)


def test_missing_split_names_the_fix():
    with pytest.raises(preprocess.SplitNotFound, match="--sources"):
        preprocess.load_split("popqa", "train", FakeHub())
    with pytest.raises(preprocess.SplitNotFound):  # dev fallback is for test only
        preprocess.load_split("popqa", "dev", FakeHub())


def test_local_dir_loader(tmp_path):
    (tmp_path / "musique").mkdir()
    record = {"question": "q", "golden_answers": ["a"]}
    write_jsonl(tmp_path / "musique" / "dev.jsonl", [record])
    load = preprocess.local_dir_loader(tmp_path)
    assert preprocess.load_split("musique", "test", load) == [record]
    with pytest.raises(FileNotFoundError, match="huggingface-cli download"):
        load("nq", "train")


def test_bad_inputs_explain_themselves(tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"query": "q", "answer": "a"}])
    with pytest.raises(ValueError, match="golden_answers"):
        preprocess.read_qa_file(bad)
    with pytest.raises(ValueError, match="name=path"):
        preprocess.collect_sources([], [str(bad)], False, "train", FakeHub())
    with pytest.raises(ValueError, match="train and test"):
        preprocess.collect_sources([], [], True, "dev", FakeHub())
