"""`search-r1` command line: serve, index build, corpus convert, retrieve, eval, sft, report.

Every command takes both spellings of a flag: the original launcher's underscores (`--index_path`)
and dashes (`--index-path`), shown in help with dashes and their defaults (`normalize_flags`).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import fields


def _add(p: argparse.ArgumentParser, name: str, **kw):
    p.add_argument(f"--{name.replace('_', '-')}", dest=name, **kw)


def normalize_flags(argv: list[str]) -> list[str]:
    """`--index_path=x` → `--index-path=x`: every parser defines the dashed spelling only, so one
    spelling shows in help and both work, in every command."""
    out = []
    for arg in argv:
        if arg.startswith("--") and len(arg) > 2:
            name, eq, value = arg.partition("=")
            arg = name.replace("_", "-") + eq + value
        out.append(arg)
    return out


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Defaults in the help of this parser and every sub-command's."""
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                show_defaults(sub)


def _serve_parser(sub):
    from search_r1.retrieval.factory import RetrieverArgs
    from search_r1.retrieval.launcher_flags import RecordGiven, add_peer_flags
    from search_r1.retrieval.server import ServerConfig

    p = sub.add_parser("serve", help="run the retrieval server (POST /retrieve)")
    d = RetrieverArgs()
    # RecordGiven: flags that a peer's flag of the same meaning can clash with, or that the peers'
    # flags fill in when absent (search_r1/retrieval/launcher_flags.py).
    _add(p, "retriever_name", default=d.retriever_name, action=RecordGiven,
         help="e5 | bge | any dense encoder name | bm25 | serpapi | google | brave | bing")
    _add(p, "retriever_model", default=d.retriever_model, help="encoder: local dir or hub id")
    _add(p, "index_path", help="dense: embeddings dir/.npy or a FAISS .index; bm25: index dir")
    _add(p, "corpus_path", help="corpus JSONL (converted to .arrow on first use) or .arrow")
    _add(p, "retriever_backend", default="auto", choices=["auto", "torch", "faiss"])
    _add(p, "faiss_gpu", action="store_true", help="put a FAISS index on all GPUs")
    _add(p, "devices", help="GPUs for the exact index, e.g. cuda:0,cuda:1 (default: all)")
    _add(p, "dtype", choices=["float16", "bfloat16", "float32"])
    _add(p, "ef_search", type=int)
    _add(p, "nprobe", type=int)
    _add(p, "query_max_length", type=int, default=d.query_max_length)
    _add(p, "encode_batch_size", type=int, default=d.encode_batch_size)
    _add(p, "encoder_cuda_graphs", action=argparse.BooleanOptionalAction, default=None,
         help="dense: replay the query encoder from CUDA graphs, one per batch/length bucket "
              "(default: on where the encoder runs on a GPU)")
    _add(p, "reranker_model", help="cross-encoder to re-score first-stage candidates")
    _add(p, "topk_retrieval", type=int, default=d.topk_retrieval, action=RecordGiven,
         help="first-stage candidates per query that the reranker re-orders")
    _add(p, "reranker_batch_size", type=int, default=d.reranker_batch_size, action=RecordGiven,
         help="(query, passage) pairs per cross-encoder forward pass")
    _add(p, "web_cache_dir")
    c = ServerConfig()
    _add(p, "topk", type=int, default=c.topk, action=RecordGiven, help="default top-k of a request")
    _add(p, "host", default="127.0.0.1", help="interface to listen on (0.0.0.0: every interface)")
    _add(p, "port", type=int, default=8000, help="port to listen on")
    _add(p, "api_key_file", help="require `Authorization: Bearer KEY`, KEY read from this file "
                                 "(or set SEARCH_R1_API_KEY)")
    _add(p, "api_key", help="the same with KEY on the command line, where `ps` shows it to every user "
                            "of the machine: prefer --api-key-file or SEARCH_R1_API_KEY; with "
                            "--retriever_name google and --cse_id, the Google API key, as in the original "
                            "Google launcher")
    _add(p, "max_batch", type=int, default=c.max_batch, help="queries per search call")
    _add(p, "max_wait_ms", type=float, default=c.max_wait_ms)
    _add(p, "max_pending", type=int, default=c.max_pending)
    _add(p, "max_topk", type=int, default=c.max_topk)
    _add(p, "max_queries_per_request", type=int, default=c.max_queries_per_request,
         help="more queries in one request get a 413 (the server batches them itself)")
    _add(p, "max_query_chars", type=int, default=c.max_query_chars,
         help="a longer query gets a 413 (a dense encoder cuts queries at --query_max_length tokens)")
    _add(p, "max_body_bytes", type=int, default=c.max_body_bytes, help="a larger request body gets a 413")
    _add(p, "max_access_response_bytes", type=int, default=c.max_access_response_bytes,
         help="an /access answer that would be larger gets a 413 (a URL asked twice counts once)")
    _add(p, "header_timeout_s", type=float, default=c.header_timeout_s,
         help="seconds a connection may wait for a request's headers before it is closed")
    _add(p, "body_timeout_s", type=float, default=c.body_timeout_s,
         help="seconds a request body may take to arrive (then 408)")
    _add(p, "pages_path", help="web pages JSONL (rows {\"url\", \"contents\", ...}, as ASearcher's "
                               "--pages_path) served by POST /access; converted to .pages.arrow on first use")
    _add(p, "pipeline", action=argparse.BooleanOptionalAction, default=c.pipeline,
         help="dense retrievers: encode one batch in a thread while another searches the batch "
              "before it (default; --no-pipeline: one thread does both, batch after batch)")
    _add(p, "worker_process", action="store_true",
         help="run the retriever (encoder, index, corpus) in a child process, away from the HTTP "
              "event loop's interpreter lock")
    add_peer_flags(p, _add)
    p.set_defaults(func=_serve)


def server_api_key(args) -> str | None:
    """The key `serve` requires: --api-key-file, SEARCH_R1_API_KEY or --api-key (warned about: any
    user of the machine reads a command line)."""
    import os
    from pathlib import Path

    if args.api_key and args.api_key_file:
        raise ValueError("--api-key and --api-key-file both give the server's key: keep --api-key-file")
    if args.api_key_file:
        try:
            key = Path(args.api_key_file).read_text(encoding="utf-8").strip()
        except OSError as e:
            raise ValueError(f"--api-key-file {args.api_key_file}: {e.strerror}") from None
        if not key:
            raise ValueError(f"--api-key-file {args.api_key_file} is empty: write the key into it")
        return key
    if args.api_key:
        logging.getLogger("search_r1.cli").warning(
            "--api-key puts the key on the command line, where every user of this machine can read it "
            "(ps, /proc); pass --api-key-file FILE (readable by you alone) or set SEARCH_R1_API_KEY")
        return args.api_key
    return os.environ.get("SEARCH_R1_API_KEY") or None


def _serve(args):
    from search_r1.retrieval.address_file import check_directory
    from search_r1.retrieval.factory import RetrieverArgs, build_retriever
    from search_r1.retrieval.launcher_flags import resolve_peer_flags
    from search_r1.retrieval.server import ServerConfig, parallel_tokenizers, serve

    resolve_peer_flags(args)  # the peers' launcher flags onto ours; a clash stops the start here
    if args.save_address_to:
        check_directory(args.save_address_to)
    parallel_tokenizers()  # before the retriever (or its worker process) tokenises anything
    r_args = RetrieverArgs(**{f.name: getattr(args, f.name) for f in fields(RetrieverArgs)})
    cfg = ServerConfig(topk=args.topk, max_topk=args.max_topk,
                       max_queries_per_request=args.max_queries_per_request,
                       max_query_chars=args.max_query_chars, max_body_bytes=args.max_body_bytes,
                       max_access_response_bytes=args.max_access_response_bytes,
                       max_batch=args.max_batch, max_wait_ms=args.max_wait_ms,
                       max_pending=args.max_pending, pipeline=args.pipeline,
                       header_timeout_s=args.header_timeout_s, body_timeout_s=args.body_timeout_s,
                       api_key=server_api_key(args))
    pages = None
    if args.pages_path:  # before the retriever, which takes far longer to load
        from search_r1.retrieval.corpus import Pages
        pages = Pages(args.pages_path)
    if args.worker_process:
        from functools import partial

        from search_r1.retrieval.worker_process import ProcessRetriever
        retriever = ProcessRetriever(partial(build_retriever, r_args))
    else:
        retriever = build_retriever(r_args)
    serve(retriever, cfg, args.host, args.port, name=args.retriever_name, pages=pages,
          save_address_to=args.save_address_to)


def _index_parser(sub):
    p = sub.add_parser("index", help="build retrieval indexes")
    isub = p.add_subparsers(dest="index_cmd", required=True)
    b = isub.add_parser("build", help="embed a corpus (dense) or index it with BM25")
    _add(b, "type", default="dense", choices=["dense", "bm25"])
    _add(b, "corpus_path", required=True)
    _add(b, "out", required=True, help="output directory")
    _add(b, "retriever_model", default="intfloat/e5-base-v2")
    _add(b, "devices", help="e.g. cuda:0,cuda:1 (default: every GPU, else CPU)")
    _add(b, "batch_size", type=int, default=256)
    _add(b, "max_length", type=int, default=256)
    _add(b, "faiss_type", help="also build a FAISS index, e.g. HNSW64 or IVF4096,PQ64")
    b.set_defaults(func=_index_build)


def _index_build(args):
    from search_r1.retrieval import build

    if args.type == "bm25":
        out = build.build_bm25_index(args.corpus_path, args.out)
    else:
        out = build.build_dense(args.corpus_path, args.out, args.retriever_model,
                                args.devices.split(",") if args.devices else None,
                                args.batch_size, args.max_length, args.faiss_type)
    print(f"index written to {out}")


def _corpus_parser(sub):
    p = sub.add_parser("corpus", help="corpus tools")
    csub = p.add_subparsers(dest="corpus_cmd", required=True)
    c = csub.add_parser("convert", help="JSONL corpus -> memory-mapped Arrow file")
    c.add_argument("jsonl")
    c.add_argument("--out")
    c.set_defaults(func=_corpus_convert)


def _corpus_convert(args):
    from search_r1.retrieval.corpus import convert_jsonl

    print(f"converted corpus written to {convert_jsonl(args.jsonl, args.out)}")


def _retrieve_parser(sub):
    p = sub.add_parser("retrieve", help="ask a running server (prints JSON)")
    p.add_argument("queries", nargs="+")
    _add(p, "retriever_url", default="http://127.0.0.1:8000/retrieve", help="the server's /retrieve URL")
    p.add_argument("--url", dest="retriever_url", help=argparse.SUPPRESS)  # the earlier name
    _add(p, "topk", type=int, default=3, help="passages per query")
    p.set_defaults(func=_retrieve)


def _retrieve(args):
    from search_r1.retrieval.client import RetrievalClient

    with RetrievalClient(url=args.retriever_url) as client:
        print(json.dumps(client.retrieve(args.queries, args.topk), indent=1, ensure_ascii=False))


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(prog="search-r1", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for add in (_serve_parser, _index_parser, _corpus_parser, _retrieve_parser):
        add(sub)
    # Commands that live with their feature: evaluation, SFT warm start, run report.
    for module in ("search_r1.evaluate", "search_r1.sft", "search_r1.report"):
        try:
            importlib.import_module(module).add_parser(sub)
        except ModuleNotFoundError as e:
            if e.name != module:  # a missing dependency is an error; a missing module is not
                raise
    show_defaults(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(normalize_flags(sys.argv[1:] if argv is None else list(argv)))
    try:
        args.func(args)
    except (FileNotFoundError, ValueError, ImportError) as e:
        # Start-up problems a user can fix: one line, no traceback.
        print(f"search-r1 {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        # A training checkpoint that fails verification (`eval` exports one first): the message names
        # the file. Imported here only: the module brings torch, which most commands do without.
        from verl.checkpoint.manifest import CheckpointCorrupt
        if not isinstance(e, CheckpointCorrupt):
            raise
        print(f"search-r1 {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
