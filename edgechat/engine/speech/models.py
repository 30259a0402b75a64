"""The speech models a front end was given, each loaded on its first use and kept while it is
used: loading Whisper or a voice takes a second or two, an answer should not wait for it twice.
Idle for `idle_unload` seconds, a model is let go (a transcription or speech under way keeps the
object it holds until it ends); what the loaded ones take is counted beside the language models'
budget (`held_bytes`)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from edgechat.config import Paths
from edgechat.engine.speech import AudioInputError
from edgechat.engine.speech.transcriber import Segment, Transcriber, Transcript
from edgechat.engine.speech.voice import Voice
from edgechat.errors import EdgechatError


def speech_models(stt: str | None, tts: str | None, paths: Paths, threads: int | None = None,
                  idle_unload: float | None = None) -> SpeechModels:
    """The named speech models (models/speech.py's names), found or fetched from the Hub now,
    loaded on first use."""
    from edgechat.models.speech import resolve_stt, resolve_tts

    return SpeechModels(resolve_stt(stt, paths) if stt else None, resolve_tts(tts, paths) if tts else None, threads or 0,
                        idle_unload)


#: resident memory per byte of model files once loaded and used: whisper-base (int8) held 188 MiB
#: for its 141 MiB, the Piper voice en_US-joe-medium 170 MiB for its 60 MiB (onnxruntime's arena)
STT_MEMORY_PER_BYTE, TTS_MEMORY_PER_BYTE = 1.4, 2.9


def _files_bytes(path: Path) -> int:
    files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
    return sum(f.stat().st_size for f in files)


class SpeechModelMissingError(EdgechatError):
    """No model of the kind a request needs was named."""


class SpeechModels:
    def __init__(self, stt: Path | None = None, tts: Path | None = None, threads: int = 0, idle_unload: float | None = None):
        self.stt, self.tts, self.threads = stt, tts, threads
        #: seconds unused before a model is let go (None: kept until the process ends)
        self.idle_unload = idle_unload
        self._transcriber: Transcriber | None = None
        self._voice: Voice | None = None
        self._last_used = {"stt": 0.0, "tts": 0.0}
        # read once: the pool asks under its lock at every load, /v1/models at every listing
        self._memory = {kind: 0 if path is None else int(_files_bytes(path) * per_byte)
                        for kind, path, per_byte in (("stt", stt, STT_MEMORY_PER_BYTE), ("tts", tts, TTS_MEMORY_PER_BYTE))}
        self._timer: threading.Timer | None = None
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
            self._used("stt")
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
            self._used("tts")
            return self._voice

    def loaded(self, kind: str) -> bool:
        """Whether the "stt" or "tts" model is loaded now."""
        return (self._transcriber if kind == "stt" else self._voice) is not None

    def memory_bytes(self, kind: str) -> int:
        """What the "stt" or "tts" model takes once loaded (its files times what loading and use
        were measured to add); 0 where none is named."""
        return self._memory[kind]

    def held_bytes(self) -> int:
        """What the loaded speech models take: the language models' pool counts it in its budget."""
        return sum(self.memory_bytes(kind) for kind in ("stt", "tts") if self.loaded(kind))

    def _used(self, kind: str) -> None:
        """Under the lock: `kind` was just used; let it go once idle for idle_unload seconds."""
        self._last_used[kind] = time.monotonic()
        if self.idle_unload is not None and self._timer is None:
            self._timer = threading.Timer(self.idle_unload, self._unload_idle)
            self._timer.daemon = True
            self._timer.start()

    def _unload_idle(self) -> None:
        with self._lock:
            self._timer = None
            now, idle = time.monotonic(), self.idle_unload or 0.0
            if self._transcriber is not None and now - self._last_used["stt"] >= idle:
                self._transcriber = None
            if self._voice is not None and now - self._last_used["tts"] >= idle:
                self._voice = None
            waits = [self._last_used[k] + idle - now for k in ("stt", "tts") if self.loaded(k)]
            if waits:  # the other one was used since: look again when its time runs out
                self._timer = threading.Timer(max(min(waits), 0.05), self._unload_idle)
                self._timer.daemon = True
                self._timer.start()


def speech_cards(speech: SpeechModels, created: int) -> list[dict]:
    """The speech models as OpenAI's /v1/models lists them, with what each does, whether it is
    loaded and what it takes loaded."""
    kinds = (("transcription", "stt", speech.stt_id), ("speech", "tts", speech.tts_id))
    return [{"id": name, "object": "model", "created": created, "owned_by": "edgechat",
             "meta": {"kind": kind, "state": "loaded" if speech.loaded(key) else "unloaded", "memory_bytes": speech.memory_bytes(key)}}
            for kind, key, name in kinds if name is not None]
