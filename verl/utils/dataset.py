"""Training prompts from parquet or JSON files, with a resumable, seeded order.

Three row layouts are accepted, told apart by their fields:
- Search-R1 / verl rows, as the original `nq_search.py` and our `scripts/data_process/qa_search.py`
  write them: `data_source`, `prompt` (chat messages), `reward_model.ground_truth`
  (`{"target": [answers]}`), `extra_info.index`. verl's search-tool rows (a system and a user
  message, `extra_info.tools_kwargs`) are the same layout.
- RLinf's rows: `prompt` and `solutions` (a list of answers, or one). `solutions` becomes the
  ground truth `{"target": [...]}`, so reward functions see one shape; `data_source` is taken from
  the row when it has one, else RLINF_DATA_SOURCE.
- The Search-R1 layout written as JSON lines.
Files are `.parquet`, `.jsonl` or `.json` (a list of rows, or one row), whatever their layout.

The prompt reaches the tokenizer as the row gives it: users choose their prompt when they build the
data, and we never re-template it.
- Chat messages with `data.apply_chat_template=true`: the tokenizer's chat template, with the
  generation prompt.
- Chat messages with `data.apply_chat_template=false`: the messages' text, joined by newlines. This
  is also the fallback, logged once per call, when the tokenizer has no chat template (a base
  model), as the original did; refusing would turn away its data and scripts.
- Text (RLinf's prompts, already formatted for the model): as written. Through a chat template it
  would be wrapped a second time, so with a template to apply it is refused and the error says to
  set `data.apply_chat_template=false`, as RLinf's own config does.
A prompt whose last message is the assistant's is an unfinished response (e.g. "<think>", written by
`qa_search.py --response-prefix`): the chat template renders it open (`continue_final_message`), the
model continues it, and the rewards read its text as the response's start (`Example.response_prefix`).
`data.apply_chat_template_kwargs` (verl's key) goes to every rendering, e.g. `{enable_thinking: false}`
for Qwen3's thinking switch; `thinks_natively` reads from the rendered template whether the model
is asked to think on its own.
Deviation from the original: without a chat template it kept only the first message, which for
verl's system + user rows drops the question; we keep every message.

Prompts longer than `max_prompt_length` are dropped with a warning rather than truncated, since a
cut question cannot be answered. `extra_info.index` becomes the prompt's group id. Where indices
are missing or repeat (the original's merged NQ + HotpotQA file restarts them for each source, and
so do several files each counted from 0), all prompts are numbered by position instead, since
samples of different questions sharing an id would be pooled into one GRPO group.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

log = logging.getLogger(__name__)

FILE_TYPES = (".parquet", ".jsonl", ".json")
# RLinf's rows carry no data source. search_r1.rewards.score_for scores a source it does not know
# by exact match, which is what RLinf's Search-R1 reward does.
RLINF_DATA_SOURCE = "rlinf"
LAYOUTS = ("Search-R1/verl rows (data_source, prompt, reward_model.ground_truth, extra_info) or "
           "RLinf rows (prompt, solutions)")


@dataclass
class Example:
    prompt_ids: list[int]
    data_source: str
    ground_truth: object
    index: int
    extra_info: dict | None = None   # the row's extra_info, passed on to a reward function that takes it
    response_prefix: str = ""   # the response's start, given in the prompt (see the module docstring)


def read_rows(path: str | Path) -> list[dict]:
    """The rows of one data file, as dicts, whatever their layout."""
    path = Path(path)
    if path.suffix not in FILE_TYPES:
        raise ValueError(f"{path}: data.train_files/val_files take {', '.join(FILE_TYPES)} files, "
                         f"not {path.suffix or 'a file without suffix'}; rename it if it is one "
                         "of these.")
    if not path.is_file():
        raise FileNotFoundError(f"No data file {path}: check data.train_files/val_files, or build "
                                "it with scripts/data_process/qa_search.py.")
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    with open(path, encoding="utf-8") as f:
        if path.suffix == ".json":
            content = json.load(f)
            return content if isinstance(content, list) else [content]
        rows = []
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path} line {n} is not JSON ({e}): each line holds one row.") from e
        return rows


def row_fields(row: dict, where: str) -> tuple[list[dict] | str, str, object, int | None]:
    """(prompt, data_source, ground truth, index or None) of a row in either layout."""
    if not isinstance(row, dict) or "prompt" not in row:
        raise ValueError(f"{where} has no `prompt`: expected {LAYOUTS}.")
    if "reward_model" in row:
        if "data_source" not in row:
            raise ValueError(f"{where} has no `data_source` (the name that picks the reward); "
                             "build the file with scripts/data_process/qa_search.py.")
        ground_truth = (row["reward_model"] or {}).get("ground_truth")
        index = (row.get("extra_info") or {}).get("index")
        return row["prompt"], row["data_source"], ground_truth, None if index is None else int(index)
    if "solutions" in row:
        answers = row["solutions"]
        answers = [answers] if isinstance(answers, str) else list(answers)
        return row["prompt"], row.get("data_source") or RLINF_DATA_SOURCE, {"target": answers}, None
    raise ValueError(f"{where} has fields {sorted(row)}: expected {LAYOUTS}.")


def messages_text(messages: list[dict], where: str) -> str:
    """The messages' text for a model fed without a chat template; one message is kept as is."""
    try:
        return "\n".join(m["content"] for m in messages)
    except (TypeError, KeyError) as e:
        raise ValueError(f"{where}: `prompt` must be text or a list of messages with a text "
                         f"`content` each ({e!r}).") from e


def response_prefix(prompt: list[dict] | str) -> str:
    """The response's start a prompt gives: the text of a last message that is the assistant's."""
    if isinstance(prompt, str) or not prompt or prompt[-1].get("role") != "assistant":
        return ""
    return prompt[-1].get("content") or ""


def encode_prompt(prompt: list[dict] | str, tokenizer, use_chat_template: bool, where: str,
                  chat=None, template_kwargs: dict | None = None) -> list[int]:
    """Token ids of a prompt, its text untouched (see the module docstring). `chat`: a
    verl.tools.chat.ChatFormat, whose template also lists the tools (the tool protocol) and holds
    its own template kwargs; `template_kwargs`: more keyword arguments of the chat template."""
    open_response = bool(response_prefix(prompt))
    if chat is not None:
        if isinstance(prompt, str):
            raise ValueError(f"{where} gives the prompt as text; the tool protocol needs chat messages, "
                             "rendered with the tools by the chat template")
        if open_response:
            raise ValueError(f"{where} ends with an assistant message (a response prefix), which the "
                             "tool protocol does not take: its prompts end with the user's message")
        return chat.prompt_ids(prompt)
    if isinstance(prompt, str):
        if use_chat_template:
            raise ValueError(f"{where} gives the prompt as text (RLinf's layout), which is fed to the "
                             "model as written: set data.apply_chat_template=false, as RLinf's "
                             "config does, or give `prompt` as chat messages.")
        return tokenizer(prompt).input_ids
    if not use_chat_template:
        return tokenizer(messages_text(prompt, where)).input_ids
    if open_response:  # rendered without its end-of-turn, so that the model continues it
        text = tokenizer.apply_chat_template(prompt, continue_final_message=True, tokenize=False,
                                             **(template_kwargs or {}))
    else:
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False,
                                             **(template_kwargs or {}))
    return tokenizer(text, add_special_tokens=False).input_ids


def thinks_natively(tokenizer, template_kwargs: dict | None = None) -> bool:
    """Whether the tokenizer's chat template, rendered with `template_kwargs`, has the model think in
    its own <think> block. The rule, read off a one-question conversation:
    - the generation prompt opens <think> and leaves it open: yes (the template starts the thinking);
    - it writes a closed <think></think> (e.g. Qwen3 with enable_thinking=false): no, thinking is off;
    - it writes no <think>: yes if the template's text knows the tag (Qwen3 with thinking on leaves
      the block to the model), else no. No chat template: no."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return False
    question = [{"role": "user", "content": "q"}]
    kwargs = template_kwargs or {}
    without = tokenizer.apply_chat_template(question, tokenize=False, **kwargs)
    with_prompt = tokenizer.apply_chat_template(question, add_generation_prompt=True, tokenize=False, **kwargs)
    opening = with_prompt.removeprefix(without)
    if "<think>" in opening:
        return "</think>" not in opening.split("<think>")[-1]
    templates = template.values() if isinstance(template, dict) else [template]
    return any("<think>" in t for t in templates)


def group_ids(indices: list[int | None], files: list[str]) -> list[int]:
    """The rows' own indices when each prompt has a distinct one, else positions 0..N-1."""
    if None not in indices and len(set(indices)) == len(indices):
        return indices
    if any(i is not None for i in indices):
        log.warning("extra_info.index is missing or repeated in %s (the original's merged files "
                    "restart it for each source); numbering the %d prompts by position instead, "
                    "since the index is the group id of a prompt's samples", files, len(indices))
    return list(range(len(indices)))


def load_examples(files, tokenizer, max_prompt_length: int, apply_chat_template: bool = True,
                  limit: int | None = None, chat=None, template_kwargs: dict | None = None) -> list[Example]:
    files = [files] if isinstance(files, (str, Path)) else [str(f) for f in files]
    use_chat_template = apply_chat_template and bool(getattr(tokenizer, "chat_template", None))
    if apply_chat_template and not use_chat_template:
        log.warning("The tokenizer has no chat template: the prompts of %s are fed as their raw text "
                    "(messages joined by newlines), as the original Search-R1 did. Set "
                    "data.apply_chat_template=false to say so and silence this.", files)
    rows, indices, dropped = [], [], 0
    for path in files:
        for i, row in enumerate(read_rows(path)):
            where = f"{path} row {i}"
            prompt, data_source, ground_truth, index = row_fields(row, where)
            ids = encode_prompt(prompt, tokenizer, use_chat_template, where, chat, template_kwargs)
            if len(ids) > max_prompt_length:
                dropped += 1
                continue
            rows.append((ids, data_source, ground_truth, row.get("extra_info"), response_prefix(prompt)))
            indices.append(index)
            if limit and len(rows) >= limit:
                break
        if limit and len(rows) >= limit:
            break
    if dropped:
        log.warning("dropped %d prompts longer than data.max_prompt_length=%d tokens", dropped, max_prompt_length)
    if not rows:
        raise ValueError(f"no usable prompts in {files}")
    return [Example(ids, source, gt, gid, extra, prefix)
            for (ids, source, gt, extra, prefix), gid in zip(rows, group_ids(indices, files))]


class PromptSampler:
    """Batches of examples in a seeded order per epoch; `state()`/`restore()` for exact resume."""

    def __init__(self, examples: list[Example], batch_size: int, shuffle: bool, seed: int):
        if batch_size > len(examples):
            raise ValueError(f"data.train_batch_size={batch_size} exceeds the {len(examples)} training prompts")
        self.examples, self.batch_size, self.shuffle, self.seed = examples, batch_size, shuffle, seed
        self.epoch, self.position = 0, 0

    @property
    def steps_per_epoch(self) -> int:
        return len(self.examples) // self.batch_size  # the last partial batch is dropped

    def _order(self, epoch):
        if not self.shuffle:
            return np.arange(len(self.examples))
        return np.random.default_rng(self.seed + epoch).permutation(len(self.examples))

    def next_batch(self) -> list[Example]:
        if self.position >= self.steps_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        order = self._order(self.epoch)
        lo = self.position * self.batch_size
        self.position += 1
        return [self.examples[i] for i in order[lo:lo + self.batch_size]]

    def state(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def restore(self, state: dict):
        self.epoch, self.position = state["epoch"], state["position"]
