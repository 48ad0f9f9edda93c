"""`search-r1 sft`: its flags, and the command that builds or reads the trajectories and trains."""
from __future__ import annotations

import json
import os
from pathlib import Path

from search_r1.sft.train import run_sft
from search_r1.sft.trajectories import load_trajectory_jsonl, make_bundled_trajectories


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
