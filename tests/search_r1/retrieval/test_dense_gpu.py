"""GPU paths of the exact index: the fused Triton kernel and the FP8 prefilter."""
import numpy as np
import pytest
import torch

from search_r1.retrieval import dense

if torch.cuda.is_available():
    from search_r1.retrieval import triton_blockmax

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def vectors(n, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn((n, d), generator=g, device="cuda"), dim=1).half()


@pytest.mark.parametrize("n,b", [(100_000 + 55, 7), (300_000, 300)])
def test_fused_blockmax_equals_full_topk(n, b):
    x, q = vectors(n, 768, 0), vectors(b, 768, 1)
    s_ref, i_ref = dense._search_chunked(x, q, 5, chunk=1 << 16)
    for fused, kernel in ((False, "auto"), (True, "pointer"), (True, "tma")):
        if kernel == "tma" and not triton_blockmax.tma_available(x):
            continue
        s, i = dense._search_blockmax(x, q, 5, fused=fused, kernel=kernel)
        # fp16 rounding may swap rows whose scores differ by less than its resolution, so compare
        # the true (fp32) scores of the rows each method chose.
        true_s = torch.einsum("bkd,bd->bk", x[i].float(), q.float())
        true_ref = torch.einsum("bkd,bd->bk", x[i_ref].float(), q.float())
        torch.testing.assert_close(true_s, true_ref, atol=2e-3, rtol=0)


def test_exact_index_on_gpu_shards_matches_cpu():
    x = vectors(50_000, 128, 2).float().cpu().numpy()
    q = vectors(16, 128, 3).float().cpu().numpy()
    s_ref, _ = dense.ExactIndex(x, ["cpu"]).search(q, 3)
    _, got = dense.ExactIndex(x, ["cuda:0", "cuda:0"]).search(q, 3)
    true_s = np.einsum("bkd,bd->bk", x[got], q)  # fp16 may swap near-ties; compare true scores
    np.testing.assert_allclose(true_s, s_ref, atol=2e-3)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("b", [8, 300])  # the pointer kernel and (on Hopper) the TMA one
def test_exact_index_sharded_over_gpus_matches_cpu(b):
    """Each shard's kernel must run on its own GPU (Triton launches on the current device)."""
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    x = vectors(200_000, 768, 6).float().cpu().numpy()
    q = vectors(b, 768, 7).float().cpu().numpy()
    s_ref, _ = dense.ExactIndex(x, ["cpu"]).search(q, 3)
    _, got = dense.ExactIndex(x, devices).search(q, 3)
    true_s = np.einsum("bkd,bd->bk", x[got], q)
    np.testing.assert_allclose(true_s, s_ref, atol=2e-3)


def test_fp8_prefilter_recall():
    x, q = vectors(500_000, 768, 4), vectors(64, 768, 5)
    _, exact = dense._search_blockmax(x, q, 3, fused=False)
    x8, scale = dense._to_fp8(x)
    _, got = dense._search_fp8(x, x8, scale, q, 3, shortlist=8)
    recall = np.mean([len(set(a.tolist()) & set(b.tolist())) / 3 for a, b in zip(got.cpu(), exact.cpu())])
    assert recall >= 0.98, recall
