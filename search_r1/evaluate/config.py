"""`EvalConfig`: the settings of one `search-r1 eval` run, and its three modes."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


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
