"""The speech models a front end was given, each loaded on its first use and kept: loading
Whisper or a voice takes a second or two, an answer should not wait for it twice."""

from __future__ import annotations

import threading
from pathlib import Path

from edgechat.config import Paths
from edgechat.engine.speech import AudioInputError
from edgechat.engine.speech.transcriber import Segment, Transcriber, Transcript
from edgechat.engine.speech.voice import Voice
from edgechat.errors import EdgechatError


def speech_models(stt: str | None, tts: str | None, paths: Paths, threads: int | None = None) -> SpeechModels:
    """The named speech models (models/speech.py's names), found or fetched from the Hub now,
    loaded on first use."""
    from edgechat.models.speech import resolve_stt, resolve_tts

    return SpeechModels(resolve_stt(stt, paths) if stt else None, resolve_tts(tts, paths) if tts else None, threads or 0)


class SpeechModelMissingError(EdgechatError):
    """No model of the kind a request needs was named."""


class SpeechModels:
    def __init__(self, stt: Path | None = None, tts: Path | None = None, threads: int = 0):
        self.stt, self.tts, self.threads = stt, tts, threads
        self._transcriber: Transcriber | None = None
        self._voice: Voice | None = None
        self._lock = threading.Lock()

    @property
    def stt_id(self) -> str | None:
        return None if self.stt is None else self.stt.name

    @property
    def tts_id(self) -> str | None:
        return None if self.tts is None else self.tts.stem

    def transcriber(self) -> Transcriber:
        if self.stt is None:
            raise SpeechModelMissingError("no speech-to-text model was named: give one with --stt-model (e.g. whisper-base)")
        with self._lock:
            if self._transcriber is None:
                self._transcriber = Transcriber(self.stt, self.threads)
            return self._transcriber

    def transcribe_file(self, file: Path, language: str | None = None, translate: bool = False) -> tuple[Transcript, list[Segment]]:
        """An audio file's transcript and all its segments; AudioInputError naming the file."""
        from edgechat.engine.speech.audio import decode

        try:
            data = file.read_bytes()
        except OSError as exc:
            raise AudioInputError(f"cannot read {file}: {exc.strerror}", str(file)) from None
        transcript = self.transcriber().transcribe(decode(data, str(file)), language, translate=translate)
        return transcript, list(transcript.segments)

    def voice(self) -> Voice:
        if self.tts is None:
            raise SpeechModelMissingError("no voice was named: give one with --tts-model (e.g. en_US-lessac-medium)")
        with self._lock:
            if self._voice is None:
                self._voice = Voice(self.tts)
            return self._voice


def speech_cards(speech: SpeechModels, created: int) -> list[dict]:
    """The speech models as OpenAI's /v1/models lists them, with what each does."""
    kinds = (("transcription", speech.stt_id), ("speech", speech.tts_id))
    return [{"id": name, "object": "model", "created": created, "owned_by": "edgechat", "meta": {"kind": kind}}
            for kind, name in kinds if name is not None]
