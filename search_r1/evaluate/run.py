"""`run_eval`: a model over the test questions in one mode (search, no-search, rag): its prompts,
generation with the agent or one answer turn, scores, and the result files."""
from __future__ import annotations

import functools
import json
import logging
import time
from dataclasses import asdict
from pathlib import Path

from search_r1.evaluate.config import EvalConfig, Mode
from search_r1.evaluate.model import build_engine, resolve_model
from search_r1.evaluate.questions import Question, load_questions
from search_r1.evaluate.recall import retrieve
from search_r1.evaluate.scoring import METRICS, group_table, paper_table, score_predictions, score_record
from search_r1.rewards import extract_answer

log = logging.getLogger(__name__)

_ANSWER_FORMAT = ("Give the final answer briefly inside <answer> and </answer>, "
                  "for example <answer> Paris </answer>.\n")
DIRECT_PROMPT = ("Answer the question below from what you know, without searching. "
                 + _ANSWER_FORMAT + "Question: {question}\n")
RAG_PROMPT = ("Answer the question below with the help of the passages. " + _ANSWER_FORMAT
              + "Passages:\n{passages}\nQuestion: {question}\n")


def _encode(tokenizer, messages: list[dict], template: str, template_kwargs: dict | None = None) -> list[int]:
    """Prompt ids exactly as the trainer builds them: its own function, so the two cannot drift
    (a tokenizer without a chat template gets the raw text, as in training)."""
    from verl.utils.dataset import encode_prompt
    use_chat_template = template != "base" and bool(getattr(tokenizer, "chat_template", None))
    if template != "base" and not use_chat_template:
        _warn_no_template()
    return encode_prompt(messages, tokenizer, use_chat_template, "evaluation prompt", template_kwargs=template_kwargs)


@functools.cache
def _warn_no_template() -> None:
    log.warning("the tokenizer has no chat template: prompts are fed as their raw text, as the trainer "
                "does (pass --template base to say so)")


def build_prompts(cfg: EvalConfig, questions: list[Question], tokenizer) -> tuple[list[list[int]], list[list[str]]]:
    """Prompt ids per question and, for rag, the ids of the passages put in the prompt."""
    from search_r1.agent.loop import format_passages

    if cfg.mode == Mode.SEARCH:
        if cfg.protocol == "tools":  # rendered with the search tool, as the tool-calling loop trains them
            from search_r1.agent.search_tool import search_chat_format
            from verl.utils.dataset import encode_prompt
            chat = search_chat_format(tokenizer, cfg.chat_template_kwargs)
            return [encode_prompt(q.messages, tokenizer, True, "evaluation prompt", chat) for q in questions], \
                [[] for _ in questions]
        return [_encode(tokenizer, q.messages, cfg.template, cfg.chat_template_kwargs) for q in questions], \
            [[] for _ in questions]
    if cfg.mode == Mode.NO_SEARCH:
        texts = [DIRECT_PROMPT.format(question=q.question) for q in questions]
        retrieved = [[] for _ in questions]
    else:
        hits = retrieve([q.question for q in questions], cfg.retriever_url, cfg.topk)
        texts = [RAG_PROMPT.format(passages=format_passages(h), question=q.question) for q, h in zip(questions, hits)]
        retrieved = [[h.get("document", h).get("id") for h in hit] for hit in hits]
    prompts = [_encode(tokenizer, [{"role": "user", "content": t}], cfg.template, cfg.chat_template_kwargs)
               for t in texts]
    return prompts, retrieved


def generate(cfg: EvalConfig, engine, prompts: list[list[int]]) -> list[dict]:
    """Per prompt: the response text and the agent's counts."""
    from tqdm import tqdm

    from search_r1.agent.loop import STOP, AgentConfig, Finish, HTTPSearcher, Schedule, SearchAgent, response_budget
    from search_r1.retrieval.client import RetrieverConfig
    from verl.workers.rollout.engine import SamplingConfig

    sampling = SamplingConfig(temperature=cfg.temperature, max_tokens=cfg.max_response_length)
    def decode(ids):
        return engine.tokenizer.decode(ids, skip_special_tokens=True)

    agent = None
    if cfg.mode == Mode.SEARCH:
        schedule = Schedule(cfg.schedule)
        if schedule == Schedule.CONTINUOUS and not engine.continuous:
            schedule = Schedule.SYNC  # only vLLM adds requests to a running batch
        retriever = RetrieverConfig(url=cfg.retriever_url, topk=cfg.topk)
        budget = response_budget(cfg.max_turns, cfg.max_response_length, cfg.max_obs_length)
        if cfg.protocol == "tools":
            from search_r1.agent.search_tool import search_tool_agent
            from verl.workers.rollout.tool_loop import ToolAgentConfig
            agent = search_tool_agent(engine, retriever, ToolAgentConfig(
                max_turns=cfg.max_turns, max_response_tokens=budget, max_obs_length=cfg.max_obs_length,
                schedule=schedule), template_kwargs=cfg.chat_template_kwargs)
        else:
            agent = SearchAgent(engine, HTTPSearcher(retriever),
                                AgentConfig(max_turns=cfg.max_turns, max_response_tokens=budget,
                                            max_obs_length=cfg.max_obs_length, topk=cfg.topk, schedule=schedule,
                                            turn_prefix=cfg.turn_prefix))
    results = []
    for lo in tqdm(range(0, len(prompts), cfg.batch_size), desc=f"eval {cfg.mode}", unit="batch"):
        batch = prompts[lo:lo + cfg.batch_size]
        if agent is not None:
            for t in agent.run(batch, sampling):
                results.append({"response": decode(t.response_ids), "searches": t.tool_calls, "turns": t.turns,
                                "finish": str(t.finish), "response_tokens": len(t.response_ids),
                                "model_tokens": sum(t.loss_mask), "retrieval_failed": t.tool_failed,
                                **({"invalid_actions": t.invalid_actions} if cfg.protocol == "tools" else {})})
            continue
        for g in engine.generate(batch, sampling, [STOP[1]]):  # one turn, up to </answer>
            finish = (Finish.ANSWER if g.stop_reason == STOP[1] else
                      Finish.LENGTH if g.finish_reason == "length" else Finish.EOS)
            results.append({"response": decode(g.token_ids), "searches": 0, "turns": 1,
                            "finish": str(finish), "response_tokens": len(g.token_ids),
                            "model_tokens": len(g.token_ids)})
    if agent is not None and cfg.protocol == "tools":
        agent.runner.close()
    return results


def run_eval(cfg: EvalConfig, engine=None) -> dict:
    """Evaluate, write the result files under `cfg.out`, and return the scores.
    `engine` replaces the one `cfg` would build (tests, or a caller that holds one already)."""
    from transformers import AutoTokenizer

    from verl.utils.dataset import response_prefix

    cfg.mode = Mode(cfg.mode)
    if cfg.template not in ("instruct", "base"):
        raise ValueError(f"--template {cfg.template!r}: use instruct or base")
    if cfg.protocol not in ("tags", "tools"):
        raise ValueError(f"--protocol {cfg.protocol!r}: use tags or tools")
    if cfg.protocol == "tools" and (cfg.template == "base" or cfg.mode != Mode.SEARCH):
        raise ValueError("--protocol tools renders the search tool with the chat template: it needs --template "
                         "instruct and --mode search")
    if cfg.turn_prefix and cfg.protocol == "tools":
        raise ValueError("--turn-prefix opens the model's turn after each <information> observation of the tags "
                         "protocol; with --protocol tools the chat template opens every turn")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    questions = load_questions(cfg.data, cfg.limit)
    model, label = resolve_model(cfg.model, cfg.base_model, out, cfg.allow_unverified_checkpoint)
    label = cfg.label or label
    tokenizer = engine.tokenizer if engine is not None else AutoTokenizer.from_pretrained(model)
    prompts, retrieved = build_prompts(cfg, questions, tokenizer)
    log.info("%d questions from %s; longest prompt %d tokens", len(questions),
             ", ".join(dict.fromkeys(q.data_source for q in questions)), max(map(len, prompts)))
    own_engine = engine is None
    if own_engine:
        from search_r1.agent.loop import response_budget
        longest = (response_budget(cfg.max_turns, cfg.max_response_length, cfg.max_obs_length)
                   if cfg.mode == Mode.SEARCH else cfg.max_response_length)
        engine = build_engine(cfg, model, max(map(len, prompts)) + longest)
    start = time.perf_counter()
    try:
        results = generate(cfg, engine, prompts)
        generate_s = time.perf_counter() - start
    finally:
        if own_engine and hasattr(engine, "shutdown"):  # vLLM: end its core's process cleanly
            engine.shutdown()

    records = []
    for q, result, ids in zip(questions, results, retrieved):
        if cfg.mode == Mode.SEARCH:  # a response begun in the prompt is scored whole, as in training
            result["response"] = response_prefix(q.messages) + result["response"]
        records.append({"data_source": q.data_source, "index": q.index, "question": q.question,
                        "type": q.kind, "hops": q.hops,
                        "golds": q.golds, "prediction": extract_answer(result["response"]), **result,
                        **({"retrieved": ids} if cfg.mode == Mode.RAG else {})})
    scores = score_predictions(records)

    with open(out / f"predictions_{cfg.mode}.jsonl", "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps({**r, **score_record(r)}, ensure_ascii=False) + "\n")
    settings = {k: v for k, v in asdict(cfg).items() if k not in ("model", "out", "label")}
    # How fast the model answered (retrieval included, engine start-up not): model-written tokens per second.
    speed = {"generate_s": round(generate_s, 3),
             "model_tokens_per_s": round(sum(r["model_tokens"] for r in results) / max(generate_s, 1e-9), 1)}
    (out / f"eval_{cfg.mode}.json").write_text(json.dumps(
        {"model": label, "model_input": cfg.model, "model_path": model, **settings, **speed, **scores},
        indent=2, ensure_ascii=False) + "\n")
    method = f"{label} ({cfg.mode})"
    table = paper_table([(method, name, {s: m[key] for s, m in scores["per_source"].items()})
                         for name, key in (("EM", "em"), ("F1", "f1"))])
    if "per_group" in scores:
        table += "\n" + group_table(scores["per_group"])
    (out / f"eval_{cfg.mode}.md").write_text(table)
    print(table)
    macro = scores["macro"]
    print(f"macro average over {len(scores['per_source'])} sources, {scores['n']} questions: "
          + ", ".join(f"{m} {macro[m]:.3f}" for m in METRICS))
    print(f"generated in {generate_s:.1f} s: {speed['model_tokens_per_s']:,.0f} model tokens/s")
    return scores
