"""Evaluate a model on QA test sets, and a retriever on answer recall.

`search-r1 eval` runs a model over test parquet files (the training schema) in one of three modes:
- search: the multi-turn search agent against a retrieval server, on the parquet's own prompt;
- no-search: the model answers directly, from a short prompt of ours built from the question;
- rag: the question's top-k passages are retrieved once and put in the prompt; one answer turn.
It scores the extracted answers per data source (EM, cover EM = gold inside the answer as whole
words, token F1, answer rate, searches, turns, response tokens), macro-averages over sources, and
writes `eval_<mode>.json`, `predictions_<mode>.jsonl` and `eval_<mode>.md`, a table laid out as
the Search-R1 paper's main table.

`search-r1 eval-retrieval` asks the retriever for each question and reports answer recall@k: the
share of questions where one of the first k passages holds a gold answer (normalised, whole words).

The model may be a training run's checkpoint: it is exported to a Hugging Face directory first.
"Searches" counts the searches the model asked for, so it is 0 in rag mode (the retrieval there is
ours). Response tokens count the whole response, observations included.
"""
from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import re
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from statistics import fmean

from search_r1.rewards import check_format, exact_match, extract_answer, gold_answers, substring_match, token_f1

log = logging.getLogger(__name__)

# data_source -> column header of the paper's main table, in its order.
PAPER_COLUMNS = {"nq": "NQ", "triviaqa": "TriviaQA", "popqa": "PopQA", "hotpotqa": "HotpotQA",
                 "2wikimultihopqa": "2wiki", "musique": "Musique", "bamboogle": "Bamboogle"}
# valid_format: the share of responses in the Search-R1 tag format (think first, answer last,
# search and information in between; search_r1.rewards.check_format), which the original's format
# and retrieval rewards require: a model that never writes it earns none of them.
METRICS = ("em", "cover_em", "f1", "answer_rate", "valid_format", "searches", "turns", "response_tokens")

_ANSWER_FORMAT = ("Give the final answer briefly inside <answer> and </answer>, "
                  "for example <answer> Paris </answer>.\n")
DIRECT_PROMPT = ("Answer the question below from what you know, without searching. "
                 + _ANSWER_FORMAT + "Question: {question}\n")
RAG_PROMPT = ("Answer the question below with the help of the passages. " + _ANSWER_FORMAT
              + "Passages:\n{passages}\nQuestion: {question}\n")


class Mode(StrEnum):
    SEARCH = "search"
    NO_SEARCH = "no-search"
    RAG = "rag"


@dataclass
class EvalConfig:
    model: str                        # HF directory, hub id, or a training run / checkpoint directory
    data: list[str]                   # test parquet files
    out: str
    mode: Mode = Mode.SEARCH
    engine: str = "vllm"              # vllm | hf
    retriever_url: str = "http://127.0.0.1:8000/retrieve"
    limit: int | None = None          # questions per data source
    temperature: float = 0.0          # greedy
    max_turns: int = 4
    topk: int = 3
    max_response_length: int = 500    # tokens the model may generate per turn
    max_obs_length: int = 500         # tokens per observation
    template: str = "instruct"        # instruct: apply the chat template; base: plain text
    protocol: str = "tags"            # tags: <search>/<information>; tools: search tool calls (search mode)
    turn_prefix: str = ""             # tags, search mode: written after each observation (AgentConfig.turn_prefix)
    # more keyword arguments of the chat template, e.g. {"enable_thinking": False} (training's
    # data.apply_chat_template_kwargs); the prompts and the tool protocol's tool messages get them
    chat_template_kwargs: dict = field(default_factory=dict)
    base_model: str | None = None     # config/tokenizer source when exporting a checkpoint
    # A checkpoint without manifest.json (written before checksums existed) is exported unchecked;
    # False: it is refused as corrupt, as a partial copy is.
    allow_unverified_checkpoint: bool = False
    label: str | None = None          # the model's name in the table
    batch_size: int = 1024            # questions per agent run (progress and memory)
    # vLLM only. continuous: a question's next turn joins the running batch as soon as its passages
    # arrive; sync: every turn waits for the batch's slowest. engine_core None: vLLM's scheduler in
    # a process of its own on a GPU (it is CPU-bound at this concurrency), in this one on CPU.
    # A core of its own made the 3B agent rollout faster
    # (benchmarks/RESULTS.md, "The engine core in its own process").
    schedule: str = "continuous"
    engine_core: str | None = None    # in_process | separate | None
    gpu_memory_utilization: float = 0.8
    # vLLM: a KV cache of this many GiB instead of a share of the device's free memory. For a GPU
    # shared with other processes, whose allocations move the free memory while vLLM measures it.
    kv_cache_gib: float | None = None
    # vLLM on a GPU: None compiles and captures CUDA graphs (minutes of start-up that pay off on a
    # large evaluation); True starts in seconds, the better choice for a small model or few questions.
    enforce_eager: bool | None = None
    seed: int = 0


# ---------------------------------------------------------------------------------------------
# Scoring: pure functions of prediction records


def score_record(record: dict) -> dict:
    pred, golds = record["prediction"], record["golds"]
    return {"em": exact_match(pred, golds), "cover_em": substring_match(pred, golds),
            "f1": token_f1(pred, golds), "answer_rate": float(pred is not None),
            "valid_format": float(check_format(record["response"]).valid)}


def score_predictions(records: list[dict]) -> dict:
    """Per data source means of METRICS (plus `n`), and their macro average over sources.

    Records hold data_source, golds, response, prediction (None: no answer extracted),
    searches, turns and response_tokens.
    """
    if not records:
        raise ValueError("no predictions to score: is the test data empty, or --limit 0?")
    by_source: dict[str, list[dict]] = defaultdict(list)
    by_group: dict[str, list[dict]] = defaultdict(list)   # by question kind and hop count, where recorded
    for r in records:
        row = {**score_record(r), "searches": r["searches"], "turns": r["turns"],
               "response_tokens": r["response_tokens"]}
        by_source[r["data_source"]].append(row)
        for key in ("hops", "type"):
            if r.get(key) is not None:
                by_group[f"{key}={r[key]}"].append(row)
    per_source = {source: {"n": len(rows), **{m: fmean(row[m] for row in rows) for m in METRICS}}
                  for source, rows in by_source.items()}
    macro = {m: fmean(s[m] for s in per_source.values()) for m in METRICS}
    per_group = {group: {"n": len(rows), **{m: fmean(row[m] for row in rows) for m in METRICS}}
                 for group, rows in sorted(by_group.items())}
    return {"n": len(records), "per_source": per_source, "macro": macro,
            **({"per_group": per_group} if per_group else {})}


def group_table(per_group: dict[str, dict]) -> str:
    """Markdown: EM, F1 and searches per question for each hop count and question kind."""
    lines = ["| group | n | EM | F1 | searches per question |", "|---|---:|---:|---:|---:|"]
    for group, m in per_group.items():
        lines.append(f"| {group} | {m['n']} | {m['em']:.3f} | {m['f1']:.3f} | {m['searches']:.2f} |")
    return "\n".join(lines) + "\n"


def paper_table(rows: list[tuple[str, str, dict[str, float]]]) -> str:
    """Markdown table in the layout of the paper's main table.

    Rows are (method, metric, {data_source: value}). The seven paper columns always appear ("–"
    when missing); other sources follow in order of appearance; Avg. is the mean over the sources
    the row has.
    """
    extra = [s for _, _, values in rows for s in values if s not in PAPER_COLUMNS]
    sources = list(PAPER_COLUMNS) + list(dict.fromkeys(extra))
    header = ["Method", "Metric", *[PAPER_COLUMNS.get(s, s) for s in sources], "Avg."]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method, metric, values in rows:
        cells = [f"{values[s]:.3f}" if s in values else "–" for s in sources]
        avg = f"{fmean(values.values()):.3f}" if values else "–"
        lines.append("| " + " | ".join([method.replace("|", "\\|"), metric, *cells, avg]) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Data


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


# ---------------------------------------------------------------------------------------------
# Model: a directory, a hub id, or a training checkpoint to export first

_STEP_DIR = re.compile(r"^global_step_\d+$")


def find_checkpoint(path: Path) -> tuple[Path | None, Path | None]:
    """(checkpoint directory, run directory) if `path` is a run, its `checkpoints/` or one
    `global_step_N`; else (None, None)."""
    from verl.checkpoint.store import checkpoint_dir, latest_step

    if not path.is_dir():
        return None, None
    if _STEP_DIR.match(path.name):
        return path, path.parent.parent
    for root, run in ((path / "checkpoints", path), (path, path.parent)):
        step = latest_step(root)
        if step is not None:
            return Path(checkpoint_dir(root, step)), run
    return None, None


def resolve_model(model: str, base_model: str | None, out: str | os.PathLike,
                  allow_unverified: bool = False) -> tuple[str, str]:
    """(loadable model path or hub id, label). A checkpoint is exported to `<out>/model`, once; the
    export checks its files against its manifest first (CheckpointCorrupt names the file that fails)."""
    ckpt, run = find_checkpoint(Path(model))
    if ckpt is None:
        return model, Path(model).name or model
    label = f"{run.name}/{ckpt.name}"
    source = base_model
    if source is None and (run / "config.yaml").is_file():
        from omegaconf import OmegaConf
        source = OmegaConf.select(OmegaConf.load(run / "config.yaml"), "actor_rollout_ref.model.path")
    if source is None:
        raise ValueError(f"{model} is a training checkpoint but {run / 'config.yaml'} is missing: pass "
                         "--base-model, the model the training started from (for its config and tokenizer)")
    if not os.path.isdir(source):  # a hub id: only its config and tokenizer files are needed
        from huggingface_hub import snapshot_download
        source = snapshot_download(source, allow_patterns=["*.json", "*.txt", "*.model", "*.jinja"])

    exported = Path(out) / "model"
    stamp = exported / "exported_from.txt"  # later modes of the same evaluation reuse the export
    if stamp.is_file() and stamp.read_text() == str(ckpt.resolve()):
        return str(exported), label
    from verl.checkpoint.export import export_hf
    log.info("exporting %s to %s", ckpt, exported)
    export_hf(ckpt, "actor", exported, source, overwrite=True, allow_unverified=allow_unverified)
    stamp.write_text(str(ckpt.resolve()))
    return str(exported), label


def build_engine(cfg: EvalConfig, model: str, max_model_len: int):
    import torch

    from verl.workers.rollout.engine_by_name import create_engine

    if cfg.engine != "vllm":
        return create_engine(cfg.engine, model, seed=cfg.seed, key="--engine")
    on_gpu = torch.cuda.is_available()
    from transformers import AutoConfig
    positions = getattr(AutoConfig.from_pretrained(model), "max_position_embeddings", None)
    if positions and max_model_len > positions:  # vLLM refuses a longer max_model_len
        log.warning("prompt + response budget = %d tokens exceeds the model's %d positions: long responses "
                    "will be cut (lower --max-turns, --max-response-length or --max-obs-length)",
                    max_model_len, positions)
        max_model_len = positions
    kv_gib = cfg.kv_cache_gib or (None if on_gpu else 1.0)  # no share-of-RAM probing on CPU
    kw = {"kv_cache_memory_bytes": int(kv_gib * 2**30)} if kv_gib else {}
    core = cfg.engine_core or ("separate" if on_gpu else "in_process")
    if core not in ("in_process", "separate"):
        raise ValueError(f"--engine-core {core!r}: use in_process or separate")
    return create_engine("vllm", model, seed=cfg.seed, max_model_len=max_model_len,
                         gpu_memory_utilization=cfg.gpu_memory_utilization, separate_core=core == "separate",
                         enforce_eager=cfg.enforce_eager, **kw)


# ---------------------------------------------------------------------------------------------
# Running a model


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


def retrieve(queries: list[str], url: str, topk: int, chunk: int = 1024) -> list[list[dict]]:
    from tqdm import tqdm

    from search_r1.retrieval.client import RetrievalClient, RetrieverConfig

    with RetrievalClient(RetrieverConfig(url=url, topk=topk)) as client:
        hits = []
        for lo in tqdm(range(0, len(queries), chunk), desc="retrieving", unit="batch",
                       disable=len(queries) <= chunk):
            hits += client.retrieve(queries[lo:lo + chunk], topk)
    return hits


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


# ---------------------------------------------------------------------------------------------
# Retrieval only


def run_retrieval_eval(data: list[str], retriever_url: str, topks: list[int], out: str,
                       limit: int | None = None, label: str = "retriever") -> dict:
    """Answer recall@k per data source (macro-averaged too); writes eval_retrieval.json/.md."""
    if not topks or min(topks) < 1:
        raise ValueError(f"--topk {topks}: give positive integers, e.g. 1,3,5")
    topks = sorted(set(topks))
    questions = load_questions(data, limit)
    hits = retrieve([q.question for q in questions], retriever_url, topks[-1])
    found: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for q, passages in zip(questions, hits):
        # The rank of the first passage holding a gold answer (inf when none does).
        first = next((rank for rank, h in enumerate(passages, 1)
                      if substring_match(h.get("document", h)["contents"], q.golds)), float("inf"))
        for k in topks:
            found[q.data_source][k].append(float(first <= k))
    per_source = {source: {"n": len(by_k[topks[0]]), **{f"recall@{k}": fmean(by_k[k]) for k in topks}}
                  for source, by_k in found.items()}
    macro = {f"recall@{k}": fmean(s[f"recall@{k}"] for s in per_source.values()) for k in topks}
    result = {"retriever": label, "retriever_url": retriever_url, "data": data, "limit": limit,
              "topk": topks, "n": len(questions), "per_source": per_source, "macro": macro}
    Path(out).mkdir(parents=True, exist_ok=True)
    Path(out, "eval_retrieval.json").write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    table = paper_table([(label, f"recall@{k}", {s: m[f"recall@{k}"] for s, m in per_source.items()})
                         for k in topks])
    Path(out, "eval_retrieval.md").write_text(table)
    print(table)
    return result


# ---------------------------------------------------------------------------------------------
# Command line


def template_kwargs(text: str) -> dict:
    """A --chat-template-kwargs value: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({e}): give an object, e.g. "
                                         "'{\"enable_thinking\": false}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object: give one, e.g. "
                                         "'{\"enable_thinking\": false}'")
    return value


def _files(values: list[str]) -> list[str]:
    return [f for v in values for f in v.split(",") if f]


def add_parser(subparsers) -> None:
    d = EvalConfig(model="", data=[], out="")
    p = subparsers.add_parser("eval", help="evaluate a model on QA test sets (EM, F1, searches)",
                              description=__doc__.split("\n\n")[1])
    p.add_argument("--model", required=True,
                   help="HF model dir, hub id, or a training run / checkpoints / global_step_N dir")
    p.add_argument("--data", nargs="+", required=True, help="test parquet file(s), training schema")
    p.add_argument("--out", required=True, help="directory for eval_<mode>.json/.md and predictions")
    p.add_argument("--mode", choices=[m.value for m in Mode], default=d.mode.value)
    p.add_argument("--engine", choices=["vllm", "hf"], default=d.engine)
    p.add_argument("--retriever-url", default=d.retriever_url, help="for search and rag modes")
    p.add_argument("--limit", type=int, help="questions per data source (default: all)")
    p.add_argument("--temperature", type=float, default=d.temperature, help="0 = greedy")
    p.add_argument("--max-turns", type=int, default=d.max_turns, help="searches allowed per question")
    p.add_argument("--topk", type=int, default=d.topk, help="passages per search")
    p.add_argument("--max-response-length", type=int, default=d.max_response_length, help="tokens per turn")
    p.add_argument("--max-obs-length", type=int, default=d.max_obs_length, help="tokens per observation")
    p.add_argument("--template", choices=["instruct", "base"], default=d.template,
                   help="instruct: apply the chat template; base: feed the prompt text as is")
    p.add_argument("--protocol", choices=["tags", "tools"], default=d.protocol,
                   help="tags: Search-R1's <search>/<information>; tools: search tool calls through the chat "
                        "template (data built with qa_search.py --template tool)")
    p.add_argument("--chat-template-kwargs", type=template_kwargs, default={}, metavar="JSON",
                   help="more keyword arguments of the chat template, as a JSON object, e.g. "
                        "'{\"enable_thinking\": false}' for Qwen3 (data.apply_chat_template_kwargs in training)")
    p.add_argument("--turn-prefix", default=d.turn_prefix,
                   help="search mode, tags: text written after each observation, opening the model's next turn "
                        "(e.g. '<think>'; as the model was trained: actor_rollout_ref.rollout.agent_kwargs.turn_prefix)")
    p.add_argument("--base-model", help="for a checkpoint: the model training started from "
                                        "(default: actor_rollout_ref.model.path of the run's config.yaml)")
    p.add_argument("--allow-unverified-checkpoint", action="store_true",
                   help="for a checkpoint without manifest.json (written before checksums existed): export it "
                        "without checking its files; by default it is refused as corrupt")
    p.add_argument("--label", help="the model's name in the table (default: from --model)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="questions per agent run")
    p.add_argument("--schedule", choices=["continuous", "sync", "async"], default=d.schedule,
                   help="vLLM: turns join the running batch when ready (continuous) or wait for the batch (sync)")
    p.add_argument("--engine-core", choices=["in_process", "separate"],
                   help="vLLM's scheduler in this process or its own (default: separate on a GPU)")
    p.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    p.add_argument("--kv-cache-gib", type=float, help="vLLM: a fixed KV cache of this many GiB instead of a share "
                   "of the free memory (for a GPU that other processes use at the same time)")
    p.add_argument("--enforce-eager", action="store_true", default=None,
                   help="vLLM on a GPU: skip compiling and CUDA graphs (starts in seconds; small models, few questions)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.set_defaults(func=main, eval_command="eval")

    r = subparsers.add_parser("eval-retrieval", help="answer recall@k of a retrieval server on QA test sets")
    r.add_argument("--data", nargs="+", required=True, help="test parquet file(s), training schema")
    r.add_argument("--retriever-url", default=d.retriever_url)
    r.add_argument("--topk", default="1,3,5", help="comma-separated k values")
    r.add_argument("--limit", type=int, help="questions per data source (default: all)")
    r.add_argument("--out", required=True, help="directory for eval_retrieval.json/.md")
    r.add_argument("--label", default="retriever", help="the retriever's name in the table")
    r.set_defaults(func=main, eval_command="eval-retrieval")


def main(args: argparse.Namespace) -> None:
    if args.eval_command == "eval-retrieval":
        try:
            topks = [int(k) for k in args.topk.split(",") if k.strip()]
        except ValueError:
            raise ValueError(f"--topk {args.topk!r}: give comma-separated integers, e.g. 1,3,5") from None
        run_retrieval_eval(_files(args.data), args.retriever_url, topks, args.out, args.limit, args.label)
        return
    run_eval(EvalConfig(
        model=args.model, data=_files(args.data), out=args.out, mode=Mode(args.mode), engine=args.engine,
        retriever_url=args.retriever_url, limit=args.limit, temperature=args.temperature,
        max_turns=args.max_turns, topk=args.topk, max_response_length=args.max_response_length,
        max_obs_length=args.max_obs_length, template=args.template, protocol=args.protocol,
        turn_prefix=args.turn_prefix, chat_template_kwargs=args.chat_template_kwargs, base_model=args.base_model,
        allow_unverified_checkpoint=args.allow_unverified_checkpoint,
        label=args.label, batch_size=args.batch_size, schedule=args.schedule, engine_core=args.engine_core,
        gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_gib=args.kv_cache_gib,
        enforce_eager=args.enforce_eager, seed=args.seed))


if __name__ == "__main__":  # `python -m search_r1.evaluate eval …`, as scripts/evaluate.sh runs it
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="python -m search_r1.evaluate", description=__doc__.splitlines()[0])
    add_parser(parser.add_subparsers(dest="cmd", required=True))
    from search_r1.cli import normalize_flags, show_defaults
    show_defaults(parser)
    parsed = parser.parse_args(normalize_flags(sys.argv[1:]))
    from verl.checkpoint.manifest import CheckpointCorrupt
    try:
        parsed.func(parsed)
    except (FileNotFoundError, ValueError, CheckpointCorrupt) as error:  # the message says what to do
        sys.exit(f"{parser.prog} {parsed.cmd}: error: {error}")
