"""The training data loader on the layouts users bring: the original Search-R1's parquet (also with
a tokenizer that has no chat template), verl's system + user rows, RLinf's JSONL; and the promise
that the prompt text reaches the tokenizer exactly as the row gives it."""
import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from verl.utils.dataset import RLINF_DATA_SOURCE, load_examples

# Our own words, standing in for whatever prompt a user's earlier runs used.
USER_PROMPT = ("Reply to the question. Reason in <think> </think>, look things up with "
               "<search> query </search>, answer in <answer> </answer>. Question: {q}\n")


class RecordingTokenizer:
    """Stands in for a tokenizer and keeps every text and message list it is given."""

    def __init__(self, chat_template: str | None = None):
        self.chat_template = chat_template
        self.texts, self.chats = [], []

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and not tokenize
        self.chats.append(messages)
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def __call__(self, text, add_special_tokens=True):
        self.texts.append(text)
        ids = list(text.encode())
        return type("Encoding", (), {"input_ids": ids})()


def original_nq_rows(questions):
    """Rows as the original nq_search.py writes them: HF `datasets.map` keeps FlashRAG's own
    columns next to the new ones, and `extra_info.index` counts from 0."""
    return [{"id": f"train_{i}", "question": q, "golden_answers": [a],
             "data_source": "nq", "prompt": [{"role": "user", "content": USER_PROMPT.format(q=q)}],
             "ability": "fact-reasoning",
             "reward_model": {"style": "rule", "ground_truth": {"target": [a]}},
             "extra_info": {"split": "train", "index": i}}
            for i, (q, a) in enumerate(questions)]


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from search_r1.local_models import load_smollm2_tokenizer
    return load_smollm2_tokenizer()


QUESTIONS = [("who wrote hamlet?", "Shakespeare"), ("capital of peru?", "Lima")]


def test_original_parquet_without_chat_template_uses_raw_text(smollm2_tokenizer, tmp_path, caplog,
                                                              monkeypatch):
    path = write_parquet(tmp_path / "train.parquet", original_nq_rows(QUESTIONS))
    monkeypatch.setattr(smollm2_tokenizer, "chat_template", None)  # a base model's tokenizer
    with caplog.at_level(logging.WARNING, logger="verl.utils.dataset"):
        examples = load_examples(path, smollm2_tokenizer, 512, apply_chat_template=True)
    for e, (q, a) in zip(examples, QUESTIONS):
        assert e.prompt_ids == smollm2_tokenizer(USER_PROMPT.format(q=q)).input_ids
        assert (e.data_source, e.ground_truth) == ("nq", {"target": [a]})
    assert [e.index for e in examples] == [0, 1]
    told = [r for r in caplog.records if "no chat template" in r.getMessage()]
    assert len(told) == 1 and "raw text" in told[0].getMessage()


def test_original_parquet_with_chat_template_is_not_retemplated(smollm2_tokenizer, tmp_path):
    rows = original_nq_rows(QUESTIONS)
    path = write_parquet(tmp_path / "train.parquet", rows)
    tok = RecordingTokenizer(chat_template="{{ messages }}")
    load_examples(path, tok, 10_000)
    assert tok.chats == [r["prompt"] for r in rows]  # the row's messages, as written
    assert tok.texts == [f"<user>{r['prompt'][0]['content']}<assistant>" for r in rows]

    # the same ids as the model's own chat template gives for the row's messages
    real = smollm2_tokenizer
    examples = load_examples(path, real, 10_000)
    text = real.apply_chat_template(rows[0]["prompt"], add_generation_prompt=True, tokenize=False)
    assert USER_PROMPT.format(q=QUESTIONS[0][0]) in text
    assert examples[0].prompt_ids == real(text, add_special_tokens=False).input_ids


def test_messages_are_joined_by_newlines_without_chat_template(tmp_path):
    # verl's search-tool rows: a system and a user message, tools in extra_info
    row = {"data_source": "searchR1_nq", "ability": "fact-reasoning",
           "prompt": [{"role": "system", "content": "You help."},
                      {"role": "user", "content": "Question: who wrote hamlet?"}],
           "reward_model": {"style": "rule", "ground_truth": {"target": ["Shakespeare"]}},
           "extra_info": {"index": 7, "split": "train", "need_tools_kwargs": True,
                          "tools_kwargs": {"search": {"create_kwargs": {"question": "q"}}}}}
    path = write_parquet(tmp_path / "verl.parquet", [row])
    for apply_chat_template, template in ((False, "{{ messages }}"), (True, None)):
        tok = RecordingTokenizer(chat_template=template)
        [example] = load_examples(path, tok, 1000, apply_chat_template=apply_chat_template)
        assert tok.texts == ["You help.\nQuestion: who wrote hamlet?"] and not tok.chats
        assert example.index == 7


def test_rlinf_jsonl(tmp_path):
    rows = [{"prompt": "<|im_start|>user\nwho wrote hamlet?<|im_end|>\n<|im_start|>assistant\n",
             "solutions": ["William Shakespeare", "Shakespeare"]},
            {"prompt": "plain text prompt\n", "solutions": "Lima", "data_source": "hotpotqa"}]
    path = write_jsonl(tmp_path / "searchr1_train.jsonl", rows)
    tok = RecordingTokenizer()
    examples = load_examples(path, tok, 1000, apply_chat_template=False)
    assert tok.texts == [r["prompt"] for r in rows]  # as written
    assert [e.ground_truth for e in examples] == [{"target": ["William Shakespeare", "Shakespeare"]},
                                                  {"target": ["Lima"]}]
    assert [e.data_source for e in examples] == [RLINF_DATA_SOURCE, "hotpotqa"]
    assert [e.index for e in examples] == [0, 1] and [(e.extra_info or {}).get("hops") for e in examples] == [None, None]

    # text would be wrapped in a second template: refused, saying what to set
    with pytest.raises(ValueError, match="data.apply_chat_template=false"):
        load_examples(path, RecordingTokenizer(chat_template="{{ messages }}"), 1000)


def test_rlinf_chat_messages_and_json_files(tmp_path):
    messages = [{"role": "user", "content": "who wrote hamlet?"}]
    path = tmp_path / "val.json"
    path.write_text(json.dumps([{"prompt": messages, "solutions": ["Shakespeare"]}]))
    tok = RecordingTokenizer(chat_template="{{ messages }}")
    [example] = load_examples(str(path), tok, 1000)
    assert tok.chats == [messages] and example.ground_truth == {"target": ["Shakespeare"]}


def test_search_r1_rows_as_jsonl(tmp_path):
    rows = original_nq_rows(QUESTIONS)
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    tok = RecordingTokenizer()
    examples = load_examples(path, tok, 10_000, apply_chat_template=False)
    assert tok.texts == [r["prompt"][0]["content"] for r in rows]
    assert [e.ground_truth for e in examples] == [r["reward_model"]["ground_truth"] for r in rows]


def test_unknown_formats_name_the_accepted_ones(tmp_path):
    csv = tmp_path / "train.csv"
    csv.write_text("question,answer\n")
    with pytest.raises(ValueError, match=r"\.parquet, \.jsonl, \.json"):
        load_examples(str(csv), RecordingTokenizer(), 100)
    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": "q", "golden_answers": ["a"]}])
    with pytest.raises(ValueError, match="row 0 has no `prompt`.*RLinf rows \\(prompt, solutions\\)"):
        load_examples(path, RecordingTokenizer(), 100)
    path = write_jsonl(tmp_path / "odd.jsonl", [{"prompt": "p", "answer": "a"}])
    with pytest.raises(ValueError, match=r"fields \['answer', 'prompt'\].*Search-R1/verl rows"):
        load_examples(path, RecordingTokenizer(), 100)
    with pytest.raises(FileNotFoundError, match="qa_search.py"):
        load_examples(str(tmp_path / "missing.parquet"), RecordingTokenizer(), 100)


def test_colliding_indices_are_renumbered(tmp_path, caplog):
    # the original's merged NQ + HotpotQA file restarts extra_info.index for each source
    nq = original_nq_rows(QUESTIONS)
    hotpot = [{**r, "data_source": "hotpotqa"} for r in original_nq_rows(QUESTIONS[::-1])]
    path = write_parquet(tmp_path / "merged.parquet", nq + hotpot)
    with caplog.at_level(logging.WARNING, logger="verl.utils.dataset"):
        examples = load_examples(path, RecordingTokenizer(), 10_000, apply_chat_template=False)
    assert [e.index for e in examples] == [0, 1, 2, 3]
    assert any("repeated" in r.getMessage() for r in caplog.records)

    # distinct indices are kept
    rows = [{**r, "extra_info": {"split": "train", "index": 10 + i}} for i, r in enumerate(nq)]
    examples = load_examples(write_parquet(tmp_path / "own.parquet", rows), RecordingTokenizer(), 10_000,
                             apply_chat_template=False)
    assert [e.index for e in examples] == [10, 11]


def test_extra_info_reaches_the_examples_with_the_hop_count_where_the_data_has_it(tmp_path):
    rows = [{"data_source": "geo_qa", "prompt": [{"role": "user", "content": f"q{i}"}],
             "reward_model": {"ground_truth": {"target": ["a"]}},
             "extra_info": {"index": i, **({"hops": i} if i else {})}} for i in range(3)]
    examples = load_examples(write_parquet(tmp_path / "t.parquet", rows), RecordingTokenizer(), 1000,
                             apply_chat_template=False)
    assert [(e.extra_info or {}).get("hops") for e in examples] == [None, 1, 2]   # for the reward (by hop count)


def test_a_prompt_ending_with_the_assistant_begins_the_response(smollm2_tokenizer, tmp_path):
    # qa_search.py --response-prefix "<think>": the prompt ends with an unfinished assistant message
    rows = original_nq_rows(QUESTIONS[:1])
    rows[0]["prompt"] = rows[0]["prompt"] + [{"role": "assistant", "content": "<think>"}]
    path = write_parquet(tmp_path / "train.parquet", rows)
    [example] = load_examples(path, smollm2_tokenizer, 10_000)
    text = smollm2_tokenizer.decode(example.prompt_ids)
    plain = smollm2_tokenizer.apply_chat_template(rows[0]["prompt"][:1], add_generation_prompt=True,
                                                  tokenize=False)
    # the generation prompt, then the prefix, left open: no end-of-turn after it
    assert text == plain + "<think>"
    assert example.response_prefix == "<think>"
    # without a chat template the messages are joined, the prefix last
    [raw] = load_examples(path, smollm2_tokenizer, 10_000, apply_chat_template=False)
    assert smollm2_tokenizer.decode(raw.prompt_ids).endswith("\n<think>") and raw.response_prefix == "<think>"
    # an ordinary prompt has none
    assert load_examples(write_parquet(tmp_path / "plain.parquet", original_nq_rows(QUESTIONS)),
                         smollm2_tokenizer, 10_000)[0].response_prefix == ""


def test_the_tool_protocol_refuses_a_response_prefix(smollm2_tokenizer):
    from search_r1.agent.search_tool import search_chat_format
    from verl.utils.dataset import encode_prompt
    prompt = [{"role": "user", "content": "Question: who wrote hamlet?"}, {"role": "assistant", "content": "<think>"}]
    with pytest.raises(ValueError, match="tool protocol does not take"):
        encode_prompt(prompt, smollm2_tokenizer, True, "row 0", search_chat_format(smollm2_tokenizer))
