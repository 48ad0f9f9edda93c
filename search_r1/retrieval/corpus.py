"""Passage corpus: JSONL `{"id", "contents", …}` converted once to a memory-mapped Arrow file.

The published wiki-18 corpus has 21M rows (~14 GB of JSONL). Holding it as Python dicts costs
tens of GB and minutes to load; an uncompressed Arrow IPC file is mapped instead, so opening it
takes milliseconds, pages come from the OS cache, and row `i` is fetched in O(1) from the offsets.

A row's other fields (ASearcher's and RLinf's corpora carry `url` and `title`) are kept as one JSON
object per row and answered inside `document`, as the original server answered the whole row.
`Pages` holds the web pages that ASearcher's `/access` serves (`--pages_path`), stored the same way
and found by URL.
"""
from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa

log = logging.getLogger(__name__)

# The columns every corpus file starts with (files converted before extra fields were kept, and
# files written by hand, have only these).
SCHEMA = pa.schema([("id", pa.string()), ("contents", pa.large_string())])
# What `convert_jsonl` writes. The format tag tells a file that keeps extra fields from an older
# conversion that dropped them: the older one is converted again from its JSONL.
FORMAT_KEY, CORPUS_FORMAT, PAGES_FORMAT = b"search_r1_format", b"corpus-2", b"pages-1"
CORPUS_SCHEMA = pa.schema([*SCHEMA, ("extra", pa.large_string())], metadata={FORMAT_KEY: CORPUS_FORMAT})
PAGES_SCHEMA = pa.schema([("url", pa.string()), ("url_hash", pa.uint64()), ("contents", pa.large_string()),
                          ("extra", pa.large_string())], metadata={FORMAT_KEY: PAGES_FORMAT})
ARROW_SUFFIX = ".arrow"
PAGES_SUFFIX = ".pages.arrow"


@dataclass
class Passage:
    id: str
    contents: str
    extra: dict | None = None   # the row's other fields (e.g. url, title), or None

    @property
    def title(self) -> str:
        return self.contents.split("\n", 1)[0].strip().strip('"')

    @property
    def text(self) -> str:
        parts = self.contents.split("\n", 1)
        return parts[1] if len(parts) > 1 else ""


def arrow_path_for(jsonl_path: str | os.PathLike, suffix: str = ARROW_SUFFIX) -> Path:
    """Where the converted form of a JSONL file lives (next to it)."""
    p = Path(jsonl_path)
    return p.with_name(p.name.removesuffix(".jsonl") + suffix)


def convert_jsonl(jsonl_path: str | os.PathLike, out_path: str | os.PathLike | None = None,
                  batch_rows: int = 65536, progress: bool = True) -> Path:
    """Stream a JSONL corpus into an uncompressed Arrow IPC file; memory stays O(batch_rows)."""
    out_path = Path(out_path) if out_path else arrow_path_for(jsonl_path)
    return _convert(Path(jsonl_path), out_path, CORPUS_SCHEMA, _corpus_columns,
                    'a corpus row {"id": ..., "contents": ...}', batch_rows, progress)


def convert_pages_jsonl(jsonl_path: str | os.PathLike, out_path: str | os.PathLike | None = None,
                        batch_rows: int = 65536, progress: bool = True) -> Path:
    """Stream a JSONL file of web pages `{"url", "contents", …}` into an Arrow file (see `Pages`)."""
    out_path = Path(out_path) if out_path else arrow_path_for(jsonl_path, PAGES_SUFFIX)
    return _convert(Path(jsonl_path), out_path, PAGES_SCHEMA, _page_columns,
                    'a page row {"url": ..., "contents": ...}', batch_rows, progress)


def _corpus_columns(row: dict) -> tuple:
    return str(row["id"]), _contents(row), _extra_json(row, ("id", "contents"))


def _page_columns(row: dict) -> tuple:
    url = row["url"]
    if not isinstance(url, str):
        raise TypeError(f"url is {type(url).__name__}, not a string")
    return url, url_hash(url), _contents(row), _extra_json(row, ("url", "contents"))


def _contents(row: dict) -> str:
    # Some corpora carry {"title", "text"} instead of "contents"; keep the published layout.
    if "contents" in row:
        contents = row["contents"]
    elif "title" in row and "text" in row:
        contents = f'"{row["title"]}"\n{row["text"]}'
    else:
        raise KeyError("contents")
    if not isinstance(contents, str):
        raise TypeError(f"contents is {type(contents).__name__}, not a string")
    return contents


def _extra_json(row: dict, columns: tuple[str, ...]) -> str | None:
    extra = {k: v for k, v in row.items() if k not in columns}
    return json.dumps(extra, ensure_ascii=False) if extra else None


def _convert(jsonl_path: Path, out_path: Path, schema: pa.Schema, to_columns: Callable[[dict], tuple],
             layout: str, batch_rows: int, progress: bool) -> Path:
    from tqdm import tqdm

    tmp_path = out_path.with_name(out_path.name + ".tmp")
    n_rows = 0
    with open(jsonl_path, "rb") as f, pa.OSFile(str(tmp_path), "wb") as sink, \
            pa.ipc.new_file(sink, schema) as writer, \
            tqdm(total=os.path.getsize(jsonl_path), unit="B", unit_scale=True,
                 desc=f"converting {jsonl_path.name}", disable=not progress) as bar:
        columns: list[list] = [[] for _ in schema]
        for line_no, line in enumerate(f, 1):
            bar.update(len(line))
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise TypeError(f"a JSON {type(row).__name__}, not an object")
                for column, value in zip(columns, to_columns(row)):
                    column.append(value)
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{jsonl_path}:{line_no}: not {layout} ({e!r})") from None
            if len(columns[0]) == batch_rows:
                writer.write_batch(pa.record_batch(columns, schema=schema))
                n_rows += batch_rows
                columns = [[] for _ in schema]
        if columns[0]:
            writer.write_batch(pa.record_batch(columns, schema=schema))
            n_rows += len(columns[0])
    os.replace(tmp_path, out_path)
    log.info("converted %s rows to %s", f"{n_rows:,}", out_path)
    return out_path


def _arrow_for(path: Path, what: str, suffix: str, fmt: bytes,
               convert: Callable[[Path, Path], Path]) -> Path:
    """The Arrow file to open for `path`: itself, or for a JSONL the file converted next to it,
    converted again when it is missing, older than the JSONL, or of an older layout."""
    if not path.exists():
        raise FileNotFoundError(f"{what} {path} does not exist")
    if path.suffix != ".jsonl":
        return path
    arrow = arrow_path_for(path, suffix)
    if not arrow.exists() or arrow.stat().st_mtime < path.stat().st_mtime:
        return convert(path, arrow)
    with pa.OSFile(str(arrow)) as f:
        current = (pa.ipc.open_file(f).schema.metadata or {}).get(FORMAT_KEY) == fmt
    if not current:
        log.info("%s was converted by an older version that dropped extra fields: converting %s again",
                 arrow, path)
        return convert(path, arrow)
    return arrow


class _MappedTable:
    """A memory-mapped Arrow IPC file whose rows are read by position."""

    def __init__(self, path: Path):
        # Rows are read at random positions: tell the kernel not to read ahead, or each
        # lookup pulls its neighbours into the page cache too, which then grows with every lookup.
        with open(path, "rb") as f:
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if hasattr(self._mmap, "madvise"):
            self._mmap.madvise(mmap.MADV_RANDOM)
        self.table = pa.ipc.open_file(pa.BufferReader(pa.py_buffer(self._mmap))).read_all()  # zero-copy
        # Start row of each record batch: a row is found by bisection, then read from its batch.
        # (ChunkedArray.take would first concatenate all batches: O(N) per call.)
        self._starts = np.cumsum([0] + [len(c) for c in self.table.column(0).chunks])

    def locate(self, positions) -> list[tuple[int, int]]:
        """(record batch, row in it) of each position."""
        pos = np.asarray(positions, dtype=np.int64)
        if len(pos) and (pos.min() < 0 or pos.max() >= self.table.num_rows):
            raise IndexError(f"row out of range 0..{self.table.num_rows - 1}")
        chunk_of = np.searchsorted(self._starts, pos, side="right") - 1
        return list(zip(chunk_of.tolist(), (pos - self._starts[chunk_of]).tolist()))

    def column_chunks(self, name: str) -> list[pa.Array] | None:
        return self.table.column(name).chunks if name in self.table.schema.names else None


def _extra(chunks: list[pa.Array] | None, c: int, j: int) -> dict | None:
    if chunks is None:
        return None
    value = chunks[c][j].as_py()
    return json.loads(value) if value else None


class Corpus:
    """Read-only, memory-mapped passages addressed by row position (the index's vector id)."""

    def __init__(self, path: str | os.PathLike):
        path = _arrow_for(Path(path), "corpus file", ARROW_SUFFIX, CORPUS_FORMAT, convert_jsonl)
        self.path = path
        self._rows = _MappedTable(path)
        table = self._rows.table
        if table.schema.names[:2] != ["id", "contents"]:
            raise ValueError(f"{path} is not a converted corpus (columns {table.schema.names})")
        self._ids = table.column("id")
        self._contents = table.column("contents")
        self._extras = self._rows.column_chunks("extra")

    def __len__(self) -> int:
        return len(self._ids)

    def __getitem__(self, i: int) -> Passage:
        return self.get_many([i])[0]

    def get_many(self, positions) -> list[Passage]:
        """Rows by position, in the given order; cost grows with len(positions), not the corpus."""
        # Element access touches only the pages of the rows asked for; a vectorised `take`
        # touched whole record batches, filling the page cache far beyond the rows asked for.
        ids, contents = self._ids.chunks, self._contents.chunks
        return [Passage(ids[c][j].as_py(), contents[c][j].as_py(), _extra(self._extras, c, j))
                for c, j in self._rows.locate(positions)]

    def iter_batches(self, batch_rows: int = 1024, start: int = 0):
        """(first_position, [contents]) in order; used to embed the corpus."""
        for lo in range(start, len(self), batch_rows):
            yield lo, self._contents.slice(lo, batch_rows).to_pylist()


def url_hash(url: str) -> int:
    """64-bit key of a URL; `Pages` bisects a sorted array of them instead of holding a dict."""
    return int.from_bytes(hashlib.blake2b(url.encode("utf-8", "surrogatepass"), digest_size=8).digest(),
                          "little")


def asearcher_url(url: str) -> str:
    """The key ASearcher's server looks a requested URL up by: agents write wiki links as
    `…/index.php/Title`, the pages file stores `…/index.php?title=Title`."""
    return url.replace("index.php/", "index.php?title=") if "index.php/" in url else url


class Pages:
    """Web pages by URL (ASearcher's `--pages_path`): JSONL rows `{"url", "contents", …}` converted
    once to a memory-mapped Arrow file. ASearcher's server holds every page in a dict; here only a
    sorted 64-bit hash of each URL (and its row) is in memory, and a lookup reads the matching rows."""

    def __init__(self, path: str | os.PathLike):
        path = _arrow_for(Path(path), "pages file", PAGES_SUFFIX, PAGES_FORMAT, convert_pages_jsonl)
        self.path = path
        self._rows = _MappedTable(path)
        if (self._rows.table.schema.metadata or {}).get(FORMAT_KEY) != PAGES_FORMAT:
            raise ValueError(f"{path} is not a converted pages file (columns "
                             f"{self._rows.table.schema.names}); pass the pages JSONL instead")
        hashes = self._rows.table.column("url_hash").to_numpy()
        self._order = np.argsort(hashes, kind="stable")
        self._sorted_hashes = hashes[self._order]
        log.info("%s pages from %s", f"{len(self):,}", path)

    def __len__(self) -> int:
        return self._rows.table.num_rows

    def get(self, url: str) -> dict | None:
        """The page row of `url` (`{"url", "contents", …}`), or None. Where the file holds a URL
        twice the later row wins, as in ASearcher's dict."""
        url = asearcher_url(url)
        h = np.uint64(url_hash(url))
        lo, hi = (np.searchsorted(self._sorted_hashes, h, side) for side in ("left", "right"))
        urls, contents = self._rows.column_chunks("url"), self._rows.column_chunks("contents")
        extras = self._rows.column_chunks("extra")
        for c, j in reversed(self._rows.locate(self._order[lo:hi])):
            if urls[c][j].as_py() == url:
                return {"url": url, "contents": contents[c][j].as_py(), **(_extra(extras, c, j) or {})}
        return None
