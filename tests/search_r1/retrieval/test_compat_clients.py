"""Other projects' retrieval clients against a real `search-r1 serve` process on 127.0.0.1.

Each client below is our own code, written to the exact request and the exact reading of the answer
of a peer's client: the original Search-R1 rollout (`LLMGenerationManager._batch_search`), verl's
search tool (`call_search_api` + `_passages2string`), RLinf's search tool worker and ASearcher's
`AsyncSearchBrowserClient` (`/retrieve` with `url`, `/access`). A field they read that the server
does not send fails here as it would fail there (KeyError, TypeError, HTTP error).
"""
import asyncio
import json
import re

import aiohttp  # RLinf's and ASearcher's clients are written with it (a test dependency)
import httpx
import pytest
import requests  # the original Search-R1's and verl's clients use it

from conftest import FACTS, ServerProcess

pytestmark = pytest.mark.e2e  # server processes, one per kind


def wiki_url(title: str) -> str:
    return "https://en.wikipedia.org/wiki/" + title.replace(" ", "_")


@pytest.fixture(scope="module")
def url_corpus(tmp_path_factory):
    """The conftest corpus, row for row (so the dense index built from it fits), with the `url` and
    `title` fields of ASearcher's wiki corpus."""
    path = tmp_path_factory.mktemp("url_corpus") / "wiki_corpus.jsonl"
    with open(path, "w") as f:
        for i, (title, text) in enumerate(FACTS):
            f.write(json.dumps({"id": str(i), "contents": f'"{title}"\n{text}', "url": wiki_url(title),
                                "title": title}) + "\n")
    return path


@pytest.fixture(scope="module")
def pages_jsonl(tmp_path_factory):
    """ASearcher's pages file: one row per page, `{"url", "contents", ...}`."""
    path = tmp_path_factory.mktemp("pages") / "wiki_webpages.jsonl"
    with open(path, "w") as f:
        for title, text in FACTS:
            f.write(json.dumps({"url": wiki_url(title), "title": title,
                                "contents": f"{title}\n\n{text} (the whole page)"}) + "\n")
        f.write(json.dumps({"url": "https://en.wikipedia.org/w/index.php?title=Seine",
                            "contents": "The Seine is a river in France."}) + "\n")
    return path


@pytest.fixture(scope="module", params=["bm25", "dense"])
def server(request, url_corpus, pages_jsonl, tmp_path_factory):
    logs = tmp_path_factory.mktemp("compat_logs")
    common = ["--corpus_path", str(url_corpus), "--pages_path", str(pages_jsonl)]
    if request.param == "bm25":
        from search_r1.retrieval.build import build_bm25_index
        index = build_bm25_index(str(url_corpus), str(tmp_path_factory.mktemp("bm25_url")), progress=False)
        args = ["--retriever_name", "bm25", "--index_path", str(index), *common]
    else:
        index = request.getfixturevalue("dense_index")
        args = ["--retriever_name", "minilm", "--retriever_model", "all-MiniLM-L6-v2",
                "--index_path", str(index), *common]
    proc = ServerProcess(args, logs / f"{request.param}.log")
    proc.kind = request.param
    yield proc
    proc.stop()


# ---------------------------------------------------------------------------------------------
# The original Search-R1 rollout: every <search> of a turn in one POST, read as document.contents
# ---------------------------------------------------------------------------------------------

class SearchR1Rollout:
    """The search half of the original `LLMGenerationManager`: a turn's actions are parsed, all its
    queries go in one request (even none), and each answer becomes an <information> block."""

    ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)

    def __init__(self, search_url: str, topk: int = 3):
        self.search_url, self.topk = search_url, topk

    def observations(self, predictions: list[str]) -> list[str]:
        actions = [self.ACTION.search(p) for p in predictions]
        queries = [m.group(2).strip() for m in actions if m and m.group(1) == "search"]
        found = self.batch_search(queries)
        assert len(found) == len(queries)
        return [f"\n\n<information>{found.pop(0).strip()}</information>\n\n" if m and m.group(1) == "search"
                else "" for m in actions]

    def batch_search(self, queries: list[str]) -> list[str]:
        return [self.passages_text(hits) for hits in self._batch_search(queries)["result"]]

    def _batch_search(self, queries: list[str]) -> dict:
        payload = {"queries": queries, "topk": self.topk, "return_scores": True}
        return requests.post(self.search_url, json=payload).json()  # no status check, as the original

    @staticmethod
    def passages_text(hits: list[dict]) -> str:
        text = ""
        for i, hit in enumerate(hits):
            title, _, body = hit["document"]["contents"].partition("\n")
            text += f"Doc {i + 1}(Title: {title}) {body}\n"
        return text


def test_search_r1_turns_empty_blank_and_large(server):
    rollout = SearchR1Rollout(server.url + "/retrieve")
    # A turn in which nobody searches still sends its (empty) request.
    assert rollout.observations(["<answer> Paris </answer>", "no action"]) == ["", ""]
    # `<search> </search>` sends a blank query, answered like any other.
    obs = rollout.observations(["<search> capital of France </search>", "<search> </search>",
                                "<search>   </search>"])
    assert obs[0].startswith("\n\n<information>Doc 1(Title: \"Paris\")")
    assert all(o.startswith("\n\n<information>") and o.endswith("</information>\n\n") for o in obs)
    # One turn of a large run: 512 prompts × 5 rollouts, all searching at once.
    topics = ["capital of Japan", "fourth planet from the Sun", "theory of relativity",
              "largest river by discharge"]
    obs = rollout.observations([f"<search> {topics[i % 4]} </search>" for i in range(2560)])
    assert len(obs) == 2560
    assert '(Title: "Tokyo")' in obs[0] and '(Title: "Mars")' in obs[1] and '(Title: "Tokyo")' in obs[2556]


def test_search_r1_over_long_query(server):
    query = "which city is the capital of Japan " * 60
    assert len(query) == 2100
    [text] = SearchR1Rollout(server.url + "/retrieve").batch_search([query])
    assert text.startswith('Doc 1(Title: "Tokyo")')


# ---------------------------------------------------------------------------------------------
# verl's search tool: retries 500/502/503/504 and connection errors, fails fast on other errors
# ---------------------------------------------------------------------------------------------

VERL_RETRIED = (500, 502, 503, 504)


def verl_call_search_api(url: str, queries: list[str], topk: int = 3, attempts: int = 3):
    """(answer JSON, None) or (None, error text), as verl's `call_search_api`; the number of POSTs
    made is returned as well."""
    payload = {"queries": queries, "topk": topk, "return_scores": True}
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    error = None
    for attempt in range(1, attempts + 1):
        response = requests.post(url, headers=headers, json=payload, timeout=30)
        if response.status_code in VERL_RETRIED:
            error = f"server error {response.status_code}"
            continue
        try:
            response.raise_for_status()
        except requests.exceptions.RequestException as e:
            return None, str(e), attempt  # not retried
        return response.json(), None, attempt
    return None, error, attempts


def verl_result_text(answer: dict) -> str:
    """The tool's text: each query's hits as `Doc i (Title: …)\\ntext`, queries joined by ---."""
    per_query = []
    for hits in answer.get("result", []):
        text = ""
        for i, hit in enumerate(hits):
            title, _, body = hit["document"]["contents"].partition("\n")
            text += f"Doc {i + 1} (Title: {title})\n{body}\n\n"
        per_query.append(text.strip())
    return "\n---\n".join(per_query)


def test_verl_search_tool(server):
    url = server.url + "/retrieve"
    answer, error, attempts = verl_call_search_api(url, ["capital of France", ""], topk=2)
    assert error is None and attempts == 1
    first, second = verl_result_text(answer).split("\n---\n")
    assert first.startswith('Doc 1 (Title: "Paris")\nParis is the capital')
    if server.kind == "dense":
        assert second.startswith("Doc 1 (Title:")  # a dense retriever ranks passages even for nothing
    # A request over the server's cap is refused with a 413, which verl does not retry.
    answer, error, attempts = verl_call_search_api(url, ["q"] * 65_537)
    assert answer is None and "413" in error and attempts == 1


# ---------------------------------------------------------------------------------------------
# RLinf's search tool worker and ASearcher's AsyncSearchBrowserClient (aiohttp)
# ---------------------------------------------------------------------------------------------

class AsyncSearchBrowser:
    """The local-server client of ASearcher (and, for /retrieve, RLinf's `AsyncSearchClient`):
    documents and urls of each query with `return_scores: false`, and pages by URL."""

    def __init__(self, server_addr: str):
        self.server_addr = server_addr  # host:port, as their configs give it

    async def _post(self, path: str, body: dict) -> dict:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://{self.server_addr}{path}", json=body,
                                    timeout=aiohttp.ClientTimeout(total=120, sock_connect=120)) as response:
                response.raise_for_status()
                return await response.json()

    async def query_async(self, req_meta: dict) -> list[dict]:
        answer = await self._post("/retrieve", req_meta)
        return [{"documents": [doc["contents"] for doc in docs], "urls": [doc["url"] for doc in docs],
                 "server_type": "async-search-browser"} for docs in answer["result"]]

    async def access_async(self, urls: list[str]) -> list[dict]:
        answer = await self._post("/access", {"urls": urls})
        return [{"page": page["contents"] if page is not None else "", "type": "access",
                 "server_type": "async-search-browser"} for page in answer["result"]]


def rlinf_tool_text(response: list[dict], topk: int) -> str:
    """RLinf's SearchToolWorker: the first query's documents as `[Doc k](url):` blocks."""
    documents, urls = response[0]["documents"][:topk], response[0]["urls"][:topk]
    if not documents:
        return "\n\n<information>\nNo search results are found.\n</information>\n<think>\n"
    blocks = [f"[Doc {k + 1}]({url}):\n" + doc[:5000] for k, (doc, url) in enumerate(zip(documents, urls))]
    return "\n\n<information>\n" + "\n\n".join(blocks) + "\n</information>\n<think>\n"


def test_rlinf_search_tool(server):
    client = AsyncSearchBrowser(server.url.removeprefix("http://"))
    req_meta = {"queries": ["capital of Japan"], "topk": 3, "return_scores": False}
    response = asyncio.run(client.query_async(req_meta))
    assert response[0]["urls"][0] == wiki_url("Tokyo")
    text = rlinf_tool_text(response, topk=3)
    assert text.startswith(f"\n\n<information>\n[Doc 1]({wiki_url('Tokyo')}):\n"
                           '"Tokyo"\nTokyo is the capital')


def test_asearcher_search_then_access(server):
    client = AsyncSearchBrowser(server.url.removeprefix("http://"))
    req_meta = {"queries": ["fourth planet from the Sun"], "topk": 10, "return_scores": False}
    [found] = asyncio.run(client.query_async(req_meta))
    assert found["urls"][0] == wiki_url("Mars") and found["documents"][0].startswith('"Mars"')
    assert len(found["urls"]) == len(found["documents"]) >= 1
    # The agent opens the first result's URL, one it made up, and a wiki link in index.php/ form.
    pages = asyncio.run(client.access_async([found["urls"][0], "https://example.com/none",
                                             "https://en.wikipedia.org/w/index.php/Seine"]))
    assert pages[0]["page"].startswith("Mars\n\nMars is the fourth planet") and pages[0]["type"] == "access"
    assert pages[1]["page"] == ""  # null for a URL the pages file lacks
    assert pages[2]["page"] == "The Seine is a river in France."
    # With scores, the extra fields sit in `document` beside id and contents.
    r = httpx.post(server.url + "/retrieve",
                   json={"queries": ["fourth planet from the Sun"], "topk": 1, "return_scores": True})
    assert r.json()["result"][0][0]["document"] == {
        "id": "13", "contents": '"Mars"\n' + dict(FACTS)["Mars"], "url": wiki_url("Mars"), "title": "Mars"}
