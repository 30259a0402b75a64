"""Speech as the file a client asked for, made as the PCM arrives: WAV and raw PCM by hand,
MP3, Opus (in Ogg), AAC (ADTS) and FLAC through PyAV's ffmpeg (it comes with the voice extra)."""

from __future__ import annotations

import numpy as np

from edgechat.engine.speech import AudioInputError
from edgechat.engine.speech.audio import wav_header

#: response_format -> (container, codec, rate: None keeps the voice's), and its media type
_CODED = {"mp3": ("mp3", "libmp3lame", None), "opus": ("ogg", "libopus", 48_000), "aac": ("adts", "aac", None), "flac": ("flac", "flac", None)}
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac", "flac": "audio/flac"}
FORMATS = tuple(MEDIA_TYPES)


class _Sink:
    """A write-only file for the muxer: what it wrote since it was last emptied."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out = b"".join(self.parts)
        self.parts.clear()
        return out


class Encoder:
    """feed(pcm) gives the bytes of the file so far, close() the rest: their concatenation is the
    whole file. A WAV of unknown length (`length` None) says so in its header, as streams do."""

    def __init__(self, fmt: str, sample_rate: int, length: int | None = None):
        if fmt not in MEDIA_TYPES:
            raise AudioInputError(f"'response_format': {fmt!r} is not one of {', '.join(FORMATS)}", "response_format")
        self.fmt, self.rate = fmt, sample_rate
        self._head = wav_header(sample_rate, length) if fmt == "wav" else b""
        self._container = None
        if fmt in _CODED:
            import av
            from av.audio.stream import AudioStream

            container, codec, rate = _CODED[fmt]
            self._sink = _Sink()
            self._container = av.open(self._sink, mode="w", format=container)
            stream = self._container.add_stream(codec, rate=rate or sample_rate)
            assert isinstance(stream, AudioStream)
            stream.layout = "mono"
            self._stream = stream

    def feed(self, pcm: bytes) -> bytes:
        head, self._head = self._head, b""
        if self._container is None:
            return head + pcm
        import av

        frame = av.AudioFrame.from_ndarray(np.frombuffer(pcm, np.int16).reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = self.rate
        for packet in self._stream.encode(frame):
            self._container.mux(packet)
        return self._sink.take()

    def close(self) -> bytes:
        head, self._head = self._head, b""
        if self._container is None:
            return head
        for packet in self._stream.encode(None):
            self._container.mux(packet)
        self._container.close()
        return self._sink.take()
