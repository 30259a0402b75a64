"""Speech models by name: a faster-whisper folder or a Piper voice's .onnx on disk, or fetched
from the Hub once and read from its cache after (offline too).

- speech to text: a folder holding model.bin, `Systran/faster-whisper-base` (any repo in that
  layout), or the short `whisper-base` / `whisper-small` / `whisper-large-v3` ...
- text to speech: an .onnx with its .onnx.json beside it, or a Piper voice's name,
  `en_US-lessac-medium`, from rhasspy/piper-voices.
"""

from __future__ import annotations

import re
from pathlib import Path

from edgechat.config import Paths
from edgechat.errors import ModelNotFoundError
from edgechat.models.hub import hub_file

#: the models a command uses when none is named (multilingual Whisper; a clear US English voice)
DEFAULT_STT = "whisper-base"
DEFAULT_TTS = "en_US-lessac-medium"
#: what faster-whisper loads from a model folder
WHISPER_FILES = ("model.bin", "config.json", "tokenizer.json", "vocabulary.txt")
PIPER_REPO = "rhasspy/piper-voices"
#: Piper's voice names: LANG_REGION-NAME-QUALITY
_PIPER_NAME = re.compile(r"(?P<lang>[a-z]{2,3})_(?P<region>[A-Z]{2})-(?P<name>[A-Za-z0-9_]+)-(?P<quality>x_low|low|medium|high)")


def speech_kind(ref: str) -> str | None:
    """"stt" or "tts" for the short names of speech models (whisper-base, en_US-lessac-medium)."""
    if re.fullmatch(r"whisper-[\w.-]+", ref):
        return "stt"
    return "tts" if _PIPER_NAME.fullmatch(ref) else None


def resolve_stt(ref: str, paths: Paths) -> Path:
    """The folder of a speech-to-text model; ModelNotFoundError says what to give instead."""
    local = Path(ref).expanduser()
    if local.is_dir():
        return local
    repo = f"Systran/faster-{ref}" if speech_kind(ref) == "stt" else ref
    if repo.count("/") != 1:
        raise ModelNotFoundError(f"{ref!r} is not a speech-to-text model: give a faster-whisper folder, "
                                 "a Hub repo such as Systran/faster-whisper-base, or whisper-base")
    return [hub_file(repo, name, ref, paths) for name in WHISPER_FILES][0].parent


def resolve_tts(ref: str, paths: Paths) -> Path:
    """The .onnx of a Piper voice (its .onnx.json beside it)."""
    local = Path(ref).expanduser()
    if local.is_file():
        return local
    name = local.name.removesuffix(".onnx")
    if not (m := _PIPER_NAME.fullmatch(name)):
        raise ModelNotFoundError(f"{ref!r} is not a voice: give a Piper .onnx (with its .onnx.json beside it) "
                                 "or a Piper voice's name such as en_US-lessac-medium")
    folder = f"{m['lang']}/{m['lang']}_{m['region']}/{m['name']}/{m['quality']}"
    onnx = hub_file(PIPER_REPO, f"{folder}/{name}.onnx", ref, paths)
    hub_file(PIPER_REPO, f"{folder}/{name}.onnx.json", ref, paths)
    return onnx
