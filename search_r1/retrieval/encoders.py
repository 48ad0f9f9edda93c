"""Dense text encoders: any Hugging Face encoder from a local directory or a hub id.

Pooling and prefixes follow each model family's own recipe: e5 wants `query: ` / `passage: `
prefixes and mean pooling, bge wants a query instruction and the CLS vector, DPR the pooler
output. `EncoderSpec.for_model` guesses from the name; every field can be overridden.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import torch

log = logging.getLogger(__name__)

# A model input and the attribute of a Rust tokenizer's Encoding that holds it.
RUST_FIELDS = {"input_ids": "ids", "attention_mask": "attention_mask", "token_type_ids": "type_ids"}

BGE_QUERY_INSTRUCTION = "Represent this sentence for searching relevant passages: "


class Pooling(StrEnum):
    MEAN = "mean"
    CLS = "cls"
    POOLER = "pooler"


@dataclass
class EncoderSpec:
    pooling: Pooling = Pooling.MEAN
    query_prefix: str = ""
    passage_prefix: str = ""
    normalize: bool = True

    @classmethod
    def for_model(cls, name: str) -> "EncoderSpec":
        low = name.lower()
        if "e5" in low:
            return cls(Pooling.MEAN, "query: ", "passage: ")
        if "bge" in low:
            return cls(Pooling.CLS, BGE_QUERY_INSTRUCTION, "")
        if "dpr" in low:
            return cls(Pooling.POOLER, "", "", normalize=False)
        return cls()


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class Encoder:
    """Batched text → L2-normalised float32 vectors (fp16/bf16 compute on GPU).

    `cuda_graphs=True` (GPU only) replays the forward pass as CUDA graphs captured per shape bucket
    (`CudaGraphForward`): a batch of short queries then costs one graph launch instead of the
    hundreds of kernel launches the eager model makes from Python.
    """

    def __init__(self, model: str, device: str | None = None, dtype: str = "auto",
                 spec: EncoderSpec | None = None, max_length: int = 256, batch_size: int = 256,
                 cuda_graphs: bool = False):
        from transformers import AutoModel, AutoTokenizer

        self.device = device or default_device()
        if cuda_graphs and not self.device.startswith("cuda"):
            raise ValueError(f"cuda_graphs needs a CUDA device; the encoder is on {self.device}")
        if dtype == "auto":
            dtype = "float16" if self.device.startswith("cuda") else "float32"
        self.dtype = getattr(torch, dtype)
        self.spec = spec or EncoderSpec.for_model(model)
        self.max_length = max_length
        self.batch_size = batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self._rust = self._rust_tokenizer()
        self.model = AutoModel.from_pretrained(model, dtype=self.dtype).to(self.device).eval()
        self.dim = self.model.config.hidden_size
        # Its own CUDA stream: the server's pipelined worker searches one batch on the default
        # stream while this encodes the next, and a stream's host sync waits for its own work only.
        self.stream = torch.cuda.Stream(self.device) if self.device.startswith("cuda") else None
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the weights are there
        self.graphs = CudaGraphForward(self._forward, torch.device(self.device), max_length) if cuda_graphs else None
        log.info("encoder %s on %s (%s, pooling=%s%s)", model, self.device, dtype, self.spec.pooling,
                 ", CUDA graphs" if cuda_graphs else "")

    def encode_queries(self, texts: list[str]) -> np.ndarray:
        return self.encode([self.spec.query_prefix + t for t in texts])

    def encode_passages(self, texts: list[str]) -> np.ndarray:
        return self.encode([self.spec.passage_prefix + t for t in texts])

    @torch.inference_mode()
    def encode(self, texts: list[str]) -> np.ndarray:
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        # Sorting by length keeps padding per batch small; results go back in input order.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        with torch.cuda.stream(self.stream):  # no-op on the CPU (stream None)
            for lo in range(0, len(texts), self.batch_size):
                idx = order[lo:lo + self.batch_size]
                batch = {name: x.to(self.device) for name, x in self.tokenize([texts[i] for i in idx]).items()}
                forward = self.graphs or self._forward
                out[idx] = forward(batch).float().cpu().numpy()
        return out

    def tokenize(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """The model's input tensors for a batch, padded to its longest text, cut at max_length.

        Through the Rust tokenizer's `encode_batch` where the model has one: it is faster than the
        transformers call, which spends most of its time turning every encoding into Python lists
        (benchmarks/RESULTS.md, "The query encoder")."""
        if self._rust is None:
            return dict(self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length,
                                       return_tensors="pt"))
        encodings = self._rust.encode_batch(texts)
        return {name: torch.from_numpy(np.array([getattr(e, RUST_FIELDS[name]) for e in encodings], dtype=np.int64))
                for name in self.tokenizer.model_input_names if name in RUST_FIELDS}  # (torch.tensor of lists: slower)

    def _rust_tokenizer(self):
        """A copy of the model's Rust tokenizer set to pad and cut as the transformers call does, or
        None where there is none or it would tokenize differently (checked on probe texts)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None or self.tokenizer.pad_token_id is None:
            return None
        from tokenizers import Tokenizer

        rust = Tokenizer.from_str(backend.to_str())  # a copy: the padding and truncation set here are ours
        rust.enable_truncation(self.max_length)
        rust.enable_padding(direction=self.tokenizer.padding_side, pad_id=self.tokenizer.pad_token_id,
                            pad_type_id=self.tokenizer.pad_token_type_id, pad_token=self.tokenizer.pad_token)
        probe = ["query: who wrote hamlet?", "x", "passage: " + "a long text of many words " * 200]
        expected = self.tokenizer(probe, padding=True, truncation=True, max_length=self.max_length)
        got = rust.encode_batch(probe)
        if any(expected[name] != [getattr(e, RUST_FIELDS[name]) for e in got] for name in ("input_ids", "attention_mask")
               if name in expected):
            log.info("the Rust tokenizer of this model differs from its transformers call: using the latter")
            return None
        return rust

    @torch.inference_mode()
    def warmup(self, longest: int = 64) -> None:
        """With CUDA graphs: capture every batch bucket up to batch_size for the padded lengths 16,
        32, … up to `longest` (64: queries of up to ≈ 60 tokens), so that no request waits for a
        capture; `longest=max_length` leaves nothing to capture later."""
        if self.graphs is not None:
            names = list(self.tokenize(["warm-up"]))  # the inputs a batch will bring
            lengths = [16]
            while lengths[-1] < longest:  # the length buckets of `_key`: powers of two, capped
                lengths.append(min(2 * lengths[-1], longest))
            with torch.cuda.stream(self.stream):
                self.graphs.capture_all(self.batch_size, lengths, names)

    def _forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._pool(self.model(**batch), batch["attention_mask"])

    def _pool(self, output, mask_BT: torch.Tensor) -> torch.Tensor:
        if self.spec.pooling == Pooling.CLS:
            emb_BD = output.last_hidden_state[:, 0]
        elif self.spec.pooling == Pooling.POOLER:
            emb_BD = output.pooler_output
        else:
            m_BT1 = mask_BT.unsqueeze(-1).to(output.last_hidden_state.dtype)
            emb_BD = (output.last_hidden_state * m_BT1).sum(1) / m_BT1.sum(1).clamp(min=1)
        if self.spec.normalize:
            emb_BD = torch.nn.functional.normalize(emb_BD.float(), dim=-1)
        return emb_BD


def shape_bucket(n: int, smallest: int, largest: int) -> int:
    """The power of two ≥ n, within [smallest, largest] (n ≤ largest): the shapes captured as graphs."""
    return min(largest, max(smallest, 1 << (n - 1).bit_length()))


class CudaGraphForward:
    """A batch's forward pass (token tensors → pooled vectors) replayed from CUDA graphs.

    One graph per (batch, length) bucket, both powers of two, captured the first time a batch of
    that bucket comes (a one-time cost per bucket). A batch is copied into the bucket's fixed input
    buffers: extra columns are padding (attention mask 0, so each row's vector is the same as with
    eager padding, up to rounding); extra rows get one visible token so that no softmax runs over a
    fully masked row, and their vectors are dropped. All graphs share one memory pool: they are
    replayed one at a time and each output is read before the next replay.
    If a capture fails (a model whose forward synchronises with the host), the eager forward is
    used from then on, with a warning.
    """

    def __init__(self, forward, device: torch.device, max_length: int, max_batch: int = 4096):
        self.forward, self.device = forward, device
        self.max_length, self.max_batch = max_length, max_batch
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor], torch.Tensor]] = {}
        self.failed = False

    def __call__(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        B, T = batch["input_ids"].shape
        entry = None if B > self.max_batch else self._graph(self._key(B, T), list(batch))
        if entry is None:
            return self.forward(batch)
        graph, inputs, out_BD = entry
        for name, x_BT in inputs.items():
            x_BT.zero_()
            x_BT[:B, :T].copy_(batch[name])
        inputs["attention_mask"][B:, 0] = 1
        graph.replay()
        return out_BD[:B]

    def capture_all(self, max_batch: int, lengths: list[int], names: list[str]) -> None:
        """Capture the buckets of every batch size up to max_batch at these lengths."""
        batch = 8
        while batch < 2 * min(max_batch, self.max_batch) and not self.failed:
            for length in lengths:
                self._graph(self._key(batch, length), names)
            batch *= 2

    def _key(self, B: int, T: int) -> tuple[int, int]:
        return shape_bucket(B, 8, self.max_batch), shape_bucket(T, 16, max(T, self.max_length))

    def _graph(self, key: tuple[int, int], names: list[str]):
        """The bucket's graph, captured on first use; None once a capture has failed."""
        if key not in self.graphs and not self.failed:
            try:
                self.graphs[key] = self._capture(*key, names=names)
            except RuntimeError as e:
                log.warning("CUDA graph capture of the encoder failed (%s); encoding eagerly from now on", e)
                self.failed = True
        return None if self.failed else self.graphs[key]

    def _capture(self, B: int, T: int, names: list[str]):
        inputs = {name: torch.zeros(B, T, dtype=torch.long, device=self.device) for name in names}
        inputs["attention_mask"][:, 0] = 1
        side = torch.cuda.Stream(self.device)  # warm-up off the default stream, as capture requires
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.forward(inputs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads may use the GPU meanwhile (the server's lookup thread).
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out_BD = self.forward(inputs)
        return graph, inputs, out_BD
