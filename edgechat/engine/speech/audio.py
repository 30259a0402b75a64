"""Audio in and out: any file the decoder reads becomes 16 kHz mono float32 samples (what Whisper
hears), checked for the mistakes a caller makes (empty, too large, not audio, silent); 16-bit PCM
out becomes a WAV file, whole or as a stream whose length is not known yet."""

from __future__ import annotations

import io
import struct

import numpy as np

from edgechat.engine.speech import AudioInputError, require

#: OpenAI's upload limit for one audio file
MAX_AUDIO_BYTES = 25 * 1024 * 1024
#: Whisper's input rate
SAMPLE_RATE = 16_000
#: a peak below this (-60 dBFS) is silence: Whisper writes words it imagines into silence
SILENCE_PEAK = 1e-3
#: the size fields of a WAV whose length is unknown while it streams (as players expect)
_UNKNOWN = 0xFFFFFFFF


def decode(data: bytes, field: str = "file") -> np.ndarray:
    """The samples of an audio file's bytes at 16 kHz, mono, float32 in [-1, 1], whatever its
    format and rate; AudioInputError naming `field` where there is nothing to hear."""
    if not data:
        raise AudioInputError(f"'{field}' is empty: send an audio file (WAV, MP3, FLAC, OGG, M4A, WebM)", field)
    if len(data) > MAX_AUDIO_BYTES:
        raise AudioInputError(f"'{field}' is {len(data) / 2**20:.1f} MiB, over the {MAX_AUDIO_BYTES // 2**20} MiB limit: "
                              "send a shorter recording or split it", field)
    require("faster_whisper", "transcription")
    from faster_whisper import decode_audio

    try:
        samples = decode_audio(io.BytesIO(data), sampling_rate=SAMPLE_RATE)
    except Exception as exc:  # av raises its own error per container and codec fault
        raise AudioInputError(f"'{field}' is not audio edgechat can read ({type(exc).__name__}): "
                              "send WAV, MP3, FLAC, OGG, M4A or WebM", field) from None
    if samples.size == 0:
        raise AudioInputError(f"'{field}' holds no audio samples", field)
    if float(np.max(np.abs(samples))) < SILENCE_PEAK:
        raise AudioInputError(f"'{field}' is silent: there is no speech to write down", field)
    return samples


def wav_header(sample_rate: int, n_bytes: int | None = None) -> bytes:
    """A 16-bit mono WAV header for `n_bytes` of PCM, or for a stream of unknown length."""
    data = _UNKNOWN if n_bytes is None else n_bytes
    riff = _UNKNOWN if n_bytes is None else 36 + n_bytes
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVE" + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
            + b"data" + struct.pack("<I", data))


def wav_bytes(pcm: bytes, sample_rate: int) -> bytes:
    """A whole WAV file of 16-bit mono PCM."""
    return wav_header(sample_rate, len(pcm)) + pcm
