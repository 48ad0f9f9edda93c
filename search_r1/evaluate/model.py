"""The model to evaluate: a directory, a hub id, or a training checkpoint to export first; and the
engine that runs it."""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from search_r1.evaluate.config import EvalConfig

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^global_step_\d+$")


def find_checkpoint(path: Path) -> tuple[Path | None, Path | None]:
    """(checkpoint directory, run directory) if `path` is a run, its `checkpoints/` or one
    `global_step_N`; else (None, None)."""
    from verl.checkpoint.store import checkpoint_dir, latest_step

    if not path.is_dir():
        return None, None
    if _STEP_DIR.match(path.name):
        return path, path.parent.parent
    for root, run in ((path / "checkpoints", path), (path, path.parent)):
        step = latest_step(root)
        if step is not None:
            return Path(checkpoint_dir(root, step)), run
    return None, None


def resolve_model(model: str, base_model: str | None, out: str | os.PathLike,
                  allow_unverified: bool = False) -> tuple[str, str]:
    """(loadable model path or hub id, label). A checkpoint is exported to `<out>/model`, once; the
    export checks its files against its manifest first (CheckpointCorrupt names the file that fails)."""
    ckpt, run = find_checkpoint(Path(model))
    if ckpt is None:
        return model, Path(model).name or model
    label = f"{run.name}/{ckpt.name}"
    source = base_model
    if source is None and (run / "config.yaml").is_file():
        from omegaconf import OmegaConf
        source = OmegaConf.select(OmegaConf.load(run / "config.yaml"), "actor_rollout_ref.model.path")
    if source is None:
        raise ValueError(f"{model} is a training checkpoint but {run / 'config.yaml'} is missing: pass "
                         "--base-model, the model the training started from (for its config and tokenizer)")
    if not os.path.isdir(source):  # a hub id: only its config and tokenizer files are needed
        from huggingface_hub import snapshot_download
        source = snapshot_download(source, allow_patterns=["*.json", "*.txt", "*.model", "*.jinja"])

    exported = Path(out) / "model"
    stamp = exported / "exported_from.txt"  # later modes of the same evaluation reuse the export
    if stamp.is_file() and stamp.read_text() == str(ckpt.resolve()):
        return str(exported), label
    from verl.checkpoint.export import export_hf
    log.info("exporting %s to %s", ckpt, exported)
    export_hf(ckpt, "actor", exported, source, overwrite=True, allow_unverified=allow_unverified)
    stamp.write_text(str(ckpt.resolve()))
    return str(exported), label


def build_engine(cfg: EvalConfig, model: str, max_model_len: int):
    import torch

    from verl.workers.rollout.engine_by_name import create_engine

    if cfg.engine != "vllm":
        return create_engine(cfg.engine, model, seed=cfg.seed, key="--engine")
    on_gpu = torch.cuda.is_available()
    from transformers import AutoConfig
    positions = getattr(AutoConfig.from_pretrained(model), "max_position_embeddings", None)
    if positions and max_model_len > positions:  # vLLM refuses a longer max_model_len
        log.warning("prompt + response budget = %d tokens exceeds the model's %d positions: long responses "
                    "will be cut (lower --max-turns, --max-response-length or --max-obs-length)",
                    max_model_len, positions)
        max_model_len = positions
    kv_gib = cfg.kv_cache_gib or (None if on_gpu else 1.0)  # no share-of-RAM probing on CPU
    kw = {"kv_cache_memory_bytes": int(kv_gib * 2**30)} if kv_gib else {}
    core = cfg.engine_core or ("separate" if on_gpu else "in_process")
    if core not in ("in_process", "separate"):
        raise ValueError(f"--engine-core {core!r}: use in_process or separate")
    return create_engine("vllm", model, seed=cfg.seed, max_model_len=max_model_len,
                         gpu_memory_utilization=cfg.gpu_memory_utilization, separate_core=core == "separate",
                         enforce_eager=cfg.enforce_eager, **kw)
