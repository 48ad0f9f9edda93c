"""`search-r1 index build`: embed a corpus (resumable, multi-GPU) or index it with BM25.

Dense output is a directory: `embeddings.npy` (fp16, N×D, memory-mapped while it is written),
`index_meta.json` (encoder, pooling, prefixes, row count, progress), and optionally a FAISS index
built from those vectors. Progress is committed after every chunk, so an interrupted build resumes
where it stopped; each GPU embeds its own contiguous range of rows in its own process.
"""
from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path

import numpy as np

from search_r1.retrieval.corpus import Corpus

log = logging.getLogger(__name__)

CHUNK_ROWS = 8192


def _progress_file(out: Path, rank: int) -> Path:
    return out / f".progress_{rank}.json"


def _embed_range(rank: int, corpus_path: str, out: str, model: str, device: str, lo: int, hi: int,
                 batch_size: int, max_length: int, progress: bool):
    from tqdm import tqdm

    from search_r1.retrieval.encoders import Encoder

    out = Path(out)
    pfile = _progress_file(out, rank)
    done = json.loads(pfile.read_text())["done"] if pfile.exists() else lo
    if done >= hi:
        return
    corpus = Corpus(corpus_path)
    encoder = Encoder(model, device=device, batch_size=batch_size, max_length=max_length)
    emb = np.load(out / "embeddings.npy", mmap_mode="r+")
    with tqdm(total=hi - lo, initial=done - lo, unit="psg", desc=f"embedding [{device}]",
              disable=not progress, position=rank) as bar:
        for start in range(done, hi, CHUNK_ROWS):
            stop = min(start + CHUNK_ROWS, hi)
            texts = corpus._contents.slice(start, stop - start).to_pylist()
            emb[start:stop] = encoder.encode_passages(texts).astype(np.float16)
            emb.flush()  # vectors reach the file before the progress that claims them
            pfile.write_text(json.dumps({"done": stop}))
            bar.update(stop - start)


def build_dense(corpus_path: str, out_dir: str, model: str, devices: list[str] | None = None,
                batch_size: int = 256, max_length: int = 256, faiss_factory: str | None = None,
                progress: bool = True) -> Path:
    import torch

    from search_r1.retrieval.encoders import EncoderSpec
    from search_r1.retrieval.models import resolve_model

    model_path = resolve_model(model)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    corpus = Corpus(corpus_path)
    n = len(corpus)
    devices = devices or ([f"cuda:{i}" for i in range(torch.cuda.device_count())] or ["cpu"])
    meta_path = out / "index_meta.json"
    from transformers import AutoConfig
    dim = AutoConfig.from_pretrained(model_path).hidden_size
    bounds = np.linspace(0, n, len(devices) + 1).astype(int)
    meta = {"model": model, "dim": dim, "rows": n, "corpus": str(corpus_path),
            "spec": {k: str(v) for k, v in asdict(EncoderSpec.for_model(model)).items()},
            "ranges": [[int(a), int(b)] for a, b in zip(bounds[:-1], bounds[1:])],
            "complete": False}
    old = json.loads(meta_path.read_text()) if meta_path.exists() else None
    if old and (old["model"], old["rows"], old["ranges"]) == (model, n, meta["ranges"]):
        log.info("resuming the build in %s", out)
    else:
        if old:
            log.warning("%s holds a build of another corpus/model/device split: starting over", out)
        for p in out.glob(".progress_*.json"):
            p.unlink()
        np.lib.format.open_memmap(out / "embeddings.npy", mode="w+", dtype=np.float16, shape=(n, dim))
        meta_path.write_text(json.dumps(meta, indent=1))

    args = [(r, str(corpus.path), str(out), model_path, dev, lo, hi, batch_size, max_length, progress)
            for r, (dev, (lo, hi)) in enumerate(zip(devices, meta["ranges"]))]
    if len(devices) == 1:
        _embed_range(*args[0])
    else:
        import torch.multiprocessing as mp
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_embed_range, args=a) for a in args]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        failed = [i for i, p in enumerate(procs) if p.exitcode != 0]
        if failed:
            raise RuntimeError(f"embedding failed on {[devices[i] for i in failed]}; "
                               "rerun the same command to resume")
    meta["complete"] = True
    meta_path.write_text(json.dumps(meta, indent=1))
    for p in out.glob(".progress_*.json"):
        p.unlink()
    if faiss_factory:
        from search_r1.retrieval.faiss_index import _faiss, build_faiss

        vectors = np.load(out / "embeddings.npy", mmap_mode="r")
        index = build_faiss(vectors, faiss_factory)
        path = out / f"{faiss_factory.replace(',', '_')}.index"
        _faiss().write_index(index, str(path))
        log.info("wrote %s", path)
    return out


def build_bm25_index(corpus_path: str, out_dir: str, progress: bool = True) -> Path:
    from search_r1.retrieval.bm25 import build_bm25

    build_bm25(Corpus(corpus_path), out_dir, progress=progress)
    return Path(out_dir)
