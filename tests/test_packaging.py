"""What pyproject.toml promises: every package-data glob ships a file, the declared Python runs the code."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from setuptools import find_packages

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


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
