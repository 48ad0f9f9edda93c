"""The flags of the peers' retrieval launchers on `search-r1 serve`, mapped onto ours at start-up.

Users bring their launch scripts; each flag below keeps the meaning it had there, and whatever we
cannot read that way stops the start with a message naming the flag to use instead.

The original re-ranking server (`retrieval_rerank_server.py`, started by
`retrieval_launch_hierarchical.sh`):
- `--retrieval_topk N`: candidates per query from the first stage, our `--topk_retrieval`;
- `--reranking_topk N`: passages per query after re-ranking, our `--topk` (a request's default);
- `--reranker_batch_size N`: (query, passage) pairs per cross-encoder pass; ours has the same name.
Given together with ours and a different value, they stop the start (which one was meant is
unknown). Given without `--reranker_model` they stop it too: the original server always re-ranked,
with a default model we do not download unasked.

The original web search servers (`retrieval_launch_serpapi.sh`, `retrieval_launch_google.sh`):
- `--search_url URL`: the engine's endpoint (any web engine here);
- `--serp_api_key KEY`, `--serp_engine NAME`: SerpAPI's key and engine;
- `--cse_id ID`, and `--api_key KEY` meaning the Google API key;
- `--snippet_only`: hits are the engine's snippets, which is all our web retrievers return.
Those scripts ran one program per engine, so they name none: without `--retriever_name`, the
SerpAPI flags select `serpapi` and `--cse_id` selects `google`.

`--api_key` is our server's bearer token everywhere else. With `google` it is read as the Google
key only where the original launcher's flags say so (`--cse_id` on the command line), and the start
is refused wherever the two roles cannot be told apart: a key is never sent to Google that was
meant to guard this server, and this server never runs unguarded because its token went to Google.
"""
from __future__ import annotations

import argparse
import logging
import os

from search_r1.retrieval.factory import WEB_ENGINES

log = logging.getLogger(__name__)

GIVEN = "_flags_given"   # the namespace attribute listing the flags of ours that were on the command line
RERANK_FLAGS = ("retrieval_topk", "reranking_topk", "reranker_batch_size")
SERPAPI_FLAGS = ("serp_api_key", "serp_engine")
GOOGLE_FLAGS = ("cse_id",)
WEB_FLAGS = ("search_url", *SERPAPI_FLAGS, *GOOGLE_FLAGS, "snippet_only")
# The original re-ranking server's default model, named in the error that asks for one.
ORIGINAL_RERANKER = "cross-encoder/ms-marco-MiniLM-L12-v2"


class RecordGiven(argparse.Action):
    """`store`, and notes that the flag was on the command line: a value equal to the default must
    still clash with the peer's flag of the same meaning."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, GIVEN, getattr(namespace, GIVEN, frozenset()) | {self.dest})


def add_peer_flags(p: argparse.ArgumentParser, add) -> None:
    """The peers' flags on the serve parser; `add(parser, name, **kw)` defines `--name` (dashed)."""
    add(p, "retrieval_topk", type=int,
        help="the original re-ranking server's name for --topk_retrieval (first-stage candidates per query)")
    add(p, "reranking_topk", type=int,
        help="the original re-ranking server's name for --topk (passages per query after re-ranking)")
    add(p, "search_url", help="web engines: the endpoint to query (the original SerpAPI launcher's flag; "
                              "default: the engine's public API)")
    add(p, "serp_api_key", help="serpapi: the SerpAPI key (else SERPAPI_API_KEY); selects serpapi when "
                                "--retriever_name is not given")
    add(p, "serp_engine", help="serpapi: the engine SerpAPI queries; none given: google")
    add(p, "cse_id", help="google: the Programmable Search Engine id (else GOOGLE_CSE_ID); with it, as in the "
                          "original Google launcher, --api_key is the Google API key; selects google when "
                          "--retriever_name is not given")
    add(p, "snippet_only", action="store_true",
        help="web engines: hits are the engine's snippets, which is all this server returns (the original "
             "Google launcher's flag)")
    add(p, "save_address_to", metavar="DIR",
        help="once the server answers /health, write its address (host:port) to DIR/Host<host>_IP<port>.txt, "
             "where ASearcher's and RLinf's clients look for it (their launch_local_server.sh passes it); "
             "removed at shutdown")


def resolve_peer_flags(args: argparse.Namespace) -> None:
    """Map the peers' flags onto ours in `args`, or raise ValueError naming the flags to change."""
    given = getattr(args, GIVEN, frozenset())
    _resolve_rerank(args, given)
    _resolve_web_engine(args, given)
    _resolve_web_keys(args)


def _resolve_rerank(args, given: frozenset) -> None:
    args.topk_retrieval = _one_of(args, given, "topk_retrieval", "retrieval_topk",
                                  "the first stage's candidates per query")
    args.topk = _one_of(args, given, "topk", "reranking_topk", "the passages a query gets")
    # --reranker_batch_size is ours as well: given is what counts, its default always has a value.
    theirs = [f for f in RERANK_FLAGS
              if f in given or (f != "reranker_batch_size" and getattr(args, f) is not None)]
    if theirs and not args.reranker_model:
        raise ValueError(f"{_flags(theirs)}: the original re-ranking server's settings, and no --reranker_model "
                         f"is given: name the cross-encoder (the original's default was {ORIGINAL_RERANKER}), "
                         f"or drop {_flags(theirs)}")
    if args.reranker_model and args.topk > args.topk_retrieval:
        raise ValueError(f"--topk {args.topk} (the original's --reranking_topk) is more than the --topk_retrieval "
                         f"{args.topk_retrieval} (--retrieval_topk) candidates the reranker re-orders: every request "
                         "of the default size would be refused; lower the first or raise the second")


def _one_of(args, given: frozenset, ours: str, theirs: str, what: str):
    value, their_value = getattr(args, ours), getattr(args, theirs)
    if their_value is None:
        return value
    if ours in given and value != their_value:
        raise ValueError(f"--{ours} {value} and --{theirs} {their_value} (the original re-ranking server's name) "
                         f"both set {what}: give one of the two")
    return their_value


def _resolve_web_engine(args, given: frozenset) -> None:
    """Without --retriever_name, the engine the original launcher's flags belong to; then every web
    flag must fit the retriever."""
    present = [f for f in WEB_FLAGS if getattr(args, f)]
    if "retriever_name" not in given and present:
        serpapi = [f for f in SERPAPI_FLAGS if getattr(args, f)]
        google = [f for f in GOOGLE_FLAGS if getattr(args, f)]
        if serpapi and google:
            raise ValueError(f"{_flags(serpapi)} (SerpAPI's) and {_flags(google)} (Google's) belong to two "
                             "launchers: give --retriever_name serpapi or --retriever_name google and its flags")
        # --search_url alone is the SerpAPI launcher's; --snippet_only alone the Google one's.
        engine = "serpapi" if serpapi or (not google and args.search_url) else "google"
        log.info("--retriever_name %s, from %s (the original %s launcher's flags)", engine, _flags(present),
                 "SerpAPI" if engine == "serpapi" else "Google")
        args.retriever_name = engine
    name = args.retriever_name.lower()
    if name not in WEB_ENGINES and present:
        raise ValueError(f"{_flags(present)}: flags of the original web search servers, and --retriever_name is "
                         f"{args.retriever_name}: give --retriever_name serpapi or google, or drop them")
    for flags, engine in ((SERPAPI_FLAGS, "serpapi"), (GOOGLE_FLAGS, "google")):
        wrong = [f for f in flags if getattr(args, f)]
        if wrong and name != engine:
            raise ValueError(f"{_flags(wrong)} belongs to --retriever_name {engine}, and this server runs {name}: "
                             "drop it or change --retriever_name")
    if args.snippet_only:
        log.info("--snippet_only: web hits are the engine's snippets, which is all this server returns")


def _resolve_web_keys(args) -> None:
    """The engine keys given as flags (into `args.web_keys`), and which role --api_key has."""
    name = args.retriever_name.lower()
    keys = {}
    if args.serp_api_key:
        keys["SERPAPI_API_KEY"] = args.serp_api_key
    if args.cse_id:
        keys["GOOGLE_CSE_ID"] = args.cse_id
    if name == "google" and args.api_key:
        env_key = os.environ.get("GOOGLE_API_KEY")
        if not args.cse_id and not env_key:
            raise ValueError(
                "--api_key with --retriever_name google: the original Google launcher meant the Google API key "
                "(and gave --cse_id with it); here, without --cse_id, it is this server's bearer token, and no "
                "Google API key is set. Either give the original's flags, --api_key GOOGLE_KEY --cse_id CSE_ID "
                "(this server's bearer token then comes from SEARCH_R1_API_KEY), or set GOOGLE_API_KEY and keep "
                "--api_key as the bearer token")
        if args.cse_id:
            if env_key and env_key != args.api_key:
                raise ValueError(
                    "--api_key with --cse_id is the Google API key, as in the original Google launcher, but "
                    "GOOGLE_API_KEY holds another key: if --api_key was meant as this server's bearer token, "
                    "put that in SEARCH_R1_API_KEY and drop --api_key; else unset GOOGLE_API_KEY")
            keys["GOOGLE_API_KEY"] = args.api_key
            args.api_key = None
            log.info("--api_key is the Google API key (given with --cse_id, as in the original Google launcher); "
                     "this server's bearer token, if any, comes from SEARCH_R1_API_KEY")
    if name == "serpapi" and args.api_key and not (args.serp_api_key or os.environ.get("SERPAPI_API_KEY")):
        raise ValueError("--api_key is this server's bearer token, and no SerpAPI key is set: the original "
                         "SerpAPI launcher gives it as --serp_api_key (or set SERPAPI_API_KEY)")
    args.web_keys = keys or None
    args.serp_engine = args.serp_engine or "google"


def _flags(names) -> str:
    return ", ".join(f"--{n}" for n in names)
