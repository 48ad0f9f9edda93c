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

The presets (packages, pins, trims) are data: offline_bundle_presets.toml, beside this file. Only
`build` reads it, so `install` needs this file alone (build copies the presets along anyway).
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


# Tried only when nothing matched a preset's platforms (the node's glibc is 2.39).
FALLBACK_PLATFORM_STEMS = ("manylinux_2_24", "manylinux_2_31", "manylinux_2_34", "manylinux_2_35")

PRESETS_FILE = Path(__file__).with_name("offline_bundle_presets.toml")
PRESET_KEYS = {"python", "platforms", "packages", "sdist_ok", "trim", "node_has", "left_out", "accepted_conflicts"}


def load_presets(path: Path = PRESETS_FILE) -> dict[str, Preset]:
    """The presets written in `path` (offline_bundle_presets.toml, which describes its keys).

    Called by `build` only: `install` must run on the node from the bundle's copy of this script,
    and on Pythons older than tomllib (3.11) too.
    """
    try:
        import tomllib
    except ImportError:
        raise BundleError("reading the presets needs Python 3.11 or newer (tomllib): run build with it") from None
    if not path.is_file():
        raise BundleError(f"{path} is missing: the presets lie beside offline_bundle.py in the repository's "
                          f"scripts/; copy it from there")
    with open(path, "rb") as f:
        tables = tomllib.load(f)
    presets: dict[str, Preset] = {}
    for name, table in tables.items():  # in file order: a subset follows the preset it names
        if "subset_of" in table:
            presets[name] = _subset_preset(path, name, table, presets)
            continue
        if unknown := set(table) - PRESET_KEYS:
            raise BundleError(f"{path}: [{name}] has unknown keys {sorted(unknown)}; known: {sorted(PRESET_KEYS)}")
        pins = [pin.partition("==") for pin in table["packages"]]  # (name, "==", version)
        if bad := [pkg + sep + version for pkg, sep, version in pins if not (pkg and sep and version)]:
            raise BundleError(f"{path}: [{name}] packages {bad} are not written NAME==VERSION")
        trims = {pkg: TrimRule(tuple(rule["drop"]), tuple(rule.get("keep", ())))
                 for pkg, rule in table.get("trim", {}).items()}
        sdist_ok = set(table.get("sdist_ok", ()))
        if strays := (set(trims) | sdist_ok) - {pkg for pkg, _, _ in pins}:
            raise BundleError(f"{path}: [{name}] trims or sdist_ok name {sorted(strays)}, which its packages lack")
        presets[name] = Preset(
            python=table["python"],
            platforms=tuple(table["platforms"]),
            packages=tuple(Package(pkg, version, trim=trims.get(pkg), sdist_ok=pkg in sdist_ok)
                           for pkg, _, version in pins),
            node_has=tuple(table["node_has"]),
            left_out=tuple(table.get("left_out", ())),
            accepted_conflicts=tuple(tuple(c) for c in table.get("accepted_conflicts", ())))
    return presets


def _subset_preset(path: Path, name: str, table: dict, presets: dict[str, Preset]) -> Preset:
    """A preset made of some packages of another, with that one's pins, Python, platforms and
    node_has, so that one node can take both bundles."""
    if unknown := set(table) - {"subset_of", "packages"}:
        raise BundleError(f"{path}: [{name}] is a subset_of preset: it takes only `packages`, not {sorted(unknown)}")
    base = presets.get(table["subset_of"])
    if base is None:
        raise BundleError(f"{path}: [{name}] is a subset of {table['subset_of']!r}, which must come above it")
    wanted = set(table["packages"])
    if missing := wanted - {p.name for p in base.packages}:
        raise BundleError(f"{path}: [{name}] packages {sorted(missing)} are not in [{table['subset_of']}]")
    return Preset(python=base.python, platforms=base.platforms, node_has=base.node_has,
                  packages=tuple(p for p in base.packages if p.name in wanted))


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
    shutil.copy2(PRESETS_FILE, out / PRESETS_FILE.name)  # install does not need it; build --list from the bundle does
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
    # No argparse choices: they would have to be read from the presets file before any command,
    # and `install` must not need that file.
    b.add_argument("--preset", default="gpu-node", metavar="NAME",
                   help=f"a preset of {PRESETS_FILE.name} (default: %(default)s)")
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
            presets = load_presets()
            if args.preset not in presets:
                b.error(f"argument --preset: invalid choice: {args.preset!r} (choose from "
                        f"{', '.join(map(repr, sorted(presets)))})")
            preset = presets[args.preset]
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
