"""The retrieval client against real servers on 127.0.0.1: a frozen server (SIGSTOP, as an
operator found it) costs one timeout and a health probe, not every retry's full timeout; keys
reach a server started with --api-key."""
from __future__ import annotations

import os
import signal
import time

import pytest

from conftest import ServerProcess
from search_r1.retrieval.client import AsyncRetrievalClient, RetrievalClient, RetrievalError, RetrieverConfig

pytestmark = pytest.mark.e2e  # a server process per test


@pytest.fixture
def bm25_server_process(tmp_path, corpus_jsonl):
    from search_r1.retrieval.build import build_bm25_index
    index = build_bm25_index(str(corpus_jsonl), str(tmp_path / "bm25"), progress=False)
    server = ServerProcess(["--retriever_name", "bm25", "--index_path", str(index), "--corpus_path",
                            str(corpus_jsonl), "--api_key", "s3cret"], tmp_path / "server.log")
    yield server
    os.kill(server.proc.pid, signal.SIGCONT)
    server.stop()


def test_a_frozen_server_fails_fast_with_its_cause(bm25_server_process):
    cfg = RetrieverConfig(url=f"{bm25_server_process.url}/retrieve", api_key="s3cret", timeout_s=1.0,
                          connect_timeout_s=0.5, retries=5)
    with RetrievalClient(cfg) as client:
        assert client.retrieve(["capital of France"], 2)[0][0]["document"]["contents"]
        os.kill(bm25_server_process.proc.pid, signal.SIGSTOP)
        t = time.perf_counter()
        with pytest.raises(RetrievalError, match="stopped answering"):
            client.retrieve(["capital of France"], 2)
        # one timed-out attempt and one unanswered probe, not six attempts of 1 s with backoff
        assert time.perf_counter() - t < 3.0


def test_the_async_client_fails_fast_too(bm25_server_process):
    import asyncio
    cfg = RetrieverConfig(url=f"{bm25_server_process.url}/retrieve", api_key="s3cret", timeout_s=1.0,
                          connect_timeout_s=0.5, retries=5)

    async def ask():
        client = AsyncRetrievalClient(cfg)
        try:
            return await client.retrieve(["capital of France"], 2)
        finally:
            await client.aclose()

    os.kill(bm25_server_process.proc.pid, signal.SIGSTOP)
    t = time.perf_counter()
    with pytest.raises(RetrievalError, match="stopped answering"):
        asyncio.run(ask())
    assert time.perf_counter() - t < 3.0


def test_the_key_reaches_the_server_and_a_wrong_one_is_not_retried(bm25_server_process):
    url = f"{bm25_server_process.url}/retrieve"
    with RetrievalClient(RetrieverConfig(url=url, api_key="s3cret")) as client:
        assert len(client.retrieve(["Berlin"], 1)) == 1
    t = time.perf_counter()
    with RetrievalClient(RetrieverConfig(url=url, api_key="wrong", retries=5)) as client:
        with pytest.raises(RetrievalError, match="401"):
            client.retrieve(["Berlin"], 1)
    assert time.perf_counter() - t < 2.0


def test_the_search_agent_checks_its_retriever_before_training(bm25_server_process):
    """The trainer's preflight: the right key passes; a wrong one stops with the URL and the 401."""
    from search_r1.agent.loop import SearchAgentLoop
    from verl.workers.rollout.agent_loop import AgentLoopSettings, PreflightError
    from verl.workers.rollout.loop_from_config import build_options

    def settings(api_key):
        return AgentLoopSettings(max_tokens_per_turn=64, options=build_options(SearchAgentLoop, {
            "retriever": {"url": f"{bm25_server_process.url}/retrieve", "api_key": api_key}}, "agent_kwargs"))

    SearchAgentLoop.preflight(settings("s3cret"))
    with pytest.raises(PreflightError, match="401"):
        SearchAgentLoop.preflight(settings(None))
