"""Fetch the published Search-R1 retrieval assets from the Hugging Face hub and finish them locally.

    corpus   wiki-18.jsonl.gz         --gunzip-->  wiki-18.jsonl
    e5_flat  part_aa, part_ab         --concat-->  e5_Flat.index
    e5_hnsw  part_* (listed)          --concat-->  e5_HNSW64.index
    bm25     bm25/* (listed)          a Lucene index folder, used as downloaded

Files come through a `Source`: `HubSource` downloads them, `LocalSource` copies them from a mirror
laid out as `<root>/<repo_id>/<filename>` (what `hf download <repo> --repo-type dataset
--local-dir <root>/<repo>` produces), which is also how the tests run everything but the network.

Resuming. `hf_hub_download` resumes interrupted downloads itself. The local steps write
`<output>.tmp`, fsync it, check it, and only then rename it into place, so an output file is never
half-written; a `.tmp` left by an interrupted run is discarded and rewritten. When an asset is
finished we write `<output>.done`, a small JSON record of its size (and row count), and later runs
skip the asset while the output still has that size. We use a marker rather than only comparing
with the parts' sizes because the parts are deleted after a successful step (unless `--keep-parts`),
and the skip must not need them, or the network, to decide. An output without a marker (say from
a manual `cat part_* > e5_Flat.index`) is accepted when its size equals the sum of the parts.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import gzip
import json
import logging
import os
import shutil
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum
from fnmatch import fnmatch
from pathlib import Path

from huggingface_hub import HfApi, hf_hub_download
from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError
from tqdm import tqdm

log = logging.getLogger(__name__)

CHUNK_BYTES = 16 << 20
PARTS_DIR = "parts"          # downloads waiting to be finished: <save-path>/parts/<asset>/


class Step(str, Enum):
    GUNZIP = "gunzip"        # one .gz file -> the output file
    CONCAT = "concat"        # parts, in order -> the output file
    TREE = "tree"            # the files are the output (a folder), nothing to finish


@dataclass(frozen=True)
class Asset:
    name: str                # what --assets takes
    repo_id: str             # a dataset repo on the hub
    step: Step
    output: str              # file or folder under --save-path
    files: tuple[str, ...] = ()   # exact files, in order; empty = list the repo and keep `pattern`
    pattern: str = ""        # fnmatch pattern; matches are sorted, which is the order `split` names parts


# Repo ids and file names of the published assets. If the hub layout changes, correct it here.
ASSETS = {a.name: a for a in (
    Asset("corpus", "PeterJinGo/wiki-18-corpus", Step.GUNZIP, "wiki-18.jsonl",
          files=("wiki-18.jsonl.gz",)),
    Asset("e5_flat", "PeterJinGo/wiki-18-e5-index", Step.CONCAT, "e5_Flat.index",
          files=("part_aa", "part_ab")),
    Asset("e5_hnsw", "PeterJinGo/wiki-18-e5-index-HNSW64", Step.CONCAT, "e5_HNSW64.index",
          pattern="part_*"),
    Asset("bm25", "PeterJinGo/wiki-18-bm25-index", Step.TREE, "bm25", pattern="bm25/*"),
)}
DEFAULT_ASSETS = ("corpus", "e5_flat")   # what the default e5 retrieval server needs


class DownloadError(RuntimeError):
    """A problem the user has to act on; the message says what to do."""


# ---------------------------------------------------------------------------------------------
# Sources


class Source(ABC):
    @abstractmethod
    def list_files(self, repo_id: str) -> list[str]:
        """Every file of the dataset repo, as paths relative to its root."""

    @abstractmethod
    def fetch(self, repo_id: str, filename: str, dest_dir: Path) -> Path:
        """Make `dest_dir/filename` a complete copy of the repo's file and return its path."""


class HubSource(Source):
    def list_files(self, repo_id: str) -> list[str]:
        try:
            return HfApi().list_repo_files(repo_id, repo_type="dataset")
        except RepositoryNotFoundError as e:
            raise DownloadError(_not_on_hub(repo_id, "", e)) from e

    def fetch(self, repo_id: str, filename: str, dest_dir: Path) -> Path:
        try:
            return Path(hf_hub_download(repo_id, filename, repo_type="dataset", local_dir=dest_dir))
        except LocalEntryNotFoundError:
            raise      # offline and not downloaded yet: the hub's own message says so
        except (EntryNotFoundError, RepositoryNotFoundError) as e:
            raise DownloadError(_not_on_hub(repo_id, filename, e)) from e


def _not_on_hub(repo_id: str, filename: str, e: Exception) -> str:
    what = f"{filename} in dataset repo {repo_id}" if filename else f"dataset repo {repo_id}"
    return (f"{what} was not found on the hub ({type(e).__name__}). If the repo is private, log in "
            f"with `hf auth login`; if it moved, correct ASSETS in {__name__}.")


class LocalSource(Source):
    """A local mirror laid out as `root/<repo_id>/<filename>` (air-gapped machines, tests)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def list_files(self, repo_id: str) -> list[str]:
        repo = self.root / repo_id
        if not repo.is_dir():
            raise DownloadError(f"{repo} does not exist: --source-dir must hold one folder per repo id, "
                                f"e.g. {self.root / repo_id}/<files>.")
        return sorted(p.relative_to(repo).as_posix() for p in repo.rglob("*") if p.is_file())

    def fetch(self, repo_id: str, filename: str, dest_dir: Path) -> Path:
        src = self.root / repo_id / filename
        if not src.is_file():
            raise DownloadError(f"{src} is missing from the mirror given by --source-dir: copy "
                                f"{filename} of dataset repo {repo_id} there, or drop --source-dir "
                                "to download from the hub.")
        dest = dest_dir / filename
        if dest.is_file() and dest.stat().st_size == src.stat().st_size:
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = _tmp_path(dest)
        shutil.copyfile(src, tmp)
        os.replace(tmp, dest)
        return dest


# ---------------------------------------------------------------------------------------------
# Local steps


def _tmp_path(out: Path) -> Path:
    return out.with_name(out.name + ".tmp")


def check_free_space(directory: Path, needed: int, purpose: str) -> None:
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise DownloadError(
            f"Not enough free disk space in {directory} {purpose}: need {needed:,} bytes "
            f"({_human(needed)}), {free:,} bytes ({_human(free)}) are free. Free up space or choose "
            "a --save-path on a larger disk.")


def concatenate(parts: list[Path], out: Path) -> int:
    """Write the parts, in order, to `out` via `out.tmp`; return the size written."""
    expected = sum(p.stat().st_size for p in parts)
    tmp = _tmp_path(out)
    tmp.unlink(missing_ok=True)     # left by an interrupted run; removing it first also frees its space
    check_free_space(out.parent, expected, f"to write {out.name}")
    with open(tmp, "wb") as dst, tqdm(total=expected, unit="B", unit_scale=True, desc=out.name) as bar:
        for part in parts:
            with open(part, "rb") as src:
                while chunk := src.read(CHUNK_BYTES):
                    dst.write(chunk)
                    bar.update(len(chunk))
        dst.flush()
        os.fsync(dst.fileno())      # the .done marker trusts the size, so the bytes must be on disk
    written = tmp.stat().st_size
    if written != expected:
        raise DownloadError(f"{tmp} has {written:,} bytes but its parts add up to {expected:,}: "
                            "the disk may be full or a part changed while being read. Run again.")
    os.replace(tmp, out)
    return written


def gunzip(src: Path, out: Path) -> tuple[int, int]:
    """Decompress `src` to `out` via `out.tmp`; return (bytes, lines).

    Reading to the end is also the integrity check: gzip verifies the CRC and length in the trailer
    and raises on truncated or damaged data.
    """
    tmp = _tmp_path(out)
    tmp.unlink(missing_ok=True)
    size = rows = 0
    last = b"\n"
    try:
        with open(src, "rb") as raw, gzip.GzipFile(fileobj=raw) as gz, open(tmp, "wb") as dst, \
                tqdm(total=src.stat().st_size, unit="B", unit_scale=True, desc=f"gunzip {src.name}") as bar:
            while chunk := gz.read(CHUNK_BYTES):
                dst.write(chunk)
                size += len(chunk)
                rows += chunk.count(b"\n")
                last = chunk[-1:]
                bar.update(raw.tell() - bar.n)     # progress in compressed bytes: their total is known
            dst.flush()
            os.fsync(dst.fileno())
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        tmp.unlink(missing_ok=True)
        raise DownloadError(f"{src} is not a valid gzip file ({e}): the download is corrupt. "
                            "Delete it and run again to fetch it afresh.") from e
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        raise DownloadError(f"The disk filled up while writing {tmp} ({size:,} bytes written so far). "
                            "Free up space or choose a --save-path on a larger disk, then run again.") from e
    if last != b"\n":
        rows += 1                   # last row without a trailing newline
    os.replace(tmp, out)
    return size, rows


# ---------------------------------------------------------------------------------------------
# Assets


@dataclass
class Result:
    asset: str
    path: Path
    bytes: int
    rows: int | None = None
    skipped: bool = False


def _marker_path(out: Path) -> Path:
    return out.with_name(out.name + ".done")


def _size_on_disk(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size


def _read_marker(out: Path) -> dict | None:
    """The finished asset's record, or None when it must be (re)done."""
    marker = _marker_path(out)
    try:
        record = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    if out.exists() and _size_on_disk(out) == record.get("bytes"):
        return record
    log.warning("%s no longer matches %s: doing it again", out, marker.name)
    return None


def _write_marker(out: Path, record: dict) -> None:
    tmp = _tmp_path(_marker_path(out))
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, _marker_path(out))


def files_of(asset: Asset, source: Source) -> list[str]:
    if asset.files:
        return list(asset.files)
    available = source.list_files(asset.repo_id)
    chosen = sorted(f for f in available if fnmatch(f, asset.pattern))
    if not chosen:
        raise DownloadError(f"No file of dataset repo {asset.repo_id} matches {asset.pattern!r} "
                            f"(it has: {', '.join(available) or 'nothing'}). Correct ASSETS in {__name__}.")
    return chosen


def fetch_asset(asset: Asset, source: Source, save_path: Path, keep_parts: bool = False) -> Result:
    out = save_path / asset.output
    record = _read_marker(out)
    if record is not None:
        log.info("%s: %s is already complete, skipping", asset.name, out)
        return Result(asset.name, out, record["bytes"], record.get("rows"), skipped=True)

    log.info("%s: fetching from %s", asset.name, asset.repo_id)
    if asset.step is Step.TREE:
        paths = [source.fetch(asset.repo_id, f, save_path) for f in files_of(asset, source)]
        record = {"bytes": _size_on_disk(out), "files": len(paths)}
        _write_marker(out, record)
        return Result(asset.name, out, record["bytes"])

    parts_dir = save_path / PARTS_DIR / asset.name
    parts = [source.fetch(asset.repo_id, f, parts_dir) for f in files_of(asset, source)]
    if asset.step is Step.CONCAT:
        expected = sum(p.stat().st_size for p in parts)
        if out.is_file() and out.stat().st_size == expected:
            log.info("%s: %s already has the parts' total size, keeping it", asset.name, out)
        else:
            concatenate(parts, out)
        record = {"bytes": expected}
    else:
        size, rows = gunzip(parts[0], out)
        record = {"bytes": size, "rows": rows}
    _write_marker(out, record)
    if not keep_parts:
        shutil.rmtree(parts_dir)
        with contextlib.suppress(OSError):      # only succeeds once no other asset has parts left
            parts_dir.parent.rmdir()
    return Result(asset.name, out, record["bytes"], record.get("rows"))


def download(names: list[str], save_path: str | os.PathLike, source: Source,
             keep_parts: bool = False) -> list[Result]:
    save_path = Path(save_path)
    save_path.mkdir(parents=True, exist_ok=True)
    return [fetch_asset(ASSETS[name], source, save_path, keep_parts) for name in dict.fromkeys(names)]


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n:.1f} TiB"


def report(results: list[Result]) -> str:
    lines = [f"{'asset':<8} {'status':<16} {'size':>10} {'rows':>12}  path"]
    for r in results:
        status = "already complete" if r.skipped else "done"
        rows = f"{r.rows:,}" if r.rows is not None else "-"
        lines.append(f"{r.asset:<8} {status:<16} {_human(r.bytes):>10} {rows:>12}  {r.path}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Download the Search-R1 wiki-18 corpus and indexes.")
    p.add_argument("--save-path", required=True, help="folder for the finished files")
    p.add_argument("--assets", default=",".join(DEFAULT_ASSETS),
                   help=f"comma-separated, from: {', '.join(ASSETS)} (default: %(default)s)")
    p.add_argument("--source-dir", default=None,
                   help="read from a local mirror laid out as DIR/<repo_id>/<file> instead of the hub")
    p.add_argument("--keep-parts", action="store_true",
                   help="keep the downloaded parts and .gz after they are finished (default: delete)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[Result]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    names = [n.strip() for n in args.assets.split(",") if n.strip()]
    unknown = [n for n in names if n not in ASSETS]
    if unknown or not names:
        raise SystemExit(f"error: unknown --assets {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(ASSETS)}.")
    source = LocalSource(args.source_dir) if args.source_dir else HubSource()
    try:
        results = download(names, args.save_path, source, keep_parts=args.keep_parts)
    except DownloadError as e:
        raise SystemExit(f"error: {e}") from e
    log.info("\n%s", report(results))
    return results
