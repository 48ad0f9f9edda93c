"""The top-level setup.py that users of the original expect hands everything to pyproject.toml."""
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_setup_py_defers_to_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    r = subprocess.run([sys.executable, "setup.py", "--name", "--version"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-2:] == [project["name"], project["version"]]
    # nothing of the metadata is repeated in setup.py, so the two cannot drift apart
    code = [line for line in (ROOT / "setup.py").read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")]
    assert code == ["from setuptools import setup", "setup()"]
