"""Turn QA datasets into the parquet files the trainer reads.

Each row: `data_source`, `prompt` (one user message: a template filled in for the question; with
`--response-prefix`, or `--template example_think`, an unfinished assistant message after it that
the model's response continues, e.g. "<think>"),
`ability`, `reward_model = {"style": "rule", "ground_truth": {"target": [answers]}}` and
`extra_info = {"split", "index", "type", "hops"}`: the question's kind and its number of hops where
the source says (the bundled task, local files with those columns), null elsewhere; `search-r1 eval`
reports by them.

Deviation from the original scripts: `extra_info.index` runs over all merged sources, so it is
unique in a file and can serve as the prompt's group id; the original restarted it at 0 for each
source, which made ids collide when NQ and HotpotQA were trained on together.

The template is one of ours (`--template base|instruct|example|example2|example_think|example2_think|tool`;
`tool` writes verl's search-tool rows: a system message and `extra_info.tools_kwargs`, for the
tool-calling protocol) or the user's (`--template-file FILE`, a format string with the placeholders of
`templates.PLACEHOLDERS`), so data can be rebuilt with the exact prompt of earlier runs; the trainer
feeds the prompt as written. `--bundled-types` keeps only some of the bundled question types (a
curriculum's first stage: the one-hop ones).

Sources, merged in this order:
- FlashRAG datasets by name (`--sources nq,hotpotqa`), from the Hugging Face hub or from a local
  copy of that repository (`--local-dir`, holding `<name>/<split>.jsonl`);
- local files with `question` and `golden_answers` columns (`--local name=path`, JSONL or parquet),
  or RLinf's rows, `prompt` and `solutions`, as its Search-R1 JSONL has them (and the trainer reads
  them): their prompt is kept exactly as written (text, or chat messages), since it is already the
  model's input and holds no separate question to fill a template with; `solutions` become the
  answers, and a row's own `data_source` wins over the NAME of `--local`. A text prompt makes a
  text `prompt` column, which the trainer feeds with `data.apply_chat_template=false`; text and chat
  prompts cannot share a file;
- the bundled geography task (`--bundled`).
Several FlashRAG datasets have no test split; asking for `test` then takes `dev`, as is usual.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq

from search_r1.data import bundled
from verl.utils.dataset import row_fields
from search_r1.data.templates import RESPONSE_PREFIXES, TEMPLATES, TOOL_SYSTEM, fill_template, read_template_file

log = logging.getLogger(__name__)

HUB_REPO = "RUC-NLPIR/FlashRAG_datasets"
FLASHRAG_SOURCES = ["nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique",
                    "bamboogle"]
ABILITY = "fact-reasoning"

_ANSWERS = pa.struct([("target", pa.list_(pa.string()))])
_EXTRA_INFO = [("split", pa.string()), ("index", pa.int64()), ("type", pa.string()), ("hops", pa.int64())]


def _schema(extra_info: list) -> pa.Schema:
    return pa.schema([
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", _ANSWERS)])),
        ("extra_info", pa.struct(extra_info)),
    ])


SCHEMA = _schema(_EXTRA_INFO)
# RLinf's text prompts, kept as written: the prompt column holds the text.
TEXT_PROMPT_SCHEMA = SCHEMA.set(SCHEMA.get_field_index("prompt"), pa.field("prompt", pa.string()))

# (dataset name, split) -> records with "question" and "golden_answers".
Loader = Callable[[str, str], list[dict]]


class SplitNotFound(LookupError):
    """The dataset exists but has no such split."""


def hub_loader(name: str, split: str) -> list[dict]:
    """One FlashRAG dataset split from the Hugging Face hub (needs network or the HF cache)."""
    from datasets import load_dataset

    try:
        ds = load_dataset(HUB_REPO, name, split=split)
    except ValueError as e:
        if "Unknown split" in str(e):
            raise SplitNotFound(str(e)) from e
        raise
    except ConnectionError as e:
        raise ConnectionError(f"Could not reach {HUB_REPO} on the Hugging Face hub ({e}). On an "
                              f"offline machine, copy the repository there (`huggingface-cli "
                              f"download {HUB_REPO} --repo-type dataset --local-dir DIR`) and "
                              "pass --local-dir DIR.") from e
    return [{"question": r["question"], "golden_answers": r["golden_answers"]} for r in ds]


def local_dir_loader(root: str | os.PathLike) -> Loader:
    """Loader over a local copy of the FlashRAG repository: `<root>/<name>/<split>.jsonl`
    (or `.parquet`)."""
    root = Path(root)

    def load(name: str, split: str) -> list[dict]:
        for suffix in (".jsonl", ".parquet"):
            path = root / name / f"{split}{suffix}"
            if path.exists():
                return read_qa_file(path)
        if not (root / name).is_dir():
            raise FileNotFoundError(f"No folder {root / name}: download the dataset with "
                                    f"`huggingface-cli download {HUB_REPO} --repo-type dataset "
                                    f"--include '{name}/*' --local-dir {root}`.")
        raise SplitNotFound(f"{root / name} has no {split}.jsonl or {split}.parquet")

    return load


def load_split(name: str, split: str, loader: Loader) -> list[dict]:
    """Records of `split`; for `test`, falls back to `dev` when the dataset has no test split."""
    tried = [split] + (["dev"] if split == "test" else [])
    for s in tried:
        try:
            records = loader(name, s)
        except SplitNotFound:
            continue
        if s != split:
            log.info("%s has no %s split; using %s instead", name, split, s)
        return records
    raise SplitNotFound(f"{name} has no {' or '.join(tried)} split: drop it from --sources or "
                        "ask for another --split.")


def read_qa_file(path: str | os.PathLike) -> list[dict]:
    """Records from a JSONL or parquet file with `question` and `golden_answers` columns, or with
    RLinf's `prompt` and `solutions` (records `{"prompt", "golden_answers", "data_source"}` then)."""
    path = Path(path)
    if path.suffix == ".parquet":
        records = pq.read_table(path).to_pylist()
    else:
        with open(path, encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
    for i, r in enumerate(records):
        if "question" in r and "golden_answers" in r:
            continue
        if isinstance(r, dict) and "prompt" in r and "solutions" in r:
            records[i] = _rlinf_record(r, f"{path} row {i}")
            continue
        raise ValueError(f"{path} row {i} has fields {sorted(r)}; each row needs `question` "
                         "and `golden_answers` (a list of acceptable answers), or RLinf's `prompt` "
                         "and `solutions`.")
    return records


def _rlinf_record(row: dict, where: str) -> dict:
    """An RLinf row (`prompt`, `solutions`, optional `data_source`) read as the trainer reads it."""
    prompt, data_source, ground_truth, _ = row_fields(row, where)
    if not isinstance(prompt, str):
        try:  # only the role and content of each message: the parquet column holds no more
            prompt = [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]
        except (TypeError, KeyError) as e:
            raise ValueError(f"{where}: `prompt` must be text or a list of messages with a `role` and a "
                             f"`content` each ({e!r})") from None
    return {"prompt": prompt, "golden_answers": ground_truth["target"],
            "data_source": row.get("data_source")}


# Rows of the tool protocol, in verl's search-tool layout: a system message, and per row the search
# tool's creation arguments in extra_info.tools_kwargs (verl's tools read them; ours need none).
TOOL_SCHEMA = _schema(_EXTRA_INFO + [
    ("need_tools_kwargs", pa.bool_()), ("question", pa.string()),
    ("tools_kwargs", pa.struct([("search", pa.struct([("create_kwargs", pa.struct([
        ("ground_truth", _ANSWERS), ("question", pa.string()), ("data_source", pa.string())]))]))])),
])


def make_row(question: str, answers, data_source: str, split: str, index: int,
             template_text: str, tool: bool = False, kind: str | None = None, hops: int | None = None,
             response_prefix: str = "") -> dict:
    if isinstance(answers, str):  # some files store a single answer as a bare string
        answers = [answers]
    ground_truth = {"target": [str(a) for a in answers]}
    prompt = [{"role": "user", "content": fill_template(template_text, question)}]
    if response_prefix:  # an unfinished assistant message: the model's response continues it
        prompt.append({"role": "assistant", "content": response_prefix})
    extra_info = {"split": split, "index": index}
    extra_info |= {k: v for k, v in (("type", kind), ("hops", hops)) if v is not None}
    if tool:
        prompt = [{"role": "system", "content": TOOL_SYSTEM}] + prompt
        extra_info |= {"need_tools_kwargs": True, "question": question, "tools_kwargs": {"search": {"create_kwargs": {
            "ground_truth": ground_truth, "question": question, "data_source": data_source}}}}
    return {"data_source": data_source, "prompt": prompt, "ability": ABILITY,
            "reward_model": {"style": "rule", "ground_truth": ground_truth}, "extra_info": extra_info}


def build_rows(sources: list[tuple[str, list[dict]]], split: str,
               template_text: str = TEMPLATES["instruct"], tool: bool = False,
               response_prefix: str = "") -> list[dict]:
    """Rows for all sources in order; `extra_info.index` is a running index over all of them.

    `template_text` is a template's text (TEMPLATES or `read_template_file`), not its name; `tool`
    writes verl's search-tool layout (the tool protocol); `response_prefix`, where given, ends each
    prompt as an unfinished assistant message."""
    rows = []
    for name, records in sources:
        kept = 0
        for r in records:
            if "prompt" in r:  # RLinf's: the model's input already, kept as written
                if tool:
                    raise ValueError(f"{name}: RLinf rows (prompt, solutions) carry their own prompt, and "
                                     "--template tool writes verl's search-tool rows from questions: convert "
                                     "them without --template tool")
                rows.append(prompt_row(r["prompt"], r["golden_answers"], r.get("data_source") or name,
                                       split, len(rows)))
                kept += 1
            else:
                rows.append(make_row(r["question"], r["golden_answers"], name, split, len(rows),
                                     template_text, tool, r.get("type"), r.get("hops"), response_prefix))
        log.info("%s/%s: %d rows", name, split, len(records))
        if kept:
            log.info("%s: %d RLinf rows (prompt, solutions) keep their prompt as written; the template "
                     "and the response prefix apply to question rows only", name, kept)
    return rows


def prompt_row(prompt: str | list[dict], answers, data_source: str, split: str, index: int) -> dict:
    """A row whose prompt is given (RLinf's), in the layout of `make_row`."""
    if isinstance(answers, str):
        answers = [answers]
    ground_truth = {"target": [str(a) for a in answers]}
    return {"data_source": data_source, "prompt": prompt, "ability": ABILITY,
            "reward_model": {"style": "rule", "ground_truth": ground_truth},
            "extra_info": {"split": split, "index": index}}


def write_parquet(rows: list[dict], path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tool = bool(rows) and "tools_kwargs" in rows[0]["extra_info"]
    text = sum(isinstance(r["prompt"], str) for r in rows)
    if 0 < text < len(rows):
        raise ValueError(f"{text} rows give the prompt as text (RLinf's) and {len(rows) - text} as chat "
                         "messages: one parquet column holds one kind; write them to two files (the trainer "
                         "takes several: data.train_files=[a,b])")
    schema = TOOL_SCHEMA if tool else TEXT_PROMPT_SCHEMA if text else SCHEMA
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def collect_sources(names: list[str], local: list[str], use_bundled: bool, split: str,
                    loader: Loader, bundled_types: list[str] | None = None) -> list[tuple[str, list[dict]]]:
    """(data_source, records): FlashRAG datasets first, then local files, then the bundled task (only
    the question types in `bundled_types`, when given: e.g. the one-hop ones for a curriculum)."""
    sources = []
    for name in names:
        if name not in FLASHRAG_SOURCES:
            log.warning("%s is not one of the known FlashRAG datasets %s; trying it anyway",
                        name, FLASHRAG_SOURCES)
        sources.append((name, load_split(name, split, loader)))
    for spec in local:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--local {spec!r} should look like name=path/to/file.jsonl")
        sources.append((name, read_qa_file(path)))
    if use_bundled:
        if split not in ("train", "test"):
            raise ValueError(f"The bundled task has train and test splits, not {split!r}.")
        records = bundled.read_jsonl(bundled.bundled_paths()[split])
        if bundled_types:
            known = [qtype for qtype, _, _ in bundled.QUESTION_TYPES]
            if unknown := sorted(set(bundled_types) - set(known)):
                raise ValueError(f"--bundled-types {','.join(unknown)}: the bundled question types are "
                                 f"{','.join(known)}")
            records = [r for r in records if r["type"] in bundled_types]
        sources.append((bundled.DATA_SOURCE, records))
    return sources


def main(argv: list[str] | None = None, loader: Loader | None = None) -> Path:
    parser = argparse.ArgumentParser(description="Build a Search-R1 training or test parquet file.")
    parser.add_argument("--sources", default="",
                        help=f"comma-separated FlashRAG datasets, e.g. nq,hotpotqa "
                             f"(known: {','.join(FLASHRAG_SOURCES)})")
    parser.add_argument("--local", action="append", default=[], metavar="NAME=PATH",
                        help="a local JSONL/parquet file with question and golden_answers, or RLinf's "
                             "prompt and solutions (the prompt kept as written); NAME becomes data_source "
                             "where a row has none (repeatable)")
    parser.add_argument("--bundled", action="store_true", help="add the bundled geography task")
    parser.add_argument("--bundled-types", default="", metavar="TYPES",
                        help="only these bundled question types, comma-separated (e.g. city_country,city_timezone: "
                             "the one-hop ones); default: all")
    parser.add_argument("--split", default="train", help="train, dev or test")
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--template", default="instruct", choices=sorted(TEMPLATES),
                        help="one of our prompt templates (base: plain text for base models; example: "
                             "instruct with one worked search; example2: with two, the second made from the "
                             "first's result; example_think, example2_think: the response begun with "
                             "<think>; tool: the tool-calling protocol, rows in verl's search-tool layout)")
    prompt.add_argument("--template-file", default=None, metavar="FILE",
                        help="your own prompt template, e.g. that of earlier runs: a text file "
                             "with {question} where the question goes (literal braces doubled); "
                             "its text is used exactly")
    parser.add_argument("--response-prefix", default=None, metavar="TEXT",
                        help="text the model's response starts with, e.g. '<think>': each prompt ends "
                             "with it as an unfinished assistant message, and the rewards read it as "
                             "the response's start (default: the template's own, '<think>' for "
                             "example_think and example2_think, else none)")
    parser.add_argument("--local-dir", default=None,
                        help="local copy of the FlashRAG dataset repository, "
                             "used instead of the hub")
    parser.add_argument("--out", required=True, help="output parquet file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    names = [n.strip() for n in args.sources.split(",") if n.strip()]
    if not (names or args.local or args.bundled):
        parser.error("nothing to convert: give --sources, --local or --bundled")
    # Read before any download, so a bad template fails at once.
    template_text = (read_template_file(args.template_file) if args.template_file
                     else TEMPLATES[args.template])
    # with --template-file, args.template keeps its default, which has no prefix
    prefix = args.response_prefix if args.response_prefix is not None else RESPONSE_PREFIXES.get(args.template, "")
    if prefix and args.template == "tool":
        parser.error("--response-prefix does not go with the tool template: its prompts end with the "
                     "user's message, as verl's tool-calling recipe writes them")
    if loader is None:
        loader = local_dir_loader(args.local_dir) if args.local_dir else hub_loader
    types = [t.strip() for t in args.bundled_types.split(",") if t.strip()]
    rows = build_rows(collect_sources(names, args.local, args.bundled, args.split, loader, types),
                      args.split, template_text, tool=args.template == "tool", response_prefix=prefix)
    path = write_parquet(rows, args.out)
    log.info("wrote %d rows to %s", len(rows), path)
    return path


if __name__ == "__main__":
    main()
