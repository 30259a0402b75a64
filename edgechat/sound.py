"""The machine's speaker and microphone, through the command-line tools that drive them (ALSA,
PulseAudio/PipeWire, sox, ffmpeg, macOS's afplay, Termux:API), found on PATH: no compiled audio
library to install, and the one line that says what to install where none is found."""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from edgechat.errors import UsageError

#: players, in the order tried: name, arguments before the WAV (None: it wants a file, not stdin)
_PLAYERS: tuple[tuple[str, list[str] | None], ...] = (
    ("aplay", ["-q", "-"]), ("paplay", []), ("pw-play", ["-"]), ("ffplay", ["-nodisp", "-autoexit", "-loglevel", "quiet", "-"]),
    ("afplay", None), ("termux-media-player", None))
#: recorders, in the order tried: name, arguments before the file they write, the file's suffix
_RECORDERS: tuple[tuple[str, list[str], str], ...] = (
    ("arecord", ["-q", "-f", "S16_LE", "-r", "16000", "-c", "1"], ".wav"),
    ("parecord", ["--channels=1", "--rate=16000", "--format=s16le", "--file-format=wav"], ".wav"),
    ("rec", ["-q", "-c", "1", "-r", "16000"], ".wav"),
    ("termux-microphone-record", ["-f"], ".m4a"))
NO_PLAYER = ("no audio player found (aplay, paplay, pw-play, ffplay, afplay, termux-media-player): install one "
             "(apt install alsa-utils; Termux: pkg install termux-api)")
NO_RECORDER = ("no microphone recorder found (arecord, parecord, rec, termux-microphone-record): install one "
               "(apt install alsa-utils; macOS: brew install sox; Termux: pkg install termux-api and the Termux:API app)")
#: how often a player is checked for a stop
_POLL_S = 0.05


def play(wav: bytes, stopped: Callable[[], bool] = lambda: False) -> None:
    """Play a WAV to the end, or until `stopped()` says so; UsageError where no player exists."""
    for name, args in _PLAYERS:
        if (exe := shutil.which(name)) is None:
            continue
        if args is not None:
            proc = subprocess.Popen([exe, *args], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            _feed(proc, wav)
            _wait(proc, stopped)
            return
        with tempfile.NamedTemporaryFile(suffix=".wav") as f:
            f.write(wav)
            f.flush()
            if name == "termux-media-player":
                # it plays in the background and returns: wait the sound's length
                subprocess.run([exe, "play", f.name], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
                end = time.monotonic() + max(0, len(wav) - 44) / 2 / _rate(wav)
                while time.monotonic() < end and not stopped():
                    time.sleep(_POLL_S)
                if stopped():
                    subprocess.run([exe, "stop"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
            else:
                _wait(subprocess.Popen([exe, f.name]), stopped)
        return
    raise UsageError(NO_PLAYER)


def _feed(proc: subprocess.Popen, data: bytes) -> None:
    def write() -> None:
        try:
            assert proc.stdin is not None
            proc.stdin.write(data)
            proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass  # stopped while it read

    threading.Thread(target=write, daemon=True).start()


def _wait(proc: subprocess.Popen, stopped: Callable[[], bool]) -> None:
    while proc.poll() is None:
        if stopped():
            proc.terminate()
            proc.wait()
            return
        time.sleep(_POLL_S)


def _rate(wav: bytes) -> int:
    return int.from_bytes(wav[24:28], "little") or 22050


class Recording:
    """The microphone recorded into a file until stop(); UsageError where no recorder exists."""

    def __init__(self, folder: Path):
        found = next(((exe, n, a, s) for n, a, s in _RECORDERS if (exe := shutil.which(n))), None)
        if found is None:
            raise UsageError(NO_RECORDER)
        exe, self.name, args, suffix = found
        self.path = folder / f"recording{suffix}"
        self._proc = subprocess.Popen([exe, *args, str(self.path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def stop(self) -> Path:
        """The recording, finished; UsageError with the recorder's own words if it failed."""
        if self.name == "termux-microphone-record":
            subprocess.run([self.name, "-q"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        elif self._proc.poll() is None:
            # SIGINT: the recorders finish the file's header on it, as on Ctrl+C
            self._proc.send_signal(signal.SIGINT)
        try:
            _, err = self._proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            _, err = self._proc.communicate()
        if not self.path.is_file() or self.path.stat().st_size <= 44:
            why = (err or b"").decode(errors="replace").strip().splitlines()
            raise UsageError(f"{self.name} recorded nothing{': ' + why[-1] if why else ''}; check the microphone")
        return self.path
