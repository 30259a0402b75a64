"""Voice, offline, on real models: Whisper base (faster-whisper) and the Piper voice
en_US-joe-medium, fetched once per machine (bench/speechmodels.py). Sentences the voice speaks
come back as their words from Whisper; every audio endpoint through the official openai client,
whole and streamed; each bad input a 400 naming its field; the voice extra missing a 501; the
command line's transcribe and say."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import wave

import httpx
import numpy as np
import openai
import pytest

from bench.speechmodels import ROUND_TRIP, wer, words
from edgechat.engine.speech import AudioInputError
from edgechat.engine.speech.audio import MAX_AUDIO_BYTES, decode, wav_bytes
from edgechat.engine.speech.models import SpeechModels
from edgechat.server import create_app
from edgechat.server.settings import ServerSettings
from tests.serving import serving

pytest.importorskip("faster_whisper", reason="the voice extra (faster-whisper, piper-tts) is not installed")
pytestmark = pytest.mark.slow

SENTENCES = list(ROUND_TRIP[:5])
#: word error rate of the round trip (voice -> Whisper base, greedy): measured 0.0-0.04 here
WER_BOUND = 0.1


@pytest.fixture(scope="module")
def speech_paths():
    from bench.speechmodels import piper_voice, whisper_dir

    try:
        return whisper_dir(), piper_voice()
    except (RuntimeError, OSError) as why:
        pytest.skip(f"speech models not available: {why}")


@pytest.fixture(scope="module")
def speech(speech_paths):
    return SpeechModels(*speech_paths, threads=2)


@pytest.fixture(scope="module")
def spoken(speech) -> list[bytes]:
    """Each sentence as a WAV file the voice spoke."""
    voice = speech.voice()
    return [wav_bytes(b"".join(voice.speak(s)), voice.sample_rate) for s in SENTENCES]


@pytest.fixture(scope="module")
def url(smol, speech):
    with serving(create_app(ServerSettings(), smol, speech=speech)) as base:
        yield base


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def test_spoken_sentences_come_back_as_their_words(speech, spoken):
    rates = []
    for sentence, audio in zip(SENTENCES, spoken, strict=True):
        transcript = speech.transcriber().transcribe(decode(audio))
        text = "".join(s.text for s in transcript.segments)
        assert transcript.language == "en"
        rates.append(wer(sentence, text))
    assert sum(rates) / len(rates) <= WER_BOUND, list(zip(SENTENCES, rates, strict=True))


def test_transcriptions_through_the_openai_client_in_every_format(client, spoken):
    audio = ("hello.wav", spoken[0], "audio/wav")
    got = client.audio.transcriptions.create(model="whisper-1", file=audio)
    assert wer(SENTENCES[0], got.text) <= WER_BOUND
    text = client.audio.transcriptions.create(model="whisper-1", file=audio, response_format="text")
    assert words(text) == words(got.text)
    srt = client.audio.transcriptions.create(model="whisper-1", file=audio, response_format="srt")
    assert re.match(r"1\n00:00:00,000 --> 00:00:0\d,\d{3}\n\S", srt), srt
    vtt = client.audio.transcriptions.create(model="whisper-1", file=audio, response_format="vtt")
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> ")
    verbose = client.audio.transcriptions.create(model="whisper-1", file=audio, response_format="verbose_json",
                                                 timestamp_granularities=["word", "segment"], language="en")
    assert verbose.language == "en" and verbose.duration > 1
    assert verbose.segments and verbose.segments[-1].end <= verbose.duration + 0.5
    spoken_words = [w.word for w in verbose.words]
    assert words(" ".join(spoken_words)) == words(verbose.text)
    assert all(a.start <= b.start for a, b in zip(verbose.words, verbose.words[1:], strict=False))


def test_a_transcription_streams_as_deltas_then_the_whole_text(client, spoken):
    audio = b"".join([spoken[1][:44], *(a[44:] for a in spoken[1:3])])  # two sentences, one WAV
    audio = wav_bytes(audio[44:], 22050)
    events = list(client.audio.transcriptions.create(model="gpt-4o-transcribe", file=("two.wav", audio), stream=True))
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    done = events[-1]
    assert done.type == "transcript.text.done" and deltas and "".join(deltas) == done.text
    assert wer(SENTENCES[1] + " " + SENTENCES[2], done.text) <= WER_BOUND


def test_translation_writes_english(client, spoken):
    got = client.audio.translations.create(model="whisper-1", file=("s.wav", spoken[3]))
    assert wer(SENTENCES[3], got.text) <= WER_BOUND


@pytest.mark.parametrize("fmt", ["wav", "mp3", "flac", "opus", "aac", "pcm"])
def test_speech_streams_in_each_format_and_is_heard_back(client, speech, fmt):
    with client.audio.speech.with_streaming_response.create(model="tts-1", voice="alloy", input=SENTENCES[4], response_format=fmt) as resp:
        chunks = list(resp.iter_bytes())
    audio = b"".join(chunks)
    if fmt == "pcm":
        audio = wav_bytes(audio, speech.voice().sample_rate)
    transcript = speech.transcriber().transcribe(decode(audio))
    assert wer(SENTENCES[4], "".join(s.text for s in transcript.segments)) <= WER_BOUND


def test_speech_arrives_sentence_by_sentence(url, speech):
    text = " ".join(SENTENCES)
    with httpx.stream("POST", f"{url}/v1/audio/speech", json={"input": text, "voice": "joe", "response_format": "pcm"}, timeout=120) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"] == "audio/pcm"
        sizes = [len(c) for c in resp.iter_raw()]
    assert len(sizes) >= len(SENTENCES), sizes  # a chunk per sentence at least, not one at the end
    # and as OpenAI's server-sent events
    with httpx.stream("POST", f"{url}/v1/audio/speech", json={"input": SENTENCES[0], "voice": "alloy", "response_format": "wav",
                                                              "stream_format": "sse"}, timeout=120) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == {"type": "speech.audio.done"} and all(e["type"] == "speech.audio.delta" for e in events[:-1])


def test_models_lists_the_speech_models(client, speech):
    listed = {m.id: m for m in client.models.list()}
    assert listed["whisper-base"].meta["kind"] == "transcription"
    assert listed["en_US-joe-medium"].meta["kind"] == "speech"


def _tone(rate: int, seconds: float = 1.0, amplitude: float = 0.0) -> bytes:
    t = np.arange(int(rate * seconds)) / rate
    return wav_bytes((amplitude * 32767 * np.sin(2 * np.pi * 440 * t)).astype(np.int16).tobytes(), rate)


@pytest.mark.parametrize(("upload", "param", "says"), [
    (b"", "file", "is empty"),
    (b"RIFF\x00\x00not a wave at all" * 100, "file", "not audio"),
    (b"just some text, not audio\n" * 200, "file", "not audio"),
    (_tone(16000), "file", "silent"),
])
def test_a_bad_audio_file_is_a_400_naming_it(url, upload, param, says):
    resp = httpx.post(f"{url}/v1/audio/transcriptions", files={"file": ("a.wav", upload)}, data={"model": "whisper-1"}, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and says in error["message"]


def test_a_file_over_the_limit_is_refused_before_it_is_decoded(url):
    resp = httpx.post(f"{url}/v1/audio/transcriptions", files={"file": ("big.wav", b"\0" * (MAX_AUDIO_BYTES + 10))}, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "file"


def test_another_sample_rate_is_resampled(client, spoken):
    with wave.open(io.BytesIO(spoken[2])) as w:
        pcm = np.frombuffer(w.readframes(w.getnframes()), np.int16)
    eight_k = pcm[np.round(np.arange(0, len(pcm), 22050 / 8000)).astype(int)[:-1]]
    got = client.audio.transcriptions.create(model="whisper-1", file=("8k.wav", wav_bytes(eight_k.tobytes(), 8000)))
    assert wer(SENTENCES[2], got.text) <= 0.2


@pytest.mark.parametrize(("fields", "param"), [
    ({"language": "xx"}, "language"),
    ({"response_format": "docx"}, "response_format"),
    ({"temperature": "hot"}, "temperature"),
    ({"timestamp_granularities[]": "sentence"}, "timestamp_granularities"),
])
def test_a_bad_transcription_field_is_a_400_naming_it(url, spoken, fields, param):
    resp = httpx.post(f"{url}/v1/audio/transcriptions", files={"file": ("a.wav", spoken[0])}, data=fields, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "", "voice": "alloy"}, "input"),
    ({"input": "word " * 20_000, "voice": "alloy"}, "input"),
    ({"input": "hello", "voice": "nobody"}, "voice"),
    ({"input": "hello", "voice": "alloy", "speed": 9}, "speed"),
    ({"input": "hello", "voice": "alloy", "response_format": "midi"}, "response_format"),
    ({"voice": "alloy"}, "input"),
])
def test_a_bad_speech_field_is_a_400_naming_it(url, body, param):
    resp = httpx.post(f"{url}/v1/audio/speech", json=body, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


def test_without_the_voice_extra_each_endpoint_says_what_to_install(smol, speech_paths, monkeypatch, spoken):
    monkeypatch.setitem(sys.modules, "faster_whisper", None)
    monkeypatch.setitem(sys.modules, "piper", None)
    with serving(create_app(ServerSettings(), smol, speech=SpeechModels(*speech_paths))) as base:
        stt = httpx.post(f"{base}/v1/audio/transcriptions", files={"file": ("a.wav", spoken[0])}, timeout=60)
        tts = httpx.post(f"{base}/v1/audio/speech", json={"input": "hello", "voice": "alloy"}, timeout=60)
    for resp in (stt, tts):
        assert resp.status_code == 501 and "pip install 'edgechat[voice]'" in resp.json()["error"]["message"]


def test_the_command_line_says_and_transcribes(speech_paths, smollm2_path, tmp_path):
    stt, tts = speech_paths
    (tmp_path / "out").mkdir()
    out = tmp_path / "out" / "hello.mp3"
    env_cmd = [sys.executable, "-m", "edgechat"]
    said = subprocess.run([*env_cmd, "say", SENTENCES[1], "-o", str(out), "--tts-model", str(tts)], capture_output=True, text=True, timeout=300)
    assert said.returncode == 0, said.stderr
    assert [p.name for p in out.parent.iterdir()] == ["hello.mp3"]  # no temp file left
    heard = subprocess.run([*env_cmd, "transcribe", str(out), "--stt-model", str(stt)], capture_output=True, text=True, timeout=300)
    assert heard.returncode == 0 and wer(SENTENCES[1], heard.stdout) <= WER_BOUND, heard.stderr
    # a spoken question, answered
    asked = subprocess.run([*env_cmd, "run", "--audio", str(out), "--stt-model", str(stt), "-m", str(smollm2_path), "--max-tokens", "8"],
                           capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert asked.returncode == 0 and asked.stdout.strip(), asked.stderr
    assert wer(SENTENCES[1], asked.stderr.split("heard: ", 1)[1]) <= WER_BOUND
    srt = subprocess.run([*env_cmd, "transcribe", str(out), "--stt-model", str(stt), "--format", "srt"], capture_output=True, text=True, timeout=300)
    assert srt.stdout.startswith("1\n00:00:00,000 --> ")
    # a user's mistakes: one line, no traceback
    for args in (["say", "", "-o", str(out.parent / "x.wav"), "--tts-model", str(tts)],
                 ["say", "hi", "-o", str(tmp_path / "x.doc"), "--tts-model", str(tts)],
                 ["transcribe", str(tmp_path / "missing.wav"), "--stt-model", str(stt)],
                 ["transcribe", __file__, "--stt-model", str(stt)]):
        bad = subprocess.run([*env_cmd, *args], capture_output=True, text=True, timeout=300)
        assert bad.returncode != 0 and "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, (args, bad.stderr)
    assert [p.name for p in out.parent.iterdir()] == ["hello.mp3"]


def test_audio_input_errors_name_the_field():
    with pytest.raises(AudioInputError) as info:
        decode(_tone(16000, amplitude=0.0), "upload")
    assert info.value.param == "upload"


def test_speech_models_by_name_download_once_then_run_offline(speech_paths, isolated_dirs, tmp_path):
    from tests.test_hub import FakeHub

    stt, tts = speech_paths
    files = {("Systran/faster-whisper-base", name): stt / name for name in ("model.bin", "config.json", "tokenizer.json", "vocabulary.txt")}
    files.update({("rhasspy/piper-voices", f"en/en_US/joe/medium/{tts.name}{ext}"): tts.with_name(tts.name + ext) for ext in ("", ".json")})
    hub = FakeHub(files)
    wav = tmp_path / "said.wav"
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    online = dict(env, HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf-home"))
    cmd = [sys.executable, "-m", "edgechat"]
    try:
        pulled = subprocess.run([*cmd, "pull", "en_US-joe-medium"], env=online, capture_output=True, text=True, timeout=300)
        assert pulled.returncode == 0 and pulled.stdout.startswith("ready: ") and pulled.stdout.strip().endswith(tts.name), pulled.stderr
        said = subprocess.run([*cmd, "say", SENTENCES[0], "-o", str(wav), "--tts-model", "en_US-joe-medium"], env=online,
                              capture_output=True, text=True, timeout=300)
        assert said.returncode == 0, said.stderr
        heard = subprocess.run([*cmd, "transcribe", str(wav), "--stt-model", "whisper-base"], env=online, capture_output=True, text=True, timeout=300)
        assert heard.returncode == 0 and wer(SENTENCES[0], heard.stdout) <= WER_BOUND, heard.stderr
    finally:
        hub.close()
    offline = dict(online, HF_HUB_OFFLINE="1")
    again = subprocess.run([*cmd, "transcribe", str(wav), "--stt-model", "whisper-base"], env=offline, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and words(again.stdout) == words(heard.stdout), again.stderr
    missing = subprocess.run([*cmd, "say", "hi", "-o", str(tmp_path / "x.wav"), "--tts-model", "en_US-amy-low"], env=offline,
                             capture_output=True, text=True, timeout=300)
    assert missing.returncode != 0 and "HF_HUB_OFFLINE" in missing.stderr and "Traceback" not in missing.stderr
    assert "edgechat pull en_US-amy-low" in missing.stderr  # and that command fetches it


@pytest.mark.skipif(not (shutil.which("tmux") and shutil.which("edgechat")), reason="needs tmux and an installed edgechat")
def test_an_audio_file_attached_in_the_chat_app_is_sent_as_its_transcript(speech_paths, spoken, isolated_dirs, tmp_path):
    from test_tui_tmux import PLACEHOLDER, Tmux

    from edgechat.config import get_paths
    from edgechat.store import open_store

    memo = tmp_path / "memo.wav"
    memo.write_bytes(spoken[2])
    isolated_dirs.config.mkdir(parents=True, exist_ok=True)
    isolated_dirs.config_file.write_text("[chat]\nmax_tokens = 8\ntemperature = 0.0\n")
    env = {**os.environ, "EDGECHAT_DATA_DIR": str(isolated_dirs.data), "TERM": "xterm-256color", "EDGECHAT_STT_MODEL": str(speech_paths[0])}
    tmux = Tmux(f"edgechat-voice-{os.getpid()}", env)
    try:
        tmux.start(f"edgechat --data-dir {isolated_dirs.data}")
        tmux.wait_for(lambda: PLACEHOLDER in tmux.screen(), 30, "the input")
        tmux.tmux("send-keys", "-l", f"/attach {memo}")
        tmux.tmux("send-keys", "Enter")
        tmux.wait_for(lambda: "memo.wav (transcript)" in tmux.screen(), 120, "the transcript's chip")
        tmux.tmux("send-keys", "-l", "What did I buy?")
        tmux.tmux("send-keys", "Enter")
        tmux.wait_for(lambda: "tok/s" in tmux.screen(), 120, "the answer")
        tmux.tmux("send-keys", "C-q")
        tmux.wait_for(lambda: not tmux.running(), 30, "edgechat to quit")
    finally:
        tmux.kill()
    store = open_store(get_paths(isolated_dirs.data))
    (conv,) = store.list_conversations()
    user = store.messages(conv.id)[0]
    store.close()
    assert user.content.startswith("File: memo.wav (transcript)\n") and user.content.endswith("What did I buy?")
    said = user.content.split("\n", 2)[2].rsplit("```", 1)[0]
    assert wer(SENTENCES[2], said) <= WER_BOUND, user.content


def test_an_audio_file_that_cannot_be_heard_is_not_attached_and_says_why(speech_paths, monkeypatch, tmp_path):
    from edgechat import attachments

    monkeypatch.setenv("EDGECHAT_STT_MODEL", str(speech_paths[0]))
    attachments._listener.cache_clear()
    (tmp_path / "quiet.wav").write_bytes(_tone(16000))
    (tmp_path / "broken.mp3").write_bytes(b"not an mp3 at all" * 50)
    found = attachments.gather(f"{tmp_path / 'quiet.wav'} {tmp_path / 'broken.mp3'}", cwd=tmp_path)
    attachments._listener.cache_clear()
    assert found.attachments == []
    assert dict(found.skipped) == {"quiet.wav": "silent: there is no speech to write down",
                                   "broken.mp3": "not audio edgechat can read (InvalidDataError): send WAV, MP3, FLAC, OGG, M4A or WebM"}


@pytest.fixture
def devices(tmp_path, monkeypatch, speech_paths, spoken):
    """A speaker and a microphone as their command-line tools: `aplay` keeps each sound it is
    given as a file, `arecord` "hears" a spoken sentence until it is interrupted, as the real
    ones do on SIGINT (this machine has neither a sound card nor a microphone)."""
    bin_dir, played = tmp_path / "bin", tmp_path / "played"
    bin_dir.mkdir()
    played.mkdir()
    said = tmp_path / "said.wav"
    said.write_bytes(spoken[0])
    (bin_dir / "aplay").write_text(f'#!/bin/bash\ncat > "{played}/$(date +%s%N).wav"\n')
    # the sentence is "spoken" once the file holds it: `heard` marks that, as a person stops talking
    (bin_dir / "arecord").write_text(f'#!/bin/bash\ntrap "exit 0" INT TERM\ncp "{said}" "${{!#}}"\ntouch "{tmp_path}/heard"\n'
                                     'while :; do sleep 0.05; done\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("EDGECHAT_STT_MODEL", str(speech_paths[0]))
    monkeypatch.setenv("EDGECHAT_TTS_MODEL", str(speech_paths[1]))
    return played


def _until(condition, timeout: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_an_answer_is_read_aloud_sentence_by_sentence_without_its_code(devices, speech):
    from edgechat.tui.voice import Voice

    notes: list[str] = []
    voice = Voice(lambda message, severity: notes.append(message))
    voice.reading = True
    answer = f"{SENTENCES[0]} {SENTENCES[1]}\n```python\nprint('not read')\n```\n{SENTENCES[2]}"
    for i in range(0, len(answer), 7):  # as tokens arrive
        voice.feed(answer[i:i + 7])
    voice.finish()
    _until(lambda: len(list(devices.iterdir())) == 3)
    heard = [" ".join(s.text for s in speech.transcriber().transcribe(decode(p.read_bytes())).segments) for p in sorted(devices.iterdir())]
    assert [wer(s, h) <= WER_BOUND for s, h in zip(SENTENCES[:3], heard, strict=True)] == [True] * 3, heard
    assert not notes


def test_esc_silences_what_is_queued(devices):
    from edgechat.tui.voice import Voice

    voice = Voice(lambda message, severity: None)
    voice.reading = True
    voice.feed(" ".join(SENTENCES) + " ")
    _until(lambda: len(list(devices.iterdir())) >= 1)
    voice.stop()
    import time

    time.sleep(3)  # long enough for the rest to have been spoken
    assert len(list(devices.iterdir())) <= 2


def test_a_question_spoken_into_the_microphone_is_written_down(devices):
    from edgechat.tui.voice import Voice

    voice = Voice(lambda message, severity: None)
    voice.listen()
    assert voice.listening
    _until(lambda: (devices.parent / "heard").exists())  # the question asked
    said = voice.heard()
    assert not voice.listening and wer(SENTENCES[0], said) <= WER_BOUND


def test_without_a_recorder_talking_says_what_to_install(speech_paths, monkeypatch, tmp_path):
    from edgechat.errors import UsageError
    from edgechat.tui.voice import Voice

    monkeypatch.setenv("PATH", str(tmp_path))  # no recorder, no player
    monkeypatch.setenv("EDGECHAT_STT_MODEL", str(speech_paths[0]))
    monkeypatch.setenv("EDGECHAT_TTS_MODEL", str(speech_paths[1]))
    with pytest.raises(UsageError, match=r"no microphone recorder found .*\(apt install alsa-utils"):
        Voice(lambda message, severity: None).listen()


@pytest.mark.skipif(not (shutil.which("tmux") and shutil.which("edgechat")), reason="needs tmux and an installed edgechat")
def test_in_the_chat_app_a_spoken_question_is_answered_aloud(devices, isolated_dirs):
    from test_tui_tmux import PLACEHOLDER, Tmux

    from edgechat.config import get_paths
    from edgechat.store import open_store

    isolated_dirs.config.mkdir(parents=True, exist_ok=True)
    isolated_dirs.config_file.write_text("[chat]\nmax_tokens = 24\ntemperature = 0.0\n")
    env = {**os.environ, "EDGECHAT_DATA_DIR": str(isolated_dirs.data), "TERM": "xterm-256color"}
    tmux = Tmux(f"edgechat-talk-{os.getpid()}", env)
    try:
        tmux.start(f"edgechat --data-dir {isolated_dirs.data}")
        tmux.wait_for(lambda: PLACEHOLDER in tmux.screen(), 30, "the input")
        tmux.tmux("send-keys", "-l", "/speak on")
        tmux.tmux("send-keys", "Enter")
        tmux.tmux("send-keys", "F5")
        tmux.wait_for(lambda: "Listening" in tmux.screen(), 30, "the recording to start")
        tmux.wait_for(lambda: (devices.parent / "heard").exists(), 30, "the question to be asked")
        tmux.tmux("send-keys", "F5")
        # one word: the input wraps the sentence where its width falls
        tmux.wait_for(lambda: "park" in tmux.screen(), 60, "the question in the input")
        tmux.tmux("send-keys", "Enter")
        tmux.wait_for(lambda: "tok/s" in tmux.screen(), 120, "the answer")
        tmux.wait_for(lambda: any(devices.iterdir()), 60, "the answer to be read aloud")
        tmux.tmux("send-keys", "C-q")
        tmux.wait_for(lambda: not tmux.running(), 30, "edgechat to quit")
    finally:
        tmux.kill()
    store = open_store(get_paths(isolated_dirs.data))
    (conv,) = store.list_conversations()
    user, answer = store.messages(conv.id)
    store.close()
    assert wer(SENTENCES[0], user.content) <= WER_BOUND
    assert answer.content.strip()
    assert "speak = true" in isolated_dirs.config_file.read_text()  # remembered


def test_a_speech_model_is_loaded_on_use_listed_counted_and_let_go_when_idle(smol, speech_paths, spoken):
    import gc
    import weakref

    speech = SpeechModels(*speech_paths, threads=2, idle_unload=3.0)

    def states() -> dict[str, str]:
        cards = httpx.get(f"{base}/v1/models", timeout=30).json()["data"]
        return {c["id"]: c["meta"]["state"] for c in cards if c.get("meta", {}).get("kind") in ("transcription", "speech")}

    with serving(create_app(ServerSettings(), smol, speech=speech)) as base:
        assert states() == {speech.stt_id: "unloaded", speech.tts_id: "unloaded"} and speech.held_bytes() == 0
        held = weakref.ref(speech.transcriber())  # loaded on first use
        assert states() == {speech.stt_id: "loaded", speech.tts_id: "unloaded"}
        assert speech.held_bytes() == speech.memory_bytes("stt") > 100 << 20
        r = httpx.post(f"{base}/v1/audio/transcriptions", files={"file": ("a.wav", spoken[0])}, data={"model": "whisper-1"}, timeout=120)
        assert r.status_code == 200, r.text
        # idle for its seconds: let go, and the object itself is gone (nothing else holds it)
        _until(lambda: gc.collect() >= 0 and held() is None, 30)
        assert states()[speech.stt_id] == "unloaded" and speech.held_bytes() == 0


def test_the_language_models_budget_counts_the_loaded_speech_models(speech_paths, smollm2_path):
    from edgechat.config import get_paths
    from edgechat.engine import EngineConfig
    from edgechat.engine.pool import ModelPool
    from edgechat.errors import NoRoomError

    speech = SpeechModels(*speech_paths, threads=2)
    speech.transcriber()
    config = EngineConfig(model=str(smollm2_path), n_ctx=512, paths=get_paths())
    need = ModelPool().add("smol", config).need
    short = ModelPool(budget=need + speech.held_bytes() - 1, held_elsewhere=speech.held_bytes)
    short.add("smol", config)
    with pytest.raises(NoRoomError):
        short.acquire("smol")
    room = ModelPool(budget=need + speech.held_bytes(), held_elsewhere=speech.held_bytes)
    room.add("smol", config)
    try:
        assert room.acquire("smol") is not None
        room.release("smol")
    finally:
        room.close()
