"""Speech, offline: Whisper (faster-whisper, CTranslate2) writes audio down, a Piper voice
(onnxruntime) reads text aloud. Both come with the `voice` extra, since CTranslate2 and Piper's
espeak-ng build have no wheel for every platform; without it every voice command and endpoint
says in one line what to install (`VoiceMissingError`)."""

from __future__ import annotations

import importlib

from edgechat.errors import EdgechatError

INSTALL_HINT = "pip install 'edgechat[voice]'"


class VoiceMissingError(EdgechatError):
    """The voice extra is not installed."""


class AudioInputError(EdgechatError):
    """Audio or text a speech model cannot take: `param` names the request field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def voice_report() -> str:
    """doctor's line: the voice extra's versions, or what to install and what each part needs."""
    from importlib.metadata import PackageNotFoundError, version

    found, missing = [], []
    for package in ("faster-whisper", "ctranslate2", "av", "piper-tts"):
        try:
            found.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            missing.append(package)
    if not missing:
        return f"Voice: {', '.join(found)} (transcribe, say, /v1/audio/*, /talk, /speak)"
    return f"Voice: not installed ({', '.join(missing)} missing): {INSTALL_HINT}"


def require(module: str, what: str) -> None:
    """VoiceMissingError unless `module` (faster_whisper or piper) can be imported."""
    try:
        importlib.import_module(module)
    except ImportError:
        raise VoiceMissingError(f"{what} needs the voice extra, which is not installed: {INSTALL_HINT}") from None
