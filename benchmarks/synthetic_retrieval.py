"""Synthetic retrieval data shared by the benchmarks and scripts/gpu_smoke.py.

Query words, random unit vectors and a random-weight BERT encoder: what bench_server.py serves,
bench_encoder.py encodes, bench_dense_search.py searches and the smoke script indexes. The
weights and vectors are random because they do not change the cost; the tokenizer is a real one,
because it sets the number of tokens. torch and transformers are imported inside the functions:
bench_server.py's client processes import this module and need neither.
"""
from __future__ import annotations

import os

WORDS = ("capital city country river mountain king queen war born died president album film "
         "novel author team league planet element language currency ocean island museum").split()


def random_query(rng, min_words: int = 4, max_words: int = 12) -> str:
    """A query of min_words to max_words WORDS drawn with `rng` (a random.Random)."""
    return " ".join(rng.choices(WORDS, k=rng.randint(min_words, max_words)))


def make_vectors(n, d, device, dtype, seed=0, store=None):
    """n random unit vectors, drawn on `device` and kept on `store` (default: the same device):
    a GPU draws wiki-18's 21M rows far faster than the CPU, even when they are then kept in host
    memory to be sharded over several GPUs."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.empty((n, d), dtype=dtype, device=store or device)
    for lo in range(0, n, 1 << 20):
        c = torch.randn((min(1 << 20, n - lo), d), generator=g, device=device)
        x[lo:lo + len(c)] = torch.nn.functional.normalize(c, dim=1).to(dtype).to(x.device)
    return x


def make_encoder_dir(out: str, tokenizer: str, dim: int, layers: int) -> str:
    """A BERT of the given shape with random weights and a real tokenizer, saved to `out` (once)."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    if not os.path.exists(os.path.join(out, "config.json")):
        tok = AutoTokenizer.from_pretrained(tokenizer)
        torch.manual_seed(0)
        cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=dim, num_hidden_layers=layers,
                         num_attention_heads=max(1, dim // 64), intermediate_size=4 * dim)
        BertModel(cfg).save_pretrained(out)
        tok.save_pretrained(out)
    return out
