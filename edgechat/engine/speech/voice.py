"""Text to speech with a Piper voice (an .onnx with its .onnx.json, run on onnxruntime): 16-bit
mono PCM, one sentence at a time, so the first sentence plays while the next is made."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

from edgechat.engine.speech import AudioInputError, require
from edgechat.errors import ModelFormatError

#: OpenAI's limit on the text of one request
MAX_INPUT_CHARS = 4096
#: OpenAI's speed range
MIN_SPEED, MAX_SPEED = 0.25, 4.0
#: the voices OpenAI's API names: clients send one of them, so each speaks with the default speaker
OPENAI_VOICES = frozenset({"alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse", "marin", "cedar"})


class Voice:
    """One Piper voice model and its speakers."""

    def __init__(self, onnx_path: Path):
        require("piper", "speech")
        from piper import PiperVoice

        onnx_path = Path(onnx_path)
        config = onnx_path.with_name(onnx_path.name + ".json")
        if onnx_path.suffix != ".onnx" or not onnx_path.is_file() or not config.is_file():
            raise ModelFormatError(f"{onnx_path} is not a Piper voice: give its .onnx with the .onnx.json beside it")
        self.path = onnx_path
        self.name = onnx_path.stem
        # Piper names voices LANG-NAME-QUALITY: "joe" for en_US-joe-medium
        self.short = self.name.split("-")[1] if self.name.count("-") == 2 else self.name
        self._voice = PiperVoice.load(onnx_path, config_path=config)
        self.sample_rate = int(self._voice.config.sample_rate)
        self.speakers = dict(self._voice.config.speaker_id_map or {})
        self._length_scale = float(self._voice.config.length_scale)
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        """The voice names a request may give (OpenAI's speak with the default speaker)."""
        return list(dict.fromkeys([self.short, self.name, *self.speakers]))

    def speaker(self, voice: str | None) -> int | None:
        """The speaker id for a request's `voice`; AudioInputError for a name it does not have."""
        if voice is None or voice in (self.name, self.short) or voice in OPENAI_VOICES:
            return None
        if voice in self.speakers:
            return self.speakers[voice]
        raise AudioInputError(f"'voice': unknown voice {voice!r}: this server speaks {', '.join(repr(n) for n in self.names())}", "voice")

    @staticmethod
    def check_text(text: str, speed: float = 1.0) -> None:
        if not text or not text.strip():
            raise AudioInputError("'input' is empty: give the text to speak", "input")
        if len(text) > MAX_INPUT_CHARS:
            raise AudioInputError(f"'input' is {len(text):,} characters, over the {MAX_INPUT_CHARS:,} one request speaks: split it", "input")
        if not MIN_SPEED <= speed <= MAX_SPEED:
            raise AudioInputError(f"'speed' must be between {MIN_SPEED} and {MAX_SPEED}, not {speed}", "speed")

    def speak(self, text: str, voice: str | None = None, speed: float = 1.0) -> Iterator[bytes]:
        """16-bit PCM at `sample_rate`, one sentence per chunk, made as the chunks are read."""
        self.check_text(text, speed)
        speaker = self.speaker(voice)
        from piper import SynthesisConfig

        config = SynthesisConfig(speaker_id=speaker, length_scale=self._length_scale / speed)
        with self._lock:
            for chunk in self._voice.synthesize(text, syn_config=config):
                yield chunk.audio_int16_bytes
