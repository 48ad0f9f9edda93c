"""Exact PyTorch search against FAISS flat search and a naive full sort."""
import faiss
import numpy as np
import pytest
import torch

from search_r1.retrieval.dense import (ExactIndex, _search_blockmax, _search_chunked, load_vectors,
                                       read_faiss_flat)
from search_r1.retrieval.faiss_index import FaissIndex, build_faiss


def unit_vectors(n, d, seed):
    x = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.fixture(scope="module")
def data():
    return unit_vectors(5000 + 77, 48, 0), unit_vectors(37, 48, 1)


def test_exact_matches_faiss_flat(data):
    x, q = data
    flat = faiss.IndexFlatIP(x.shape[1])
    flat.add(x)
    ref_s, ref_i = flat.search(q, 10)
    for devices in (["cpu"], ["cpu", "cpu", "cpu"]):  # one shard and three shards
        s, i = ExactIndex(x, devices).search(q, 10)
        np.testing.assert_array_equal(i, ref_i)
        np.testing.assert_allclose(s, ref_s, atol=1e-5)


@pytest.mark.parametrize("k", [1, 3, 10])
def test_blockmax_prefilter_is_exact(data, k):
    x, q = data
    xt, qt = torch.from_numpy(x), torch.from_numpy(q)
    s_ref, i_ref = _search_chunked(xt, qt, k, chunk=1000)
    s, i = _search_blockmax(xt, qt, k)
    np.testing.assert_array_equal(i.numpy(), i_ref.numpy())
    np.testing.assert_allclose(s.numpy(), s_ref.numpy(), atol=1e-5)
    naive = np.argsort(-(q @ x.T), axis=1, kind="stable")[:, :k]
    np.testing.assert_array_equal(i.numpy(), naive)


def test_blockmax_finds_rows_in_the_tail():
    x = unit_vectors(1000, 16, 2)  # 1000 = 7 whole blocks of 128 + a tail of 104 rows
    q = x[[995, 3]]                # the best hit of query 0 sits in the tail
    s, i = _search_blockmax(torch.from_numpy(x), torch.from_numpy(q), 2)
    assert i[0, 0] == 995 and i[1, 0] == 3


def test_negative_scores_and_k_larger_than_shard(data):
    x, q = data
    s, i = ExactIndex(x[:5], ["cpu", "cpu"]).search(-q, 50)  # k clamps to N
    assert s.shape == (len(q), 5)
    assert (np.diff(s, axis=1) <= 0).all()


def test_read_faiss_flat_file(tmp_path, data):
    x, _ = data
    for index in (faiss.IndexFlatIP(x.shape[1]), faiss.IndexFlatL2(x.shape[1])):
        index.add(x)
        faiss.write_index(index, str(tmp_path / "f.index"))
        np.testing.assert_array_equal(np.asarray(read_faiss_flat(tmp_path / "f.index")), x)
    hnsw = faiss.IndexHNSWFlat(x.shape[1], 8, faiss.METRIC_INNER_PRODUCT)
    faiss.write_index(hnsw, str(tmp_path / "h.index"))
    with pytest.raises(ValueError, match="not a FAISS flat index"):
        read_faiss_flat(tmp_path / "h.index")
    with pytest.raises(FileNotFoundError):
        load_vectors(tmp_path / "missing.index")


@pytest.mark.parametrize("factory", ["Flat", "HNSW32", "IVF16,Flat", "IVF16,PQ24x4"])
def test_faiss_factories(tmp_path, data, factory):
    x, q = data
    index = build_faiss(x, factory)
    faiss.write_index(index, str(tmp_path / "i.index"))
    params = {"nprobe": 16} if factory.startswith("IVF") else ({"efSearch": 128} if "HNSW" in factory else {})
    s, i = FaissIndex.load(str(tmp_path / "i.index"), search_params=params).search(q, 3)
    _, exact = ExactIndex(x, ["cpu"]).search(q, 3)
    recall = np.mean([len(set(a) & set(b)) / 3 for a, b in zip(i, exact)])
    # PQ on random 48-d vectors is coarse; chance would be 3 / 5077.
    assert recall >= (0.99 if "PQ" not in factory else 0.25), recall
