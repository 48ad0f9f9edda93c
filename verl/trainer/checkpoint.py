"""Sharded, resumable training checkpoints, and a streaming export to a Hugging Face model directory.

Every rank writes only its own shards (torch.distributed.checkpoint, "DCP"), so saving never gathers
a whole model on one device: the original Search-R1 did, and crashed on large models. The HF export
reads those shards back a few tensors at a time, so it needs about one safetensors shard of memory
and no process group or GPU.

Layout of one checkpoint (all ranks write into the same directory: a shared filesystem on multi-node):

    <root>/global_step_<N>/
        <name>/model/            DCP directory of the model's (sharded) state dict, e.g. name = "actor"
        <name>/optimizer/        DCP directory of its optimizer state (absent if saved without one)
        <name>/scheduler.pt      its LR scheduler state (absent if saved without one)
        trainer_state.json       {"step", "world_size", "models", "trainer": what the trainer passed}
        rng/rank_<r>.pt          python, numpy, torch CPU (and CUDA) RNG states of rank r
        manifest.json            size and sha256 of every other file, written last
    <root>/latest                text file with the step of the newest complete checkpoint

A checkpoint is written into `global_step_<N>.tmp` and renamed only when every rank has finished, so
a crash never leaves a directory that looks complete. Model and optimizer state are resharded by DCP
when resuming at another world size; RNG states are then skipped with a warning.

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

Export: `python -m verl.trainer.checkpoint export --checkpoint DIR --model actor
--config-source ORIGINAL_MODEL_DIR --out OUT [--dtype bfloat16] [--allow-unverified-checkpoint]`.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
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
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict, get_state_dict, set_model_state_dict, set_state_dict)
from torch.distributed.tensor import DTensor

logger = logging.getLogger(__name__)

# name -> (model, optimizer or None, LR scheduler or None)
ModelParts = tuple[torch.nn.Module, torch.optim.Optimizer | None, torch.optim.lr_scheduler.LRScheduler | None]

_STEP_DIR = re.compile(r"^global_step_(\d+)$")
MANIFEST = "manifest.json"
# Every checkpoint this code writes has a manifest; only those written before manifests existed may
# lack one, and loading those is the user's explicit choice.
_UNVERIFIED_HINT = ("a checkpoint written before checksums existed loads unchecked with "
                    "trainer.allow_unverified_checkpoint=true (--allow-unverified-checkpoint for export "
                    "and evaluation)")
# Free space below which a failed write is put down to a full disk even when the error does not say
# so: torch's zip writer reports ENOSPC as "unexpected pos N vs M".
_NEARLY_FULL_BYTES = 64 << 20
# Files of the original model directory that hold weights: everything else (config, tokenizer, chat
# template, generation config, custom code) is copied into the export.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".index.json")
# Wrapper segments that can appear in parameter names (torch.compile, FSDP1, activation
# checkpointing). get_state_dict already removes them; we strip them again in case a checkpoint was
# written from a state dict taken another way.
_WRAPPER_SEGMENTS = ("_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


class CheckpointCorrupt(RuntimeError):
    """A file of a checkpoint is missing or differs from what its manifest recorded when it was saved.
    Plain constructor arguments, so that it pickles through Ray and all_gather_object."""

    def __init__(self, checkpoint: str, file: str, reason: str):
        super().__init__(checkpoint, file, reason)
        self.checkpoint, self.file, self.reason = checkpoint, file, reason

    def __str__(self) -> str:
        return f"checkpoint {self.checkpoint} is corrupted: {self.file} {self.reason}"


def checkpoint_dir(root: str | os.PathLike, step: int) -> str:
    return os.path.join(root, f"global_step_{step}")


# ---------------------------------------------------------------- save / load

def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    models: Mapping[str, ModelParts],
    trainer_state: dict[str, Any],
    keep_last: int | None = None,
) -> str:
    """Save every model of `models` (e.g. {"actor": (model, optim, sched), "critic": (...)}) with the
    trainer state (data-loader position and anything else JSON-able) and this rank's RNG states.

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
    rank, world_size = _rank(), _world_size()
    # Before any collective: a state that fails to serialise must fail on every rank, not hang them.
    try:
        state_json = json.dumps(
            {"step": step, "world_size": world_size, "models": sorted(models), "trainer": trainer_state}, indent=2)
    except TypeError as error:
        raise TypeError(f"trainer_state must be JSON-serialisable (plain numbers, strings, lists, dicts): {error}")
    rng_state = _rng_state()  # first, so that nothing done while saving changes what is saved

    with _single_process_quiet():
        state_dicts = {name: (get_model_state_dict(model), None) if optimizer is None
                       else get_state_dict(model, optimizer)
                       for name, (model, optimizer, _) in models.items()}
    _refuse_non_finite(state_dicts, root, step)

    final = checkpoint_dir(root, step)
    tmp = final + ".tmp"
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        for leftover in Path(root).glob("global_step_*.tmp"):  # from a crash; only one save runs at a time
            shutil.rmtree(leftover)
    _barrier()
    need, free = _check_free_space(root, state_dicts)

    try:
        _write_files(tmp, state_dicts, models, rng_state, state_json)
        _write_manifest(tmp, step)
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
                                        f"{step} ({_last_line(error)}). {_NO_SPACE_ADVICE}") from error
        raise RuntimeError(f"Saving checkpoint step {step} under {root} failed: {error}. Its partial directory "
                           f"was removed; older checkpoints are untouched.") from error

    error = None
    if rank == 0:
        try:
            _publish(root, step, tmp, final, keep_last)
        except Exception as caught:
            error = caught
    _agree(error, "publishing the checkpoint")  # nobody goes on (or loads) before it has its final name
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


def verify_checkpoint(ckpt: str | os.PathLike, allow_unverified: bool = False, under: str | None = None) -> bool:
    """Check every file of the checkpoint directory `ckpt` against the size and sha256 its manifest
    recorded when it was saved; raise CheckpointCorrupt naming the first file that differs or is
    missing. `under`: check only the files below this relative folder (e.g. "actor/model", what an
    export reads). A checkpoint without a manifest is corrupt too (a partial copy looks like that),
    unless `allow_unverified` (trainer.allow_unverified_checkpoint), meant for checkpoints written
    before manifests existed: then it returns False with a warning. With a process group, call on
    every rank: each checks a share of the files."""
    listed, error = None, None
    try:
        listed = _read_manifest(ckpt)
        if listed is None and not allow_unverified:
            raise CheckpointCorrupt(str(ckpt), os.path.join(ckpt, MANIFEST), f"is missing (a partial copy, or a "
                                    f"save cut short); {_UNVERIFIED_HINT}")
        if listed is not None:
            names = sorted(listed) if under is None else sorted(r for r in listed if Path(under) in Path(r).parents)
            if not names:
                raise CheckpointCorrupt(str(ckpt), os.path.join(ckpt, under), f"has no file listed in {MANIFEST}")
            for rel in names[_rank()::_world_size()]:
                _check_file(ckpt, rel, listed[rel])
    except CheckpointCorrupt as caught:
        error = caught
    failures = [e for e in _gather(error) if e is not None]
    if failures:
        raise failures[0]
    if listed is None:
        warnings.warn(f"Checkpoint {ckpt} has no {MANIFEST}: loading it without verification "
                      f"(trainer.allow_unverified_checkpoint)")
        return False
    return True


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
    with _reading(ckpt, state_file, verified):
        saved = json.loads(Path(state_file).read_text())
    saved_world_size, world_size = saved["world_size"], _world_size()

    for name, (model, optimizer, scheduler) in models.items():
        if name not in saved["models"]:
            raise ValueError(f"Checkpoint {ckpt} has no model {name!r}; it has {saved['models']}")
        model_dir, optim_dir = os.path.join(ckpt, name, "model"), os.path.join(ckpt, name, "optimizer")
        if optimizer is not None and not os.path.isdir(optim_dir):
            raise FileNotFoundError(f"{name!r} was saved without optimizer state ({optim_dir} is missing): "
                                    f"pass None as its optimizer to load the weights only")
        try:
            with _single_process_quiet():
                if optimizer is None:
                    model_sd = get_model_state_dict(model)
                    with _reading(ckpt, model_dir, verified):
                        dcp.load(model_sd, checkpoint_id=model_dir, no_dist=not _distributed())
                    set_model_state_dict(model, model_sd)
                else:
                    # The state dicts of the live objects say which shard this rank holds; DCP
                    # fills them in place, reading (and resharding) only what is needed.
                    model_sd, optim_sd = get_state_dict(model, optimizer)
                    with _reading(ckpt, model_dir, verified):
                        dcp.load(model_sd, checkpoint_id=model_dir, no_dist=not _distributed())
                    with _reading(ckpt, optim_dir, verified):
                        dcp.load(optim_sd, checkpoint_id=optim_dir, no_dist=not _distributed())
                    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        except CheckpointCorrupt:
            raise
        # DCP's CheckpointException derives from BaseException, not Exception: name it, or it escapes.
        except (Exception, CheckpointException) as error:
            raise RuntimeError(
                f"Could not load {name!r} from {ckpt} (saved at world size {saved_world_size}, now {world_size}): "
                f"{error}. The model (and optimizer) must be built exactly as when saving.") from error
        if scheduler is not None:
            sched_file = os.path.join(ckpt, name, "scheduler.pt")
            if not os.path.isfile(sched_file):
                raise FileNotFoundError(f"{name!r} was saved without a scheduler ({sched_file} is missing)")
            with _reading(ckpt, sched_file, verified):
                scheduler.load_state_dict(torch.load(sched_file, weights_only=True))

    if saved_world_size == world_size:
        rng_file = os.path.join(ckpt, "rng", f"rank_{_rank()}.pt")
        with _reading(ckpt, rng_file, verified):
            _set_rng_state(torch.load(rng_file, weights_only=True))
    else:
        warnings.warn(f"Checkpoint {ckpt} was saved at world size {saved_world_size}, resuming at {world_size}: "
                      f"model and optimizer were resharded, but RNG states were not restored, so sampling "
                      f"and dropout will not repeat the original run exactly.")
    logger.info("Loaded checkpoint %s", ckpt)
    return saved["trainer"]


@contextmanager
def _reading(ckpt: str, path: str, verified: bool) -> Iterator[None]:
    """Reading `path` of a checkpoint: where it has no manifest (loaded unverified) and the read
    fails, a damaged file cannot be told from a mismatched model, so the failure is CheckpointCorrupt
    naming the file. A verified file that fails to load is a mismatch: that error goes on as it is."""
    try:
        yield
    # DCP's CheckpointException derives from BaseException, not Exception: name it, or it escapes.
    except (Exception, CheckpointException) as error:
        if verified:
            raise
        raise CheckpointCorrupt(ckpt, path, f"could not be loaded ({_last_line(error)}); the checkpoint has no "
                                            f"{MANIFEST} to check its files against, so a damaged file is "
                                            f"likely") from error


# ---------------------------------------------------------------- the parts of a save

def _refuse_non_finite(state_dicts: dict, root: str | os.PathLike, step: int) -> None:
    """A nan or inf saved would be resumed from, and rotation would delete the good checkpoints
    behind it. Every rank checks its own shards; all raise if any rank found one."""
    bad = sorted({name for names in _gather(_non_finite_tensors(state_dicts)) for name in names})
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
    reports = _gather((local_bytes, _free_bytes(root), _last_checkpoint_bytes(root) if _rank() == 0 else None))
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
        listed = _read_manifest(ckpt)
    except CheckpointCorrupt:
        listed = None
    if listed is not None:
        return sum(entry["bytes"] for entry in listed.values())
    return sum(p.stat().st_size for p in Path(ckpt).rglob("*") if p.is_file())


def _write_files(tmp: str, state_dicts: dict, models: Mapping[str, ModelParts], rng_state: dict,
                 state_json: str) -> None:
    rank = _rank()
    with _single_process_quiet():
        for name, (model_sd, optim_sd) in state_dicts.items():
            # Collective: when a rank's write fails, DCP raises on every rank.
            dcp.save(model_sd, checkpoint_id=os.path.join(tmp, name, "model"), no_dist=not _distributed())
            if optim_sd is not None:
                dcp.save(optim_sd, checkpoint_id=os.path.join(tmp, name, "optimizer"), no_dist=not _distributed())
    error = None
    try:
        for name, (_, _, scheduler) in models.items():
            if scheduler is not None and rank == 0:
                _save_file(scheduler.state_dict(), os.path.join(tmp, name, "scheduler.pt"))
        _save_file(rng_state, os.path.join(tmp, "rng", f"rank_{rank}.pt"))
        if rank == 0:
            _write_text(os.path.join(tmp, "trainer_state.json"), state_json)
    except Exception as caught:
        error = caught
    _agree(error, "writing the checkpoint")  # and every rank's files are on disk


def _write_manifest(tmp: str, step: int) -> None:
    """Hash every file of the finished directory, each rank a share, and write the manifest last and
    atomically: a directory with a manifest is complete."""
    files, error = [], None
    if _rank() == 0:
        try:
            files = _files_of(tmp)
        except OSError as caught:
            error = caught
    _agree(error, "listing the checkpoint's files")
    files = _gather(files)[0]
    hashed = {}
    try:
        for rel in files[_rank()::_world_size()]:
            path = os.path.join(tmp, rel)
            hashed[rel] = {"bytes": os.path.getsize(path), "sha256": _sha256(path)}
    except OSError as caught:
        error = caught
    parts = _gather(hashed)
    _agree(error, "checksumming the checkpoint (its directory must be on a file system every rank shares)")
    error = None
    if _rank() == 0:
        manifest = {"step": step, "files": {rel: entry for part in parts for rel, entry in sorted(part.items())}}
        try:
            _write_text(os.path.join(tmp, MANIFEST), json.dumps(manifest, indent=1, sort_keys=True), atomic=True)
        except OSError as caught:
            error = caught
    _agree(error, f"writing {MANIFEST}")


def _publish(root: str | os.PathLike, step: int, tmp: str, final: str, keep_last: int | None) -> None:
    """Rank 0: give the checkpoint its final name, point `latest` at it, delete the oldest."""
    replaced = f"{final}.old.tmp"  # saving a step again, after resuming from an earlier one
    if os.path.isdir(final):
        os.replace(final, replaced)  # a crash from here on leaves only a `.tmp` behind
    os.replace(tmp, final)
    shutil.rmtree(replaced, ignore_errors=True)
    _write_text(os.path.join(root, "latest"), f"{step}\n", atomic=True)
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


# ---------------------------------------------------------------- manifests

def _read_manifest(ckpt: str | os.PathLike) -> dict[str, dict] | None:
    """{relative path: {"bytes", "sha256"}}, or None when the checkpoint has no manifest."""
    path = os.path.join(ckpt, MANIFEST)
    try:
        return json.loads(Path(path).read_text())["files"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointCorrupt(str(ckpt), path, f"cannot be read ({error})") from None


def _check_file(ckpt: str | os.PathLike, rel: str, entry: dict) -> None:
    path = os.path.join(ckpt, rel)
    try:
        size = os.path.getsize(path)
        if size != entry["bytes"]:
            raise CheckpointCorrupt(str(ckpt), path, f"has {size} bytes where {MANIFEST} recorded {entry['bytes']} "
                                                     f"(a partial write or copy)")
        if _sha256(path) != entry["sha256"]:
            raise CheckpointCorrupt(str(ckpt), path, f"does not match its sha256 checksum in {MANIFEST} (it changed "
                                                     f"on disk or in a copy after it was saved)")
    except FileNotFoundError:
        raise CheckpointCorrupt(str(ckpt), path, f"is missing (listed in {MANIFEST})") from None
    except OSError as error:
        raise CheckpointCorrupt(str(ckpt), path, f"cannot be read ({error})") from None


def _files_of(directory: str | os.PathLike) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in Path(directory).rglob("*")
                  if p.is_file() and p.name != MANIFEST)


def _sha256(path: str | os.PathLike) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# ---------------------------------------------------------------- export to Hugging Face

def export_hf(
    checkpoint_dir: str | os.PathLike,
    model_name: str,
    out_dir: str | os.PathLike,
    config_source: str | os.PathLike,
    max_shard_bytes: int = 2**31,
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
    allow_unverified: bool = False,
) -> str:
    """Write `model_name` of a checkpoint as a Hugging Face model directory, streaming from the DCP
    shards. `checkpoint_dir` is a `global_step_<N>` directory or a checkpoint root (newest step is
    used); `config_source` is the original model directory (config and tokenizer are copied from
    it); `dtype` casts floating-point weights (e.g. "bfloat16"), None keeps them as saved;
    `overwrite` replaces an existing `out_dir` (only once the new export is complete).
    The model's files are checked against the checkpoint's manifest first: a corrupted checkpoint,
    or one without a manifest unless `allow_unverified`, raises CheckpointCorrupt and nothing is
    written. Single process, no GPU; peak memory is about one shard of `max_shard_bytes`."""
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM

    ckpt = _resolve_checkpoint(checkpoint_dir)
    model_dir = os.path.join(ckpt, model_name, "model")
    if not os.path.isdir(model_dir):
        names = sorted(p.parent.name for p in Path(ckpt).glob("*/model"))
        raise FileNotFoundError(f"{ckpt} has no model {model_name!r}; it has {names}")
    verified = _verify_for_export(ckpt, model_name, allow_unverified)
    if not os.path.isfile(os.path.join(config_source, "config.json")):
        raise FileNotFoundError(f"{config_source} has no config.json: --config-source must be the local directory "
                                f"of the model training started from")
    out = Path(out_dir)
    if out.resolve() == Path(config_source).resolve():
        raise ValueError(f"The export would overwrite the original model {config_source}: choose another output")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty: choose a new output directory, delete it, "
                              f"or pass overwrite=True (--overwrite)")
    if isinstance(dtype, str):
        name, dtype = dtype, getattr(torch, dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"Unknown dtype {name!r}: use float32, bfloat16 or float16")

    with _reading(ckpt, os.path.join(model_dir, ".metadata"), verified):
        metadata = dcp.FileSystemReader(model_dir).read_metadata().state_dict_metadata
    saved = {_hf_name(key): (key, meta) for key, meta in metadata.items() if isinstance(meta, TensorStorageMetadata)}

    # The names HF writes: those of a model built from the config (on the meta device: no memory),
    # with tied weights once. get_state_dict saves a tied lm_head.weight separately; it is dropped.
    config = AutoConfig.from_pretrained(config_source)
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(config)
    tied = ({name for name, _ in reference.named_parameters(remove_duplicate=False)}
            - {name for name, _ in reference.named_parameters()})
    expected = set(reference.state_dict()) - tied
    missing = sorted(expected - set(saved))
    if missing:
        raise ValueError(f"Checkpoint {model_dir} lacks weights that {config.architectures} needs, "
                         f"e.g. {missing[:5]}: is --model {model_name!r} the model that started from {config_source}?")
    extra = sorted(set(saved) - expected - tied)
    if extra:
        logger.warning("Exporting %d weights that %s does not know, e.g. %s",
                       len(extra), config.architectures, extra[:5])
    names = [name for name in saved if name not in tied]  # checkpoint order: layer by layer

    def out_dtype(name):
        saved_dtype = saved[name][1].properties.dtype
        return dtype if dtype is not None and saved_dtype.is_floating_point else saved_dtype

    def nbytes(name):
        return saved[name][1].size.numel() * out_dtype(name).itemsize

    # Plan the shards from the metadata first: file names carry the shard count.
    shards, size = [[]], 0
    for name in names:
        if shards[-1] and size + nbytes(name) > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes(name)

    tmp = Path(f"{out}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weight_map = {}
    for i, shard in enumerate(tqdm(shards, desc="Exporting", unit="shard", disable=len(shards) == 1)):
        file_name = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        # DCP copies each stored chunk into these tensors, casting to their dtype on the way.
        tensors = {name: torch.empty(saved[name][1].size, dtype=out_dtype(name)) for name in shard}
        with _single_process_quiet(), _reading(ckpt, model_dir, verified):
            dcp.load({saved[name][0]: tensors[name] for name in shard}, checkpoint_id=model_dir, no_dist=True)
        save_file(tensors, tmp / file_name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))
        logger.info("Wrote %s (%d tensors)", file_name, len(shard))
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(nbytes(n) for n in names)}, "weight_map": weight_map}
        _write_text(tmp / "model.safetensors.index.json", json.dumps(index, indent=2))

    for source in Path(config_source).iterdir():
        if source.is_file() and not source.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(source, tmp / source.name)
    config_json = json.loads(Path(config_source, "config.json").read_text())
    float_dtypes = {out_dtype(n) for n in names if out_dtype(n).is_floating_point}
    if len(float_dtypes) == 1:  # from_pretrained(dtype="auto") reads it
        written = str(float_dtypes.pop()).removeprefix("torch.")
        config_json["dtype"] = written
        if "torch_dtype" in config_json:  # configs written by transformers < 4.56
            config_json["torch_dtype"] = written
    _write_text(tmp / "config.json", json.dumps(config_json, indent=2) + "\n")

    replaced = Path(f"{out}.old")
    shutil.rmtree(replaced, ignore_errors=True)  # left by a crash between the two renames
    if out.exists():
        os.replace(out, replaced)
    os.replace(tmp, out)
    shutil.rmtree(replaced, ignore_errors=True)
    logger.info("Exported %s of %s to %s (%d shards)", model_name, ckpt, out, len(shards))
    return str(out)


def _verify_for_export(ckpt: str, model_name: str, allow_unverified: bool) -> bool:
    """verify_checkpoint for the files an export reads (the model's, not its optimizer's); a failure
    says that nothing was written and which other steps there are."""
    try:
        return verify_checkpoint(ckpt, allow_unverified, under=os.path.join(model_name, "model"))
    except CheckpointCorrupt as error:
        root = os.path.dirname(os.path.abspath(ckpt))
        others = [s for s in complete_steps(root) if checkpoint_dir(root, s) != os.path.abspath(ckpt)]
        raise CheckpointCorrupt(error.checkpoint, error.file, f"{error.reason}. Nothing was exported"
                                + (f"; other checkpoints under {root}: steps {others}" if others else "")) from None


# ---------------------------------------------------------------- helpers

def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _world_size() -> int:
    return dist.get_world_size() if _distributed() else 1


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _gather(obj: Any) -> list[Any]:
    """`obj` of every rank, in rank order (a list of one without a process group)."""
    if not _distributed():
        return [obj]
    out = [None] * _world_size()
    dist.all_gather_object(out, obj)
    return out


def _agree(error: BaseException | None, what: str) -> None:
    """Raise on every rank if any rank failed `what` (and wait for all ranks otherwise): a rank
    that raised alone would leave the others waiting forever in the next collective."""
    failures = [f for f in _gather(None if error is None else f"rank {_rank()}: {error!r}") if f]
    if error is not None:
        raise error
    if failures:
        raise RuntimeError(f"{what} failed on {failures[0]}")


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


def _last_line(error: BaseException) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(error).__name__


@contextmanager
def _single_process_quiet():
    # DCP warns on every call without a process group, even when told so with no_dist=True.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _resolve_checkpoint(path: str | os.PathLike) -> str:
    if os.path.isfile(os.path.join(path, "trainer_state.json")):
        return str(path)
    step = latest_step(path)
    if step is None:
        raise FileNotFoundError(f"{path} is neither a checkpoint (global_step_<N>/) nor a directory of checkpoints")
    return checkpoint_dir(path, step)


def _hf_name(key: str) -> str:
    for segment in _WRAPPER_SEGMENTS:
        key = key.replace(segment, "")
    return key


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


def _write_text(path: str | os.PathLike, text: str, atomic: bool = False) -> None:
    target = f"{path}.writing" if atomic else path
    with open(target, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    if atomic:
        os.replace(target, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m verl.trainer.checkpoint", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="write one model of a checkpoint as a Hugging Face model directory")
    export.add_argument("--checkpoint", required=True,
                        help="a global_step_<N> directory, or the checkpoint root (its newest step)")
    export.add_argument("--model", default="actor", help="which model of the checkpoint (default: actor)")
    export.add_argument("--config-source", required=True, help="the original model directory (config, tokenizer)")
    export.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    export.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="cast floating-point weights (default: keep the saved dtype)")
    export.add_argument("--max-shard-bytes", type=int, default=2**31, help="size limit of one safetensors file")
    export.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    export.add_argument("--allow-unverified-checkpoint", action="store_true",
                        help=f"export a checkpoint that has no {MANIFEST} (written before checksums existed) "
                             f"without checking its files; by default such a checkpoint is refused as corrupt")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        export_hf(args.checkpoint, args.model, args.out, args.config_source, args.max_shard_bytes, args.dtype,
                  args.overwrite, args.allow_unverified_checkpoint)
    except (FileNotFoundError, FileExistsError, ValueError, CheckpointCorrupt) as error:  # says what to do
        parser.exit(1, f"error: {error}\n")


if __name__ == "__main__":
    main()
