"""The SFT data: `Example`, one trajectory as ids and a loss mask exactly as a rollout makes them
(`_Builder` borrows the search agent's observation format), gold search trajectories for the bundled
questions (`make_bundled_trajectories`), a user's trajectories from JSONL (`load_trajectory_jsonl`),
and the refusal of test-split questions (`check_train_split`)."""
from __future__ import annotations

import json
import logging
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from types import SimpleNamespace
from typing import Callable

from search_r1.agent.loop import AgentConfig, SearchAgent
from search_r1.data.bundled import with_article
from search_r1.data.templates import make_prompt, make_prompt_text

log = logging.getLogger(__name__)

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
