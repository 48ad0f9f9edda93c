"""Every command takes both flag spellings (the original launcher's underscores and dashes), names
the same thing the same way, and shows its defaults in help."""
import subprocess
import sys
from pathlib import Path

import pytest

from search_r1.cli import build_parser, normalize_flags

ROOT = Path(__file__).resolve().parents[2]


def parse(*argv):
    return build_parser().parse_args(normalize_flags(list(argv)))


@pytest.mark.parametrize("spelling", ["--index_path", "--index-path"])
def test_serve_takes_both_spellings(spelling):
    args = parse("serve", spelling, "idx", "--corpus_path=c.jsonl", "--encoder-cuda-graphs")
    assert args.index_path == "idx" and args.corpus_path == "c.jsonl" and args.encoder_cuda_graphs


def test_eval_and_sft_take_underscores_too():
    args = parse("eval", "--model", "m", "--data", "d.parquet", "--out", "o", "--retriever_url", "http://x/retrieve",
                 "--max_turns", "2", "--engine_core", "separate")
    assert (args.retriever_url, args.max_turns, args.engine_core) == ("http://x/retrieve", 2, "separate")
    args = parse("sft", "--out", "o", "--bundled", "8", "--retriever_url", "http://x/retrieve", "--max_obs_length=64")
    assert args.retriever_url == "http://x/retrieve" and args.max_obs_length == 64


def test_retrieve_names_the_url_as_the_other_commands_do():
    assert parse("retrieve", "q", "--retriever-url", "http://x/retrieve").retriever_url == "http://x/retrieve"
    assert parse("retrieve", "q", "--url", "http://y/retrieve").retriever_url == "http://y/retrieve"


def test_help_shows_one_spelling_and_the_defaults():
    sub = next(a for a in build_parser()._actions if a.dest == "cmd").choices
    serve = sub["serve"].format_help()
    assert "--index-path" in serve and "--index_path" not in serve
    assert "(default: 8000)" in serve and "(default: 127.0.0.1)" in serve


def test_infer_takes_both_spellings():
    r = subprocess.run([sys.executable, "infer.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "(default: 3)" in r.stdout
    from infer import build_parser as infer_parser
    assert infer_parser().parse_args(normalize_flags(["q", "--max_turns", "2"])).max_turns == 2
