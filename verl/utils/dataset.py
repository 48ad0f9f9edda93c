"""Training prompts from parquet files, with a resumable, seeded order.

Rows carry `data_source`, `prompt` (chat messages), `reward_model.ground_truth`, `extra_info`.
Prompts are tokenised once (chat template, or the message text as is for base models); prompts
longer than `max_prompt_length` are dropped with a warning rather than truncated, since a cut
question cannot be answered.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import pyarrow.parquet as pq

log = logging.getLogger(__name__)


@dataclass
class Example:
    prompt_ids: list[int]
    data_source: str
    ground_truth: object
    index: int


def load_examples(files, tokenizer, max_prompt_length: int, apply_chat_template: bool = True,
                  limit: int | None = None) -> list[Example]:
    files = [files] if isinstance(files, str) else list(files)
    examples, dropped = [], 0
    for path in files:
        table = pq.read_table(path)
        missing = {"prompt", "data_source", "reward_model"} - set(table.column_names)
        if missing:
            raise ValueError(f"{path} lacks the columns {sorted(missing)} "
                             "(build it with scripts/data_process/qa_search.py)")
        for i, row in enumerate(table.to_pylist()):
            messages = row["prompt"]
            if apply_chat_template:
                ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                ids = tokenizer(ids, add_special_tokens=False).input_ids
            else:
                ids = tokenizer("".join(m["content"] for m in messages)).input_ids
            if len(ids) > max_prompt_length:
                dropped += 1
                continue
            gt = (row.get("reward_model") or {}).get("ground_truth")
            index = (row.get("extra_info") or {}).get("index", len(examples))
            examples.append(Example(ids, row["data_source"], gt, int(index) if index is not None else i))
            if limit and len(examples) >= limit:
                break
    if dropped:
        log.warning("dropped %d prompts longer than data.max_prompt_length=%d tokens", dropped, max_prompt_length)
    if not examples:
        raise ValueError(f"no usable prompts in {files}")
    return examples


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
