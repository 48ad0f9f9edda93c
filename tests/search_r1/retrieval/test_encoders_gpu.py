"""The encoder's forward replayed from CUDA graphs gives the eager encoder's vectors (a random
BERT with a BERT-vocabulary tokenizer: `SMOKE_BERT_TOKENIZER`, as the GPU smoke passes it, or the
bundled MiniLM's)."""
import os

import numpy as np
import pytest
import torch

from search_r1.retrieval.encoders import Encoder
from search_r1.retrieval.models import resolve_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

WORDS = "capital city country river mountain king queen war born died president album film novel".split()


def queries(n, seed):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=rng.integers(1, 40))) for _ in range(n)]


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    from transformers import AutoTokenizer, BertConfig, BertModel
    out = tmp_path_factory.mktemp("bert")
    tok = AutoTokenizer.from_pretrained(os.environ.get("SMOKE_BERT_TOKENIZER") or resolve_model("all-MiniLM-L6-v2"))
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=tok.vocab_size, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                         intermediate_size=1024)).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def test_cuda_graph_vectors_equal_eager_ones(bert_dir):
    eager = Encoder(bert_dir, device="cuda", batch_size=512)
    graphed = Encoder(bert_dir, device="cuda", batch_size=512, cuda_graphs=True)
    for n, seed in ((1, 0), (7, 1), (187, 2), (600, 3), (187, 4)):  # 600: two batches; (187, 4): a graph reused
        texts = queries(n, seed)
        a, b = eager.encode_queries(texts), graphed.encode_queries(texts)
        assert np.min(np.sum(a * b, axis=1)) > 0.999  # unit vectors: cosine; fp16 rounding differs
    assert not graphed.graphs.failed
    buckets = set(graphed.graphs.graphs)
    assert {b for b, _ in buckets} == {8, 128, 256, 512} and len(buckets) <= 6  # 600 = 512 + 88


def test_warmup_captures_the_buckets_of_short_queries(bert_dir):
    graphed = Encoder(bert_dir, device="cuda", batch_size=100, cuda_graphs=True)
    graphed.warmup()
    assert set(graphed.graphs.graphs) == {(b, t) for b in (8, 16, 32, 64, 128) for t in (16, 32, 64)}
    texts = queries(100, 5)  # up to 40 words: within 64 tokens
    vectors = graphed.encode_queries(texts)
    assert len(graphed.graphs.graphs) == 15  # nothing captured while serving
    eager = Encoder(bert_dir, device="cuda", batch_size=100).encode_queries(texts)
    assert np.min(np.sum(vectors * eager, axis=1)) > 0.999
