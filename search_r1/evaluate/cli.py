"""`search-r1 eval` and `search-r1 eval-retrieval`: their flags, read into `EvalConfig`."""
from __future__ import annotations

import argparse
import json
import sys

from search_r1.evaluate.config import EvalConfig, Mode
from search_r1.evaluate.recall import run_retrieval_eval
from search_r1.evaluate.run import run_eval


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
                              description=sys.modules[__package__].__doc__.split("\n\n")[1])
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
