"""The whole download path except the network, run against a fake mirror (`--source-dir`)."""
import gzip
import json
import os
import random
import shutil
import subprocess
import sys
from collections import namedtuple

import pytest

from search_r1.retrieval import download as dl

CORPUS_REPO = dl.ASSETS["corpus"].repo_id
FLAT_REPO = dl.ASSETS["e5_flat"].repo_id
HNSW_REPO = dl.ASSETS["e5_hnsw"].repo_id
BM25_REPO = dl.ASSETS["bm25"].repo_id


@pytest.fixture
def mirror(tmp_path):
    """A mirror of every asset, small; returns (root, originals)."""
    root = tmp_path / "mirror"
    rng = random.Random(0)
    rows = [{"id": str(i), "contents": f'"Title {i}"\nText of passage {i}.'} for i in range(500)]
    corpus = "".join(json.dumps(r) + "\n" for r in rows).encode()
    (root / CORPUS_REPO).mkdir(parents=True)
    (root / CORPUS_REPO / "wiki-18.jsonl.gz").write_bytes(gzip.compress(corpus))

    flat = rng.randbytes(300_001)
    (root / FLAT_REPO).mkdir(parents=True)
    (root / FLAT_REPO / "part_aa").write_bytes(flat[:200_000])
    (root / FLAT_REPO / "part_ab").write_bytes(flat[200_000:])

    hnsw = rng.randbytes(50_000)
    (root / HNSW_REPO).mkdir(parents=True)
    for i, suffix in enumerate("abc"):     # three parts, to check the listed parts are sorted
        (root / HNSW_REPO / f"part_a{suffix}").write_bytes(hnsw[i * 20_000:(i + 1) * 20_000])
    (root / HNSW_REPO / "README.md").write_text("not a part\n")

    (root / BM25_REPO / "bm25").mkdir(parents=True)
    (root / BM25_REPO / "bm25" / "segments_1").write_bytes(b"seg")
    (root / BM25_REPO / "bm25" / "_0.cfs").write_bytes(rng.randbytes(1000))
    Originals = namedtuple("Originals", "corpus rows flat hnsw")
    return root, Originals(corpus, len(rows), flat, hnsw)


def run(root, save, *extra):
    return dl.main(["--save-path", str(save), "--source-dir", str(root), *extra])


def test_fetches_and_finishes_every_asset(mirror, tmp_path):
    root, orig = mirror
    save = tmp_path / "save"
    results = run(root, save, "--assets", "corpus,e5_flat,e5_hnsw,bm25")

    assert (save / "wiki-18.jsonl").read_bytes() == orig.corpus
    assert (save / "e5_Flat.index").read_bytes() == orig.flat
    assert (save / "e5_HNSW64.index").read_bytes() == orig.hnsw
    assert (save / "bm25" / "segments_1").read_bytes() == b"seg"
    by_name = {r.asset: r for r in results}
    assert by_name["corpus"].rows == orig.rows
    assert by_name["corpus"].bytes == len(orig.corpus)
    assert by_name["e5_flat"].bytes == len(orig.flat)
    assert not any(r.skipped for r in results)
    # Parts are deleted by default; nothing temporary is left behind.
    assert not (save / dl.PARTS_DIR).exists()
    assert not list(save.glob("*.tmp"))
    assert "500" in dl.report(results)


def test_keep_parts(mirror, tmp_path):
    root, _ = mirror
    save = tmp_path / "save"
    run(root, save, "--keep-parts")
    assert (save / dl.PARTS_DIR / "e5_flat" / "part_ab").is_file()
    assert (save / dl.PARTS_DIR / "corpus" / "wiki-18.jsonl.gz").is_file()


def test_second_run_skips_work(mirror, tmp_path, monkeypatch):
    root, orig = mirror
    save = tmp_path / "save"
    run(root, save, "--assets", "corpus,e5_flat,bm25")

    def must_not_run(*args, **kwargs):
        raise AssertionError("a finished asset was redone")
    monkeypatch.setattr(dl, "concatenate", must_not_run)
    monkeypatch.setattr(dl, "gunzip", must_not_run)
    monkeypatch.setattr(dl.LocalSource, "fetch", must_not_run)
    results = run(root, save, "--assets", "corpus,e5_flat,bm25")
    assert all(r.skipped for r in results)
    assert {r.asset: r.rows for r in results}["corpus"] == orig.rows


def test_output_changed_after_marker_is_redone(mirror, tmp_path):
    root, orig = mirror
    save = tmp_path / "save"
    run(root, save, "--assets", "e5_flat")
    with open(save / "e5_Flat.index", "r+b") as f:
        f.truncate(1000)
    [result] = run(root, save, "--assets", "e5_flat")
    assert not result.skipped
    assert (save / "e5_Flat.index").read_bytes() == orig.flat


def test_truncated_tmp_from_interrupted_run_is_redone(mirror, tmp_path):
    root, orig = mirror
    save = tmp_path / "save"
    save.mkdir()
    (save / "e5_Flat.index.tmp").write_bytes(orig.flat[:12_345])
    (save / "wiki-18.jsonl.tmp").write_bytes(orig.corpus[:100])
    run(root, save)
    assert (save / "e5_Flat.index").read_bytes() == orig.flat
    assert (save / "wiki-18.jsonl").read_bytes() == orig.corpus
    assert not list(save.glob("*.tmp"))


def test_manual_concatenation_without_marker_is_kept(mirror, tmp_path, monkeypatch):
    root, orig = mirror
    save = tmp_path / "save"
    save.mkdir()
    (save / "e5_Flat.index").write_bytes(orig.flat)
    monkeypatch.setattr(dl, "concatenate", lambda *a: pytest.fail("should have kept the existing file"))
    [result] = run(root, save, "--assets", "e5_flat")
    assert result.bytes == len(orig.flat)
    assert (save / "e5_Flat.index.done").is_file()


def test_missing_part_names_the_file(mirror, tmp_path):
    root, _ = mirror
    (root / FLAT_REPO / "part_ab").unlink()
    with pytest.raises(SystemExit) as exc:
        run(root, tmp_path / "save", "--assets", "e5_flat")
    assert "part_ab" in str(exc.value)
    assert not (tmp_path / "save" / "e5_Flat.index").exists()


@pytest.mark.parametrize("damage", ["truncate", "flip", "not_gzip"])
def test_corrupt_gzip_is_reported(mirror, tmp_path, damage):
    root, _ = mirror
    gz = root / CORPUS_REPO / "wiki-18.jsonl.gz"
    data = bytearray(gz.read_bytes())
    if damage == "truncate":
        data = data[:-50]
    elif damage == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        data = bytearray(b"<html>rate limited</html>")
    gz.write_bytes(bytes(data))
    save = tmp_path / "save"
    with pytest.raises(SystemExit) as exc:
        run(root, save, "--assets", "corpus")
    assert "wiki-18.jsonl.gz" in str(exc.value) and "gzip" in str(exc.value)
    assert not (save / "wiki-18.jsonl").exists()
    assert not (save / "wiki-18.jsonl.done").exists()


def test_not_enough_disk_space_names_bytes_needed(mirror, tmp_path, monkeypatch):
    root, orig = mirror
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(dl.shutil, "disk_usage", lambda path: usage._replace(free=10))
    with pytest.raises(SystemExit) as exc:
        run(root, tmp_path / "save", "--assets", "e5_flat")
    assert f"{len(orig.flat):,} bytes" in str(exc.value)


def test_pattern_without_matches_lists_repo_files(mirror, tmp_path):
    root, _ = mirror
    for part in (root / HNSW_REPO).glob("part_*"):
        part.unlink()
    with pytest.raises(SystemExit) as exc:
        run(root, tmp_path / "save", "--assets", "e5_hnsw")
    assert "part_*" in str(exc.value) and "README.md" in str(exc.value)


def test_unknown_asset_lists_choices(tmp_path):
    with pytest.raises(SystemExit) as exc:
        dl.main(["--save-path", str(tmp_path), "--assets", "e5_flat,colbert"])
    assert "colbert" in str(exc.value) and "e5_hnsw" in str(exc.value)


def test_script_runs_from_checkout(mirror, tmp_path):
    """The thin CLI works when run as a file from another directory."""
    root, orig = mirror
    script = os.path.join(os.path.dirname(__file__), "..", "..", "..", "scripts", "download.py")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, script, "--save-path", str(tmp_path / "save"),
                    "--source-dir", str(root), "--assets", "e5_flat"],
                   check=True, env=env, cwd=tmp_path, capture_output=True)
    assert (tmp_path / "save" / "e5_Flat.index").read_bytes() == orig.flat
