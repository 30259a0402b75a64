"""Speech to text with a Whisper model in CTranslate2 form (faster-whisper): segments with their
times, written as they are decoded, in the spoken language or translated to English."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edgechat.engine.speech import AudioInputError, require
from edgechat.errors import ModelFormatError


@dataclass
class Word:
    word: str
    start: float
    end: float


@dataclass
class Segment:
    id: int
    start: float
    end: float
    text: str
    tokens: list[int]
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float
    temperature: float
    words: list[Word] = field(default_factory=list)


@dataclass
class Transcript:
    """What is known before the first segment (the language heard, the audio's length) and the
    segments, decoded as they are read."""

    language: str
    duration: float
    segments: Iterator[Segment]


class Transcriber:
    """One Whisper model; one transcription at a time (CTranslate2 uses every thread it was given)."""

    def __init__(self, model_dir: Path, threads: int = 0):
        require("faster_whisper", "transcription")
        from faster_whisper import WhisperModel
        from faster_whisper.tokenizer import _LANGUAGE_CODES

        if not (Path(model_dir) / "model.bin").is_file():
            raise ModelFormatError(f"{model_dir} is not a faster-whisper model folder (no model.bin): "
                                   "name one such as Systran/faster-whisper-base")
        self.path = Path(model_dir)
        self.languages = frozenset(_LANGUAGE_CODES)
        # int8 weights: the speed of the CTranslate2 CPU path, and a quarter of float32's memory
        self._model = WhisperModel(str(model_dir), device="cpu", compute_type="int8", cpu_threads=threads)
        self.multilingual = self._model.model.is_multilingual
        self._lock = threading.Lock()

    def check_language(self, language: str | None, param: str = "language") -> None:
        if language is not None and language not in self.languages:
            raise AudioInputError(f"'{param}': unknown language {language!r}: give an ISO-639-1 code such as 'en' or 'fr'", param)
        if language not in (None, "en") and not self.multilingual:
            raise AudioInputError(f"'{param}': this Whisper model hears English only", param)

    def transcribe(self, samples: np.ndarray, language: str | None = None, prompt: str | None = None, temperature: float = 0.0,
                   translate: bool = False, words: bool = False) -> Transcript:
        """Segments of `samples` (16 kHz mono); decoding runs as the segments are read, holding
        the model until the last one."""
        self.check_language(language)
        self._lock.acquire()
        try:
            # beam 1: greedy decoding, the fast path on a small CPU (Whisper's own fallback to
            # higher temperatures still redoes a segment that reads as garbage)
            temps = [temperature] if temperature > 0 else [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
            raw, info = self._model.transcribe(samples, language=language, task="translate" if translate else "transcribe",
                                               beam_size=1, temperature=temps, initial_prompt=prompt or None, word_timestamps=words)
        except BaseException:
            self._lock.release()
            raise
        return Transcript(info.language, float(info.duration), self._segments(raw))

    def _segments(self, raw) -> Iterator[Segment]:
        try:
            for i, s in enumerate(raw):
                yield Segment(i, float(s.start), float(s.end), s.text, list(s.tokens), float(s.avg_logprob), float(s.compression_ratio),
                              float(s.no_speech_prob), float(s.temperature or 0.0),
                              [Word(w.word, float(w.start), float(w.end)) for w in (s.words or [])])
        finally:
            self._lock.release()
