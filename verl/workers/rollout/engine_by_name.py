"""`create_engine`: a generation engine by the name `rollout.name` or `search-r1 eval --engine` gives."""

from __future__ import annotations

import torch

from verl.workers.rollout.engine import Engine
from verl.workers.rollout.hf_engine import HFEngine
from verl.workers.rollout.vllm_engine import VLLMEngine


def create_engine(name: str, model_path: str, *, device: str = "auto", seed: int = 0, key: str = "engine",
                  **vllm_kw) -> Engine:
    """The generation engine `name`: "vllm" (VLLMEngine with `vllm_kw`) or "hf" (transformers on
    `device`: auto takes the GPU when there is one; bf16 on a GPU, fp32 on the CPU). `key` names the
    setting that chose `name`, for the error."""
    if name == "vllm":
        return VLLMEngine(model_path, seed=seed, **vllm_kw)
    if name == "hf":
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        return HFEngine(model_path, device=device, dtype="bfloat16" if device == "cuda" else "float32", seed=seed)
    raise ValueError(f"{key}={name!r}: use vllm or hf")
