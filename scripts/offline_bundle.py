#!/usr/bin/env python3
"""Carry Python packages to a machine that has no network: a wheelhouse split into checksummed parts.

On a connected machine, `build` downloads the wheels a target node needs (for the node's Python
version and platform, not this machine's), trims the large ones of what a training node never loads,
packs them into one tar stream and cuts that stream into parts of at most `--part-mb` MB
(1 MB = 10**6 bytes), with a manifest of sha256 sums. On the node, `install` checks every part,
reassembles the wheels, checks every wheel, and runs `pip install --no-index --no-deps --target`.

    python scripts/offline_bundle.py build --preset gpu-node --out .gpu_bundle --part-mb 55
    python scripts/offline_bundle.py build --preset gpu-node --list        # what would be fetched
    python scripts/offline_bundle.py build --preset retrieval-node --out .retrieval_bundle   # the server only
    python3 .gpu_bundle/offline_bundle.py install --from .gpu_bundle --target /tmp/gpu_site
    python scripts/offline_bundle.py install --from .gpu_bundle --verify-only   # parts + wheels only

The install side uses only the standard library and pip (the node has no network and no index);
`build` copies this file into the bundle so the bundle directory is all the node needs. Without
Python at hand the parts are still plain: `cat parts/part_* | tar -x` yields the wheels.

The "gpu-node" preset is the recipe recorded in shared/GPU_NODE.md: vLLM 0.26.0 (the release built
for torch 2.11 + CUDA 13) and Ray 2.60.0, both trimmed, plus the dependencies the node lacks. It
deliberately differs from vLLM's own pins in one place: apache-tvm-ffi is the newest release, not
vLLM's ==0.1.10, because xgrammar 0.2.8 needs >= 0.1.11 (vLLM pins it for flashinfer, left out).
"""
from __future__ import annotations

import argparse
import base64
import csv
import fnmatch
import hashlib
import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("offline_bundle")

MANIFEST_FORMAT = "search-r1-offline-bundle/1"
MB = 1_000_000
CHUNK = 1 << 20


class BundleError(RuntimeError):
    """A bundle that cannot be built or installed; the message says what to do next."""


# --------------------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrimRule:
    """Which archive members of a wheel to delete.

    Patterns are fnmatch patterns on paths inside the wheel ("*" also crosses "/"); a pattern that
    names a directory also matches everything under it, so "ray/jars" drops the whole directory.
    `keep` wins over `drop`. Files of the wheel's .dist-info directory are never dropped.
    """

    drop: tuple[str, ...]
    keep: tuple[str, ...] = ()

    @staticmethod
    def _matches(path: str, patterns: tuple[str, ...]) -> bool:
        return any(fnmatch.fnmatchcase(path, p) or fnmatch.fnmatchcase(path, p.rstrip("/") + "/*")
                   for p in patterns)

    def drops(self, path: str) -> bool:
        return self._matches(path, self.drop) and not self._matches(path, self.keep)


@dataclass(frozen=True)
class Package:
    name: str
    version: str
    trim: TrimRule | None = None
    # Pure-Python project published only as an sdist: build the wheel here with `pip wheel`.
    sdist_ok: bool = False


@dataclass(frozen=True)
class Preset:
    python: str
    platforms: tuple[str, ...]
    packages: tuple[Package, ...]
    # Installed on the node already: never bundled, and taken as satisfying requirements.
    node_has: tuple[str, ...]
    # Required by a bundled package but deliberately not carried (optional at run time for us).
    left_out: tuple[str, ...] = ()
    # (requirer, requirement) pairs whose version pin is knowingly broken, with the reason.
    accepted_conflicts: tuple[tuple[str, str, str], ...] = ()


# pip matches manylinux tags exactly, so the target's compatible tags are listed one by one.
DEFAULT_PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
# Tried only when nothing matched the platforms above (the node's glibc is 2.39).
FALLBACK_PLATFORM_STEMS = ("manylinux_2_24", "manylinux_2_31", "manylinux_2_34", "manylinux_2_35")

VLLM_TRIM = TrimRule(
    drop=(
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",  # FlashAttention-2; Hopper uses the FA3 library
        "vllm/_flashmla_C.abi3.so",
        "vllm/_flashmla_extension_C.abi3.so",
        "vllm/_qutlass_C.abi3.so",
        "vllm/vllm-rs",  # a file in 0.26.0; a directory would go as well
        "vllm/third_party",
    ),
    # The bundled Python modules (e.g. pynvml) are needed: without them vLLM finds no CUDA platform.
    keep=("vllm/third_party/*.py", "vllm/third_party/*.json"),
)
RAY_TRIM = TrimRule(
    drop=(
        "ray/jars",
        "ray/dashboard/*.js.map",
        "ray/rllib",
        "ray/tune",
        "ray/train",
        "ray/data",
        "ray/llm",
        "ray/serve",
    ),
)

GPU_NODE = Preset(
    python="3.12",
    platforms=DEFAULT_PLATFORMS,
    packages=(
        Package("vllm", "0.26.0", trim=VLLM_TRIM),
        Package("ray", "2.60.0", trim=RAY_TRIM),
        # vLLM's missing dependencies (GPU_NODE.md), pinned to satisfy vllm 0.26.0's Requires-Dist.
        Package("cbor2", "6.3.0"),
        Package("pyzmq", "27.3.0"),
        Package("openai-harmony", "0.0.8"),
        Package("openai", "2.54.0"),  # 2.x: 3.x needs httpx2
        Package("distro", "1.9.0"),
        Package("jiter", "0.19.0"),
        Package("sniffio", "1.3.1"),
        Package("msgspec", "0.22.0"),
        Package("pybase64", "1.5.1"),
        Package("cachetools", "8.0.2"),
        Package("llguidance", "1.7.6"),  # vllm: >=1.7.0,<1.8.0
        Package("xgrammar", "0.2.8"),
        Package("apache-tvm-ffi", "0.1.15.post2"),  # xgrammar 0.2.8 needs >=0.1.11
        Package("fastapi", "0.136.3"),  # vllm: >=0.133.0,<0.137.0
        Package("starlette", "1.10.0"),
        Package("pydantic", "2.14.4"),
        Package("pydantic-core", "2.50.5"),  # pydantic 2.14.4 pins it exactly
        Package("annotated-types", "0.8.0"),
        Package("typing-inspection", "0.4.5"),
        Package("partial-json-parser", "0.2.1.1.post7"),
        Package("blake3", "1.0.11"),
        Package("setproctitle", "1.3.8"),
        Package("python-json-logger", "4.2.0"),
        Package("compressed-tensors", "0.17.0"),
        Package("loguru", "0.7.3"),  # compressed-tensors imports it
        Package("depyf", "0.20.0"),
        Package("astor", "0.8.1"),
        Package("dill", "0.4.1"),
        Package("gguf", "0.19.0"),
        Package("ijson", "3.6.0"),
        Package("lark", "1.2.2"),
        Package("outlines-core", "0.2.14"),
        # Ray's missing dependencies.
        Package("jsonschema", "4.26.0"),
        Package("jsonschema-specifications", "2025.9.1"),
        Package("referencing", "0.37.0"),
        Package("rpds-py", "2026.9.1"),
        # What Search-R1 itself needs and the node lacks (wandb is not needed there).
        Package("hydra-core", "1.3.8"),
        Package("omegaconf", "2.3.0"),  # hydra-core 1.3.8: omegaconf<2.4
        Package("antlr4-python3-runtime", "4.9.3", sdist_ok=True),  # hydra/omegaconf: ==4.9.*
        Package("uvicorn", "0.54.0"),
        Package("httptools", "0.9.0"),
        Package("bm25s", "0.3.16"),
        Package("pystemmer", "3.1.0"),
        Package("faiss-cpu", "1.15.1"),
    ),
    # From the task brief and `pip list` on the node (2026-11-26).
    node_has=(
        "torch", "torchvision", "torchaudio", "transformers", "numpy", "pyarrow", "safetensors",
        "tokenizers", "sentencepiece", "accelerate", "peft", "sentence-transformers", "pytest",
        "httpx", "httpcore", "h11", "anyio", "click", "typing-extensions", "prometheus-client",
        "psutil", "requests", "pyyaml", "jinja2", "msgpack", "filelock", "aiohttp", "protobuf",
        "grpcio", "tqdm", "regex", "tiktoken", "einops", "triton", "uvloop", "cloudpickle",
        "packaging", "pillow", "numba", "scipy", "attrs", "annotated-doc", "py-cpuinfo", "six",
        "setuptools", "ninja", "opencv-python-headless", "huggingface-hub", "aiosignal",
        "aiohappyeyeballs", "frozenlist", "multidict", "propcache", "yarl", "idna",
    ),
    left_out=(
        # vLLM extras we do not use for offline generation in a trainer (GPU_NODE.md recipe).
        "flashinfer-python", "mistral-common", "anthropic", "mcp", "model-hosting-container-standards",
        "opentelemetry-sdk", "opentelemetry-api", "opentelemetry-exporter-otlp",
        "opentelemetry-semantic-conventions-ai", "prometheus-fastapi-instrumentator",
        "lm-format-enforcer", "watchfiles", "torchcodec", "pynvvideocodec", "tilelang",
        "nvidia-cudnn-frontend", "nvtx", "fastsafetensors", "nvidia-cutlass-dsl", "quack-kernels",
        "tokenspeed-mla", "humming-kernels",
    ),
    accepted_conflicts=(
        ("vllm", "apache-tvm-ffi", "xgrammar 0.2.8 needs >=0.1.11; vLLM pins 0.1.10 for flashinfer"),
        ("vllm", "numba", "the node's numba is used as is (vLLM pins 0.65.0)"),
        ("vllm", "setuptools", "the node's setuptools is used as is"),
    ),
)

# The retrieval server alone (`search-r1 serve`: dense, BM25, FAISS) on a node like the one above:
# no vLLM, no Ray, no Hydra — 23 MB of wheels (19 of them FAISS) against the GPU node's ≈ 230 MB.
SERVER_PACKAGES = ("fastapi", "starlette", "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
                   "sniffio", "uvicorn", "httptools", "bm25s", "pystemmer", "faiss-cpu")
RETRIEVAL_NODE = Preset(
    python=GPU_NODE.python,
    platforms=GPU_NODE.platforms,
    packages=tuple(p for p in GPU_NODE.packages if p.name in SERVER_PACKAGES),
    node_has=GPU_NODE.node_has,
)

PRESETS = {"gpu-node": GPU_NODE, "retrieval-node": RETRIEVAL_NODE}


# --------------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------------
def normalize(name: str) -> str:
    """PEP 503 project name: lower case, runs of -_. become a single dash."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name_version(filename: str) -> tuple[str, str]:
    parts = Path(filename).name.split("-")
    if len(parts) < 5 or not filename.endswith(".whl"):
        raise BundleError(f"{filename}: not a wheel file name (name-version-python-abi-platform.whl)")
    return normalize(parts[0]), parts[1]


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _fmt_mb(n: int) -> str:
    return f"{n / MB:.1f} MB"


# --------------------------------------------------------------------------------------------------
# Trimming a wheel
# --------------------------------------------------------------------------------------------------
@dataclass
class TrimReport:
    removed: list[str]
    bytes_removed: int  # uncompressed
    size_before: int  # file size of the wheel
    size_after: int


def _find_record(names: list[str]) -> str:
    records = [n for n in names if re.fullmatch(r"[^/]+\.dist-info/RECORD", n)]
    if len(records) != 1:
        raise BundleError(f"expected one .dist-info/RECORD in the wheel, found {records or 'none'}")
    return records[0]


def trim_wheel(src: Path, dst: Path, rule: TrimRule) -> TrimReport:
    """Write `src` to `dst` without the members `rule` drops, and RECORD without their rows.

    Kept members keep their bytes, timestamps and permission bits, so their RECORD hashes stay valid
    and pip installs the result like the original.
    """
    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise BundleError("trim_wheel needs a destination other than its source")
    removed: list[str] = []
    bytes_removed = 0
    with zipfile.ZipFile(src) as zin:
        infos = zin.infolist()
        record_name = _find_record([i.filename for i in infos])
        dist_info = record_name.split("/")[0] + "/"
        dropped = set()
        for info in infos:
            if not info.filename.startswith(dist_info) and rule.drops(info.filename):
                dropped.add(info.filename)
                removed.append(info.filename)
                bytes_removed += info.file_size
        rows = list(csv.reader(io.StringIO(zin.read(record_name).decode("utf-8"))))
        kept_rows = [row for row in rows if row and row[0] not in dropped]
        record_buf = io.StringIO()
        csv.writer(record_buf, lineterminator="\n").writerows(kept_rows)
        tmp = dst.with_name(dst.name + ".partial")
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zout:
            for info in infos:
                if info.filename in dropped:
                    continue
                if info.filename == record_name:
                    zout.writestr(info, record_buf.getvalue().encode("utf-8"))
                    continue
                with zin.open(info) as fin, zout.open(_copy_info(info), "w") as fout:
                    shutil.copyfileobj(fin, fout, CHUNK)
    os.replace(tmp, dst)
    return TrimReport(removed, bytes_removed, src.stat().st_size, dst.stat().st_size)


def _copy_info(info: zipfile.ZipInfo) -> zipfile.ZipInfo:
    """A fresh ZipInfo with the member's name, date and permission bits (sizes are recomputed)."""
    out = zipfile.ZipInfo(info.filename, date_time=info.date_time)
    out.file_size = info.file_size  # lets zipfile decide on zip64 before the data is written
    out.external_attr = info.external_attr
    out.create_system = info.create_system
    stored = info.compress_type == zipfile.ZIP_STORED
    out.compress_type = zipfile.ZIP_STORED if stored else zipfile.ZIP_DEFLATED
    return out


def check_record(wheel: Path) -> list[str]:
    """Problems between a wheel's members and its RECORD (empty list: consistent)."""
    problems = []
    with zipfile.ZipFile(wheel) as z:
        names = [i.filename for i in z.infolist() if not i.filename.endswith("/")]
        record_name = _find_record(names)
        rows = [r for r in csv.reader(io.StringIO(z.read(record_name).decode("utf-8"))) if r]
        listed = {r[0]: r for r in rows}
        for name in names:
            if name not in listed:
                problems.append(f"{name}: in the wheel but not in RECORD")
        for path, row in listed.items():
            if path not in names:
                problems.append(f"{path}: in RECORD but not in the wheel")
            elif path != record_name and len(row) >= 2 and row[1]:
                if _record_hash(z.read(path)) != row[1]:
                    problems.append(f"{path}: hash differs from RECORD")
    return problems


# --------------------------------------------------------------------------------------------------
# Downloading
# --------------------------------------------------------------------------------------------------
def fallback_platforms(platforms: tuple[str, ...]) -> list[str]:
    arches = sorted({m.group(1) for p in platforms if (m := re.search(r"(x86_64|aarch64)$", p))})
    extra = [f"{stem}_{arch}" for arch in arches for stem in FALLBACK_PLATFORM_STEMS]
    return [p for p in extra if p not in platforms] + ["any"]


def pip_download_cmd(spec: str, python: str, platforms: list[str], dest: Path) -> list[str]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--python-version", python, "--implementation", "cp", "--disable-pip-version-check",
           "-d", str(dest)]
    for platform in platforms:
        cmd += ["--platform", platform]
    return cmd + [spec]


def _cached_wheel(pkg: Package, folder: Path) -> Path | None:
    if not folder.is_dir():
        return None
    for path in sorted(folder.glob("*.whl")):
        name, version = wheel_name_version(path.name)
        if name == normalize(pkg.name) and version == pkg.version:
            return path
    return None


def fetch(pkg: Package, python: str, platforms: tuple[str, ...], downloads: Path) -> Path:
    """The wheel of `pkg` for the target, from the download cache or PyPI."""
    cached = _cached_wheel(pkg, downloads)
    if cached:
        return cached
    downloads.mkdir(parents=True, exist_ok=True)
    spec = f"{pkg.name}=={pkg.version}"
    errors = []
    for attempt in (list(platforms), fallback_platforms(platforms)):
        cmd = pip_download_cmd(spec, python, attempt, downloads)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode == 0 and (found := _cached_wheel(pkg, downloads)):
            return found
        errors.append(proc.stderr.strip().splitlines()[-1:] or ["(no message)"])
    if pkg.sdist_ok:
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-binary=:all:",
                   "--disable-pip-version-check", "-w", tmp, spec]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            built = list(Path(tmp).glob("*.whl"))
            if proc.returncode == 0 and len(built) == 1:
                if not built[0].name.endswith("-none-any.whl"):
                    raise BundleError(f"{spec}: the wheel built from the sdist is not pure Python "
                                      f"({built[0].name}); it must be built on the target")
                return Path(shutil.copy2(built[0], downloads / built[0].name))
            errors.append(proc.stderr.strip().splitlines()[-1:] or ["(no message)"])
    raise BundleError(f"{spec}: no wheel for Python {python} on {', '.join(platforms)} (nor the "
                      f"fallback tags): {' / '.join(e[0] for e in errors)}. Pick another version "
                      f"in the preset, or mark it sdist_ok if it is pure Python.")


# --------------------------------------------------------------------------------------------------
# Checking the set of wheels
# --------------------------------------------------------------------------------------------------
def wheel_requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        metadata = [n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        text = z.read(metadata[0]).decode("utf-8")
    return [line.split(":", 1)[1].strip() for line in text.splitlines()
            if line.startswith("Requires-Dist:")]


def check_requirements(wheels: list[Path], preset: Preset, python: str) -> tuple[list[str], list[str]]:
    """(conflicts, unmet): pins broken inside the bundle, and requirements nobody provides.

    Markers are evaluated for CPython `python` on x86-64 Linux with no extras. Requirements on
    packages the node has are taken as met (their versions are the node's business).
    """
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip always vendors it
        from pip._vendor.packaging.requirements import Requirement
    env = {"python_version": python, "python_full_version": python + ".0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
    versions = dict(wheel_name_version(w.name) for w in wheels)
    node = {normalize(n) for n in preset.node_has}
    left_out = {normalize(n) for n in preset.left_out}
    accepted = {(normalize(a), normalize(b)) for a, b, _ in preset.accepted_conflicts}
    conflicts, unmet = [], []
    for wheel in wheels:
        owner = wheel_name_version(wheel.name)[0]
        for line in wheel_requirements(wheel):
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            name = normalize(req.name)
            if (owner, name) in accepted:
                continue
            if name in versions:
                if not req.specifier.contains(versions[name], prereleases=True):
                    conflicts.append(f"{owner} requires {line}, the bundle has {name} {versions[name]}")
            elif name not in node and name not in left_out:
                unmet.append(f"{owner} requires {line}: neither bundled nor on the node")
    return conflicts, unmet


def check_unique(wheels: list[Path], preset: Preset) -> None:
    seen: dict[str, str] = {}
    node = {normalize(n) for n in preset.node_has}
    for wheel in wheels:
        name, _ = wheel_name_version(wheel.name)
        if name in seen:
            raise BundleError(f"two wheels of {name}: {seen[name]} and {wheel.name}; keep one version")
        if name in node:
            raise BundleError(f"{wheel.name}: {name} is installed on the node already; drop it")
        seen[name] = wheel.name


# --------------------------------------------------------------------------------------------------
# Parts: one tar stream of the wheels, cut into fixed-size files
# --------------------------------------------------------------------------------------------------
class _PartWriter:
    """A write-only stream that lands in parts_dir/part_000, part_001, … of at most part_bytes."""

    def __init__(self, parts_dir: Path, part_bytes: int):
        self.parts_dir, self.part_bytes = parts_dir, part_bytes
        self.parts: list[dict] = []
        self._file = None
        self._hash = None
        self._size = 0

    def _roll(self) -> None:
        self._finish()
        name = f"part_{len(self.parts):03d}"
        self._file = open(self.parts_dir / name, "wb")
        self._hash, self._size = hashlib.sha256(), 0
        self.parts.append({"file": name})

    def _finish(self) -> None:
        if self._file is not None:
            self._file.close()
            self.parts[-1].update(size=self._size, sha256=self._hash.hexdigest())
            self._file = None

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        while view:
            if self._file is None or self._size == self.part_bytes:
                self._roll()
            n = min(len(view), self.part_bytes - self._size)
            self._file.write(view[:n])
            self._hash.update(view[:n])
            self._size += n
            view = view[n:]
        return len(data)

    def close(self) -> None:
        self._finish()


def write_parts(wheels: list[Path], parts_dir: Path, part_bytes: int) -> tuple[list[dict], list[dict]]:
    """Pack `wheels` (in order) into one tar stream split into parts. Returns (wheel entries, parts)."""
    if part_bytes < tarfile.RECORDSIZE:
        raise BundleError(f"parts must hold at least {tarfile.RECORDSIZE} bytes")
    if parts_dir.exists():
        shutil.rmtree(parts_dir)
    parts_dir.mkdir(parents=True)
    entries = []
    writer = _PartWriter(parts_dir, part_bytes)
    with tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for wheel in wheels:
            info = tarfile.TarInfo(wheel.name)
            info.size, info.mode, info.mtime = wheel.stat().st_size, 0o644, 0
            with open(wheel, "rb") as f:
                tar.addfile(info, f)
            name, version = wheel_name_version(wheel.name)
            entries.append({"file": wheel.name, "name": name, "version": version,
                            "size": info.size, "sha256": sha256_file(wheel)})
    writer.close()
    return entries, writer.parts


class _ConcatReader:
    """Reads several files one after the other, as `cat` would."""

    def __init__(self, paths: list[Path]):
        self._paths = list(paths)
        self._file = None

    def read(self, n: int = -1) -> bytes:
        out = bytearray()
        while n < 0 or len(out) < n:
            if self._file is None:
                if not self._paths:
                    break
                self._file = open(self._paths.pop(0), "rb")
            block = self._file.read(-1 if n < 0 else n - len(out))
            if not block:
                self._file.close()
                self._file = None
                continue
            out += block
        return bytes(out)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def load_manifest(bundle: Path) -> dict:
    path = bundle / "manifest.json"
    if not path.is_file():
        raise BundleError(f"{path} is missing: copy manifest.json from the build machine next to parts/")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != MANIFEST_FORMAT:
        raise BundleError(f"{path}: format {manifest.get('format')!r}, expected {MANIFEST_FORMAT!r}")
    return manifest


def verify_parts(bundle: Path, manifest: dict) -> list[Path]:
    """Check every part's presence, size and sha256; raise naming the first bad part."""
    paths = []
    for part in manifest["parts"]:
        path = bundle / "parts" / part["file"]
        if not path.is_file():
            raise BundleError(f"{part['file']} is missing from {path.parent}: copy it again")
        size = path.stat().st_size
        if size != part["size"]:
            raise BundleError(f"{part['file']} has {size} bytes, the manifest says {part['size']}: "
                              f"it is incomplete or corrupt; copy it again")
        digest = sha256_file(path)
        if digest != part["sha256"]:
            raise BundleError(f"{part['file']} fails its checksum (sha256 {digest}, the manifest says "
                              f"{part['sha256']}): it is corrupt; copy it again")
        paths.append(path)
    return paths


def reassemble(bundle: Path, dest: Path) -> list[Path]:
    """Verify the parts, unpack the wheels into `dest`, verify each wheel. Returns them in order."""
    manifest = load_manifest(bundle)
    paths = verify_parts(bundle, manifest)
    expected = {w["file"]: w for w in manifest["wheels"]}
    dest.mkdir(parents=True, exist_ok=True)
    out: list[Path] = []
    reader = _ConcatReader(paths)
    try:
        with tarfile.open(fileobj=reader, mode="r|") as tar:
            for member in tar:
                entry = expected.get(member.name)
                if entry is None or not member.isfile() or "/" in member.name:
                    raise BundleError(f"unexpected member {member.name!r} in the parts")
                target = dest / member.name
                digest = hashlib.sha256()
                with tar.extractfile(member) as fin, open(target, "wb") as fout:
                    while block := fin.read(CHUNK):
                        digest.update(block)
                        fout.write(block)
                if digest.hexdigest() != entry["sha256"]:
                    raise BundleError(f"{member.name} fails its checksum after reassembly")
                out.append(target)
    except tarfile.TarError as exc:
        raise BundleError(f"the concatenated parts are not a valid archive ({exc})") from exc
    finally:
        reader.close()
    missing = [w["file"] for w in manifest["wheels"] if w["file"] not in {p.name for p in out}]
    if missing:
        raise BundleError(f"wheels missing after reassembly: {missing}")
    return out


# --------------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------------
def describe(preset: Preset, python: str, platforms: tuple[str, ...]) -> str:
    lines = [f"Python {python}, platforms {', '.join(platforms)} (fallback: "
             f"{', '.join(fallback_platforms(platforms))})"]
    for pkg in preset.packages:
        how = []
        if pkg.trim:
            how.append("trimmed: drop " + " ".join(pkg.trim.drop)
                       + (" keep " + " ".join(pkg.trim.keep) if pkg.trim.keep else ""))
        if pkg.sdist_ok:
            how.append("wheel built from the sdist if PyPI has none")
        lines.append(f"  {pkg.name}=={pkg.version}" + (f"  ({'; '.join(how)})" if how else ""))
    lines.append(f"{len(preset.packages)} packages; not bundled (on the node): {', '.join(preset.node_has)}")
    return "\n".join(lines)


def build(preset: Preset, out: Path, part_mb: float, python: str | None = None,
          platforms: tuple[str, ...] | None = None, preset_name: str = "") -> dict:
    python = python or preset.python
    platforms = tuple(platforms or preset.platforms)
    out.mkdir(parents=True, exist_ok=True)
    # Downloads are cached per target Python: a wheel's file name alone may fit several.
    downloads, wheels_dir = out / "downloads" / f"py{python}", out / "wheels"
    if wheels_dir.exists():
        shutil.rmtree(wheels_dir)
    wheels_dir.mkdir()
    wheels, trims = [], {}
    for i, pkg in enumerate(preset.packages, 1):
        src = fetch(pkg, python, platforms, downloads)
        dst = wheels_dir / src.name
        if pkg.trim:
            log.info("[%d/%d] %s: trimming %s", i, len(preset.packages), src.name,
                     _fmt_mb(src.stat().st_size))
            report = trim_wheel(src, dst, pkg.trim)
            trims[dst.name] = {"files_removed": len(report.removed), "bytes_removed": report.bytes_removed,
                               "size_before": report.size_before, "size_after": report.size_after}
            for pattern in pkg.trim.drop:
                if not any(TrimRule((pattern,)).drops(r) for r in report.removed):
                    log.info("    (nothing matched %s)", pattern)
            log.info("    removed %d files, %s -> %s", len(report.removed),
                     _fmt_mb(report.size_before), _fmt_mb(report.size_after))
        else:
            log.info("[%d/%d] %s (%s)", i, len(preset.packages), src.name, _fmt_mb(src.stat().st_size))
            shutil.copy2(src, dst)
        wheels.append(dst)
    check_unique(wheels, preset)
    conflicts, unmet = check_requirements(wheels, preset, python)
    for line in unmet:
        log.warning("%s", line)
    if conflicts:
        raise BundleError("version conflicts inside the bundle:\n  " + "\n  ".join(conflicts))
    part_bytes = int(part_mb * MB)
    entries, parts = write_parts(wheels, out / "parts", part_bytes)
    for entry in entries:
        if entry["file"] in trims:
            entry["trimmed"] = trims[entry["file"]]
    manifest = {"format": MANIFEST_FORMAT, "preset": preset_name, "python": python,
                "platforms": list(platforms), "part_bytes": part_bytes, "archive": "tar",
                "total_bytes": sum(p["size"] for p in parts), "wheels": entries, "parts": parts}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    shutil.copy2(Path(__file__), out / "offline_bundle.py")
    return manifest


def install(bundle: Path, target: Path | None, verify_only: bool = False) -> list[Path]:
    manifest = load_manifest(bundle)
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if not verify_only:
        if target is None:
            raise BundleError("install needs --target SITE_DIR (or --verify-only)")
        if manifest["python"] != here:
            raise BundleError(f"the bundle is for Python {manifest['python']}, this is {here}: run "
                              f"this with python{manifest['python']}, or pass --verify-only")
    with tempfile.TemporaryDirectory(prefix=".reassembled_", dir=bundle) as tmp:
        log.info("verifying %d parts and reassembling %d wheels", len(manifest["parts"]),
                 len(manifest["wheels"]))
        wheels = reassemble(bundle, Path(tmp))
        if verify_only:
            for wheel in wheels:
                with zipfile.ZipFile(wheel) as z:
                    if (bad := z.testzip()) is not None:
                        raise BundleError(f"{wheel.name}: member {bad} is corrupt")
            print(f"OK: {len(manifest['parts'])} parts and {len(wheels)} wheels match the manifest")
            return wheels
        target = target.resolve()
        target.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--upgrade",
               "--disable-pip-version-check", "--no-warn-script-location", "--target", str(target),
               *map(str, wheels)]
        log.info("pip install --no-index --no-deps --target %s (%d wheels)", target, len(wheels))
        if subprocess.run(cmd).returncode != 0:
            raise BundleError("pip install failed (its messages are above)")
    print(f"installed {len(wheels)} wheels into {target}; use them with:")
    print(f"export PYTHONPATH={target}${{PYTHONPATH:+:$PYTHONPATH}} PATH={target}/bin:$PATH")
    return wheels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="download, trim, split (on a connected machine)")
    b.add_argument("--preset", choices=sorted(PRESETS), default="gpu-node")
    b.add_argument("--python", help="target Python version, e.g. 3.12 (default: the preset's)")
    b.add_argument("--platform", action="append", dest="platforms",
                   help="target platform tag, repeatable (default: the preset's manylinux tags)")
    b.add_argument("--out", type=Path, help="bundle directory (git-ignore it)")
    b.add_argument("--part-mb", type=float, default=55.0, help="largest part, in MB of 10**6 bytes")
    b.add_argument("--list", action="store_true", help="show what would be fetched, fetch nothing")
    i = sub.add_parser("install", help="verify, reassemble, pip install (on the node)")
    i.add_argument("--from", dest="bundle", type=Path, required=True, help="the bundle directory")
    i.add_argument("--target", type=Path, help="directory to install into (put it on PYTHONPATH)")
    i.add_argument("--verify-only", action="store_true",
                   help="check parts and wheels, install nothing (works on any Python)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.command == "build":
            preset = PRESETS[args.preset]
            python = args.python or preset.python
            platforms = tuple(args.platforms or preset.platforms)
            if args.list:
                print(describe(preset, python, platforms))
                return 0
            if args.out is None:
                parser.error("build needs --out DIR (or --list)")
            manifest = build(preset, args.out, args.part_mb, python, platforms, args.preset)
            print(f"\n{len(manifest['wheels'])} wheels, {_fmt_mb(manifest['total_bytes'])} in "
                  f"{len(manifest['parts'])} parts:")
            for part in manifest["parts"]:
                print(f"  {args.out / 'parts' / part['file']}  {part['size']:>11,d} bytes  "
                      f"sha256 {part['sha256'][:16]}…")
            print(f"on the node: python3 {args.out}/offline_bundle.py install --from {args.out} "
                  f"--target SITE_DIR")
        else:
            install(args.bundle, args.target, args.verify_only)
    except BundleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
