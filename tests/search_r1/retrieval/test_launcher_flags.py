"""`search-r1 serve` with the peers' launcher flags: the original re-ranking launcher's depths and
batch, the original SerpAPI and Google launchers' keys and endpoint, and ASearcher's and RLinf's
`--save-address-to`. Servers are real processes (or a real uvicorn) on 127.0.0.1; the web search
engines, out of reach in tests, are test_web's fake upstream server on 127.0.0.1."""
import glob
import json
import os
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from conftest import ServerProcess, free_port
from search_r1.cli import build_parser, main as cli_main, normalize_flags
from search_r1.retrieval.address_file import AnnouncingServer, client_host
from search_r1.retrieval.base import Retriever
from search_r1.retrieval.factory import RetrieverArgs, build_retriever
from search_r1.retrieval.launcher_flags import resolve_peer_flags
from search_r1.retrieval.models import resolve_model
from search_r1.retrieval.server import ServerConfig, create_app, uvicorn_config
from search_r1.retrieval.web import WebEngine
from test_web import KEYS, PATHS, FakeEngines  # the fake upstream engine on 127.0.0.1


@pytest.fixture(autouse=True)
def keep_tokenizers_parallelism(monkeypatch):
    """`search-r1 serve` run in this process sets TOKENIZERS_PARALLELISM=true: undone after each test."""
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", os.environ.get("TOKENIZERS_PARALLELISM", "false"))


@pytest.fixture(autouse=True)
def no_keys_in_the_environment(monkeypatch):
    """Keys come from the flags in these tests; one left in the environment would hide a fault."""
    for name in (*KEYS, "SEARCH_R1_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):  # requests to 127.0.0.1 must not go to a proxy
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)


def resolved(*argv):
    args = build_parser().parse_args(normalize_flags(["serve", *argv]))
    resolve_peer_flags(args)
    return args


def retriever_args(args) -> RetrieverArgs:
    from dataclasses import fields
    return RetrieverArgs(**{f.name: getattr(args, f.name) for f in fields(RetrieverArgs)})


@pytest.fixture(scope="module")
def bm25_index(corpus_jsonl, tmp_path_factory):
    from search_r1.retrieval.build import build_bm25_index
    return build_bm25_index(str(corpus_jsonl), str(tmp_path_factory.mktemp("bm25")), progress=False)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory) -> str:
    # No trained cross-encoder ships with a package we can install offline: a tiny random BERT with
    # one output and the bundled MiniLM word-piece tokenizer (the plumbing, not ranking quality).
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("all-MiniLM-L6-v2"))
    torch.manual_seed(0)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=64, num_labels=1, max_position_embeddings=128)
    path = tmp_path_factory.mktemp("cross_encoder")
    BertForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


# --- the original re-ranking launcher (retrieval_launch_hierarchical.sh) ---------------------------

def test_hierarchical_launchers_flags_set_first_stage_depth_final_depth_and_batch(
        bm25_index, corpus_jsonl, cross_encoder):
    args = resolved("--retriever_name", "bm25", "--index_path", str(bm25_index), "--corpus_path", str(corpus_jsonl),
                    "--retrieval_topk", "6", "--reranking_topk", "2", "--reranker_model", cross_encoder,
                    "--reranker_batch_size", "4")
    assert (args.topk_retrieval, args.topk, args.reranker_batch_size) == (6, 2, 4)
    retriever = build_retriever(retriever_args(args))
    try:
        assert retriever.topk_retrieval == 6 and retriever.reranker.batch_size == 4
        [hits] = retriever.search(["capital of France"], args.topk)
        assert len(hits) == 2
    finally:
        retriever.close()
    # ours and theirs may both be given where they agree
    assert resolved("--topk", "3", "--reranking_topk", "3", "--reranker_model", cross_encoder).topk == 3


@pytest.mark.parametrize("ours, theirs", [(["--topk", "3"], ["--reranking_topk", "5"]),
                                          (["--topk_retrieval", "10"], ["--retrieval_topk", "20"]),
                                          (["--topk-retrieval=10"], ["--retrieval-topk=20"])])
def test_an_original_rerank_flag_that_contradicts_ours_stops_the_start(ours, theirs, capsys):
    # --topk 3 and --topk_retrieval 10 are our defaults: given on the command line, they still clash
    assert cli_main(["serve", *ours, *theirs, "--reranker_model", "m"]) == 2
    err = capsys.readouterr().err
    names = [f.split("=")[0].replace("-", "_").lstrip("_") for f in (ours[0], theirs[0])]
    assert all(f"--{name}" in err for name in names) and "give one of the two" in err


def test_rerank_flags_without_a_reranker_or_with_a_deeper_final_depth_stop_the_start(capsys):
    assert cli_main(["serve", "--retrieval_topk", "10", "--reranker_batch_size", "32"]) == 2
    err = capsys.readouterr().err
    assert "--retrieval_topk, --reranker_batch_size" in err and "--reranker_model" in err
    assert cli_main(["serve", "--retrieval_topk", "3", "--reranking_topk", "5", "--reranker_model", "m"]) == 2
    err = capsys.readouterr().err
    assert "--topk 5" in err and "--topk_retrieval 3" in err


# --- the original web search launchers (retrieval_launch_serpapi.sh, retrieval_launch_google.sh) ----

@pytest.fixture
def fake_engine():
    server = FakeEngines()
    yield server
    server.close()


@pytest.mark.e2e  # a server process
def test_serpapi_launchers_flags_serve_from_the_engine_with_the_flags_key(fake_engine, tmp_path):
    """retrieval_launch_serpapi.sh's flags as they are (no --retriever_name: they select serpapi);
    --search_url points at the fake engine instead of serpapi.com."""
    key = KEYS["SERPAPI_API_KEY"]
    server = ServerProcess(["--search_url", fake_engine.url(WebEngine.SERPAPI), "--topk", "3",
                            "--serp_api_key", key], tmp_path / "serpapi.log")
    try:
        r = httpx.post(server.url + "/retrieve", json={"queries": ["capital of Peru"]}, timeout=30)
        assert r.status_code == 200 and len(r.json()["result"][0]) == 3
        assert httpx.get(server.url + "/health").json()["retriever"] == "serpapi"
    finally:
        server.stop()
    [sent] = fake_engine.requests
    assert sent["path"] == PATHS[WebEngine.SERPAPI]
    assert sent["params"]["api_key"] == key and sent["params"]["engine"] == "google"
    assert key not in (tmp_path / "serpapi.log").read_text()


@pytest.mark.e2e  # a server process
def test_google_launchers_api_key_is_the_google_key_and_the_bearer_token_comes_from_the_environment(
        fake_engine, tmp_path):
    """retrieval_launch_google.sh's flags (--api_key is Google's key there), with --search_url at the
    fake engine; this server's own token is SEARCH_R1_API_KEY, never the Google key."""
    google_key, cse, token = KEYS["GOOGLE_API_KEY"], KEYS["GOOGLE_CSE_ID"], "bearer-TOKEN-42"
    server = ServerProcess(["--api_key", google_key, "--topk", "5", "--cse_id", cse, "--snippet_only",
                            "--search_url", fake_engine.url(WebEngine.GOOGLE)], tmp_path / "google.log",
                           env={"SEARCH_R1_API_KEY": token})
    try:
        body = {"queries": ["capital of Kenya"]}
        assert httpx.post(server.url + "/retrieve", json=body, timeout=30).status_code == 401
        with_google_key = {"Authorization": f"Bearer {google_key}"}
        assert httpx.post(server.url + "/retrieve", json=body, headers=with_google_key, timeout=30).status_code == 401
        r = httpx.post(server.url + "/retrieve", json=body, headers={"Authorization": f"Bearer {token}"}, timeout=30)
        assert r.status_code == 200 and len(r.json()["result"][0]) == 5
    finally:
        server.stop()
    [sent] = fake_engine.requests
    assert (sent["path"], sent["params"]["key"], sent["params"]["cx"]) == (PATHS[WebEngine.GOOGLE], google_key, cse)
    assert google_key not in (tmp_path / "google.log").read_text()


def test_api_key_in_a_role_that_cannot_be_told_apart_stops_the_start(monkeypatch, capsys):
    secret = "SECRET-never-printed"
    # google without --cse_id and without a Google key: the original's Google key, or our token?
    assert cli_main(["serve", "--retriever_name", "google", "--api_key", secret]) == 2
    err = capsys.readouterr().err
    assert "--api_key" in err and "GOOGLE_API_KEY" in err and "--cse_id" in err and secret not in err
    # the original's flags, but another Google key in the environment
    monkeypatch.setenv("GOOGLE_API_KEY", "another-key")
    assert cli_main(["serve", "--api_key", secret, "--cse_id", "cse"]) == 2
    err = capsys.readouterr().err
    assert "--api_key" in err and "GOOGLE_API_KEY" in err and "SEARCH_R1_API_KEY" in err and secret not in err
    # serpapi has no Google key to confuse it with, but no SerpAPI key either: the token is not one
    assert cli_main(["serve", "--retriever_name", "serpapi", "--api_key", secret]) == 2
    err = capsys.readouterr().err
    assert "--api_key" in err and "--serp_api_key" in err and "SERPAPI_API_KEY" in err and secret not in err


def test_api_key_keeps_its_bearer_role_where_the_engine_key_is_set_elsewhere(monkeypatch):
    monkeypatch.setenv("GOOGLE_API_KEY", "google-key")
    monkeypatch.setenv("GOOGLE_CSE_ID", "cse")
    args = resolved("--retriever_name", "google", "--api_key", "token")
    assert args.api_key == "token" and args.web_keys is None
    args = resolved("--retriever_name", "serpapi", "--serp_api_key", "serp-key", "--api_key", "token")
    assert args.api_key == "token" and args.web_keys == {"SERPAPI_API_KEY": "serp-key"}
    # the same Google key in both places is no contradiction
    args = resolved("--api_key", "google-key", "--cse_id", "cse")
    assert args.retriever_name == "google" and args.api_key is None
    assert args.web_keys == {"GOOGLE_API_KEY": "google-key", "GOOGLE_CSE_ID": "cse"}


@pytest.mark.parametrize("argv, named", [
    (["--retriever_name", "bm25", "--cse_id", "x"], "--cse_id"),
    (["--retriever_name", "brave", "--serp_api_key", "k"], "--serp_api_key"),
    (["--retriever_name", "serpapi", "--cse_id", "x"], "--cse_id"),
    (["--serp_api_key", "k", "--cse_id", "x"], "--retriever_name"),
    (["--snippet_only", "--retriever_name", "e5"], "--snippet_only"),
])
def test_web_flags_that_do_not_fit_the_retriever_stop_the_start(argv, named, capsys):
    assert cli_main(["serve", *argv]) == 2
    assert named in capsys.readouterr().err


def test_missing_engine_key_names_the_launchers_flag_too(fake_engine, capsys):
    assert cli_main(["serve", "--search_url", fake_engine.url(WebEngine.SERPAPI)]) == 2
    err = capsys.readouterr().err
    assert "SERPAPI_API_KEY" in err and "--serp_api_key" in err


# --- --save-address-to (ASearcher's and RLinf's launch_local_server.sh) -----------------------------

def peer_server_list(directory: Path) -> list[str]:
    """What ASearcher's client reads: every line of every DIR/Host*_IP*.txt."""
    lines = []
    for name in glob.glob(str(directory) + "/Host*_IP*.txt"):
        lines.extend(open(name).readlines())
    return lines


def wait_for(predicate, timeout_s=15.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.e2e  # a server process
def test_save_address_to_writes_the_address_the_peers_clients_read(bm25_index, corpus_jsonl, tmp_path):
    addresses = tmp_path / "addresses"  # created by the server
    server = ServerProcess(["--retriever_name", "bm25", "--index_path", str(bm25_index), "--corpus_path",
                            str(corpus_jsonl), "--save-address-to", str(addresses)], tmp_path / "server.log")
    try:
        assert wait_for(lambda: peer_server_list(addresses)), (tmp_path / "server.log").read_text()[-2000:]
        [line] = peer_server_list(addresses)
        assert line == f"127.0.0.1:{server.port}"  # no newline: the client puts the line into its URL
        assert [p.name for p in addresses.iterdir()] == [f"Host127.0.0.1_IP{server.port}.txt"]
        r = httpx.post(f"http://{line}/retrieve", json={"queries": ["capital of Japan"], "topk": 2}, timeout=30)
        assert r.status_code == 200 and "Tokyo" in json.dumps(r.json())
    finally:
        server.stop()
    assert list(addresses.iterdir()) == []  # a stopped server is no longer offered to clients


def test_save_address_to_a_file_stops_the_start_before_the_index_loads(tmp_path, capsys):
    taken = tmp_path / "address.txt"
    taken.write_text("not a directory")
    assert cli_main(["serve", "--index_path", str(tmp_path / "missing"), "--save_address_to", str(taken)]) == 2
    err = capsys.readouterr().err
    assert "--save-address-to" in err and "is a file" in err and "missing" not in err


class Unready(Retriever):
    """The real BM25 retriever, reporting a problem until told it is gone: /health answers 503 meanwhile."""

    def __init__(self, inner):
        self.inner, self.problem = inner, "index still loading"

    def search(self, queries, topk):
        return self.inner.search(queries, topk)

    def health_problem(self):
        return self.problem


def test_address_file_appears_only_once_the_server_is_healthy(bm25_index, corpus_jsonl, tmp_path):
    retriever = Unready(build_retriever(RetrieverArgs(retriever_name="bm25", index_path=str(bm25_index),
                                                      corpus_path=str(corpus_jsonl))))
    cfg, port = ServerConfig(), free_port()
    server = AnnouncingServer(uvicorn_config(create_app(retriever, cfg), cfg, "127.0.0.1", port), tmp_path,
                              "127.0.0.1")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        assert wait_for(lambda: server.started)
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 503
        time.sleep(1.0)  # several polls of /health
        assert list(tmp_path.iterdir()) == []
        retriever.problem = None
        assert wait_for(lambda: peer_server_list(tmp_path))
        assert peer_server_list(tmp_path) == [f"127.0.0.1:{port}"]
        assert [p.name for p in tmp_path.iterdir()] == [f"Host127.0.0.1_IP{port}.txt"]  # no temporary left
    finally:
        server.should_exit = True
        thread.join(10)
    assert list(tmp_path.iterdir()) == []  # removed in the server's shutdown


def test_a_server_on_every_interface_writes_an_address_clients_can_reach():
    assert client_host("127.0.0.1") == "127.0.0.1" and client_host("node7") == "node7"
    import ipaddress
    host = client_host("0.0.0.0")
    ipaddress.ip_address(host)  # an address, not 0.0.0.0
    assert host != "0.0.0.0"
