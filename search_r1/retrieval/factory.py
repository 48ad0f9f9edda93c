"""Build the retriever that `search-r1 serve` flags describe, checking files before loading."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from search_r1.retrieval.base import Retriever

log = logging.getLogger(__name__)

WEB_ENGINES = ("serpapi", "google", "brave", "bing")


@dataclass
class RetrieverArgs:
    retriever_name: str = "e5"          # e5 | bge | <any dense name> | bm25 | serpapi | google | brave | bing
    retriever_model: str = "intfloat/e5-base-v2"
    index_path: str | None = None
    corpus_path: str | None = None
    retriever_backend: str = "auto"     # auto | torch | faiss (dense only)
    faiss_gpu: bool = False
    devices: str | None = None          # e.g. "cuda:0,cuda:1"; default: all GPUs, else CPU
    dtype: str | None = None            # float16 | bfloat16 | float32 for the exact index
    ef_search: int | None = None        # HNSW search depth
    nprobe: int | None = None           # IVF lists probed
    query_max_length: int = 256
    encode_batch_size: int = 256
    encoder_cuda_graphs: bool | None = None  # dense: the query encoder from CUDA graphs; None: on a GPU
    reranker_model: str | None = None
    topk_retrieval: int = 10            # first-stage candidates per query when reranking
    reranker_batch_size: int = 128      # (query, passage) pairs per cross-encoder forward pass
    web_cache_dir: str | None = None
    search_url: str | None = None       # web engines: the endpoint; None: the engine's public API
    serp_engine: str = "google"         # serpapi: the engine SerpAPI queries (its `engine` parameter)
    # Web engine keys given on the command line, by their environment variable's name (web.KEY_ENV);
    # they win over the environment. Never printed: kept out of repr.
    web_keys: dict[str, str] | None = field(default=None, repr=False)


def _require(path: str | None, what: str) -> Path:
    if not path:
        raise ValueError(f"--{what} is required for this retriever")
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"--{what} {p} does not exist")
    return p


def build_retriever(a: RetrieverArgs) -> Retriever:
    name = a.retriever_name.lower()
    if name in WEB_ENGINES:
        from search_r1.retrieval.web import WebSearchRetriever
        retriever = WebSearchRetriever(engine=name, base_url=a.search_url, cache_dir=a.web_cache_dir,
                                       credentials=a.web_keys, serp_engine=a.serp_engine)
    elif name == "bm25":
        retriever = _bm25(a)
    else:
        retriever = _dense(a)
    if a.reranker_model:
        from search_r1.retrieval.rerank import CrossEncoderReranker, RerankRetriever
        retriever = RerankRetriever(retriever, CrossEncoderReranker(a.reranker_model,
                                                                    batch_size=a.reranker_batch_size),
                                    topk_retrieval=a.topk_retrieval)
    return retriever


def _bm25(a: RetrieverArgs) -> Retriever:
    from search_r1.retrieval import bm25
    index = _require(a.index_path, "index_path")
    if bm25.is_lucene_index(index):
        return bm25.PyseriniBM25Retriever(str(index))
    from search_r1.retrieval.corpus import Corpus
    return bm25.BM25Retriever(str(index), Corpus(_require(a.corpus_path, "corpus_path")))


def _dense(a: RetrieverArgs) -> Retriever:
    from search_r1.retrieval.corpus import Corpus
    from search_r1.retrieval.dense import FLAT_FOURCC, DenseRetriever, ExactIndex, load_vectors
    from search_r1.retrieval.encoders import Encoder, EncoderSpec, default_device
    from search_r1.retrieval.models import resolve_model

    index_path = _require(a.index_path, "index_path")
    corpus = Corpus(_require(a.corpus_path, "corpus_path"))
    devices = a.devices.split(",") if a.devices else None
    is_flat = index_path.is_dir() or index_path.suffix == ".npy" or \
        open(index_path, "rb").read(4) in FLAT_FOURCC
    backend = a.retriever_backend
    if backend == "auto":
        backend = "torch" if is_flat and not a.faiss_gpu else "faiss"
    if backend == "torch":
        if not is_flat:
            raise ValueError(f"{index_path} is not a flat index; the exact PyTorch backend needs "
                             "flat vectors (use --retriever_backend faiss)")
        index = ExactIndex(load_vectors(index_path), devices, a.dtype)
    else:
        from search_r1.retrieval.faiss_index import FaissIndex
        params = {k: v for k, v in (("efSearch", a.ef_search), ("nprobe", a.nprobe)) if v}
        index = FaissIndex.load(str(index_path), use_gpu=a.faiss_gpu, search_params=params)
    # The model name usually tells its family (e5/bge/dpr); a local path may not, then the
    # retriever name (the original launcher's `--retriever_name e5`) decides the prefixes.
    family = a.retriever_model if any(f in a.retriever_model.lower() for f in ("e5", "bge", "dpr")) \
        else a.retriever_name
    device = (devices or [default_device()])[0]
    # CUDA graphs by default on a GPU: replaying the encoder's forward spares short queries most of
    # its kernel-launch overhead, and the whole server serves more
    # (benchmarks/RESULTS.md, "The query encoder").
    graphs = device.startswith("cuda") if a.encoder_cuda_graphs is None else a.encoder_cuda_graphs
    encoder = Encoder(resolve_model(a.retriever_model), device=device, spec=EncoderSpec.for_model(family),
                      max_length=a.query_max_length, batch_size=a.encode_batch_size, cuda_graphs=graphs)
    return DenseRetriever(encoder, index, corpus, str(index_path))
