"""What a checkpoint holds and whether it is intact: its manifest (size and sha256 of every file,
written last, so that a directory with one is complete), verification against it, and
CheckpointCorrupt, which names the first file that differs. Every reader verifies first: resume,
rollback and the export (hence evaluation)."""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from verl.utils import process_group as pg

MANIFEST = "manifest.json"
# Every checkpoint this code writes has a manifest; only those written before manifests existed may
# lack one, and loading those is the user's explicit choice.
UNVERIFIED_HINT = ("a checkpoint written before checksums existed loads unchecked with "
                    "trainer.allow_unverified_checkpoint=true (--allow-unverified-checkpoint for export "
                    "and evaluation)")

class CheckpointCorrupt(RuntimeError):
    """A file of a checkpoint is missing or differs from what its manifest recorded when it was saved.
    Plain constructor arguments, so that it pickles through Ray and all_gather_object."""

    def __init__(self, checkpoint: str, file: str, reason: str):
        super().__init__(checkpoint, file, reason)
        self.checkpoint, self.file, self.reason = checkpoint, file, reason

    def __str__(self) -> str:
        return f"checkpoint {self.checkpoint} is corrupted: {self.file} {self.reason}"

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
        listed = read_manifest(ckpt)
        if listed is None and not allow_unverified:
            raise CheckpointCorrupt(str(ckpt), os.path.join(ckpt, MANIFEST), f"is missing (a partial copy, or a "
                                    f"save cut short); {UNVERIFIED_HINT}")
        if listed is not None:
            names = sorted(listed) if under is None else sorted(r for r in listed if Path(under) in Path(r).parents)
            if not names:
                raise CheckpointCorrupt(str(ckpt), os.path.join(ckpt, under), f"has no file listed in {MANIFEST}")
            for rel in names[pg.rank()::pg.world_size()]:
                _check_file(ckpt, rel, listed[rel])
    except CheckpointCorrupt as caught:
        error = caught
    failures = [e for e in pg.gather_objects(error) if e is not None]
    if failures:
        raise failures[0]
    if listed is None:
        warnings.warn(f"Checkpoint {ckpt} has no {MANIFEST}: loading it without verification "
                      f"(trainer.allow_unverified_checkpoint)")
        return False
    return True

@contextmanager
def reading(ckpt: str, path: str, verified: bool) -> Iterator[None]:
    """Reading `path` of a checkpoint: where it has no manifest (loaded unverified) and the read
    fails, a damaged file cannot be told from a mismatched model, so the failure is CheckpointCorrupt
    naming the file. A verified file that fails to load is a mismatch: that error goes on as it is."""
    try:
        yield
    # DCP's CheckpointException derives from BaseException, not Exception: name it, or it escapes.
    except (Exception, CheckpointException) as error:
        if verified:
            raise
        raise CheckpointCorrupt(ckpt, path, f"could not be loaded ({last_line(error)}); the checkpoint has no "
                                            f"{MANIFEST} to check its files against, so a damaged file is "
                                            f"likely") from error

def write_manifest(tmp: str, step: int) -> None:
    """Hash every file of the finished directory, each rank a share, and write the manifest last and
    atomically: a directory with a manifest is complete."""
    files, error = [], None
    if pg.rank() == 0:
        try:
            files = _files_of(tmp)
        except OSError as caught:
            error = caught
    pg.agree(error, "listing the checkpoint's files")
    files = pg.gather_objects(files)[0]
    hashed = {}
    try:
        for rel in files[pg.rank()::pg.world_size()]:
            path = os.path.join(tmp, rel)
            hashed[rel] = {"bytes": os.path.getsize(path), "sha256": _sha256(path)}
    except OSError as caught:
        error = caught
    parts = pg.gather_objects(hashed)
    pg.agree(error, "checksumming the checkpoint (its directory must be on a file system every rank shares)")
    error = None
    if pg.rank() == 0:
        manifest = {"step": step, "files": {rel: entry for part in parts for rel, entry in sorted(part.items())}}
        try:
            write_text(os.path.join(tmp, MANIFEST), json.dumps(manifest, indent=1, sort_keys=True), atomic=True)
        except OSError as caught:
            error = caught
    pg.agree(error, f"writing {MANIFEST}")

def read_manifest(ckpt: str | os.PathLike) -> dict[str, dict] | None:
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

def last_line(error: BaseException) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(error).__name__

def write_text(path: str | os.PathLike, text: str, atomic: bool = False) -> None:
    target = f"{path}.writing" if atomic else path
    with open(target, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    if atomic:
        os.replace(target, path)
