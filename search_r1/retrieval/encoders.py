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
    """Batched text → L2-normalised float32 vectors (fp16/bf16 compute on GPU)."""

    def __init__(self, model: str, device: str | None = None, dtype: str = "auto",
                 spec: EncoderSpec | None = None, max_length: int = 256, batch_size: int = 256):
        from transformers import AutoModel, AutoTokenizer

        self.device = device or default_device()
        if dtype == "auto":
            dtype = "float16" if self.device.startswith("cuda") else "float32"
        self.dtype = getattr(torch, dtype)
        self.spec = spec or EncoderSpec.for_model(model)
        self.max_length = max_length
        self.batch_size = batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.model = AutoModel.from_pretrained(model, dtype=self.dtype).to(self.device).eval()
        self.dim = self.model.config.hidden_size
        log.info("encoder %s on %s (%s, pooling=%s)", model, self.device, dtype, self.spec.pooling)

    def encode_queries(self, texts: list[str]) -> np.ndarray:
        return self.encode([self.spec.query_prefix + t for t in texts])

    def encode_passages(self, texts: list[str]) -> np.ndarray:
        return self.encode([self.spec.passage_prefix + t for t in texts])

    @torch.inference_mode()
    def encode(self, texts: list[str]) -> np.ndarray:
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        # Sorting by length keeps padding per batch small; results go back in input order.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        for lo in range(0, len(texts), self.batch_size):
            idx = order[lo:lo + self.batch_size]
            batch = self.tokenizer([texts[i] for i in idx], padding=True, truncation=True,
                                   max_length=self.max_length, return_tensors="pt").to(self.device)
            out[idx] = self._pool(self.model(**batch), batch["attention_mask"]).float().cpu().numpy()
        return out

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
