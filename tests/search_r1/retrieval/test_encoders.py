"""The encoder's shape buckets for CUDA graphs, and the premise they rest on: padding a batch with
masked columns and extra rows leaves each real row's vector as it was (checked on CPU with the
bundled MiniLM; the graphs themselves are checked in test_encoders_gpu.py)."""
import numpy as np
import pytest
import torch

from search_r1.retrieval.encoders import Encoder, shape_bucket
from search_r1.retrieval.models import resolve_model


def test_shape_bucket_is_the_next_power_of_two_within_bounds():
    assert [shape_bucket(n, 8, 512) for n in (1, 8, 9, 187, 256, 257, 512)] == [8, 8, 16, 256, 256, 512, 512]
    assert shape_bucket(200, 16, 200) == 200  # capped at the largest (a max_length that is no power of two)


def test_cuda_graphs_need_a_cuda_device():
    with pytest.raises(ValueError, match="cuda_graphs needs a CUDA device"):
        Encoder(resolve_model("all-MiniLM-L6-v2"), device="cpu", cuda_graphs=True)


def test_padding_to_a_bucket_keeps_every_vector():
    enc = Encoder(resolve_model("all-MiniLM-L6-v2"), device="cpu")
    texts = ["capital of france", "who wrote the novel about a whale and a captain", "river"]
    batch = dict(enc.tokenizer(texts, padding=True, return_tensors="pt"))
    B, T = batch["input_ids"].shape
    padded = {name: torch.zeros(8, 32, dtype=torch.long) for name in batch}
    for name, x in padded.items():
        x[:B, :T] = batch[name]
    padded["attention_mask"][B:, 0] = 1  # as CudaGraphForward fills the rows beyond the batch
    with torch.inference_mode():
        eager = enc._forward(batch).numpy()
        bucketed = enc._forward(padded)[:B].numpy()
    np.testing.assert_allclose(bucketed, eager, atol=1e-5)
    np.testing.assert_allclose(enc.encode(texts), eager, atol=1e-5)


def test_rust_tokenizer_path_gives_the_transformers_calls_tensors():
    enc = Encoder(resolve_model("all-MiniLM-L6-v2"), device="cpu", max_length=32)
    assert enc._rust is not None  # MiniLM has a Rust (fast) tokenizer: the direct path is taken
    texts = ["query: capital of france", "x", "passage: " + "many words of a long passage " * 20, ""]
    fast = enc.tokenize(texts)
    slow = dict(enc.tokenizer(texts, padding=True, truncation=True, max_length=32, return_tensors="pt"))
    assert list(fast) == enc.tokenizer.model_input_names and fast.keys() == slow.keys()
    for name in fast:
        assert fast[name].dtype == torch.int64 and torch.equal(fast[name], slow[name]), name
    assert fast["input_ids"].shape == (4, 32)  # cut at max_length, the others padded to it
    # A copy pads to the longest text of a batch; the model's own tokenizer is left as it was.
    assert enc._rust is not enc.tokenizer.backend_tokenizer and enc._rust.padding["length"] is None
