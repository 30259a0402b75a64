"""`edgechat transcribe FILE...` (speech to text) and `edgechat say TEXT` (text to speech, to a
file or the speaker), and the speech models `serve` and `run --audio` are given. Both need the
`voice` extra; without it each says in one line what to install."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import click

from edgechat.cli.common import data_dir_option
from edgechat.config import get_paths
from edgechat.engine.speech import AudioInputError
from edgechat.engine.speech.models import SpeechModels, speech_models
from edgechat.errors import UsageError
from edgechat.models.speech import DEFAULT_STT, DEFAULT_TTS
from edgechat.sound import play

#: a file's extension -> the encoder's format
_FORMAT_BY_SUFFIX = {".wav": "wav", ".mp3": "mp3", ".flac": "flac", ".ogg": "opus", ".opus": "opus", ".aac": "aac", ".pcm": "pcm", ".raw": "pcm"}

stt_model_option = click.option("--stt-model", envvar="EDGECHAT_STT_MODEL", default=DEFAULT_STT, show_default=True, metavar="MODEL",
                                help="Speech to text: a faster-whisper folder, a Hub repo, or whisper-base / whisper-small (env: EDGECHAT_STT_MODEL).")
tts_model_option = click.option("--tts-model", envvar="EDGECHAT_TTS_MODEL", default=DEFAULT_TTS, show_default=True, metavar="VOICE",
                                help="Text to speech: a Piper voice's .onnx or its name (env: EDGECHAT_TTS_MODEL).")


def transcribe_file(models: SpeechModels, file: Path, language: str | None = None, translate: bool = False):
    """The transcript of one audio file and its segments; a bad file is a UsageError naming it."""
    try:
        return models.transcribe_file(file, language, translate)
    except AudioInputError as exc:
        raise UsageError(str(exc).replace(f"'{file}'", str(file))) from None


@click.command("transcribe")
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path))
@stt_model_option
@click.option("--language", default=None, help="The spoken language's ISO-639-1 code (default: heard from the audio).")
@click.option("--translate", is_flag=True, help="Write English, whatever the language spoken.")
@click.option("--format", "fmt", type=click.Choice(["text", "srt", "vtt", "json"]), default="text", show_default=True)
@data_dir_option
def transcribe_cmd(files: tuple[Path, ...], stt_model: str, language: str | None, translate: bool, fmt: str, data_dir: str | None) -> None:
    """Write down what is said in audio FILES (WAV, MP3, FLAC, OGG, M4A, WebM), offline."""
    from edgechat.server.audio_api import subtitles

    models = speech_models(stt_model, None, get_paths(data_dir))
    for file in files:
        transcript, segments = transcribe_file(models, file, language, translate)
        text = "".join(s.text for s in segments).strip()
        if len(files) > 1 and fmt == "text":
            click.echo(f"{file}: {text}")
        elif fmt == "text":
            click.echo(text)
        elif fmt == "json":
            click.echo(json.dumps({"file": str(file), "language": transcript.language, "duration": round(transcript.duration, 3), "text": text,
                                   "segments": [{"start": round(s.start, 3), "end": round(s.end, 3), "text": s.text} for s in segments]}))
        else:
            click.echo(subtitles(segments, fmt))


@click.command("say")
@click.argument("text", required=True)
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the speech to this file (.wav, .mp3, .flac, .ogg, .aac, .pcm) instead of playing it.")
@tts_model_option
@click.option("--voice", default=None, help="A speaker of a voice that has several.")
@click.option("--speed", type=float, default=1.0, show_default=True, help="0.25 to 4.")
@data_dir_option
def say_cmd(text: str, output: Path | None, tts_model: str, voice: str | None, speed: float, data_dir: str | None) -> None:
    """Read TEXT aloud ("-": standard input), offline: to the speaker, or to a file with -o."""
    from edgechat.engine.speech.encode import Encoder

    if text == "-":
        text = sys.stdin.read()
    fmt = "wav"
    if output is not None:
        fmt = _FORMAT_BY_SUFFIX.get(output.suffix.lower(), "")
        if not fmt:
            raise UsageError(f"{output}: name a .wav, .mp3, .flac, .ogg, .aac or .pcm file")
    models = speech_models(None, tts_model, get_paths(data_dir))
    try:
        speaker = models.voice()
        pcm = b"".join(speaker.speak(text, voice, speed))
    except AudioInputError as exc:
        raise UsageError(f"{exc}".replace("'input'", "the text").replace("'voice'", "--voice").replace("'speed'", "--speed")) from None
    encoder = Encoder(fmt, speaker.sample_rate, len(pcm))
    audio = encoder.feed(pcm) + encoder.close()
    if output is not None:
        _write_atomically(output, audio)
        click.echo(f"{output}: {len(pcm) / 2 / speaker.sample_rate:.1f} s of speech", err=True)
    else:
        try:
            play(audio)
        except UsageError as exc:
            raise UsageError(f"{exc}, or write a file with -o out.wav") from None


def _write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def register(cli: click.Group) -> None:
    cli.add_command(transcribe_cmd)
    cli.add_command(say_cmd)
