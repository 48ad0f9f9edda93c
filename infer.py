"""Ask a question to a search agent model and watch it think, search, read and answer.

    python infer.py "Which country is the city of Lyon in?" --model PATH_OR_HUB_ID \
        --retriever-url http://127.0.0.1:8000/retrieve
    python infer.py                      # interactive: one question per line

Each model turn is printed as soon as it is generated, coloured by tag (think, search,
information, answer; tool_call and tool_response with --protocol tools), followed by the passages
the retriever returned. Offline it works with a
local model directory; without --model it uses the bundled SmolLM2-135M-Instruct.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

COLOURS = {"think": "\033[2m", "search": "\033[33;1m", "information": "\033[36m",
           "answer": "\033[32;1m", "tool_call": "\033[33;1m", "tool_response": "\033[36m"}
RESET = "\033[0m"
TAG = re.compile(r"(</?(?:think|search|information|answer|tool_call|tool_response)>)")


def colourise(text: str, state: list[str], enabled: bool) -> str:
    """Colour text by the tag it sits in; `state` carries the open tag across calls."""
    if not enabled:
        return text
    out = []
    for part in TAG.split(text):
        m = re.fullmatch(r"<(/?)(\w+)>", part)
        if m:
            state[0] = "" if m.group(1) else m.group(2)
            out.append(COLOURS.get(m.group(2), "") + part + RESET)
        else:
            out.append(COLOURS.get(state[0], "") + part + RESET if state[0] else part)
    return "".join(out)


def retriever_problem(url: str) -> str | None:
    """None when the retrieval server at `url` answers its health check; else what is wrong."""
    import httpx
    try:
        r = httpx.get(url.rsplit("/", 1)[0] + "/health", timeout=3)
    except httpx.TransportError as e:
        return f"no retrieval server answers at {url} ({type(e).__name__})"
    return None if r.status_code == 200 else f"the retrieval server at {url} is not healthy (HTTP {r.status_code})"


def start_hints(args) -> list[str]:
    """What to tell the user before the model loads: a missing server, the untrained default model."""
    hints = []
    if problem := retriever_problem(args.retriever_url):
        from search_r1.data.bundled import bundled_paths
        corpus = bundled_paths()["corpus"]
        hints.append(f"warning: {problem}: every search will fail, and the model can only answer from what it "
                     f"knows. Serve the bundled corpus first, e.g.\n"
                     f"  search-r1 index build --type bm25 --corpus_path {corpus} --out outputs/bundled_bm25\n"
                     f"  search-r1 serve --retriever_name bm25 --index_path outputs/bundled_bm25 --corpus_path {corpus}")
    if args.model is None:
        trained = os.path.join("outputs", "demo", "run", "hf_actor")
        hint = (f"; the demo's trained model is at {trained}: --model {trained}"
                if os.path.isdir(trained) else "; `make demo` trains one")
        hints.append(f"note: no --model, so the untrained bundled SmolLM2-135M-Instruct answers{hint}")
    return hints


def checkpoint_problem(model: str | None) -> str | None:
    """What to do instead when `model` is a training run or checkpoint: its shards are read only by the
    export, which checks them against the checkpoint's manifest first."""
    if model is None or not os.path.isdir(model):
        return None
    from pathlib import Path

    from search_r1.evaluate import find_checkpoint
    ckpt, run = find_checkpoint(Path(model))
    if ckpt is None:
        return None
    return (f"--model {model} is a training checkpoint ({ckpt}), not a model directory: use {run / 'hf_actor'} "
            f"(the trainer exports the actor there with each checkpoint) or export it first, which checks its "
            f"files against its manifest: python -m verl.checkpoint export --checkpoint {ckpt} "
            f"--config-source BASE_MODEL_DIR --out DIR")


def template_kwargs_arg(text: str) -> dict:
    from search_r1.evaluate import template_kwargs
    return template_kwargs(text)


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("question", nargs="?", help="omit for an interactive prompt")
    p.add_argument("--model", help="model dir or hub id (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--retriever-url", default="http://127.0.0.1:8000/retrieve", help="the retrieval server")
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf", help="generation engine")
    p.add_argument("--device", default=None, help="hf engine: cpu or cuda (default: cuda if present)")
    p.add_argument("--template", choices=["instruct", "base"], default="instruct",
                   help="instruct: the chat template; base: the prompt as plain text")
    p.add_argument("--protocol", choices=["tags", "tools"], default="tags",
                   help="tags: Search-R1's <search>/<information>; tools: search tool calls through the chat "
                        "template (a model trained with --protocol tools)")
    p.add_argument("--response-prefix", default="", metavar="TEXT",
                   help="text the response starts with, as in the model's training data (e.g. '<think>' "
                        "for data built with --template example_think); tags protocol only")
    p.add_argument("--turn-prefix", default="", metavar="TEXT",
                   help="text written after each observation, opening the model's next turn, as in its training "
                        "(actor_rollout_ref.rollout.agent_kwargs.turn_prefix); tags protocol only")
    p.add_argument("--chat-template-kwargs", type=template_kwargs_arg, default={}, metavar="JSON",
                   help="more keyword arguments of the chat template, as a JSON object, e.g. "
                        "'{\"enable_thinking\": false}' for Qwen3 (data.apply_chat_template_kwargs in training). "
                        "Where the template has the model think natively, our prompt does not ask for <think>")
    p.add_argument("--max-turns", type=int, default=4, help="searches allowed")
    # All turns together; --max-response-length, its earlier name, still works (the trainer's key of
    # that name counts one turn).
    p.add_argument("--max-response-tokens", "--max-response-length", dest="max_response_tokens", type=int,
                   default=2048, help="tokens of the whole response, every turn and passage included")
    p.add_argument("--topk", type=int, default=3, help="passages per search")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--no-colour", action="store_true", help="plain text output")
    return p


def prompt_ids(tok, question: str, args, chat=None) -> list[int]:
    """The prompt's ids for `question`; `chat`: the tool protocol's ChatFormat. Where the chat template
    has the model think natively (verl.utils.dataset.thinks_natively), our prompt does not ask for <think>."""
    from search_r1.data.templates import make_prompt, make_prompt_text
    from verl.utils.dataset import thinks_natively
    native = thinks_natively(tok, args.chat_template_kwargs)
    if chat is not None:
        return chat.prompt_ids(make_prompt(question, "tool", native))
    if args.template == "instruct" and tok.chat_template:
        prompt = tok.apply_chat_template(make_prompt(question, native_thinking=native), add_generation_prompt=True,
                                         tokenize=False, **args.chat_template_kwargs)
    else:
        prompt = make_prompt_text(question, "base")
    return tok(prompt + args.response_prefix, add_special_tokens=False).input_ids


def main(argv=None) -> int:
    from search_r1.cli import normalize_flags
    parser = build_parser()
    args = parser.parse_args(normalize_flags(sys.argv[1:] if argv is None else list(argv)))
    if args.response_prefix and args.protocol == "tools":
        parser.error("--response-prefix goes with the tags protocol only: the tool protocol's prompts end "
                     "with the user's message")
    if args.turn_prefix and args.protocol == "tools":
        parser.error("--turn-prefix goes with the tags protocol only: in the tool protocol the chat template "
                     "opens every turn")
    if problem := checkpoint_problem(args.model):
        parser.error(problem)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for hint in start_hints(args):
        print(hint, file=sys.stderr, flush=True)
    import torch

    from verl.workers.rollout.engine import SamplingConfig
    from verl.workers.rollout.hf_engine import HFEngine
    from verl.workers.rollout.vllm_engine import VLLMEngine
    from search_r1.agent.loop import AgentConfig, HTTPSearcher, SearchAgent
    from search_r1.retrieval.client import RetrieverConfig

    model = args.model
    if model is None:
        from search_r1.local_models import materialize_smollm2
        model = materialize_smollm2(os.path.join(os.path.expanduser("~"), ".cache", "search_r1", "smollm2"))
    if args.engine == "vllm":
        engine = VLLMEngine(model, max_model_len=args.max_response_tokens + 1024)
    else:
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        engine = HFEngine(model, device=device, dtype="bfloat16" if device == "cuda" else "float32")
    tok = engine.tokenizer
    colour = sys.stdout.isatty() and not args.no_colour
    state = [""]

    def show(trajectory, kind, ids):
        text = tok.decode(ids, skip_special_tokens=True)
        print(colourise(text, state, colour), end="", flush=True)

    retriever = RetrieverConfig(url=args.retriever_url, topk=args.topk, retries=2)
    if args.protocol == "tools":
        from search_r1.agent.search_tool import search_tool_agent
        from verl.workers.rollout.tool_loop import ToolAgentConfig
        agent = search_tool_agent(engine, retriever, ToolAgentConfig(
            max_turns=args.max_turns, max_response_tokens=args.max_response_tokens), on_event=show,
            template_kwargs=args.chat_template_kwargs)
    else:
        agent = SearchAgent(engine, HTTPSearcher(retriever), AgentConfig(
            max_turns=args.max_turns, topk=args.topk, max_response_tokens=args.max_response_tokens,
            turn_prefix=args.turn_prefix), on_event=show)

    chat = agent.chat if args.protocol == "tools" else None
    def ask(question: str):
        state[0] = ""
        print(colourise(args.response_prefix, state, colour), end="", flush=True)  # the response's start
        (t,) = agent.run([prompt_ids(tok, question, args, chat)],
                         SamplingConfig(temperature=args.temperature, max_tokens=args.max_response_tokens))
        from search_r1.rewards import extract_answer
        answer = extract_answer(args.response_prefix + tok.decode(t.response_ids, skip_special_tokens=True))
        print(f"\n\nanswer: {answer!r}   ({t.tool_calls} searches, finished by {t.finish}"
              f"{', retrieval failed' if t.tool_failed else ''})")

    if args.question:
        ask(args.question)
        return 0
    print("Ask a question (empty line or Ctrl-D to quit).")
    while True:
        try:
            question = input("? ").strip()
        except (EOFError, KeyboardInterrupt):
            return 0
        if not question:
            return 0
        ask(question)


if __name__ == "__main__":
    sys.exit(main())
