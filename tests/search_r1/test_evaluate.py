"""Evaluation: metrics on hand-made predictions, the paper-table layout, and `search-r1 eval` end to
end with the tiny model (HF engine) against a real BM25 server over the bundled corpus, in all three
modes, from a training checkpoint too; retrieval-only answer recall."""
import argparse
import json
import os
import subprocess
from pathlib import Path

import pytest

from search_r1 import evaluate
from search_r1.evaluate import EvalConfig, paper_table, question_text, run_eval, score_predictions
from search_r1.rewards import check_format

ROOT = Path(__file__).resolve().parents[2]


def rec(source, golds, prediction, searches=0, turns=1, tokens=10):
    response = "" if prediction is None else f"<answer> {prediction} </answer>"
    return {"data_source": source, "golds": golds, "response": response, "prediction": prediction,
            "searches": searches, "turns": turns, "response_tokens": tokens}


def test_score_predictions_two_sources_and_macro_average():
    records = [
        rec("nq", ["Paris"], "paris", searches=1, turns=2, tokens=20),      # EM after normalising
        rec("nq", ["Barack Obama"], "President Barack Obama", searches=3, turns=4, tokens=40),  # cover only
        rec("hotpotqa", ["São Paulo"], "Sao Paulo"),                        # accents dropped
        rec("hotpotqa", ["1990"], None),                                     # no answer
        rec("hotpotqa", ["東京"], "東京"),                                     # CJK: one token
    ]
    scores = score_predictions(records)
    nq, hp = scores["per_source"]["nq"], scores["per_source"]["hotpotqa"]
    assert scores["n"] == 5 and nq["n"] == 2 and hp["n"] == 3
    assert nq["em"] == 0.5 and nq["cover_em"] == 1.0
    assert nq["f1"] == pytest.approx((1 + 2 * (2 / 3) * 1 / (2 / 3 + 1)) / 2)  # 2/3 precision, full recall
    assert nq["searches"] == 2 and nq["turns"] == 3 and nq["response_tokens"] == 30
    assert hp["em"] == pytest.approx(2 / 3) and hp["answer_rate"] == pytest.approx(2 / 3)
    assert nq["valid_format"] == 0.0   # an answer without a <think> first is not the format
    assert hp["f1"] == pytest.approx(2 / 3) and hp["cover_em"] == pytest.approx(2 / 3)
    # macro: the mean of the sources' means, not of the questions
    assert scores["macro"]["em"] == pytest.approx((0.5 + 2 / 3) / 2)
    assert scores["macro"]["answer_rate"] == pytest.approx((1 + 2 / 3) / 2)


def test_scores_by_hops_and_kind_where_the_data_has_them():
    """Records that carry `hops` and `type` (the bundled task) are also scored by them: EM and
    searches per question for one- and two-hop questions; records without them add no group."""
    records = [{**rec("geo", ["India"], "India", searches=1), "hops": 1, "type": "city_country"},
               {**rec("geo", ["Delhi"], "Mumbai", searches=1), "hops": 2, "type": "city_country_capital"},
               {**rec("geo", ["Rupee"], "Rupee", searches=2), "hops": 2, "type": "city_country_currency"},
               rec("nq", ["Paris"], "Paris")]
    scores = score_predictions(records)
    groups = scores["per_group"]
    assert list(groups) == ["hops=1", "hops=2", "type=city_country", "type=city_country_capital",
                            "type=city_country_currency"]
    assert groups["hops=2"]["n"] == 2 and groups["hops=2"]["em"] == 0.5 and groups["hops=2"]["searches"] == 1.5
    assert groups["hops=1"]["em"] == 1.0
    table = evaluate.group_table(groups)
    assert "| hops=2 | 2 | 0.500 |" in table and table.count("\n") == 7
    assert "per_group" not in score_predictions([rec("nq", ["Paris"], "Paris")])


def test_score_predictions_edge_cases():
    scores = score_predictions([rec("x", ["yes"], ""), rec("x", ["1"], "1990"), rec("x", ["The"], "the")])
    x = scores["per_source"]["x"]
    # an empty answer is an answer (wrong); "1" is not inside "1990"; a gold that normalises to
    # nothing matches an equally empty prediction but is never found inside one
    assert x["answer_rate"] == 1.0 and x["cover_em"] == 0.0
    assert x["em"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="no predictions"):
        score_predictions([])


def test_paper_table_layout():
    rows = [("tiny (search)", "EM", {"geo_qa": 0.5, "hotpotqa": 0.25, "nq": 0.125}),
            ("tiny (search)", "F1", {"nq": 0.5, "my_set": 1.0})]
    lines = paper_table(rows).splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == ["Method", "Metric", "NQ", "TriviaQA", "PopQA", "HotpotQA", "2wiki", "Musique",
                      "Bamboogle", "geo_qa", "my_set", "Avg."]
    assert lines[1].count("---") == len(header)
    em = [c.strip() for c in lines[2].strip("|").split("|")]
    assert em == ["tiny (search)", "EM", "0.125", "–", "–", "0.250", "–", "–", "–", "0.500", "–",
                  f"{(0.5 + 0.25 + 0.125) / 3:.3f}"]
    f1 = [c.strip() for c in lines[3].strip("|").split("|")]
    assert f1[2] == "0.500" and f1[10] == "1.000" and f1[-1] == "0.750"


def test_question_text_from_both_templates():
    from search_r1.data.templates import make_prompt
    for template in ("instruct", "base"):
        assert question_text(make_prompt("where is Lyon", template)) == "where is Lyon?"
    with pytest.raises(ValueError, match="Question: "):
        question_text([{"role": "user", "content": "no question here"}])


# ---------------------------------------------------------------------------------------------
# End to end against a BM25 server over the bundled corpus


@pytest.fixture(scope="module")
def test_parquet(tmp_path_factory):
    from search_r1.data import preprocess
    return str(preprocess.main(["--bundled", "--split", "test", "--out",
                                str(tmp_path_factory.mktemp("data") / "test.parquet")]))


@pytest.fixture(scope="module")
def bm25_server(bundled_bm25_server):
    return bundled_bm25_server


def test_load_questions_limit_per_source(test_parquet):
    from search_r1.data.bundled import bundled_paths, read_jsonl
    questions = evaluate.load_questions([test_parquet], limit=4)
    raw = read_jsonl(bundled_paths()["test"])[:4]
    assert [q.question.rstrip("?") for q in questions] == [r["question"].rstrip("?") for r in raw]
    assert [q.golds for q in questions] == [r["golden_answers"] for r in raw]
    assert [(q.kind, q.hops) for q in questions] == [(r["type"], r["hops"]) for r in raw]  # for the by-hops scores
    assert len(evaluate.load_questions([test_parquet, test_parquet], limit=6)) == 6  # per source


@pytest.mark.e2e  # a whole evaluation per mode
@pytest.mark.parametrize("mode", ["search", "no-search", "rag"])
def test_eval_tiny_model_all_modes(mode, tiny_model_dir, test_parquet, bm25_server, tmp_path):
    cfg = EvalConfig(model=tiny_model_dir, data=[test_parquet], out=str(tmp_path), mode=mode, engine="hf",
                     retriever_url=bm25_server.url + "/retrieve", limit=4, max_turns=1,
                     max_response_length=16, max_obs_length=64, label="tiny")
    scores = run_eval(cfg)
    geo = scores["per_source"]["geo_qa"]
    assert scores["n"] == 4 and geo["n"] == 4 and set(evaluate.METRICS) <= set(geo)
    assert 1 <= geo["turns"] <= 2 and geo["response_tokens"] > 0

    saved = json.loads((tmp_path / f"eval_{mode}.json").read_text())
    assert saved["mode"] == mode and saved["model"] == "tiny" and saved["macro"] == scores["macro"]
    assert saved["generate_s"] > 0 and saved["model_tokens_per_s"] > 0
    preds = [json.loads(l) for l in (tmp_path / f"predictions_{mode}.jsonl").read_text().splitlines()]
    assert len(preds) == 4
    for p in preds:
        assert {"question", "golds", "prediction", "response", "searches", "finish", "em"} <= set(p)
        assert p["question"].endswith("?") and "Question" not in p["question"]
    if mode == "rag":  # the passages of the question went into the prompt
        assert all(len(p["retrieved"]) == 3 for p in preds)
    if mode != "search":
        assert geo["searches"] == 0 and geo["turns"] == 1
    table = (tmp_path / f"eval_{mode}.md").read_text()
    assert f"| tiny ({mode}) | EM |" in table and f"| tiny ({mode}) | F1 |" in table and "geo_qa" in table


class ScriptedEngine:
    """Searches once for the question, then answers with its gold: checks the bookkeeping."""

    continuous = False  # whole batches only

    def __init__(self, tokenizer, golds: dict[str, str]):
        self.tokenizer, self.golds = tokenizer, golds

    def generate(self, prompts, sampling, stop):
        from verl.workers.rollout.engine import Generation
        out = []
        for ids in prompts:
            text = self.tokenizer.decode(ids)
            question = next(q for q in self.golds if q in text)
            if "Doc 1(Title:" in text or "</search>" not in stop:  # passages read, or no searching
                reply, tag = f"<think>found</think>\n<answer> {self.golds[question]} </answer>", "</answer>"
            else:
                reply, tag = f"<think>look up</think>\n<search> {question} </search>", "</search>"
            out.append(Generation(self.tokenizer.encode(reply, add_special_tokens=False), "stop", tag))
        return out


class ContinuingEngine(ScriptedEngine):
    """The scripted engine for a context that ends with an opened "<think>" (`ends`): the model
    continues it, so its reply goes without the "<think>" the script begins with. Keeps those replies."""

    def __init__(self, tokenizer, golds: dict[str, str], ends: str):
        super().__init__(tokenizer, golds)
        self.ends, self.continued = ends, []

    def generate(self, prompts, sampling, stop):
        from verl.workers.rollout.engine import Generation
        out = []
        for ids, g in zip(prompts, super().generate(prompts, sampling, stop)):
            text = self.tokenizer.decode(g.token_ids)
            if self.tokenizer.decode(ids).endswith(self.ends):
                self.continued.append(text)
                text = text.removeprefix("<think>")
            out.append(Generation(self.tokenizer.encode(text, add_special_tokens=False), g.finish_reason,
                                  g.stop_reason))
        return out


@pytest.mark.parametrize("mode", ["search", "rag"])
def test_eval_scripted_answers_count_searches(mode, tiny_model_dir, test_parquet, bm25_server, tmp_path):
    from transformers import AutoTokenizer
    questions = evaluate.load_questions([test_parquet], limit=3)
    engine = ScriptedEngine(AutoTokenizer.from_pretrained(tiny_model_dir),
                            {q.question: q.golds[0] for q in questions})
    scores = run_eval(EvalConfig(model=tiny_model_dir, data=[test_parquet], out=str(tmp_path), mode=mode,
                                 retriever_url=bm25_server.url + "/retrieve", limit=3), engine=engine)
    geo = scores["per_source"]["geo_qa"]
    assert geo["em"] == 1.0 and geo["f1"] == 1.0 and geo["answer_rate"] == 1.0
    assert geo["valid_format"] == 1.0   # think, (search, information, think,) answer
    assert (geo["searches"], geo["turns"]) == ((1, 2) if mode == "search" else (0, 1))
    preds = [json.loads(l) for l in (tmp_path / f"predictions_{mode}.jsonl").read_text().splitlines()]
    assert all(p["finish"] == "answer" for p in preds)
    if mode == "search":
        assert all("<information>" in p["response"] and "Doc 1(Title:" in p["response"] for p in preds)


def test_eval_retrieval_recall_cli(test_parquet, bm25_server, tmp_path, capsys):
    """With the question as the query, BM25 finds the passage of a one-hop question (the city's)
    but rarely the second passage of a two-hop one (the country's): three of the five question
    types in the bundled set are two-hop."""
    from search_r1.data import preprocess
    from search_r1.data.bundled import bundled_paths, read_jsonl
    one_hop = tmp_path / "one_hop.jsonl"
    one_hop.write_text("".join(json.dumps(r) + "\n" for r in read_jsonl(bundled_paths()["test"]) if r["hops"] == 1))
    both = preprocess.main(["--bundled", "--local", f"geo_1hop={one_hop}", "--split", "test",
                            "--out", str(tmp_path / "both.parquet")])
    parser = argparse.ArgumentParser()
    evaluate.add_parser(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["eval-retrieval", "--data", str(both), "--retriever-url",
                              bm25_server.url + "/retrieve", "--topk", "3,1", "--out", str(tmp_path),
                              "--label", "BM25"])
    args.func(args)
    result = json.loads((tmp_path / "eval_retrieval.json").read_text())
    geo, geo_1hop = result["per_source"]["geo_qa"], result["per_source"]["geo_1hop"]
    assert geo["n"] == 375 and geo_1hop["n"] == 150 and result["topk"] == [1, 3]
    assert geo_1hop["recall@3"] > 0.9 and geo_1hop["recall@1"] <= geo_1hop["recall@3"]
    assert 0.35 <= geo["recall@3"] < 0.7  # the one-hop two fifths, few two-hop answers
    assert result["macro"]["recall@3"] == pytest.approx((geo["recall@3"] + geo_1hop["recall@3"]) / 2)
    table = (tmp_path / "eval_retrieval.md").read_text()
    assert "| BM25 | recall@3 |" in table and "| Bamboogle | geo_1hop | geo_qa | Avg. |" in table  # order of appearance
    assert "| BM25 | recall@1 |" in capsys.readouterr().out
    with pytest.raises(ValueError, match="comma-separated"):
        args.topk = "1,three"
        args.func(args)


def test_eval_from_training_checkpoint(tiny_model_dir, test_parquet, tmp_path):
    """A run directory is exported once (config source from its config.yaml), then evaluated."""
    from transformers import AutoModelForCausalLM
    from verl.checkpoint.store import save_checkpoint
    run = tmp_path / "run"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    save_checkpoint(run / "checkpoints", 3, {"actor": (model, None, None)}, {"step": 3})
    (run / "config.yaml").write_text(f"actor_rollout_ref:\n  model:\n    path: {tiny_model_dir}\n")

    out = tmp_path / "eval"
    path, label = evaluate.resolve_model(str(run), None, out)
    assert path == str(out / "model") and label == "run/global_step_3"
    exported = AutoModelForCausalLM.from_pretrained(path)
    assert all((a == b).all() for a, b in zip(exported.state_dict().values(), model.state_dict().values()))
    mtime = os.path.getmtime(out / "model" / "config.json")
    # a global_step dir gives the same export, reused; a plain model dir is taken as it is
    assert evaluate.resolve_model(str(run / "checkpoints" / "global_step_3"), None, out)[0] == path
    assert os.path.getmtime(out / "model" / "config.json") == mtime
    assert evaluate.resolve_model(tiny_model_dir, None, out) == (tiny_model_dir, Path(tiny_model_dir).name)
    (run / "config.yaml").unlink()
    with pytest.raises(ValueError, match="--base-model"):
        evaluate.resolve_model(str(run), None, tmp_path / "other")

    scores = run_eval(EvalConfig(model=str(run / "checkpoints"), data=[test_parquet], out=str(out),
                                 mode="no-search", engine="hf", limit=2, max_response_length=8,
                                 base_model=tiny_model_dir))
    assert scores["n"] == 2


def test_eval_refuses_a_checkpoint_that_fails_verification(tiny_model_dir, test_parquet, tmp_path, capsys):
    """The export behind `search-r1 eval` checks the checkpoint first: a changed shard is refused by
    name, and so is a checkpoint without its manifest unless --allow-unverified-checkpoint."""
    from transformers import AutoModelForCausalLM

    from search_r1.cli import main
    from verl.checkpoint.manifest import CheckpointCorrupt
    from verl.checkpoint.store import save_checkpoint
    run = tmp_path / "run"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    save_checkpoint(run / "checkpoints", 3, {"actor": (model, None, None)}, {"step": 3})
    ckpt = run / "checkpoints" / "global_step_3"
    shard = ckpt / "actor" / "model" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match="sha256 checksum") as caught:
        evaluate.resolve_model(str(run), tiny_model_dir, tmp_path / "eval")
    assert caught.value.file == str(shard) and not (tmp_path / "eval" / "model").exists()
    assert main(["eval", "--model", str(run), "--base-model", tiny_model_dir, "--data", test_parquet,
                 "--out", str(tmp_path / "eval"), "--engine", "hf"]) == 2
    assert str(shard) in capsys.readouterr().err

    save_checkpoint(run / "checkpoints", 3, {"actor": (model, None, None)}, {"step": 3})  # intact again
    (ckpt / "manifest.json").unlink()
    with pytest.raises(CheckpointCorrupt, match="manifest.json is missing"):
        evaluate.resolve_model(str(run), tiny_model_dir, tmp_path / "eval")
    with pytest.warns(UserWarning, match="without verification"):
        path, _ = evaluate.resolve_model(str(run), tiny_model_dir, tmp_path / "eval", allow_unverified=True)
    assert Path(path, "model.safetensors").is_file()


@pytest.mark.e2e  # the script in a process of its own
def test_evaluate_sh(tiny_model_dir, test_parquet, tmp_path):
    env = {**os.environ, "MODES": "no-search", "OUT": str(tmp_path / "out")}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "evaluate.sh"), tiny_model_dir, test_parquet,
                        "--engine", "hf", "--limit", "2", "--max-response-length", "8"],
                       capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| NQ | TriviaQA |" in r.stdout
    assert (tmp_path / "out" / "eval_no-search.json").is_file()
    r = subprocess.run(["bash", str(ROOT / "scripts" / "evaluate.sh")], capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stderr


@pytest.mark.e2e  # a vLLM engine
def test_eval_vllm_continuous_with_its_own_core_matches_sync(tiny_model_dir, test_parquet, bm25_server, tmp_path):
    """vLLM with the default schedule (continuous) and the engine core in a child process gives the
    greedy responses of the sync schedule with the core in this process, and the child ends cleanly;
    `--kv-cache-gib` reaches vLLM.
    (Multi-turn agreement of the schedules: tests/search_r1/agent/test_loop.py.)"""
    from conftest import vllm_skip_reason
    if reason := vllm_skip_reason():
        pytest.skip(reason)

    def evaluate_with(name, *flags):
        out = tmp_path / name
        r = subprocess.run(["python", "-m", "search_r1.cli", "eval", "--model", tiny_model_dir, "--data", test_parquet,
                            "--retriever-url", bm25_server.url + "/retrieve", "--limit", "6", "--max-turns", "2",
                            "--max-response-length", "64", "--max-obs-length", "96", "--out", str(out), *flags],
                           capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-3000:]
        preds = [json.loads(l) for l in (out / "predictions_search.jsonl").read_text().splitlines()]
        return preds, r.stdout + r.stderr

    sync, _ = evaluate_with("sync", "--schedule", "sync", "--engine-core", "in_process")
    continuous, log = evaluate_with("continuous", "--engine-core", "separate", "--kv-cache-gib", "0.25")
    assert [p["response"] for p in continuous] == [p["response"] for p in sync]
    assert "Explicitly set (0.25/" in log   # vLLM took the fixed KV cache (for a shared GPU)
    assert json.loads((tmp_path / "continuous" / "eval_search.json").read_text())["schedule"] == "continuous"
    assert "exited unexpectedly" not in log and "resource_tracker" not in log


@pytest.mark.e2e  # fits conftest's tool caller, then a whole evaluation
def test_eval_tool_protocol_with_the_tool_caller(tool_caller_model, verl_tool_data, bm25_server, tmp_path):
    """`search-r1 eval --protocol tools`: prompts rendered with the search tool, the tool-calling loop
    against the real server, searches counted; on both engines (HF's sync loop, vLLM's continuous
    one) with the same greedy call and tool message."""
    from conftest import vllm_skip_reason
    from search_r1.cli import main as cli
    results = {}
    for engine in ("hf", "vllm"):
        if engine == "vllm" and vllm_skip_reason():
            continue
        out = tmp_path / engine
        assert cli(["eval", "--model", str(tool_caller_model), "--data", str(verl_tool_data / "test.parquet"),
                    "--out", str(out), "--engine", engine, "--protocol", "tools", "--max-turns", "1",
                    "--max-response-length", "48", "--max-obs-length", "96",
                    "--retriever_url", bm25_server.url + "/retrieve"]) == 0
        preds = [json.loads(l) for l in (out / "predictions_search.jsonl").read_text().splitlines()]
        assert len(preds) == 4 and all(p["searches"] == 1 and not p["retrieval_failed"] for p in preds)
        assert all("<tool_response>\nDoc 1(Title:" in p["response"] for p in preds)
        # the tiny model answers well only after the passage it was fitted with: its later text varies
        results[engine] = [p["response"].split("</tool_response>")[0] for p in preds]
    if "vllm" in results:
        assert results["vllm"] == results["hf"]
    with pytest.raises(ValueError, match="--protocol tools .* --mode search"):
        run_eval(EvalConfig(model=str(tool_caller_model), data=[str(verl_tool_data / "test.parquet")],
                            out=str(tmp_path / "rag"), mode="rag", protocol="tools"))


def test_eval_scores_a_response_begun_in_the_prompt_whole(tiny_model_dir, bm25_server, tmp_path):
    """Data with a response prefix (`--template example_think`): the model continues the prompt's
    "<think>", and the predictions hold the whole response, prefix first, as training scores it."""
    from transformers import AutoTokenizer

    from search_r1.data import preprocess
    data = str(preprocess.main(["--bundled", "--split", "test", "--template", "example_think",
                                "--out", str(tmp_path / "think.parquet")]))
    questions = evaluate.load_questions([data], limit=2)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    # the first turn continues the prefix
    engine = ContinuingEngine(tok, {q.question: q.golds[0] for q in questions}, ends="<think>")
    scores = run_eval(EvalConfig(model=tiny_model_dir, data=[data], out=str(tmp_path / "out"),
                                 retriever_url=bm25_server.url + "/retrieve", limit=2), engine=engine)
    assert len(engine.continued) == 2 and scores["per_source"]["geo_qa"]["em"] == 1.0
    assert scores["per_source"]["geo_qa"]["valid_format"] == 1.0   # only with the prefix in front
    preds = [json.loads(l) for l in (tmp_path / "out" / "predictions_search.jsonl").read_text().splitlines()]
    for p in preds:
        # (the worked example's passage in the prompt makes the scripted engine answer at once)
        assert p["response"].startswith("<think>found</think>") and p["response"].count("<think>") == 1
        assert check_format(p["response"]).valid


def test_eval_turn_prefix_opens_the_turn_after_each_observation(tiny_model_dir, test_parquet, bm25_server, tmp_path):
    """`--turn-prefix '<think>'`: the agent writes it after the passages, the model continues it, and the
    prediction is the valid whole; refused with the tool protocol."""
    from transformers import AutoTokenizer

    questions = evaluate.load_questions([test_parquet], limit=2)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = ContinuingEngine(tok, {q.question: q.golds[0] for q in questions}, ends="</information>\n\n<think>")
    scores = run_eval(EvalConfig(model=tiny_model_dir, data=[test_parquet], out=str(tmp_path / "out"), limit=2,
                                 retriever_url=bm25_server.url + "/retrieve", turn_prefix="<think>"), engine=engine)
    assert len(engine.continued) == 2 and scores["per_source"]["geo_qa"]["valid_format"] == 1.0
    preds = [json.loads(l) for l in (tmp_path / "out" / "predictions_search.jsonl").read_text().splitlines()]
    assert all("</information>\n\n<think>found</think>" in p["response"] for p in preds)
    with pytest.raises(ValueError, match="--turn-prefix"):
        run_eval(EvalConfig(model=tiny_model_dir, data=[test_parquet], out=str(tmp_path / "tools"),
                            protocol="tools", turn_prefix="<think>"))


def test_chat_template_kwargs_reach_the_prompts_of_every_mode_and_protocol(thinking_tokenizer_dir, tmp_path):
    import argparse

    from transformers import AutoTokenizer

    from search_r1.evaluate import EvalConfig, Question, add_parser, build_prompts
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["eval", "--model", "m", "--data", "d", "--out", "o",
                              "--chat-template-kwargs", '{"enable_thinking": false}'])
    assert args.chat_template_kwargs == {"enable_thinking": False}
    tok = AutoTokenizer.from_pretrained(thinking_tokenizer_dir)
    question = Question("nq", "Where is Tartu?", ["Estonia"], [{"role": "user", "content": "Question: Where is Tartu?"}], 0)
    for mode, protocol in (("search", "tags"), ("search", "tools"), ("no-search", "tags")):
        for kwargs, ends_thinking_off in (({}, False), (args.chat_template_kwargs, True)):
            cfg = EvalConfig(model="m", data=[], out=str(tmp_path), mode=mode, protocol=protocol,
                             chat_template_kwargs=kwargs)
            (ids,), _ = build_prompts(cfg, [question], tok)
            assert tok.decode(ids).endswith("<think>\n\n</think>\n\n") == ends_thinking_off, (mode, protocol)
