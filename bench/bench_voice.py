"""Voice through `edgechat serve` against faster-whisper and Piper called directly, on the same
files and text, the same settings (Whisper base int8, greedy, the same threads; the Piper voice
en_US-joe-medium), in the same run, alternating the two so the machine's noise falls on both.

- transcription: real-time factor (seconds of work per second of audio) of /v1/audio/transcriptions
  and of WhisperModel.transcribe; speed ratio = direct RTF / server RTF (target >= 0.95);
- speech: real-time factor of /v1/audio/speech (wav, read whole) and of PiperVoice.synthesize,
  and time to the first audio byte of a streamed request against Piper's first sentence (target:
  the server adds < 50 ms);
- word error rate of the round trip (voice -> Whisper) through the server and directly.

    python -m bench.bench_voice [--rounds 3] [--threads 2] [--json]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.bench_serve import _free_port, _server
from bench.speechmodels import ROUND_TRIP, piper_voice, wer, whisper_dir
from edgechat.config import get_paths
from edgechat.models import resolve_model

SENTENCES = ROUND_TRIP


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    from faster_whisper import WhisperModel
    from piper import PiperVoice

    from edgechat.engine.speech.audio import wav_bytes

    stt, tts = whisper_dir(), piper_voice()
    direct_stt = WhisperModel(str(stt), device="cpu", compute_type="int8", cpu_threads=args.threads)
    direct_tts = PiperVoice.load(tts)
    rate = direct_tts.config.sample_rate
    audio = [wav_bytes(b"".join(c.audio_int16_bytes for c in direct_tts.synthesize(s)), rate) for s in SENTENCES]
    seconds = [(len(a) - 44) / 2 / rate for a in audio]

    port = _free_port()
    cmd = [sys.executable, "-m", "edgechat", "serve", "-m", str(resolve_model("smollm2-135m-instruct", get_paths())), "--port", str(port),
           "--threads", str(args.threads), "--stt-model", str(stt), "--tts-model", str(tts)]
    rows: dict[str, list[float]] = {k: [] for k in ("stt_server", "stt_direct", "tts_server", "tts_direct", "ttfb_server", "ttfb_direct")}
    wers: dict[str, list[float]] = {"server": [], "direct": []}
    with tempfile.TemporaryDirectory() as logs, _server(cmd, port, "serve", Path(logs)) as url, httpx.Client(timeout=300) as http:
        # warm both: the first call loads the models
        http.post(f"{url}/v1/audio/transcriptions", files={"file": ("w.wav", audio[0])}).raise_for_status()
        http.post(f"{url}/v1/audio/speech", json={"input": "Warm up.", "voice": "joe", "response_format": "wav"}).raise_for_status()
        for r in range(args.rounds):
            for text, wav, secs in zip(SENTENCES, audio, seconds, strict=True):
                t = time.perf_counter()
                got = http.post(f"{url}/v1/audio/transcriptions", files={"file": ("s.wav", wav)}).json()["text"]
                rows["stt_server"].append((time.perf_counter() - t) / secs)
                t = time.perf_counter()
                segments, _ = direct_stt.transcribe(io.BytesIO(wav), beam_size=1)
                direct = "".join(s.text for s in segments)
                rows["stt_direct"].append((time.perf_counter() - t) / secs)
                if r == 0:
                    wers["server"].append(wer(text, got))
                    wers["direct"].append(wer(text, direct))

                t = time.perf_counter()
                with http.stream("POST", f"{url}/v1/audio/speech", json={"input": text, "voice": "joe", "response_format": "wav"}) as resp:
                    first = None
                    for _ in resp.iter_raw():
                        first = first or time.perf_counter() - t
                rows["tts_server"].append((time.perf_counter() - t) / secs)
                rows["ttfb_server"].append(first or 0.0)
                t = time.perf_counter()
                first = None
                for _ in direct_tts.synthesize(text):
                    first = first or time.perf_counter() - t
                rows["tts_direct"].append((time.perf_counter() - t) / secs)
                rows["ttfb_direct"].append(first or 0.0)

    med = {k: statistics.median(v) for k, v in rows.items()}
    result = {
        "audio_seconds": round(sum(seconds), 2),
        "stt_rtf_server": round(med["stt_server"], 3), "stt_rtf_direct": round(med["stt_direct"], 3),
        "stt_speed_ratio": round(med["stt_direct"] / med["stt_server"], 3),
        "tts_rtf_server": round(med["tts_server"], 4), "tts_rtf_direct": round(med["tts_direct"], 4),
        "tts_speed_ratio": round(med["tts_direct"] / med["tts_server"], 3),
        "first_audio_ms_server": round(med["ttfb_server"] * 1000, 1), "first_audio_ms_direct": round(med["ttfb_direct"] * 1000, 1),
        "first_audio_added_ms": round((med["ttfb_server"] - med["ttfb_direct"]) * 1000, 1),
        "wer_server": round(statistics.mean(wers["server"]), 4), "wer_direct": round(statistics.mean(wers["direct"]), 4),
    }
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:24} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
