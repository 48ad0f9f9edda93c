"""The questions of test parquet files (the training schema): text, gold answers, the prompt."""
from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass

from search_r1.rewards import gold_answers


@dataclass
class Question:
    data_source: str
    question: str
    golds: list[str]
    messages: list[dict]   # the parquet's prompt: the search mode's prompt
    index: int
    kind: str | None = None   # extra_info.type and .hops, where the data has them (the bundled task)
    hops: int | None = None


def question_text(messages: list[dict]) -> str:
    """The question inside a prompt built by our templates (or the original Search-R1 ones):
    the text after the last "Question: " (a response prefix, the assistant's, is not part of it)."""
    content = "".join(m["content"] for m in messages if m.get("role") != "assistant")
    at = content.rfind("Question: ")
    if at < 0:
        raise ValueError(f"cannot find the question in the prompt {content[:200]!r}…: it needs a "
                         "'Question: …' line (build the parquet with scripts/data_process/qa_search.py)")
    return content[at + len("Question: "):].strip()


def load_questions(files: list[str], limit: int | None = None) -> list[Question]:
    """Questions from test parquet files, the first `limit` of each data source."""
    import pyarrow.parquet as pq

    questions, per_source = [], defaultdict(int)
    for path in files:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no test file {path}: build one with "
                                    "`python scripts/data_process/qa_search.py --split test --out FILE`")
        table = pq.read_table(path)
        missing = {"data_source", "prompt", "reward_model"} - set(table.column_names)
        if missing:
            raise ValueError(f"{path} lacks the columns {sorted(missing)}: build it with "
                             "scripts/data_process/qa_search.py")
        for i, row in enumerate(table.to_pylist()):
            source = row["data_source"]
            if limit is not None and per_source[source] >= limit:
                continue
            per_source[source] += 1
            extra = row.get("extra_info") or {}
            question = extra.get("question") or question_text(row["prompt"])
            questions.append(Question(source, question, gold_answers(row["reward_model"]["ground_truth"]),
                                      row["prompt"], int(extra.get("index", i)), extra.get("type"),
                                      extra.get("hops")))
    if not questions:
        raise ValueError(f"no questions in {files}")
    return questions
