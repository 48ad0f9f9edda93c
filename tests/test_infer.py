"""infer.py through its command line: a real model (tiny, random) and the real retrieval server."""
import subprocess
import sys
from pathlib import Path

import pytest

import infer

ROOT = Path(__file__).resolve().parents[1]


def test_colourise_follows_tags_across_calls():
    state = [""]
    out = infer.colourise("<think>hmm", state, True) + infer.colourise(" more</think> plain", state, True)
    assert "\033[2mhmm" in out and "\033[2m more" in out and out.endswith(" plain")
    assert infer.colourise("<answer>x</answer>", [""], False) == "<answer>x</answer>"


@pytest.mark.e2e  # infer.py in processes of its own
def test_infer_question_and_interactive(tiny_model_dir, dense_server):
    base = [sys.executable, str(ROOT / "infer.py"), "--model", tiny_model_dir, "--retriever-url",
            dense_server.url + "/retrieve", "--max-response-length", "48", "--no-colour"]
    r = subprocess.run(base + ["What is the capital of Japan?"], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "answer:" in r.stdout and "finished by" in r.stdout
    r = subprocess.run(base, input="Who painted the Mona Lisa?\n\n", capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("answer:") == 1 and "Ask a question" in r.stdout
    # the tool-calling protocol: the prompt lists the search tool (the tiny model's template has none,
    # so ours is used, with its warning)
    r = subprocess.run(base + ["--protocol", "tools", "What is the capital of Japan?"], capture_output=True,
                       text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "answer:" in r.stdout and "searches, finished by" in r.stdout and "ChatML tool template" in r.stderr
    # a model trained on data with a response prefix: the response starts with it, shown first
    r = subprocess.run(base + ["--response-prefix", "<think>", "What is the capital of Japan?"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("<think>") and "answer:" in r.stdout
    r = subprocess.run(base + ["--protocol", "tools", "--response-prefix", "<think>", "Who?"], capture_output=True,
                       text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 2 and "tags protocol only" in r.stderr
    r = subprocess.run(base + ["--protocol", "tools", "--turn-prefix", "<think>", "Who?"], capture_output=True,
                       text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 2 and "--turn-prefix goes with the tags protocol only" in r.stderr


def test_start_hints_name_a_missing_server_and_the_untrained_model(tmp_path, monkeypatch):
    import socket
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/retrieve"
    monkeypatch.chdir(tmp_path)
    args = infer.build_parser().parse_args(["--retriever-url", url])
    warning, note = infer.start_hints(args)
    assert f"no retrieval server answers at {url}" in warning and "search-r1 serve --retriever_name bm25" in warning
    assert "untrained bundled SmolLM2" in note and "make demo" in note
    (tmp_path / "outputs" / "demo" / "run" / "hf_actor").mkdir(parents=True)
    assert "--model outputs/demo/run/hf_actor" in infer.start_hints(args)[1]


@pytest.mark.e2e  # dense_server: a server process
def test_no_hints_with_a_healthy_server_and_a_model(dense_server):
    args = infer.build_parser().parse_args(["--model", "m", "--retriever-url", dense_server.url + "/retrieve"])
    assert infer.start_hints(args) == []


def test_a_training_checkpoint_is_refused_with_what_to_use_instead(tmp_path, capsys):
    """infer.py reads model directories; a run or checkpoint goes through the export, which checks it."""
    import torch

    from verl.checkpoint.store import save_checkpoint
    save_checkpoint(tmp_path / "run" / "checkpoints", 2, {"actor": (torch.nn.Linear(2, 2), None, None)}, {})
    for given in (tmp_path / "run", tmp_path / "run" / "checkpoints" / "global_step_2"):
        with pytest.raises(SystemExit) as exited:
            infer.main(["--model", str(given), "Who?"])
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert "is a training checkpoint" in err and str(tmp_path / "run" / "hf_actor") in err
        assert "python -m verl.checkpoint export --checkpoint" in err
    assert infer.checkpoint_problem(str(tmp_path)) is None  # no checkpoint there: a model directory as before


def test_prompt_asks_for_thinking_only_where_the_template_does_not(thinking_tokenizer_dir):
    """With the thinking switch on, the model's template asks for thinking, so our prompt leaves out its
    <think> instruction; with it off (--chat-template-kwargs), the instruction stays and the kwargs reach
    the template (its empty think block ends the prompt). Both protocols."""
    from transformers import AutoTokenizer

    from search_r1.agent.search_tool import search_chat_format
    from search_r1.data.templates import THINK_INSTRUCTION
    tok = AutoTokenizer.from_pretrained(thinking_tokenizer_dir)
    for protocol in ("tags", "tools"):
        texts = {}
        for flag in ("{}", '{"enable_thinking": false}'):
            args = infer.build_parser().parse_args(["--protocol", protocol, "--chat-template-kwargs", flag, "q"])
            chat = search_chat_format(tok, args.chat_template_kwargs) if protocol == "tools" else None
            texts[flag] = tok.decode(infer.prompt_ids(tok, "Where is Tartu?", args, chat))
        assert THINK_INSTRUCTION.strip() not in texts["{}"] and not texts["{}"].endswith("</think>\n\n")
        assert THINK_INSTRUCTION.strip() in texts['{"enable_thinking": false}']
        assert texts['{"enable_thinking": false}'].endswith("<think>\n\n</think>\n\n")
    with pytest.raises(SystemExit):
        infer.build_parser().parse_args(["--chat-template-kwargs", "[1]", "q"])
