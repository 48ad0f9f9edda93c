"""scripts/offline_bundle.py: wheel trimming with a consistent RECORD, parts + manifest round trip,
refusal of corrupt parts, and a real `pip install --no-index` of a trimmed wheel. No network."""
from __future__ import annotations

import base64
import csv
import hashlib
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "offline_bundle.py"
_spec = importlib.util.spec_from_file_location("offline_bundle", SCRIPT)
ob = importlib.util.module_from_spec(_spec)
sys.modules["offline_bundle"] = ob  # dataclasses look their module up while the file executes
_spec.loader.exec_module(ob)
PRESETS = ob.load_presets()  # scripts/offline_bundle_presets.toml


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(folder: Path, name: str = "fakepkg", version: str = "1.0", files: dict | None = None,
               executable: tuple[str, ...] = (), requires: tuple[str, ...] = ("numpy",)) -> Path:
    """A minimal valid wheel: the package files plus METADATA, WHEEL and a full RECORD."""
    files = dict(files or {f"{name}/__init__.py": b"VALUE = 1\n"})
    dist = f"{name}-{version}.dist-info"
    files[f"{dist}/METADATA"] = (f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                 + "".join(f"Requires-Dist: {r}\n" for r in requires)).encode()
    files[f"{dist}/WHEEL"] = (b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                              b"Tag: py3-none-any\n")
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    for path, data in files.items():
        writer.writerow([path, record_hash(data), len(data)])
    writer.writerow([f"{dist}/RECORD", "", ""])
    files[f"{dist}/RECORD"] = record.getvalue().encode()
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for member, data in files.items():
            info = zipfile.ZipInfo(member, date_time=(2024, 1, 2, 3, 4, 6))
            info.external_attr = (0o100755 if member in executable else 0o100644) << 16
            z.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    return path


@pytest.fixture
def fake_wheel(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    return make_wheel(src, files={
        "fakepkg/__init__.py": b"VALUE = 1\n",
        "fakepkg/_big_C.abi3.so": os.urandom(4096),
        "fakepkg/bin/tool": b"#!/bin/sh\necho hi\n",
        "fakepkg/third_party/__init__.py": b"",
        "fakepkg/third_party/pynvml.py": b"X = 2\n",
        "fakepkg/third_party/lib/config.json": b"{}",
        "fakepkg/third_party/lib/header.h": b"int x;\n",
        "fakepkg/third_party/lib/blob.so": os.urandom(512),
        "fakepkg/static/app.js": b"1",
        "fakepkg/static/deep/app.js.map": b"{}",
    }, executable=("fakepkg/bin/tool",))


RULE = ob.TrimRule(drop=("fakepkg/_big_C.abi3.so", "fakepkg/missing.so", "fakepkg/third_party",
                         "fakepkg/static/*.js.map"),
                   keep=("fakepkg/third_party/*.py", "fakepkg/third_party/*.json"))


def test_trim_removes_matches_and_keeps_record_consistent(tmp_path, fake_wheel):
    out = tmp_path / "out" / fake_wheel.name
    out.parent.mkdir()
    report = ob.trim_wheel(fake_wheel, out, RULE)

    assert sorted(report.removed) == ["fakepkg/_big_C.abi3.so", "fakepkg/static/deep/app.js.map",
                                      "fakepkg/third_party/lib/blob.so", "fakepkg/third_party/lib/header.h"]
    assert report.bytes_removed == 4096 + 2 + 512 + 7 and report.size_after < report.size_before
    with zipfile.ZipFile(out) as z:
        assert z.testzip() is None
        names = set(z.namelist())
        assert not names & set(report.removed)
        assert {"fakepkg/third_party/pynvml.py", "fakepkg/third_party/lib/config.json",
                "fakepkg/static/app.js", "fakepkg-1.0.dist-info/METADATA"} <= names
        assert z.getinfo("fakepkg/bin/tool").external_attr >> 16 == 0o100755
        record = z.read("fakepkg-1.0.dist-info/RECORD").decode()
    assert "_big_C" not in record and "header.h" not in record
    assert ob.check_record(out) == []
    assert ob.check_record(fake_wheel) == []


def test_trim_never_drops_dist_info(tmp_path, fake_wheel):
    out = tmp_path / "t.whl"
    ob.trim_wheel(fake_wheel, out, ob.TrimRule(drop=("*",)))
    with zipfile.ZipFile(out) as z:
        assert sorted(z.namelist()) == ["fakepkg-1.0.dist-info/METADATA", "fakepkg-1.0.dist-info/RECORD",
                                        "fakepkg-1.0.dist-info/WHEEL"]
    assert ob.check_record(out) == []


def test_check_record_reports_a_stale_row(tmp_path, fake_wheel):
    # A naive trim that leaves RECORD alone is exactly what pip would complain about.
    stale = tmp_path / "stale.whl"
    with zipfile.ZipFile(fake_wheel) as zin, zipfile.ZipFile(stale, "w") as zout:
        for info in zin.infolist():
            if info.filename != "fakepkg/_big_C.abi3.so":
                zout.writestr(info, zin.read(info))
    assert ob.check_record(stale) == ["fakepkg/_big_C.abi3.so: in RECORD but not in the wheel"]


def test_pip_installs_the_trimmed_wheel_offline(tmp_path, fake_wheel):
    out = tmp_path / "trimmed" / fake_wheel.name
    out.parent.mkdir()
    ob.trim_wheel(fake_wheel, out, RULE)
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index",
                           "--disable-pip-version-check", "--target", str(site), str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (site / "fakepkg/third_party/pynvml.py").is_file()
    assert not (site / "fakepkg/_big_C.abi3.so").exists()
    assert not (site / "fakepkg/third_party/lib/header.h").exists()
    assert os.access(site / "fakepkg/bin/tool", os.X_OK)
    check = subprocess.run([sys.executable, "-c", "import fakepkg.third_party.pynvml as m; print(m.X)"],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(site)})
    assert check.stdout.strip() == "2"


def make_bundle(tmp_path, part_bytes=20_000, python=None):
    """Wheels of awkward sizes (one larger than a part, one empty-ish) packed into parts."""
    src = tmp_path / "wheels"
    src.mkdir()
    wheels = []
    for i, size in enumerate([50_000, 3, 12_345, 0]):
        path = src / f"pkg{i}-1.{i}-py3-none-any.whl"
        path.write_bytes(os.urandom(size))
        wheels.append(path)
    bundle = tmp_path / "bundle"
    entries, parts = ob.write_parts(wheels, bundle / "parts", part_bytes)
    manifest = {"format": ob.MANIFEST_FORMAT, "python": python or "3.12", "platforms": [],
                "part_bytes": part_bytes, "wheels": entries, "parts": parts}
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    return wheels, bundle, manifest


def test_parts_manifest_and_reassembly_round_trip(tmp_path):
    wheels, bundle, manifest = make_bundle(tmp_path)
    parts = sorted((bundle / "parts").iterdir())
    assert [p.name for p in parts] == [p["file"] for p in manifest["parts"]] == [
        f"part_{i:03d}" for i in range(len(parts))]
    assert len(parts) >= 4 and all(p.stat().st_size <= 20_000 for p in parts)
    for part, entry in zip(parts, manifest["parts"]):
        assert entry["size"] == part.stat().st_size
        assert entry["sha256"] == hashlib.sha256(part.read_bytes()).hexdigest()
    assert [w["file"] for w in manifest["wheels"]] == [w.name for w in wheels]
    assert [w["name"] for w in manifest["wheels"]] == ["pkg0", "pkg1", "pkg2", "pkg3"]

    out = ob.reassemble(bundle, tmp_path / "out")
    assert [p.name for p in out] == [w.name for w in wheels]
    for got, want in zip(out, wheels):
        assert got.read_bytes() == want.read_bytes()


def test_corrupt_part_is_refused_by_name(tmp_path, capsys):
    _, bundle, _ = make_bundle(tmp_path)
    part = bundle / "parts" / "part_001"
    data = bytearray(part.read_bytes())
    data[100] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(ob.BundleError, match=r"part_001 fails its checksum.*copy it again"):
        ob.reassemble(bundle, tmp_path / "out")
    assert ob.main(["install", "--from", str(bundle), "--verify-only"]) == 1
    assert "part_001" in capsys.readouterr().err


def test_truncated_or_missing_part_is_refused(tmp_path):
    _, bundle, _ = make_bundle(tmp_path)
    part = bundle / "parts" / "part_002"
    part.write_bytes(part.read_bytes()[:-1])
    with pytest.raises(ob.BundleError, match=r"part_002 has \d+ bytes"):
        ob.reassemble(bundle, tmp_path / "out")
    part.unlink()
    with pytest.raises(ob.BundleError, match="part_002 is missing"):
        ob.reassemble(bundle, tmp_path / "out")


def test_install_command_end_to_end(tmp_path, fake_wheel, capsys):
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    trimmed = tmp_path / "w" / fake_wheel.name
    trimmed.parent.mkdir()
    ob.trim_wheel(fake_wheel, trimmed, RULE)
    other = make_wheel(tmp_path / "w", name="otherpkg", version="2.0")
    bundle = tmp_path / "bundle"
    entries, parts = ob.write_parts([trimmed, other], bundle / "parts", 1 << 14)
    (bundle / "manifest.json").write_text(json.dumps({
        "format": ob.MANIFEST_FORMAT, "python": here, "wheels": entries, "parts": parts}))

    assert ob.main(["install", "--from", str(bundle), "--verify-only"]) == 0
    assert "OK: " in capsys.readouterr().out
    site = tmp_path / "site"
    assert ob.main(["install", "--from", str(bundle), "--target", str(site)]) == 0
    out = capsys.readouterr().out
    assert f"export PYTHONPATH={site.resolve()}" in out
    assert (site / "fakepkg/__init__.py").is_file() and (site / "otherpkg/__init__.py").is_file()
    assert not [p for p in bundle.iterdir() if p.name.startswith(".reassembled_")]


def test_install_refuses_another_python(tmp_path):
    _, bundle, _ = make_bundle(tmp_path, python="2.7")
    with pytest.raises(ob.BundleError, match="for Python 2.7.*--verify-only"):
        ob.install(bundle, tmp_path / "site")


def test_gpu_node_preset_is_consistent():
    preset = PRESETS["gpu-node"]
    names = [ob.normalize(p.name) for p in preset.packages]
    assert len(names) == len(set(names)), "one version of each package"
    assert not set(names) & {ob.normalize(n) for n in preset.node_has}
    assert {"vllm", "ray", "xgrammar", "apache-tvm-ffi", "pydantic-core", "antlr4-python3-runtime",
            "faiss-cpu", "pystemmer", "hydra-core"} <= set(names)
    assert "wandb" not in names
    versions = {ob.normalize(p.name): p.version for p in preset.packages}
    assert versions["vllm"] == "0.26.0" and versions["ray"] == "2.60.0"
    assert versions["openai"].startswith("2.") and versions["llguidance"].startswith("1.7.")
    vllm_trim = next(p.trim for p in preset.packages if p.name == "vllm")
    assert vllm_trim.drops("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so")
    assert not vllm_trim.drops("vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so")
    assert vllm_trim.drops("vllm/third_party/deep_gemm/include/x.h")
    assert not vllm_trim.drops("vllm/third_party/pynvml.py")
    ray_trim = next(p.trim for p in preset.packages if p.name == "ray")
    assert ray_trim.drops("ray/data/__init__.py") and not ray_trim.drops("ray/dashboard/modules/x.py")
    assert ray_trim.drops("ray/dashboard/client/build/static/js/main.js.map")


def test_retrieval_node_preset_is_the_servers_part_of_the_gpu_node():
    gpu = {ob.normalize(p.name): p.version for p in PRESETS["gpu-node"].packages}
    server = {ob.normalize(p.name): p.version for p in PRESETS["retrieval-node"].packages}
    assert server.items() <= gpu.items()  # the same pins: one node can take both bundles
    assert {"fastapi", "uvicorn", "pydantic-core", "bm25s", "faiss-cpu"} <= set(server)
    assert not set(server) & {"vllm", "ray", "hydra-core", "xgrammar"}
    assert ob.main(["build", "--preset", "retrieval-node", "--list"]) == 0


def test_download_command_targets_the_node():
    platforms = PRESETS["gpu-node"].platforms
    assert platforms[0] == "manylinux_2_28_x86_64" and "manylinux2014_x86_64" in platforms
    cmd = ob.pip_download_cmd("vllm==0.26.0", "3.12", list(platforms), Path("d"))
    assert cmd[1:4] == ["-m", "pip", "download"]
    assert {"--no-deps", "--only-binary=:all:"} <= set(cmd)
    assert cmd[cmd.index("--python-version") + 1] == "3.12"
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--platform"] == list(platforms)
    fallback = ob.fallback_platforms(platforms)
    assert "manylinux_2_31_x86_64" in fallback and fallback[-1] == "any"


def test_list_fetches_nothing(capsys):
    assert ob.main(["build", "--preset", "gpu-node", "--list"]) == 0
    out = capsys.readouterr().out
    assert "vllm==0.26.0" in out and "antlr4-python3-runtime==4.9.3" in out
    assert "wheel built from the sdist" in out and "keep vllm/third_party/*.py" in out


def test_an_unknown_preset_is_refused_with_the_known_names(capsys):
    with pytest.raises(SystemExit) as exit_:
        ob.main(["build", "--preset", "cpu-node", "--list"])
    assert exit_.value.code == 2
    assert "invalid choice: 'cpu-node' (choose from 'gpu-node', 'retrieval-node')" in capsys.readouterr().err


@pytest.mark.parametrize("text, message", [
    ('[a]\npython = "3.12"\nplatforms = []\nnode_has = []\npackages = ["x==1"]\nextras = []\n', "unknown keys"),
    ('[a]\npython = "3.12"\nplatforms = []\nnode_has = []\npackages = ["x>=1"]\n', "NAME==VERSION"),
    ('[a]\npython = "3.12"\nplatforms = []\nnode_has = []\npackages = ["x==1"]\nsdist_ok = ["y"]\n',
     "which its packages lack"),
    ('[b]\nsubset_of = "a"\npackages = ["x"]\n', "must come above it"),
    ('[a]\npython = "3.12"\nplatforms = []\nnode_has = []\npackages = ["x==1"]\n'
     '[b]\nsubset_of = "a"\npackages = ["y"]\n', "are not in [a]"),
])
def test_a_mistake_in_the_presets_file_is_named(tmp_path, text, message):
    path = tmp_path / "presets.toml"
    path.write_text(text)
    with pytest.raises(ob.BundleError, match=re.escape(message)):
        ob.load_presets(path)


def test_the_bundles_own_copy_installs_without_the_presets_file(tmp_path, fake_wheel, monkeypatch):
    """build copies the script (and the presets) into the bundle; on the node, `install` runs from
    that copy, which needs no presets file: here it is removed first."""
    monkeypatch.setattr(ob, "fetch", lambda pkg, python, platforms, downloads: fake_wheel)
    preset = ob.Preset(python=f"{sys.version_info.major}.{sys.version_info.minor}", platforms=(),
                       packages=(ob.Package("fakepkg", "1.0", trim=RULE),), node_has=("numpy",))
    bundle = tmp_path / "bundle"
    ob.build(preset, bundle, part_mb=0.02)
    assert (bundle / "offline_bundle.py").read_bytes() == SCRIPT.read_bytes()
    assert (bundle / "offline_bundle_presets.toml").read_bytes() == ob.PRESETS_FILE.read_bytes()
    (bundle / "offline_bundle_presets.toml").unlink()
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, str(bundle / "offline_bundle.py"), "install", "--from", str(bundle),
                        "--target", str(site)], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (site / "fakepkg/__init__.py").is_file() and not (site / "fakepkg/_big_C.abi3.so").exists()


def test_requirement_check_and_uniqueness(tmp_path):
    alpha = make_wheel(tmp_path, name="alpha", version="1.0")
    beta = make_wheel(tmp_path, name="beta", version="1.0",
                      requires=("alpha>=2", "gamma; sys_platform == 'win32'", "delta; extra == 'x'"))
    preset = ob.Preset(python="3.12", platforms=(), packages=(), node_has=("numpy",))
    assert ob.check_requirements([alpha], preset, "3.12") == ([], [])
    assert ob.check_requirements([alpha], ob.Preset("3.12", (), (), node_has=()), "3.12")[1] == [
        "alpha requires numpy: neither bundled nor on the node"]
    assert ob.check_requirements([alpha, beta], preset, "3.12")[0] == [
        "beta requires alpha>=2, the bundle has alpha 1.0"]
    accepted = ob.Preset("3.12", (), (), node_has=("numpy",), accepted_conflicts=(("beta", "alpha", "why"),))
    assert ob.check_requirements([alpha, beta], accepted, "3.12") == ([], [])
    (tmp_path / "np").mkdir()
    numpy_wheel = make_wheel(tmp_path / "np", name="numpy", version="1.0", requires=())
    with pytest.raises(ob.BundleError, match="two wheels of alpha"):
        ob.check_unique([alpha, alpha], preset)
    with pytest.raises(ob.BundleError, match="installed on the node"):
        ob.check_unique([numpy_wheel], preset)
