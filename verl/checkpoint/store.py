"""Sharded, resumable training checkpoints: save, load, rotation, and the checks around them.

Every rank writes only its own shards (torch.distributed.checkpoint, "DCP"), so saving never gathers
a whole model on one device: the original Search-R1 did, and crashed on large models.

Layout of one checkpoint (all ranks write into the same directory: a shared filesystem on multi-node):

    <root>/global_step_<N>/
        <name>/model/            DCP directory of the model's (sharded) state dict, e.g. name = "actor"
        <name>/optimizer/        DCP directory of its optimizer state (absent if saved without one)
        <name>/scheduler.pt      its LR scheduler state (absent if saved without one)
        <name>/adapter_config.json  a model that trains LoRA adapters: their config (PEFT's format)
        trainer_state.json       {"step", "world_size", "models", "trainer": what the trainer passed}
        rng/rank_<r>.pt          python, numpy, torch CPU (and CUDA) RNG states of rank r
        manifest.json            size and sha256 of every other file, written last
    <root>/latest                text file with the step of the newest complete checkpoint

A checkpoint is written into `global_step_<N>.tmp` and renamed only when every rank has finished, so
a crash never leaves a directory that looks complete. Model and optimizer state are resharded by DCP
when resuming at another world size; RNG states are then skipped with a warning.

What a checkpoint holds of a model is what training changes: its parameters that require gradients
(all of them in full fine-tuning; a LoRA model's adapters, and a value model's head). Frozen weights
come from the model's own directory, as when training started, and are neither saved nor loaded.

Faults never pass silently. A shard that changed on disk (a flipped exponent bit loads as a huge
but finite weight, and DCP does not notice) fails its checksum on load: `CheckpointCorrupt` names the file, and
the trainer falls back to the previous checkpoint. Every reader checks first: resume, rollback and
the export (hence evaluation). A checkpoint without a manifest is corrupt as well (a partial copy
looks like that); only checkpoints written before manifests existed may be read unchecked, and only
when asked (`allow_unverified`: trainer.allow_unverified_checkpoint, --allow-unverified-checkpoint),
and a file of theirs that fails to load is then taken for a damaged one. A state with a nan or inf
is refused before anything is written. Free space is checked against the last checkpoint's size (or the state's bytes
for the first) before writing, and a save that fails for any reason removes its partial directory.
Older checkpoints are deleted only once the new one is complete with its manifest, so rotation
never deletes the newest checkpoint that verified. Checks that one rank could fail alone (a shard of
nan, a full local disk, a corrupted file) are agreed on by every rank, so that all raise together
instead of leaving the others waiting in a collective.

Manifests and verification: verl.checkpoint.manifest; the export: verl.checkpoint.export.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import re
import shutil
import traceback
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_state_dict, set_model_state_dict, set_state_dict)
from torch.distributed.tensor import DTensor

from verl.checkpoint.manifest import (CheckpointCorrupt, last_line, read_manifest, reading, verify_checkpoint,
                                      write_manifest, write_text)
from verl.utils import process_group as pg

logger = logging.getLogger(__name__)

# name -> (model, optimizer or None, LR scheduler or None)
ModelParts = tuple[torch.nn.Module, torch.optim.Optimizer | None, torch.optim.lr_scheduler.LRScheduler | None]

# Beside a model that trains LoRA adapters: their config, in PEFT's format (read by the export).
ADAPTER_CONFIG = "adapter_config.json"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")
# Free space below which a failed write is put down to a full disk even when the error does not say
# so: torch's zip writer reports ENOSPC as "unexpected pos N vs M".
_NEARLY_FULL_BYTES = 64 << 20

def checkpoint_dir(root: str | os.PathLike, step: int) -> str:
    return os.path.join(root, f"global_step_{step}")

# ---------------------------------------------------------------- save / load

def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    models: Mapping[str, ModelParts],
    trainer_state: dict[str, Any],
    keep_last: int | None = None,
    adapters: Mapping[str, dict] | None = None,
) -> str:
    """Save every model of `models` (e.g. {"actor": (model, optim, sched), "critic": (...)}) with the
    trainer state (data-loader position and anything else JSON-able) and this rank's RNG states.
    `adapters`: name -> the LoRA config (PEFT's adapter_config.json) of each model that trains
    adapters, saved beside it for the export.

    Call on every rank (it has collectives); returns the checkpoint directory. Keeps the newest
    `keep_last` checkpoints (None or 0: keep all), never deleting the one just written.
    Save after the first optimizer step: torch's get_state_dict fills an empty optimizer state by
    taking a step with zero learning rate, which would shift Adam's step count.
    Raises, on every rank and with nothing written, when a weight or optimizer value is not finite
    or the file system lacks the room (OSError ENOSPC); a save that fails part-way removes its
    partial directory. Older checkpoints are untouched in all these cases.
    """
    if keep_last is not None and keep_last < 0:
        raise ValueError(f"keep_last={keep_last}: give the number of checkpoints to keep, or 0/None to keep all")
    rank, world_size = pg.rank(), pg.world_size()
    # Before any collective: a state that fails to serialise must fail on every rank, not hang them.
    try:
        state_json = json.dumps(
            {"step": step, "world_size": world_size, "models": sorted(models), "trainer": trainer_state}, indent=2)
        adapter_json = {name: json.dumps(config, indent=2) for name, config in (adapters or {}).items()}
    except TypeError as error:
        raise TypeError(f"trainer_state and adapters must be JSON-serialisable (plain numbers, strings, lists, "
                        f"dicts): {error}")
    rng_state = _rng_state()  # first, so that nothing done while saving changes what is saved

    with single_process_quiet():
        state_dicts = {name: _state_dicts(model, optimizer) for name, (model, optimizer, _) in models.items()}
    _refuse_non_finite(state_dicts, root, step)

    final = checkpoint_dir(root, step)
    tmp = final + ".tmp"
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        for leftover in Path(root).glob("global_step_*.tmp"):  # from a crash; only one save runs at a time
            shutil.rmtree(leftover)
    pg.barrier()
    need, free = _check_free_space(root, state_dicts)

    try:
        _write_files(tmp, state_dicts, models, rng_state, state_json, adapter_json)
        write_manifest(tmp, step)
    except BaseException as error:
        try:
            free_now = _free_bytes(root)  # before the cleanup gives the space back
        except OSError:
            free_now = free
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise
        if _out_of_space(error, free_now):
            raise OSError(errno.ENOSPC, f"{_no_space(root, need, free)}: the disk filled up while writing step "
                                        f"{step} ({last_line(error)}). {_NO_SPACE_ADVICE}") from error
        raise RuntimeError(f"Saving checkpoint step {step} under {root} failed: {error}. Its partial directory "
                           f"was removed; older checkpoints are untouched.") from error

    error = None
    if rank == 0:
        try:
            _publish(root, step, tmp, final, keep_last)
        except Exception as caught:
            error = caught
    pg.agree(error, "publishing the checkpoint")  # nobody goes on (or loads) before it has its final name
    return final

def latest_step(root: str | os.PathLike) -> int | None:
    """Step of the newest complete checkpoint under `root`, or None. Directories left by a crash
    (`.tmp`) never count."""
    try:
        step = int(Path(root, "latest").read_text().strip())
        if os.path.isdir(checkpoint_dir(root, step)):
            return step
    except (FileNotFoundError, ValueError):
        pass
    # No (valid) `latest` file, e.g. a copied directory: any renamed step directory is complete.
    steps = complete_steps(root)
    return steps[-1] if steps else None

def resume_steps(root: str | os.PathLike) -> list[int]:
    """Steps to resume from, in order of preference: the newest complete checkpoint (the one
    `latest` names), then every older one, the fallbacks when a checkpoint fails verification."""
    newest = latest_step(root)
    return [] if newest is None else [s for s in reversed(complete_steps(root)) if s <= newest]

def complete_steps(root: str | os.PathLike) -> list[int]:
    """Steps of the renamed (complete) checkpoint directories under `root`, ascending."""
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for entry in os.listdir(root)
                  if (m := _STEP_DIR.match(entry)) and os.path.isdir(os.path.join(root, entry)))

def load_checkpoint(root: str | os.PathLike, step: int, models: Mapping[str, ModelParts],
                    allow_unverified: bool = False) -> dict[str, Any]:
    """Restore models, optimizers and schedulers in place, and this rank's RNG states; returns the
    trainer state given to `save_checkpoint`. Call on every rank. Optimizers and schedulers may be
    None to load weights only. Every file is checked against the manifest first (`verify_checkpoint`):
    a corrupted checkpoint, or one without a manifest unless `allow_unverified`, raises
    CheckpointCorrupt before anything is read into the models. In an unverified checkpoint a file
    that cannot be read raises CheckpointCorrupt too (nothing rules out a damaged file there), so that
    a resume falls back from it as from a failed checksum."""
    ckpt = checkpoint_dir(root, step)
    if not os.path.isdir(ckpt):
        found = complete_steps(root)
        raise FileNotFoundError(f"No checkpoint at {ckpt}; complete checkpoints under {root}: steps {found}")
    verified = verify_checkpoint(ckpt, allow_unverified)
    state_file = os.path.join(ckpt, "trainer_state.json")
    if not os.path.isfile(state_file):
        raise CheckpointCorrupt(ckpt, state_file, f"is missing: the checkpoint is incomplete; complete checkpoints "
                                                  f"under {root}: steps {complete_steps(root)}")
    with reading(ckpt, state_file, verified):
        saved = json.loads(Path(state_file).read_text())
    saved_world_size, world_size = saved["world_size"], pg.world_size()

    for name, (model, optimizer, scheduler) in models.items():
        if name not in saved["models"]:
            raise ValueError(f"Checkpoint {ckpt} has no model {name!r}; it has {saved['models']}")
        model_dir, optim_dir = os.path.join(ckpt, name, "model"), os.path.join(ckpt, name, "optimizer")
        if optimizer is not None and not os.path.isdir(optim_dir):
            raise FileNotFoundError(f"{name!r} was saved without optimizer state ({optim_dir} is missing): "
                                    f"pass None as its optimizer to load the weights only")
        try:
            with single_process_quiet():
                # The state dicts of the live objects say which shard this rank holds; DCP fills
                # them in place, reading (and resharding) only what is needed.
                model_sd, optim_sd = _state_dicts(model, optimizer)
                # Frozen weights are left out on purpose: torch's strict check of the keys is off
                # for such a model; DCP has already refused a checkpoint that lacks a key asked for.
                options = StateDictOptions(strict=all(p.requires_grad for p in model.parameters()))
                with reading(ckpt, model_dir, verified):
                    dcp.load(model_sd, checkpoint_id=model_dir, no_dist=not pg.is_distributed())
                if optimizer is None:
                    set_model_state_dict(model, model_sd, options=options)
                else:
                    with reading(ckpt, optim_dir, verified):
                        dcp.load(optim_sd, checkpoint_id=optim_dir, no_dist=not pg.is_distributed())
                    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                                   options=options)
        except CheckpointCorrupt:
            raise
        # DCP's CheckpointException derives from BaseException, not Exception: name it, or it escapes.
        except (Exception, CheckpointException) as error:
            raise RuntimeError(
                f"Could not load {name!r} from {ckpt} (saved at world size {saved_world_size}, now {world_size}): "
                f"{error}. The model (and optimizer) must be built exactly as when saving (LoRA adapters "
                f"included: the same model.lora_rank and target_modules).") from error
        if scheduler is not None:
            sched_file = os.path.join(ckpt, name, "scheduler.pt")
            if not os.path.isfile(sched_file):
                raise FileNotFoundError(f"{name!r} was saved without a scheduler ({sched_file} is missing)")
            with reading(ckpt, sched_file, verified):
                scheduler.load_state_dict(torch.load(sched_file, weights_only=True))

    if saved_world_size == world_size:
        rng_file = os.path.join(ckpt, "rng", f"rank_{pg.rank()}.pt")
        with reading(ckpt, rng_file, verified):
            _set_rng_state(torch.load(rng_file, weights_only=True))
    else:
        warnings.warn(f"Checkpoint {ckpt} was saved at world size {saved_world_size}, resuming at {world_size}: "
                      f"model and optimizer were resharded, but RNG states were not restored, so sampling "
                      f"and dropout will not repeat the original run exactly.")
    logger.info("Loaded checkpoint %s", ckpt)
    return saved["trainer"]

def _state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict | None]:
    """(model state dict, optimizer state dict or None) of what training changes: the parameters that
    require gradients (module docstring) and the persistent buffers."""
    options = StateDictOptions(ignore_frozen_params=True)
    model_sd, optim_sd = ((get_model_state_dict(model, options=options), None) if optimizer is None
                          else get_state_dict(model, optimizer, options=options))
    # torch leaves a frozen weight in under its second name when two share it (a tied lm_head)
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {key: value for key, value in model_sd.items() if key not in frozen}, optim_sd


# ---------------------------------------------------------------- the parts of a save

def _refuse_non_finite(state_dicts: dict, root: str | os.PathLike, step: int) -> None:
    """A nan or inf saved would be resumed from, and rotation would delete the good checkpoints
    behind it. Every rank checks its own shards; all raise if any rank found one."""
    bad = sorted({name for names in pg.gather_objects(_non_finite_tensors(state_dicts)) for name in names})
    if bad:
        raise RuntimeError(
            f"Refusing to save checkpoint step {step}: not finite (nan or inf) in {len(bad)} tensor(s), e.g. "
            f"{', '.join(bad[:3])}. Nothing was written and the checkpoints under {root} are untouched: resume "
            f"from the newest of them once the cause (learning rate, data, a corrupted resume) is found.")


def _non_finite_tensors(state_dicts: dict) -> list[str]:
    # Every check is queued before any is read, so that a GPU waits once, not once per tensor.
    checks = [(f"{name} {part} {key}", torch.isfinite(_local(tensor)).all())
              for name, (model_sd, optim_sd) in state_dicts.items()
              for part, state in (("weights", model_sd), ("optimizer state", optim_sd or {}))
              for key, tensor in _tensors(state) if tensor.is_floating_point()]
    return [label for label, finite in checks if not finite]


def _tensors(tree: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(dotted key, tensor) of every tensor in a nested state dict."""
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from _tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from _tensors(value, f"{prefix}.{i}" if prefix else str(i))

_NO_SPACE_ADVICE = ("Free space there, keep fewer checkpoints (trainer.keep_last_checkpoints: older ones are deleted "
                    "only after a new one is complete, so one more must fit), or save to a larger disk "
                    "(trainer.default_local_dir); the checkpoints already there are untouched")


def _check_free_space(root: str | os.PathLike, state_dicts: dict) -> tuple[int, int]:
    """Raise OSError(ENOSPC) on every rank unless the file system of `root` has room for the new
    checkpoint: as much as the last one took, or for the first the state's bytes over all ranks.
    Old checkpoints are deleted only after the new one is complete, so this room comes on top.
    Returns (bytes needed, bytes free)."""
    local_bytes = sum(_local(t).numel() * _local(t).element_size()
                      for model_sd, optim_sd in state_dicts.values() for _, t in _tensors([model_sd, optim_sd]))
    reports = pg.gather_objects((local_bytes, _free_bytes(root),
                                 _last_checkpoint_bytes(root) if pg.rank() == 0 else None))
    last = reports[0][2]  # every rank decides from the same numbers
    need = last if last is not None else sum(r[0] for r in reports)
    free = min(r[1] for r in reports)
    if free < need:
        raise OSError(errno.ENOSPC, f"{_no_space(root, need, free)}: nothing was written. {_NO_SPACE_ADVICE}")
    return need, free


def _no_space(root: str | os.PathLike, need: int, free: int) -> str:
    return (f"no space left on {_mount_point(root)} (needs ~{_size(need)}, {_size(free)} free) "
            f"for a checkpoint in {root}")


def _last_checkpoint_bytes(root: str | os.PathLike) -> int | None:
    steps = complete_steps(root)
    if not steps:
        return None
    ckpt = checkpoint_dir(root, steps[-1])
    try:
        listed = read_manifest(ckpt)
    except CheckpointCorrupt:
        listed = None
    if listed is not None:
        return sum(entry["bytes"] for entry in listed.values())
    return sum(p.stat().st_size for p in Path(ckpt).rglob("*") if p.is_file())

def _write_files(tmp: str, state_dicts: dict, models: Mapping[str, ModelParts], rng_state: dict,
                 state_json: str, adapter_json: dict[str, str]) -> None:
    rank = pg.rank()
    with single_process_quiet():
        for name, (model_sd, optim_sd) in state_dicts.items():
            # Collective: when a rank's write fails, DCP raises on every rank.
            dcp.save(model_sd, checkpoint_id=os.path.join(tmp, name, "model"), no_dist=not pg.is_distributed())
            if optim_sd is not None:
                dcp.save(optim_sd, checkpoint_id=os.path.join(tmp, name, "optimizer"), no_dist=not pg.is_distributed())
    error = None
    try:
        for name, (_, _, scheduler) in models.items():
            if scheduler is not None and rank == 0:
                _save_file(scheduler.state_dict(), os.path.join(tmp, name, "scheduler.pt"))
        _save_file(rng_state, os.path.join(tmp, "rng", f"rank_{rank}.pt"))
        if rank == 0:
            write_text(os.path.join(tmp, "trainer_state.json"), state_json)
            for name, text in adapter_json.items():
                write_text(os.path.join(tmp, name, ADAPTER_CONFIG), text)
    except Exception as caught:
        error = caught
    pg.agree(error, "writing the checkpoint")  # and every rank's files are on disk

def _publish(root: str | os.PathLike, step: int, tmp: str, final: str, keep_last: int | None) -> None:
    """Rank 0: give the checkpoint its final name, point `latest` at it, delete the oldest."""
    replaced = f"{final}.old.tmp"  # saving a step again, after resuming from an earlier one
    if os.path.isdir(final):
        os.replace(final, replaced)  # a crash from here on leaves only a `.tmp` behind
    os.replace(tmp, final)
    shutil.rmtree(replaced, ignore_errors=True)
    write_text(os.path.join(root, "latest"), f"{step}\n", atomic=True)
    if keep_last:
        # Only reached once this checkpoint is complete, finite and checksummed: a refused or failed
        # save returns before, so the newest checkpoint that verified is never deleted.
        older = [s for s in complete_steps(root) if s != step]
        for old in older[: max(0, len(older) - (keep_last - 1))]:
            shutil.rmtree(checkpoint_dir(root, old))
    logger.info("Saved checkpoint %s", final)

def _out_of_space(error: BaseException, free_now: int) -> bool:
    """Whether a failed save is the disk's fault: ENOSPC anywhere in the error (DCP's
    CheckpointException carries each rank's failure as text), or a file system left (nearly) full."""
    text = "".join(traceback.format_exception(error))
    return os.strerror(errno.ENOSPC) in text or f"[Errno {errno.ENOSPC}]" in text or free_now < _NEARLY_FULL_BYTES

# ---------------------------------------------------------------- helpers

def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor

def _free_bytes(root: str | os.PathLike) -> int:
    path = Path(root)
    while not path.exists() and path != path.parent:  # the root itself may not exist yet
        path = path.parent
    return shutil.disk_usage(path).free

def _mount_point(root: str | os.PathLike) -> str:
    path = Path(os.path.realpath(root))
    while not path.exists() or (not os.path.ismount(path) and path != path.parent):
        path = path.parent
    return str(path)

def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 1e3:.1f} kB"

@contextmanager
def single_process_quiet():
    # DCP warns on every call without a process group, even when told so with no_dist=True.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield

def _rng_state() -> dict[str, Any]:
    # numpy's state as a tensor, so that the file loads with weights_only=True.
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state = {"python": random.getstate(), "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss,
                                                    cached_gaussian), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device: one GPU per rank
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached_gaussian))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])

def _save_file(obj: Any, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
