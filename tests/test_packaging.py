"""What pyproject.toml promises: every package-data glob ships a file, the declared Python runs the code."""

from __future__ import annotations

import ast
import json
import os
import site
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from setuptools import find_packages

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# The environment as the suite was started, before conftest's isolated_dirs points XDG_CACHE_HOME
# (where pip keeps its wheel cache) into each test's temp dir: pip runs with the user's own cache.
USER_ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def _packages() -> list[str]:
    return find_packages(str(ROOT), include=PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"])


def _requirements() -> dict[str, Requirement]:
    return {Requirement(r).name: Requirement(r) for r in PYPROJECT["project"]["dependencies"]}


def test_every_package_data_glob_matches_a_file():
    packages = _packages()
    for package, globs in PYPROJECT["tool"]["setuptools"]["package-data"].items():
        # "*" means any package; a named one, that package only
        dirs = [ROOT / p.replace(".", "/") for p in (packages if package == "*" else [package])]
        for pattern in globs:
            assert any(any(d.glob(pattern)) for d in dirs), f"package-data {package!r}: {pattern!r} matches no file"


def test_tomllib_has_its_backport_below_python_3_11():
    # tomllib is in the standard library from 3.11; the package says it runs on older Pythons
    assert PYPROJECT["project"]["requires-python"] == ">=3.10"
    tomli = _requirements().get("tomli")
    assert tomli is not None, "tomli is not a dependency"
    assert tomli.marker is not None
    assert tomli.marker.evaluate({"python_version": "3.10"}) and not tomli.marker.evaluate({"python_version": "3.11"})
    importers = []
    for package in ("edgechat", "quantize"):
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.If) and any(
                    isinstance(n, ast.Import) and n.names[0].name == "tomllib" for n in node.body
                ):
                    importers.append(path)
                    # the usual fallback: `if sys.version_info >= (3, 11): import tomllib / else: import tomli as tomllib`
                    assert "sys.version_info >= (3, 11)" in ast.unparse(node.test), path
                    assert ast.unparse(node.orelse[0]) == "import tomli as tomllib", path
            plain = [n for n in tree.body if isinstance(n, ast.Import) and any(a.name == "tomllib" for a in n.names)]
            assert not plain, f"{path.relative_to(ROOT)} imports tomllib without the tomli fallback"
    assert importers, "nothing imports tomllib any more: drop the tomli dependency and this test"


def test_gguf_has_an_upper_bound_that_admits_the_installed_release():
    # quantize/writer.py uses gguf's internals, which change between releases
    from importlib.metadata import version

    spec = _requirements()["gguf"].specifier
    assert any(s.operator == "<" for s in spec), "gguf needs an upper bound"
    assert spec.contains(version("gguf"))


def _site_dirs() -> list[str]:
    """The site-packages folders of the interpreter running the suite (a venv's own, and the
    system's or the user's where it sees them), in its order."""
    dirs = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
    return [d for d in dict.fromkeys(dirs) if d in sys.path]


@pytest.mark.slow
def test_the_built_wheel_installs_into_a_fresh_venv_and_answers(tmp_path):
    """What `pip install edgechat-*.whl` (and pipx, which does the same in its own venv) gives a
    user: the command, the shipped catalog and styles, the embedded model. The fresh venv sees the
    packages of the environment running the suite (a .pth naming its site-packages: a venv made
    from a venv's interpreter would see only the base interpreter's), so pip resolves every
    dependency against the wheel's metadata but installs only edgechat, offline (`--no-index`:
    a dependency this environment lacks fails here in seconds instead of being downloaded or
    compiled; a venv of its own downloaded ~40 packages and built llama-cpp-python)."""
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(ROOT)],
                   check=True, timeout=600, env=USER_ENV)
    wheel = next(wheels.glob("edgechat-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "edgechat/models/catalog.toml" in names and "edgechat/tui/app.tcss" in names
    venv = tmp_path / "venv"
    # no pip of its own either: this environment's pip, run by the venv's interpreter, installs there
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    bin_dir = venv / ("Scripts" if sys.platform == "win32" else "bin")
    purelib = subprocess.run([str(bin_dir / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True, timeout=60, env=USER_ENV).stdout.strip()
    Path(purelib, "suite-env.pth").write_text("".join(f"{d}\n" for d in _site_dirs()))
    install = subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "--no-index", "-q", str(wheel)],
                             capture_output=True, text=True, timeout=600, env=USER_ENV, cwd=tmp_path)
    assert install.returncode == 0, install.stdout + install.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(EDGECHAT_DATA_DIR=str(tmp_path / "data"), HF_HUB_OFFLINE="1")
    where = subprocess.run([str(bin_dir / "python"), "-c", "import edgechat; print(edgechat.__file__)"], capture_output=True,
                           text=True, env=env, cwd=tmp_path, timeout=60, check=True).stdout
    assert where.startswith(str(venv)), where  # the wheel's copy, not this checkout's
    proc = subprocess.run([str(bin_dir / "edgechat"), "run", "--temperature", "0", "--max-tokens", "4", "--json", "Hi"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["model"] == "smollm2-135m-instruct"
    listing = subprocess.run([str(bin_dir / "edgechat"), "models", "--catalog"], capture_output=True, text=True,
                             env=env, cwd=tmp_path, timeout=300, check=True).stdout
    assert "qwen3-4b" in listing
