"""Voice in the chat app, as one object the chat screen holds: answers read aloud as they stream
(each whole sentence spoken while the next is made, silenced at once by Esc), and a question
spoken into the microphone, written down into the input."""

from __future__ import annotations

import functools
import os
import queue
import re
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from edgechat.errors import EdgechatError

if TYPE_CHECKING:
    from edgechat.sound import Recording

#: a sentence ends at . ! ? or … followed by a space, or at a line's end
_SENTENCE_END = re.compile(r"(?<=[.!?…])\s+|\n+")
#: code is not read aloud: fenced blocks whole, inline code's backticks, Markdown's marks
_FENCE = re.compile(r"```.*?(```|$)", re.DOTALL)
_MARKS = re.compile(r"[*_#>`|]+|\[([^\]]*)\]\([^)]*\)")


def speakable(text: str) -> str:
    """Markdown as it should sound: no code blocks, no marks, a link by its words."""
    text = _FENCE.sub(" ", text)
    return " ".join(_MARKS.sub(lambda m: m.group(1) or " ", text).split())


class Voice:
    """Reading aloud and listening for one chat screen. `notify(message, severity)` is called
    from any thread (the screen passes one that hops onto the event loop)."""

    def __init__(self, notify: Callable[[str, str], None]):
        self.notify = notify
        self.reading = False
        self._speech = None
        self._pending = ""
        self._in_fence = False
        #: each answer's sentences carry the generation they were queued in: stop() moves it on
        self._generation = 0
        self._sentences: queue.Queue[tuple[int, str]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._recording: Recording | None = None
        self._folder: tempfile.TemporaryDirectory | None = None

    def _models(self):
        if self._speech is None:
            from edgechat.config import get_paths
            from edgechat.engine.speech.models import speech_models
            from edgechat.models.speech import DEFAULT_STT, DEFAULT_TTS

            self._speech = speech_models(os.environ.get("EDGECHAT_STT_MODEL") or DEFAULT_STT,
                                         os.environ.get("EDGECHAT_TTS_MODEL") or DEFAULT_TTS, get_paths())
        return self._speech

    # ---- answers read aloud ------------------------------------------------------------------

    def feed(self, text: str) -> None:
        """More of the answer: each sentence it completes is queued to be spoken."""
        if not self.reading:
            return
        self._pending += text
        *whole, self._pending = _SENTENCE_END.split(self._pending)
        for sentence in whole:
            self._queue(sentence)

    def finish(self) -> None:
        """The answer ended: what is left of it is spoken too."""
        if self.reading and self._pending.strip():
            self._queue(self._pending)
        self._pending, self._in_fence = "", False

    def stop(self) -> None:
        """Silence now: what is playing stops, what was queued is dropped."""
        self._generation += 1
        self._pending, self._in_fence = "", False

    def _queue(self, sentence: str) -> None:
        # a fence's lines arrive one by one: count the fences to know when code is being read
        if sentence.count("```") % 2:
            self._in_fence = not self._in_fence
            return
        if self._in_fence or not (words := speakable(sentence)):
            return
        self._sentences.put((self._generation, words))
        if self._thread is None:
            self._thread = threading.Thread(target=self._speak_queued, name="read-aloud", daemon=True)
            self._thread.start()

    def _speak_queued(self) -> None:
        from edgechat.engine.speech.audio import wav_bytes
        from edgechat.sound import play

        while True:
            generation, sentence = self._sentences.get()
            if generation != self._generation:
                continue
            try:
                voice = self._models().voice()
                pcm = b"".join(voice.speak(sentence))
                if generation == self._generation:
                    play(wav_bytes(pcm, voice.sample_rate), functools.partial(self._superseded, generation))
            except EdgechatError as exc:
                self.reading = False
                self.stop()
                self.notify(f"Reading aloud is off: {exc}", "error")

    def _superseded(self, generation: int) -> bool:
        return generation != self._generation

    # ---- a spoken question -------------------------------------------------------------------

    @property
    def listening(self) -> bool:
        return self._recording is not None

    def listen(self) -> None:
        """Start recording from the microphone; EdgechatError (one line) where that cannot be."""
        from edgechat.sound import Recording

        self._models()  # a missing model is said now, not after the user spoke
        self._folder = tempfile.TemporaryDirectory(prefix="edgechat-talk-")
        try:
            self._recording = Recording(Path(self._folder.name))
        except EdgechatError:
            self._folder.cleanup()
            self._folder = None
            raise

    def heard(self) -> str:
        """Stop recording and write down what was said (blocking: call it off the event loop)."""
        recording, folder = self._recording, self._folder
        self._recording = self._folder = None
        assert recording is not None and folder is not None, "listen() first"
        try:
            _, segments = self._models().transcribe_file(recording.stop())
            return "".join(s.text for s in segments).strip()
        finally:
            folder.cleanup()
