"""OpenAI's audio API: `POST /v1/audio/transcriptions` and `/v1/audio/translations` (a multipart
upload written down by Whisper, as json, text, srt, vtt or verbose_json, or streamed as
`transcript.text.delta` events) and `POST /v1/audio/speech` (text read aloud by a Piper voice,
sent as it is made, sentence by sentence). There is one model of each kind, so any `model` name
a client sends (whisper-1, tts-1, ...) gets it. Without the voice extra each endpoint is a 501
saying what to install; a bad file or field is a 400 naming it."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from edgechat.engine.speech import AudioInputError, VoiceMissingError
from edgechat.engine.speech.audio import MAX_AUDIO_BYTES, decode
from edgechat.engine.speech.encode import FORMATS, MEDIA_TYPES, Encoder
from edgechat.engine.speech.models import SpeechModelMissingError, SpeechModels
from edgechat.engine.speech.transcriber import Segment, Transcript
from edgechat.errors import ModelFormatError
from edgechat.server.dispatch import Api
from edgechat.server.errors import ApiError, bad_request

TRANSCRIPT_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
log = logging.getLogger("edgechat.server")


def _api_error(exc: Exception) -> ApiError:
    if isinstance(exc, AudioInputError):
        return bad_request(str(exc), param=exc.param, code="invalid_value")
    if isinstance(exc, VoiceMissingError):
        return ApiError(501, str(exc), type="server_error", code="voice_not_installed")
    if isinstance(exc, SpeechModelMissingError):
        return ApiError(404, str(exc), code="model_not_found")
    if isinstance(exc, ModelFormatError):
        return ApiError(500, str(exc), type="server_error", code="model_load_failed")
    raise exc


def _timestamp(seconds: float, sep: str) -> str:
    ms = round(seconds * 1000)
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def subtitles(segments: list[Segment], fmt: str) -> str:
    """The segments as SubRip (srt) or WebVTT (vtt) cues."""
    sep = "," if fmt == "srt" else "."
    cues = [f"{_timestamp(s.start, sep)} --> {_timestamp(s.end, sep)}\n{s.text.strip()}\n" for s in segments]
    if fmt == "srt":
        return "\n".join(f"{i}\n{cue}" for i, cue in enumerate(cues, 1))
    return "WEBVTT\n\n" + "\n".join(cues)


def _segment_json(s: Segment) -> dict:
    return {"id": s.id, "seek": 0, "start": round(s.start, 3), "end": round(s.end, 3), "text": s.text, "tokens": s.tokens,
            "temperature": s.temperature, "avg_logprob": s.avg_logprob, "compression_ratio": s.compression_ratio,
            "no_speech_prob": s.no_speech_prob}


def transcript_body(t: Transcript, segments: list[Segment], fmt: str, task: str, words: bool, seg_times: bool) -> Response:
    text = "".join(s.text for s in segments).strip()
    if fmt == "text":
        return PlainTextResponse(text + "\n")
    if fmt in ("srt", "vtt"):
        return PlainTextResponse(subtitles(segments, fmt), media_type="text/vtt" if fmt == "vtt" else "application/x-subrip")
    usage = {"type": "duration", "seconds": round(t.duration)}
    if fmt == "json":
        return JSONResponse({"text": text, "usage": usage})
    body: dict = {"task": task, "language": t.language, "duration": round(t.duration, 3), "text": text}
    if seg_times:
        body["segments"] = [_segment_json(s) for s in segments]
    if words:
        body["words"] = [{"word": w.word.strip(), "start": round(w.start, 3), "end": round(w.end, 3)} for s in segments for w in s.words]
    body["usage"] = usage
    return JSONResponse(body)


class AudioApi(Api):
    def __init__(self, dispatcher):
        super().__init__(dispatcher)
        self.speech: SpeechModels = dispatcher.speech

    def routes(self) -> list[Route]:
        return [
            Route("/v1/audio/transcriptions", self.transcriptions, methods=["POST"]),
            Route("/v1/audio/translations", self.translations, methods=["POST"]),
            Route("/v1/audio/speech", self.speech_endpoint, methods=["POST"]),
        ]

    # ---- speech to text ----------------------------------------------------------------------

    async def transcriptions(self, request: Request) -> Response:
        return await self._written_down(request, translate=False)

    async def translations(self, request: Request) -> Response:
        return await self._written_down(request, translate=True)

    async def _form(self, request: Request):
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise bad_request("send the audio as multipart/form-data with a 'file' field", param="file", code="invalid_value")
        try:
            return await request.form(max_files=1, max_fields=64, max_part_size=MAX_AUDIO_BYTES + 1)
        except AssertionError:  # starlette's own check that python-multipart is there
            raise VoiceMissingError("the audio endpoints need the voice extra, which is not installed: pip install 'edgechat[voice]'") from None
        except Exception as exc:  # a malformed body or a part past the size limit
            raise bad_request(f"the multipart body could not be read: {exc}", param="file", code="invalid_value") from None

    async def _written_down(self, request: Request, translate: bool) -> Response:
        try:
            form = await self._form(request)
            upload = form.get("file")
            if not isinstance(upload, UploadFile):
                raise AudioInputError("'file' is missing: attach the audio as the multipart field 'file'", "file")
            fmt = str(form.get("response_format") or "json")
            if fmt not in TRANSCRIPT_FORMATS:
                raise AudioInputError(f"'response_format': {fmt!r} is not one of {', '.join(TRANSCRIPT_FORMATS)}", "response_format")
            language = None if translate else (str(form.get("language") or "") or None)
            try:
                temperature = float(str(form.get("temperature") or 0.0))
            except ValueError:
                raise AudioInputError("'temperature' must be a number between 0 and 1", "temperature") from None
            if not 0.0 <= temperature <= 1.0:
                raise AudioInputError("'temperature' must be between 0 and 1", "temperature")
            granularities = set(form.getlist("timestamp_granularities[]") or form.getlist("timestamp_granularities"))
            if unknown := granularities - {"word", "segment"}:
                raise AudioInputError(f"'timestamp_granularities': {sorted(unknown)[0]!r} is not word or segment", "timestamp_granularities")
            stream = str(form.get("stream") or "false").lower() == "true"
            prompt = str(form.get("prompt") or "") or None
            data = await upload.read()
            started = time.monotonic()
            samples = await asyncio.to_thread(decode, data, "file")
            transcriber = await asyncio.to_thread(self.speech.transcriber)
            transcriber.check_language(language)
            words = "word" in granularities and fmt == "verbose_json"
            transcript = await asyncio.to_thread(transcriber.transcribe, samples, language, prompt, temperature, translate, words)
        except (AudioInputError, VoiceMissingError, SpeechModelMissingError, ModelFormatError) as exc:
            raise _api_error(exc) from None
        if stream:
            return StreamingResponse(self._deltas(transcript), media_type="text/event-stream")
        segments = await asyncio.to_thread(list, transcript.segments)
        log.info("transcribed %.1f s of audio in %.2f s", transcript.duration, time.monotonic() - started)
        return transcript_body(transcript, segments, fmt, "translate" if translate else "transcribe", words,
                               fmt == "verbose_json" and (not granularities or "segment" in granularities))

    async def _deltas(self, transcript: Transcript) -> AsyncIterator[bytes]:
        """OpenAI's streamed transcription: a delta per segment, then the whole text."""
        texts: list[str] = []
        async for segment in _threaded(transcript.segments):
            delta = segment.text if texts else segment.text.lstrip()
            texts.append(delta)
            yield _sse({"type": "transcript.text.delta", "delta": delta})
        yield _sse({"type": "transcript.text.done", "text": "".join(texts),
                    "usage": {"type": "duration", "seconds": round(transcript.duration)}})

    # ---- text to speech ----------------------------------------------------------------------

    async def speech_endpoint(self, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            raise bad_request("the body is not JSON: send {\"input\": ..., \"voice\": ...}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise bad_request("the body must be a JSON object", code="invalid_value")
        text, voice_name, fmt = body.get("input"), body.get("voice"), body.get("response_format") or "mp3"
        speed = body.get("speed", 1.0)
        stream_format = body.get("stream_format") or "audio"
        try:
            if not isinstance(text, str):
                raise AudioInputError("'input' must be the text to speak, a string", "input")
            if voice_name is not None and not isinstance(voice_name, str):
                raise AudioInputError("'voice' must be a voice's name", "voice")
            if isinstance(speed, bool) or not isinstance(speed, (int, float)):
                raise AudioInputError("'speed' must be a number", "speed")
            if fmt not in FORMATS:
                raise AudioInputError(f"'response_format': {fmt!r} is not one of {', '.join(FORMATS)}", "response_format")
            if stream_format not in ("audio", "sse"):
                raise AudioInputError(f"'stream_format': {stream_format!r} is not audio or sse", "stream_format")
            voice = await asyncio.to_thread(self.speech.voice)
            voice.check_text(text, float(speed))
            voice.speaker(voice_name)
            encoder = Encoder(fmt, voice.sample_rate)
        except (AudioInputError, VoiceMissingError, SpeechModelMissingError, ModelFormatError) as exc:
            raise _api_error(exc) from None
        chunks = _encoded(voice.speak(text, voice_name, float(speed)), encoder)
        if stream_format == "sse":
            return StreamingResponse(_audio_events(chunks), media_type="text/event-stream")
        return StreamingResponse(_threaded(chunks), media_type=MEDIA_TYPES[fmt])


def _encoded(pcm: Iterator[bytes], encoder: Encoder) -> Iterator[bytes]:
    for chunk in pcm:
        if out := encoder.feed(chunk):
            yield out
    if out := encoder.close():
        yield out


async def _audio_events(chunks: Iterator[bytes]) -> AsyncIterator[bytes]:
    """OpenAI's `stream_format: sse`: base64 audio deltas, then the end."""
    async for chunk in _threaded(chunks):
        yield _sse({"type": "speech.audio.delta", "audio": base64.b64encode(chunk).decode()})
    yield _sse({"type": "speech.audio.done"})


async def _threaded(items: Iterator) -> AsyncIterator:
    """Each item of a blocking iterator made on a worker thread, so the event loop serves others."""
    done = object()
    while (item := await asyncio.to_thread(next, items, done)) is not done:
        yield item


def _sse(event: dict) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()
