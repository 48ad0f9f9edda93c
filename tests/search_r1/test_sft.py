"""SFT warm start: gold trajectories from a real BM25 server over the bundled corpus, in the exact
rollout layout; the masked loss against a naive loop; a short run that learns and saves; user
JSONL; the refusal to train on test-split questions."""
import argparse
import itertools
import json

import pytest
import torch

from search_r1.agent.loop import AgentConfig, SearchAgent
from search_r1.data.bundled import bundled_paths, read_jsonl
from search_r1.data.templates import make_prompt
from search_r1.retrieval.client import RetrievalClient
from search_r1.sft import (Example, add_parser, load_trajectory_jsonl, make_bundled_trajectories,
                           masked_nll, mean_nll, run_sft)


@pytest.fixture(scope="module")
def bm25_url(bundled_bm25_server):
    return bundled_bm25_server.url + "/retrieve"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def train_questions():
    return read_jsonl(bundled_paths()["train"])[:24]


@pytest.fixture(scope="module")
def bundled(bm25_url, tokenizer, train_questions):
    with RetrievalClient(url=bm25_url) as client:
        return make_bundled_trajectories(train_questions, client.retrieve, tokenizer, max_obs_length=200)


def runs(example):
    """(loss mask value, ids) for each run of equal mask values."""
    out, pos = [], 0
    for m, group in itertools.groupby(example.loss_mask):
        n = len(list(group))
        out.append((m, example.response_ids[pos:pos + n]))
        pos += n
    return out


def test_trajectories_have_the_rollout_layout(bundled, tokenizer, train_questions, bm25_url):
    examples, stats = bundled
    assert stats["kept"] == len(examples) > 0 and stats["kept"] + stats["dropped"] == len(train_questions)
    assert {e.meta["hops"] for e in examples} == {1, 2}
    agent = SearchAgent(engine=type("E", (), {"tokenizer": tokenizer}), searcher=None,
                        cfg=AgentConfig(max_obs_length=200))
    for e in examples:
        assert len(e.loss_mask) == len(e.response_ids)
        chat = tokenizer.apply_chat_template(make_prompt(e.meta["question"]), add_generation_prompt=True,
                                             tokenize=False)
        assert e.prompt_ids == tokenizer(chat, add_special_tokens=False).input_ids
        parts = runs(e)
        assert [m for m, _ in parts] == [1, 0] * e.meta["hops"] + [1]
        model_texts = [tokenizer.decode(ids) for m, ids in parts if m == 1]
        for text in model_texts[:-1]:
            assert text.startswith("<think> ") and text.endswith(" </search>")
        assert model_texts[-1].endswith(" </answer>" + tokenizer.eos_token)
        assert e.response_ids[-1] == tokenizer.eos_token_id and e.loss_mask[-1] == 1
        for _, ids in (p for p in parts if p[0] == 0):
            text = tokenizer.decode(ids)
            assert text.startswith("\n\n<information>Doc 1(Title: ") and text.endswith("</information>\n\n")
            assert len(ids) <= 200

    # The observations are the agent's own ids for the hits of the real server.
    one_hop = next(e for e in examples if e.meta["type"] == "city_country")
    question = next(q for q in train_questions if q["id"] == one_hop.meta["id"])
    city = question["question"].removeprefix("Which country is the city of ").removesuffix(" in?")
    with RetrievalClient(url=bm25_url) as client:
        hits = client.retrieve([city], 3)[0]
    parts = runs(one_hop)
    assert parts[1][1] == agent.passage_ids(hits)
    assert tokenizer.decode(parts[0][1]) == (f"<think> I need to find which country {city} is in. </think>\n"
                                             f"<search> {city} </search>")
    answer = tokenizer.decode(parts[2][1]).split("<answer> ")[1].split(" </answer>")[0]
    assert answer in question["golden_answers"]

    two_hop = next(e for e in examples if e.meta["type"] == "city_country_capital")
    second = tokenizer.decode(runs(two_hop)[2][1])
    assert "Now I need the capital of" in second and second.endswith(" capital </search>")


def test_tool_protocol_trajectories_are_what_the_tool_loop_writes(bm25_url, tokenizer, train_questions):
    """--protocol tools: the prompt rendered with the search tool, searches as search tool calls, the
    passages as tool messages from the chat template's framing: the SFT trajectory is the one the
    tool-calling loop builds when the model writes its turns (checked by replaying them through it)."""
    import asyncio
    from search_r1.agent.search_tool import search_chat_format, search_tool_agent
    from search_r1.retrieval.client import RetrieverConfig
    from verl.workers.rollout.engine import Generation, SamplingConfig
    from verl.workers.rollout.tool_loop import ToolAgentConfig

    with RetrievalClient(url=bm25_url) as client:
        examples, _ = make_bundled_trajectories(train_questions[:8], client.retrieve, tokenizer,
                                                max_obs_length=200, protocol="tools")
    chat = search_chat_format(tokenizer)
    example = next(e for e in examples if e.meta["hops"] == 2)
    assert example.prompt_ids == chat.prompt_ids(make_prompt(example.meta["question"], "tool"))
    model_turns = [ids for m, ids in runs(example) if m == 1]
    first = tokenizer.decode(model_turns[0])
    assert first.startswith("<think> I need to find which country ") and \
        '</think>\n<tool_call>\n{"name": "search", "arguments": {"query_list": ["' in first and \
        first.endswith('"]}}\n</tool_call>')
    assert tokenizer.decode(model_turns[-1]).endswith(" </answer>" + tokenizer.eos_token)

    class Replay:  # hands back the example's own model turns, as an engine would have written them
        tokenizer = chat.tokenizer
        continuous = False

        def __init__(self):
            self.turns = list(model_turns)

        def generate(self, prompts, sampling, stop):
            ids = self.turns.pop(0)
            return [Generation(ids, "stop", "</tool_call>" if tokenizer.decode(ids).endswith("</tool_call>") else None)]

    agent = search_tool_agent(Replay(), RetrieverConfig(url=bm25_url, topk=3),
                              ToolAgentConfig(max_turns=2, max_response_tokens=4096, max_obs_length=200))
    (t,) = agent.run([example.prompt_ids], SamplingConfig(temperature=0, max_tokens=512))
    agent.runner.close()
    assert (t.response_ids, t.loss_mask) == (example.response_ids, example.loss_mask)


def test_questions_without_evidence_are_dropped(tokenizer, train_questions):
    # Stands in for a retriever that misses: every query gets the same unrelated passage.
    def unrelated(queries, topk):
        return [[{"document": {"id": "x", "contents": '"Atlantis"\nAtlantis is a legendary island.'},
                  "score": 1.0}] for _ in queries]

    examples, stats = make_bundled_trajectories(train_questions, unrelated, tokenizer)
    assert examples == [] and stats["dropped"] == len(train_questions)
    assert sum(stats["dropped_by_type"].values()) == len(train_questions)


def test_masked_nll_matches_naive_loop(bundled, tiny_model_dir, tokenizer):
    from verl.workers.modeling import build_causal_lm
    model = build_causal_lm(tiny_model_dir)
    e = next(e for e in bundled[0] if e.meta["hops"] == 2)
    with torch.no_grad():
        nll, n = masked_nll(model, [e], tokenizer.pad_token_id)
        ids = torch.tensor([e.prompt_ids + e.response_ids])
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    P, naive, count = len(e.prompt_ids), 0.0, 0
    for j, (tok, m) in enumerate(zip(e.response_ids, e.loss_mask)):
        if m:  # the observation tokens never count
            naive -= logp[P + j - 1, tok].item()
            count += 1
    assert n == count == sum(e.loss_mask) < len(e.response_ids)
    assert nll.item() / n == pytest.approx(naive / count, rel=1e-4)


@pytest.mark.e2e  # a training run
def test_short_run_learns_saves_and_is_deterministic(bundled, tiny_model_dir, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    from verl.workers.modeling import build_causal_lm
    data = bundled[0][:8]
    kwargs = dict(epochs=3, lr=1e-3, batch_size=4, micro_batch_size=3, max_length=1024, seed=0,
                  warmup_ratio=0.0, device="cpu")
    before = mean_nll(build_causal_lm(tiny_model_dir), data, tokenizer.pad_token_id)
    summary = run_sft(tiny_model_dir, data, tmp_path / "a", **kwargs)
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    after = mean_nll(trained, data, tokenizer.pad_token_id)
    assert after < before - 1.0, (before, after)
    assert (tmp_path / "a" / "model.safetensors").exists() and (tmp_path / "a" / "tokenizer.json").exists()
    metrics = [json.loads(line) for line in (tmp_path / "a" / "sft_metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == summary["steps"] == 6
    assert {"loss", "tokens", "lr", "step"} <= set(metrics[0]) and metrics[-1]["loss"] < metrics[0]["loss"]

    # Same seed, same first epoch: the same data order and the same losses, bit for bit.
    run_sft(tiny_model_dir, data, tmp_path / "b", **{**kwargs, "epochs": 1})
    again = [json.loads(line) for line in (tmp_path / "b" / "sft_metrics.jsonl").read_text().splitlines()]
    assert [m["loss"] for m in again] == [m["loss"] for m in metrics[:2]]


def test_user_jsonl(tokenizer, tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "Where is Lyon?"}],
             "turns": [{"role": "model", "text": "<think> Look it up. </think>\n<search> Lyon </search>"},
                       {"role": "observation", "text": "Doc 1(Title: Lyon) Lyon is a city in France."},
                       {"role": "model", "text": "<think> France. </think>\n<answer> France </answer>"}]},
            {"prompt": "Question: Where is Lyon?\n",
             "turns": [{"role": "model", "text": "<answer> France </answer>"}]}]
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    first, second = load_trajectory_jsonl(path, tokenizer)
    chat = tokenizer.apply_chat_template(rows[0]["prompt"], add_generation_prompt=True, tokenize=False)
    assert first.prompt_ids == tokenizer(chat, add_special_tokens=False).input_ids
    parts = runs(first)
    assert [m for m, _ in parts] == [1, 0, 1]
    assert tokenizer.decode(parts[1][1]) == ("\n\n<information>Doc 1(Title: Lyon) Lyon is a city in France."
                                             "</information>\n\n")
    answer_ids = tokenizer.encode(rows[0]["turns"][2]["text"], add_special_tokens=False)
    assert parts[2][1] == answer_ids + [tokenizer.eos_token_id]
    assert second.prompt_ids == tokenizer(rows[1]["prompt"]).input_ids and set(second.loss_mask) == {1}

    path.write_text(json.dumps({"prompt": "q", "turns": [{"role": "tool", "text": "x"}]}) + "\n")
    with pytest.raises(ValueError, match="'model' or 'observation'"):
        load_trajectory_jsonl(path, tokenizer)


def test_test_split_questions_are_refused(tokenizer, tiny_model_dir, tmp_path):
    test_q = read_jsonl(bundled_paths()["test"])[0]
    with pytest.raises(ValueError, match="TEST split"):
        make_bundled_trajectories([test_q], lambda q, k: pytest.fail("must refuse before searching"), tokenizer)
    leaked = Example([1, 2], [3], [1], {"id": test_q["id"], "passage_ids": test_q["passage_ids"]})
    with pytest.raises(ValueError, match="TEST split"):
        run_sft(tiny_model_dir, [leaked], tmp_path / "out", epochs=1, device="cpu")
    assert not (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.e2e  # the CLI in a process of its own
def test_cli_bundled(bm25_url, tiny_model_dir, tmp_path):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["sft", "--model", tiny_model_dir, "--out", str(tmp_path / "m"), "--bundled", "6",
                              "--retriever-url", bm25_url, "--epochs", "1", "--lr", "1e-4",
                              "--batch-size", "3", "--max-length", "1024", "--device", "cpu"])
    args.func(args)
    stats = json.loads((tmp_path / "m" / "sft_data_stats.json").read_text())
    assert stats["questions"] == 6 and stats["kept"] > 0
    assert len((tmp_path / "m" / "sft_metrics.jsonl").read_text().splitlines()) == -(-stats["kept"] // 3)
    assert (tmp_path / "m" / "config.json").exists()
