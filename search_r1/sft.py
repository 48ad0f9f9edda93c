"""Supervised warm start on search trajectories written in the exact rollout format.

A small instruct model (the bundled SmolLM2-135M) rarely writes `<search>` or `<answer>` on its own,
so RL starts with almost no reward to learn from. A short SFT pass on gold trajectories teaches
the format first. The original Search-R1 has no SFT stage; this one is ours.

What makes a trajectory "exact": it is built from ids the way `SearchAgent` builds a rollout (or,
with `--protocol tools`, the tool-calling loop: search tool calls, tool messages from the chat
template's own framing, the prompt rendered with the search tool).
- prompt ids as `verl.utils.dataset.load_examples` makes them (chat template + generation prompt);
- each model segment (`<think> … </think>` then `<search> … </search>` or `<answer> … </answer>`)
  tokenized on its own and appended, loss 1;
- each observation made by `SearchAgent.passage_ids` from real retrieval hits (same wrapper,
  same cut at `max_obs_length`), loss 0: the model is never trained on the passages;
- EOS after the answer, loss 1. The rollout's engine stops on `</answer>` before any EOS, so this
  token is never sampled in RL; it is here so the SFT model also stops when run without stop strings.

Gold paths for the bundled geography task use the retriever the model will meet in RL, and a
question is kept only if its answer (and, for two hops, the country) is in the observation the
model actually reads, so we never teach answering without evidence.
"""
from __future__ import annotations

import json
import logging
import math
import os
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch

from search_r1.agent.loop import AgentConfig, SearchAgent
from search_r1.data.bundled import with_article
from search_r1.data.templates import make_prompt, make_prompt_text

log = logging.getLogger(__name__)

METRICS_FILE = "sft_metrics.jsonl"
SearchFn = Callable[[list[str], int], list[list[dict]]]   # (queries, topk) -> hits per query


@dataclass
class Example:
    """One SFT trajectory: the same ids and mask a rollout would produce."""
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]                       # 1 = model token (trained), 0 = observation
    meta: dict = field(default_factory=dict)   # bundled: question id, type, passage_ids

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


# ---------------------------------------------------------------------------------------------
# Building trajectories


class _Builder:
    """Turns prompt / model text / hits into ids exactly as the rollout does."""

    def __init__(self, tokenizer, template: str = "instruct", max_obs_length: int = 500, protocol: str = "tags"):
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token_id: set one so the model can learn to stop")
        if protocol not in ("tags", "tools"):
            raise ValueError(f"protocol {protocol!r}: use tags or tools")
        self.tok, self.protocol = tokenizer, protocol
        self.template = "tool" if protocol == "tools" else template
        self.max_obs_length = max_obs_length
        # loop.py owns the observation format; borrowing its agent keeps the two from drifting.
        self.agent = SearchAgent(engine=SimpleNamespace(tokenizer=tokenizer), searcher=None,
                                 cfg=AgentConfig(max_obs_length=max_obs_length))
        self.chat = None
        if protocol == "tools":  # the tool loop's own rendering of prompts and tool messages
            from search_r1.agent.search_tool import search_chat_format
            self.chat = search_chat_format(tokenizer)

    def segment(self, thought: str, action: str, content: str) -> str:
        """A model turn: a thought, then a search (a <search> tag or a search tool call) or the answer."""
        if action == "search" and self.protocol == "tools":
            call = json.dumps({"name": "search", "arguments": {"query_list": [content]}})
            return f"<think> {thought} </think>\n<tool_call>\n{call}\n</tool_call>"
        return _segment(thought, action, content)

    def prompt_ids(self, prompt: list[dict] | str) -> list[int]:
        # The trainer's own function (chat template, or raw text for text prompts and tokenizers
        # without a template), so SFT and RL see the same prompt ids.
        from verl.utils.dataset import encode_prompt
        use_chat_template = isinstance(prompt, list) and bool(getattr(self.tok, "chat_template", None))
        return encode_prompt(prompt, self.tok, use_chat_template, "SFT prompt", self.chat)

    def question_prompt_ids(self, question: str) -> list[int]:
        if self.template == "base":
            return self.prompt_ids(make_prompt_text(question, "base"))
        return self.prompt_ids(make_prompt(question, self.template))

    def model_ids(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def observation_ids_from_hits(self, hits: list[dict]) -> list[int]:
        if self.chat is not None:
            from search_r1.agent.loop import format_passages
            return self.chat.tool_message_ids(format_passages(hits), self.max_obs_length)
        return self.agent.passage_ids(hits)

    def observation_ids_from_text(self, body: str) -> list[int]:
        """The agent's wrapper and cut around already formatted passages."""
        a = self.agent
        room = a.cfg.max_obs_length - len(a._open_ids) - len(a._close_ids)
        return a._open_ids + a._encode(body)[:max(0, room)] + a._close_ids

    def example(self, prompt_ids: list[int], turns: list[tuple[str, list[int]]], meta: dict) -> Example:
        """turns: ("model" | "observation", ids); EOS goes after the last model turn."""
        response, mask = [], []
        for role, ids in turns:
            response += ids
            mask += [int(role == "model")] * len(ids)
        response.append(self.tok.eos_token_id)
        mask.append(1)
        return Example(prompt_ids, response, mask, meta)


def _segment(thought: str, action: str, content: str) -> str:
    return f"<think> {thought} </think>\n<{action}> {content} </{action}>"


def _mentions(text: str, name: str) -> bool:
    # Whole words only: "Niger" must not count as found inside "Nigeria".
    return re.search(rf"(?<!\w){re.escape(name)}(?!\w)", text, re.IGNORECASE) is not None


def _first_mentioned(text: str, names: list[str]) -> str | None:
    return next((n for n in names if _mentions(text, n)), None)


@lru_cache(maxsize=1)
def _bundled_titles() -> dict[str, str]:
    from search_r1.data.bundled import bundled_paths, read_jsonl
    return {row["id"]: row["contents"].partition("\n")[0].strip().strip('"')
            for row in read_jsonl(bundled_paths()["corpus"])}


@lru_cache(maxsize=1)
def _test_cities() -> dict[str, str]:
    """City passage id -> question text, for every city of the bundled test split."""
    from search_r1.data.bundled import bundled_paths, read_jsonl
    return {q["passage_ids"][0]: q["question"] for q in read_jsonl(bundled_paths()["test"])}


def check_train_split(items: list[dict]) -> None:
    """Refuse bundled questions about a test-split city (items: question records or Example.meta).

    The bundled splits are disjoint by city; SFT on a test city would leak its answers into the
    evaluation. Items without passage ids (user data) are not bundled questions and pass.
    """
    leaked = [it for it in items if it.get("passage_ids") and it["passage_ids"][0] in _test_cities()]
    if leaked:
        raise ValueError(
            f"{len(leaked)} SFT question(s) are about cities of the bundled TEST split "
            f"(e.g. {leaked[0].get('question') or leaked[0].get('id')!r}): SFT must only use the "
            "training questions (search_r1.data.bundled.bundled_paths()['train']).")


def make_bundled_trajectories(questions: list[dict], search_fn: SearchFn, tokenizer,
                              template: str = "instruct", topk: int = 3,
                              max_obs_length: int = 500, protocol: str = "tags") -> tuple[list[Example], dict]:
    """Gold search trajectories for bundled questions; returns (examples, stats).

    search_fn(queries, topk) returns hits in the `/retrieve` layout (e.g. `RetrievalClient.retrieve`
    or `HTTPSearcher.search`). One-hop questions search the city and answer; two-hop questions
    search the city, then "<country> capital" / "currency" / "population", then answer. Questions
    whose evidence is missing from what the model would read are dropped and counted in stats. With
    protocol "tools" the searches are search tool calls and the passages tool messages, exactly as
    the tool-calling loop writes them.
    """
    check_train_split(questions)
    b = _Builder(tokenizer, template, max_obs_length, protocol)
    titles = _bundled_titles()
    dropped: Counter = Counter()

    def search(queries: list[str]) -> list[tuple[list[int], str]]:
        hits = search_fn(queries, topk) if queries else []
        out = []
        for h in hits:
            ids = b.observation_ids_from_hits(h[:topk])
            out.append((ids, tokenizer.decode(ids)))  # the text the model reads, after the cut
        return out

    cities = [titles[q["passage_ids"][0]] for q in questions]
    first = search(cities)
    # Second hop: only two-hop questions whose first observation names the country.
    second_queries, hop2 = [], {}
    for i, q in enumerate(questions):
        if q["hops"] == 2:
            country = titles[q["passage_ids"][1]]
            if _mentions(first[i][1], country):
                hop2[i] = len(second_queries)
                second_queries.append(f"{country} {q['type'].rsplit('_', 1)[1]}")
            else:
                dropped[q["type"]] += 1
    second = search(second_queries)

    examples = []
    for i, q in enumerate(questions):
        city, kind = cities[i], q["type"]
        meta = {"id": q["id"], "question": q["question"], "type": kind, "hops": q["hops"],
                "passage_ids": q["passage_ids"]}
        obs1_ids, obs1 = first[i]
        if q["hops"] == 1:
            answer = _first_mentioned(obs1, q["golden_answers"])
            if answer is None:
                dropped[kind] += 1
                continue
            if kind == "city_country":
                plan, found = f"I need to find which country {city} is in.", f"{city} is in {with_article(answer)}."
            else:
                plan, found = (f"I need to find the time zone of {city}.",
                               f"{city} is in the {answer} time zone.")
            turns = [("model", b.model_ids(b.segment(plan, "search", city))), ("observation", obs1_ids),
                     ("model", b.model_ids(b.segment(f"The passage says {found}", "answer", answer)))]
        else:
            if i not in hop2:
                continue  # counted above
            obs2_ids, obs2 = second[hop2[i]]
            answer = _first_mentioned(obs2, q["golden_answers"])
            if answer is None:
                dropped[kind] += 1
                continue
            country = titles[q["passage_ids"][1]]
            what = kind.rsplit("_", 1)[1]                      # "capital", "currency" or "population"
            article = "the " if what == "currency" else ""
            turns = [
                ("model", b.model_ids(b.segment(f"I need to find which country {city} is in, then its {what}.",
                                               "search", city))),
                ("observation", obs1_ids),
                ("model", b.model_ids(b.segment(f"{city} is in {with_article(country)}. Now I need the {what} of "
                                               f"{with_article(country)}.",
                                               "search", f"{country} {what}"))),
                ("observation", obs2_ids),
                ("model", b.model_ids(b.segment(f"The passage says the {what} of {with_article(country)} is {article}{answer}.",
                                               "answer", answer))),
            ]
        examples.append(b.example(b.question_prompt_ids(q["question"]), turns, meta))
    stats = {"questions": len(questions), "kept": len(examples), "dropped": sum(dropped.values()),
             "dropped_by_type": dict(dropped)}
    log.info("SFT trajectories: kept %d of %d questions; dropped %d whose evidence was not retrieved %s",
             len(examples), len(questions), stats["dropped"], dict(dropped))
    return examples, stats


def load_trajectory_jsonl(path: str | os.PathLike, tokenizer, max_obs_length: int = 500) -> list[Example]:
    """User trajectories, one JSON object a line:
    `{"prompt": [chat messages] or "raw text", "turns": [{"role": "model" | "observation", "text": …}]}`.

    Model turns are trained on (each tokenized on its own, EOS added after the last one);
    observation text is the formatted passages only: the `<information>` wrapper and the cut at
    `max_obs_length` tokens are added here, exactly as the agent does.
    """
    b = _Builder(tokenizer, max_obs_length=max_obs_length)
    examples = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            row = json.loads(line)
            if "prompt" not in row or not row.get("turns"):
                raise ValueError(f"{where}: each line needs 'prompt' and a non-empty 'turns' list")
            turns = []
            for t in row["turns"]:
                role, text = t.get("role"), t.get("text", "")
                if role == "model":
                    turns.append(("model", b.model_ids(text)))
                elif role == "observation":
                    if "<information>" in text:
                        raise ValueError(f"{where}: give only the passages of an observation; the "
                                         "<information> tags are added as the agent adds them")
                    turns.append(("observation", b.observation_ids_from_text(text)))
                else:
                    raise ValueError(f"{where}: turn role {role!r}: use 'model' or 'observation'")
            if turns[-1][0] != "model":
                raise ValueError(f"{where}: the last turn must be the model's (its answer)")
            examples.append(b.example(b.prompt_ids(row["prompt"]), turns, {"source": where}))
    if not examples:
        raise ValueError(f"no trajectories in {path}")
    return examples


# ---------------------------------------------------------------------------------------------
# Loss and training


def _pack(examples: list[Example], pad_id: int):
    from verl.batch import pack_trajectories
    return pack_trajectories([e.prompt_ids for e in examples], [e.response_ids for e in examples],
                             [e.loss_mask for e in examples], list(range(len(examples))), pad_id)


def masked_nll(model, examples: list[Example], pad_id: int, device="cpu") -> tuple[torch.Tensor, int]:
    """(sum of -log p over the model tokens, number of model tokens). Observations, prompt and
    padding never contribute."""
    from verl.workers.packing import TOKENS_PER_PACK, forward_packed, tokens_per_pack
    batch = _pack(examples, pad_id).to(device)
    logprobs_BR, _ = forward_packed(model, batch.input_ids_BT, batch.attention_mask_BT, batch.prompt_width,
                                    max_tokens_per_pack=tokens_per_pack(TOKENS_PER_PACK, batch.input_ids_BT.device),
                                    loss_mask_BR=batch.loss_mask_BR)
    return -(logprobs_BR * batch.loss_mask_BR).sum(), int(batch.loss_mask_BR.sum().item())


def _autocast(device: torch.device):
    # bf16 compute on GPUs; fp32 on the CPU. forward_packed takes the softmax in fp32 either way.
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


@torch.no_grad()
def mean_nll(model, examples: list[Example], pad_id: int, micro_batch_size: int = 8, device="cpu") -> float:
    """Mean NLL per model token over `examples` (for before/after comparisons)."""
    device = torch.device(device)
    total, tokens = 0.0, 0
    for lo in range(0, len(examples), micro_batch_size):
        with _autocast(device):
            nll, n = masked_nll(model, examples[lo:lo + micro_batch_size], pad_id, device)
        total, tokens = total + nll.item(), tokens + n
    return total / max(tokens, 1)


def _train_step(model, rows: list[Example], optimizer, scheduler, micro_batch_size: int, pad_id: int,
                device: torch.device, max_grad_norm: float) -> dict:
    # Every micro-batch divides by the whole batch's token count, so the accumulated gradient is
    # that of the mean over all model tokens of the batch, however it is split.
    tokens = sum(sum(e.loss_mask) for e in rows)
    lr = scheduler.get_last_lr()[0]
    optimizer.zero_grad(set_to_none=True)
    nll_sum = 0.0
    for lo in range(0, len(rows), micro_batch_size):
        with _autocast(device):
            nll, _ = masked_nll(model, rows[lo:lo + micro_batch_size], pad_id, device)
        (nll / tokens).backward()
        nll_sum += nll.item()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm).item()
    if math.isfinite(grad_norm):
        optimizer.step()
    else:
        log.warning("non-finite gradient norm: step skipped")
    scheduler.step()
    return {"loss": nll_sum / tokens, "tokens": tokens, "lr": lr, "grad_norm": grad_norm}


def run_sft(model, data: list[Example], out_dir: str | os.PathLike, epochs: int = 2, lr: float = 5e-5,
            batch_size: int = 16, micro_batch_size: int = 8, max_length: int = 2048, seed: int = 0,
            warmup_ratio: float = 0.05, device: str | None = None, tokenizer=None,
            weight_decay: float = 0.0, max_grad_norm: float = 1.0) -> dict:
    """Train `model` (a path, or a loaded causal LM with `tokenizer`) on `data`, one process.

    batch_size and micro_batch_size count trajectories; trajectories longer than max_length
    tokens are left out (cutting one would drop its answer). Writes per-step metrics to
    `<out_dir>/sft_metrics.jsonl` and the trained model and tokenizer to `<out_dir>`.
    Returns a summary (steps, first and last loss, examples used).
    """
    from tqdm import tqdm

    from verl.workers.modeling import build_causal_lm
    from verl.workers.update import build_lr_scheduler, build_optimizer

    if isinstance(model, (str, os.PathLike)):
        from transformers import AutoTokenizer
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(str(model))
        model = build_causal_lm(str(model))
    if tokenizer is None:
        raise ValueError("run_sft got a model object without its tokenizer: pass tokenizer=…")
    check_train_split([e.meta for e in data])
    if batch_size < 1 or micro_batch_size < 1:
        raise ValueError("batch_size and micro_batch_size must be at least 1")
    used = [e for e in data if len(e) <= max_length]
    if len(used) < len(data):
        log.warning("left out %d of %d trajectories longer than max_length=%d tokens",
                    len(data) - len(used), len(data), max_length)
    if not used:
        raise ValueError(f"no trajectory fits in max_length={max_length} tokens: raise --max-length")

    torch.manual_seed(seed)
    order_rng = random.Random(seed)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model.to(device).train()
    steps_per_epoch = math.ceil(len(used) / batch_size)
    total_steps = epochs * steps_per_epoch
    optimizer = build_optimizer(model, lr, weight_decay, (0.9, 0.999))
    scheduler = build_lr_scheduler(optimizer, round(warmup_ratio * total_steps), total_steps, "constant", 0.0)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    losses = []
    with open(out / METRICS_FILE, "w") as metrics_file, tqdm(total=total_steps, desc="sft") as bar:
        for epoch in range(epochs):
            order = list(range(len(used)))
            order_rng.shuffle(order)
            for lo in range(0, len(order), batch_size):
                rows = [used[i] for i in order[lo:lo + batch_size]]
                m = _train_step(model, rows, optimizer, scheduler, micro_batch_size, pad_id, device,
                                max_grad_norm)
                m = {"step": len(losses) + 1, "steps": total_steps, "epoch": epoch, **m}
                losses.append(m["loss"])
                metrics_file.write(json.dumps(m) + "\n")
                metrics_file.flush()
                bar.update()
                bar.set_postfix(loss=f"{m['loss']:.3f}")
    model.save_pretrained(out)   # safetensors
    tokenizer.save_pretrained(out)
    summary = {"steps": total_steps, "examples": len(used), "first_loss": losses[0], "last_loss": losses[-1],
               "out_dir": str(out)}
    log.info("SFT done: %d steps, loss %.3f -> %.3f, model saved to %s", total_steps, losses[0], losses[-1], out)
    return summary


# ---------------------------------------------------------------------------------------------
# Command line: `search-r1 sft`


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("sft", help="supervised warm start on search trajectories")
    p.add_argument("--model", help="model dir or hub id (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, help="where the trained model and sft_metrics.jsonl go")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--bundled", type=int, metavar="N_QUESTIONS",
                     help="gold trajectories for the first N bundled training questions")
    src.add_argument("--data", metavar="FILE.jsonl", help="your own trajectories (see load_trajectory_jsonl)")
    p.add_argument("--retriever-url", default="http://127.0.0.1:8000/retrieve",
                   help="the server the RL rollout will use (--bundled)")
    p.add_argument("--topk", type=int, default=3, help="passages per search (--bundled)")
    p.add_argument("--max-obs-length", type=int, default=500, help="tokens per observation, as data.max_obs_length")
    p.add_argument("--template", choices=["instruct", "base"], default="instruct",
                   help="the prompt (--bundled, tags protocol); the tools protocol uses the tool template")
    p.add_argument("--protocol", choices=["tags", "tools"], default="tags",
                   help="tags: Search-R1's <search>/<information>; tools: search tool calls and tool messages "
                        "through the chat template (--bundled)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--batch-size", type=int, default=16, help="trajectories per optimizer step")
    p.add_argument("--micro-batch-size", type=int, default=8, help="trajectories per forward")
    p.add_argument("--max-length", type=int, default=2048, help="longer trajectories are left out")
    p.add_argument("--warmup-ratio", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", help="cpu or cuda (default: cuda if present)")
    p.set_defaults(func=sft_command)


def sft_command(args) -> None:
    from transformers import AutoTokenizer

    from verl.workers.modeling import build_causal_lm

    model_path = args.model
    if model_path is None:
        from search_r1.local_models import materialize_smollm2
        model_path = materialize_smollm2(os.path.join(os.path.expanduser("~"), ".cache", "search_r1", "smollm2"))
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    if args.bundled is not None:
        from search_r1.data.bundled import bundled_paths, read_jsonl
        from search_r1.retrieval.client import RetrievalClient

        if args.bundled < 1:
            raise ValueError("--bundled needs a positive number of questions")
        questions = read_jsonl(bundled_paths()["train"])[:args.bundled]
        with RetrievalClient(url=args.retriever_url) as client:
            data, stats = make_bundled_trajectories(questions, client.retrieve, tokenizer, args.template,
                                                    args.topk, args.max_obs_length, args.protocol)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "sft_data_stats.json").write_text(json.dumps(stats, indent=1))
        if not data:
            raise ValueError(f"none of the {len(questions)} questions had its answer in the retrieved "
                             f"passages: check the server at {args.retriever_url} serves the bundled corpus")
    else:
        data = load_trajectory_jsonl(args.data, tokenizer, args.max_obs_length)
    run_sft(build_causal_lm(str(model_path)), data, args.out, epochs=args.epochs, lr=args.lr,
            batch_size=args.batch_size, micro_batch_size=args.micro_batch_size, max_length=args.max_length,
            seed=args.seed, warmup_ratio=args.warmup_ratio, device=args.device, tokenizer=tokenizer)
