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
    for name in ("base", "instruct", "example", "example2"):
        text = make_prompt_text("Who painted the Mona Lisa", name)
        for tag in ("<think>", "</think>", "<search>", "</search>", "<information>",
                    "</information>", "<answer>", "</answer>"):
            assert tag in text, (name, tag)
        assert text.rstrip().endswith("Question: Who painted the Mona Lisa?")
        assert make_prompt("Who painted the Mona Lisa", name) == [{"role": "user", "content": text}]
    # the worked example is a whole valid trajectory, about a city the bundled corpus does not have
    from search_r1.data.bundled import bundled_paths
    from search_r1.rewards import check_format
    example = make_prompt_text("Who painted the Mona Lisa", "example")
    trajectory = example[example.index("<think>", example.index("another question")):example.rindex("Question:")]
    assert check_format(trajectory.strip()).valid
    assert "Tartu" not in bundled_paths()["corpus"].read_text(encoding="utf-8")
    # the two-search one too, and its answer is none of the bundled questions' answers
    example2 = make_prompt_text("Who painted the Mona Lisa", "example2")
    trajectory = example2[example2.index("<think>", example2.index("another question")):example2.rindex("Question:")]
    assert check_format(trajectory.strip()).valid and trajectory.count("<search>") == 2
    answer = trajectory[trajectory.index("<answer>") + 8:trajectory.index("</answer>")].strip()
    for split in ("train", "test"):
        assert f'"{answer}"' not in bundled_paths()[split].read_text(encoding="utf-8")
    # the tool protocol: searches are tool calls the chat template teaches; think and answer stay tags
    system, user = make_prompt("Who painted the Mona Lisa", "tool")
    assert system["role"] == "system" and user["role"] == "user" and "search tool" in user["content"]
    assert "<answer>" in user["content"] and "<search>" not in user["content"]
    assert user["content"].rstrip().endswith("Question: Who painted the Mona Lisa?")


def test_tool_template_writes_verls_search_tool_rows(tmp_path):
    """verl's layout: system + user messages, extra_info with need_tools_kwargs, question and
    tools_kwargs.search.create_kwargs; the trainer's loader reads the file."""
    import pyarrow.parquet as pq
    from search_r1.data import preprocess
    from verl.utils.dataset import read_rows, row_fields
    path = preprocess.main(["--bundled", "--split", "test", "--template", "tool", "--out", str(tmp_path / "t.parquet")])
    row = pq.read_table(path).to_pylist()[0]
    assert [m["role"] for m in row["prompt"]] == ["system", "user"]
    info = row["extra_info"]
    assert info["need_tools_kwargs"] and info["question"] and info["index"] == 0
    kwargs = info["tools_kwargs"]["search"]["create_kwargs"]
    assert kwargs["ground_truth"] == row["reward_model"]["ground_truth"] and kwargs["data_source"] == "geo_qa"
    prompt, source, gt, index = row_fields(read_rows(path)[0], "row 0")
    assert source == "geo_qa" and gt == row["reward_model"]["ground_truth"] and index == 0
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
        "extra_info": {"split": "test", "index": 0, "type": None, "hops": None},  # local files say neither
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
    with pytest.raises(ValueError, match="city_country,city_timezone"):
        preprocess.collect_sources([], [], True, "test", FakeHub(), ["city_capital"])


def test_bundled_types_keep_only_those_questions(tmp_path):
    # a curriculum's first stage: the one-hop questions alone
    out = preprocess.main(["--bundled", "--split", "test", "--bundled-types", "city_country,city_timezone",
                           "--out", str(tmp_path / "one_hop.parquet")])
    rows = pq.read_table(out).to_pylist()
    assert len(rows) == 150 and {r["extra_info"]["hops"] for r in rows} == {1}


# Our own words, standing in for the prompt of a user's earlier runs; braces in the text are literal.
USER_TEMPLATE = ("Think in <think> </think>, search with <search> q </search>, answer in "
                 "<answer> </answer>, e.g. {{\"answer\": \"Paris\"}}. Question: {question}\n")


def test_template_file_renders_the_users_prompt(local_files, tmp_path):
    jsonl, _ = local_files
    template = tmp_path / "my_prompt.txt"
    template.write_text(USER_TEMPLATE)
    out = preprocess.main(["--local", f"alpha={jsonl}", "--template-file", str(template),
                           "--out", str(tmp_path / "mine.parquet")])
    rows = pq.read_table(out).to_pylist()
    expected = ("Think in <think> </think>, search with <search> q </search>, answer in "
                "<answer> </answer>, e.g. {\"answer\": \"Paris\"}. Question: who wrote hamlet?\n")
    assert rows[0]["prompt"] == [{"role": "user", "content": expected}]
    assert rows[1]["prompt"][0]["content"].endswith("Question: capital of peru?\n")

    # the trainer's loader hands that text to the tokenizer unchanged
    from verl.utils.dataset import load_examples

    class Recorder:
        chat_template = None

        def __init__(self):
            self.texts = []

        def __call__(self, text, add_special_tokens=True):
            self.texts.append(text)
            return type("Encoding", (), {"input_ids": list(text.encode())})()

    tok = Recorder()
    load_examples(str(out), tok, 10_000, apply_chat_template=False)
    assert tok.texts == [r["prompt"][0]["content"] for r in rows]


@pytest.mark.parametrize("text, message", [
    ("Question: {query}\n", r"placeholders \['query'\].*\['question'\]"),
    ("Answer briefly.\n", r"no \{question\} placeholder"),
    ("JSON {\"a\": 1} Question: {question}\n", r"""placeholders \['"a"'\].*brace twice"""),
    ("Question: {question} }\n", r"Single '}'.*brace twice"),
])
def test_template_file_errors_say_what_to_fix(local_files, tmp_path, text, message):
    jsonl, _ = local_files
    template = tmp_path / "bad.txt"
    template.write_text(text)
    with pytest.raises(ValueError, match=message):
        preprocess.main(["--local", f"alpha={jsonl}", "--template-file", str(template),
                         "--out", str(tmp_path / "never.parquet")])
    assert not (tmp_path / "never.parquet").exists()


def test_template_and_template_file_exclude_each_other(local_files, tmp_path, capsys):
    jsonl, _ = local_files
    with pytest.raises(SystemExit):
        preprocess.main(["--local", f"alpha={jsonl}", "--template", "base", "--template-file",
                         str(tmp_path / "t.txt"), "--out", str(tmp_path / "x.parquet")])
    assert "not allowed with argument" in capsys.readouterr().err


def test_readme_documents_data_formats_and_placeholders():
    from pathlib import Path

    from search_r1.data.templates import PLACEHOLDERS
    from verl.utils.dataset import FILE_TYPES, RLINF_DATA_SOURCE

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    data = readme.split("\n## Data\n", 1)[1].split("\n## ", 1)[0]
    for word in ["--template-file", "solutions", "reward_model.ground_truth.target", "tools_kwargs",
                 RLINF_DATA_SOURCE, *FILE_TYPES, *(f"{{{name}}}" for name in PLACEHOLDERS)]:
        assert word in data, word


def test_response_prefix_ends_the_prompt_as_an_open_assistant_message(tmp_path, capsys):
    def prompts(*args):
        out = preprocess.main(["--bundled", "--split", "test", *args, "--out", str(tmp_path / "p.parquet")])
        return [r["prompt"] for r in pq.read_table(out).to_pylist()]

    think = prompts("--template", "example_think")
    assert all(p[-1] == {"role": "assistant", "content": "<think>"} for p in think)
    assert [p[:1] for p in think] == prompts("--template", "example")   # the same user message before it
    assert prompts("--template", "example_think", "--response-prefix", "")[0] == think[0][:1]
    assert prompts("--response-prefix", "<think> Let me")[0][-1]["content"] == "<think> Let me"
    assert len(prompts()[0]) == 1   # no prefix unless asked
    with pytest.raises(SystemExit):
        prompts("--template", "tool", "--response-prefix", "<think>")
    assert "does not go with the tool template" in capsys.readouterr().err


RLINF_ROWS = [
    {"prompt": "<|im_start|>user\nAnswer the question. Question: who wrote hamlet?<|im_end|>\n"
               "<|im_start|>assistant\n", "solutions": ["William Shakespeare", "Shakespeare"], "query_id": "q1"},
    {"prompt": "Question: capital of peru?\n", "solutions": "Lima", "data_source": "hotpotqa"},
]


def test_local_rlinf_jsonl_converts_as_the_trainer_reads_it(tmp_path):
    """qa_search.py --local takes RLinf's Search-R1 JSONL, which the trainer takes as it is: the
    parquet it writes gives the trainer the same prompts (as written), answers and sources."""
    from verl.utils.dataset import load_examples
    from search_r1.retrieval.models import resolve_model
    from transformers import AutoTokenizer

    rlinf = write_jsonl(tmp_path / "searchr1_train.jsonl", RLINF_ROWS)
    out = preprocess.main(["--local", f"nq={rlinf}", "--out", str(tmp_path / "train.parquet")])
    table = pq.read_table(out)
    assert table.schema.equals(preprocess.TEXT_PROMPT_SCHEMA)
    rows = table.to_pylist()
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in RLINF_ROWS]  # never re-templated
    assert [r["data_source"] for r in rows] == ["nq", "hotpotqa"]  # a row's own source wins over NAME
    assert [r["reward_model"]["ground_truth"]["target"] for r in rows] == [["William Shakespeare", "Shakespeare"],
                                                                            ["Lima"]]
    assert [r["extra_info"]["index"] for r in rows] == [0, 1]

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("all-MiniLM-L6-v2"))
    converted = load_examples(str(out), tokenizer, 1000, apply_chat_template=False)
    original = load_examples(str(rlinf), tokenizer, 1000, apply_chat_template=False)
    assert [e.prompt_ids for e in converted] == [e.prompt_ids for e in original]
    assert [e.ground_truth for e in converted] == [e.ground_truth for e in original]


def test_local_rlinf_chat_rows_merge_with_question_rows_and_text_rows_do_not(local_files, tmp_path):
    jsonl, _ = local_files
    messages = [{"role": "user", "content": "who painted the mona lisa?"}]
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": messages, "solutions": ["Leonardo da Vinci"]}])
    out = preprocess.main(["--local", f"alpha={jsonl}", "--local", f"rlinf={chat}",
                           "--out", str(tmp_path / "merged.parquet")])
    rows = pq.read_table(out).to_pylist()
    assert rows[0]["prompt"] == make_prompt("who wrote hamlet", "instruct")
    assert rows[2]["prompt"] == messages and rows[2]["data_source"] == "rlinf"
    assert [r["extra_info"]["index"] for r in rows] == [0, 1, 2]

    text = write_jsonl(tmp_path / "text.jsonl", RLINF_ROWS)
    with pytest.raises(ValueError, match=r"2 rows give the prompt as text .* data.train_files=\[a,b\]"):
        preprocess.main(["--local", f"alpha={jsonl}", "--local", f"nq={text}", "--out", str(tmp_path / "x.parquet")])
    with pytest.raises(ValueError, match="without --template tool"):
        preprocess.main(["--local", f"nq={text}", "--template", "tool", "--out", str(tmp_path / "y.parquet")])
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": [{"text": "hi"}], "solutions": ["a"]}])
    with pytest.raises(ValueError, match="row 0: `prompt` must be text or a list of messages"):
        preprocess.read_qa_file(bad)
