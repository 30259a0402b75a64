"""Files brought into a message: which files a command names, which of them are text, and the
fenced blocks the model is given them in (and read back from, to edit a sent message)."""

from __future__ import annotations

import functools
import glob
import os
import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from urllib.parse import unquote

from edgechat.errors import UsageError
from edgechat.images import media_type, undecoded

#: the most text one file may bring (a PDF: its extracted text); far beyond any small context
MAX_FILE_BYTES = 512 * 1024
#: a PDF is mostly fonts and images: its file may be this big before its text is read
MAX_PDF_BYTES = 32 * 1024 * 1024
#: the most bytes one picture may bring (a phone camera's JPEG is a few MB; the projector resizes it)
MAX_IMAGE_BYTES = 20 * 1024 * 1024
#: picture files by suffix (edgechat/images.py tells them by their first bytes without one)
IMAGE_TYPES = {"png": "image/png", "jpg": "image/jpeg", "jpeg": "image/jpeg", "gif": "image/gif",
               "webp": "image/webp", "bmp": "image/bmp"}
#: audio files by suffix: attached as what is said in them (Whisper, the voice extra)
AUDIO_SUFFIXES = frozenset({"wav", "mp3", "flac", "ogg", "opus", "m4a", "webm", "aac"})
#: the most files one /attach takes (a directory of thousands is a mistake, not a question)
MAX_FILES = 50
#: a paste longer than this (characters) becomes an attachment instead of filling the input
LONG_PASTE = 2000
#: an excerpt's size in characters (~150 tokens): small enough to pick, whole enough to read
EXCERPT_CHARS = 600
#: what stands between two excerpts of one file that were not next to each other
GAP = "\n[…]\n"
#: directories that hold tools' state, not the user's material (hidden ones are skipped too)
_SKIP_DIRS = {"node_modules", "__pycache__", "venv"}

_HEADER = re.compile(r"File: (?P<name>[^\n]+)\n(?P<fence>`{3,})(?P<lang>[^\n`]*)\n")


@dataclass(frozen=True)
class Attachment:
    name: str  # as the chip and the block's header show it
    text: str
    #: the fence's info string (the file's suffix): Markdown renderers and models read it
    lang: str = ""

    def block(self) -> str:
        # a fence longer than any backtick run inside, so the file's own fences stay inside
        runs = [len(r) for r in re.findall(r"`+", self.text)]
        fence = "`" * max(3, max(runs, default=0) + 1)
        body = self.text.rstrip("\n")
        return f"File: {self.name}\n{fence}{self.lang}\n{body}\n{fence}"


@dataclass(frozen=True)
class ImageAttachment:
    """A picture going with a message: its bytes as read, sent to a vision model as they are."""

    name: str
    data: bytes
    media_type: str

    @property
    def size(self) -> str:
        """Its size for a chip: "12 KB", "1.4 MB"."""
        return file_size(len(self.data))

    def part(self):
        """The message content part the engine reads (engine.ImageInput)."""
        from edgechat.engine.types.request import ImageInput

        return ImageInput(self.data, self.media_type)


def file_size(n: int) -> str:
    """Bytes as the chips and the limits say them: "512 KB", "1.4 MB", "20 MB"."""
    if n >= 1024 * 1024:
        return f"{n / (1024 * 1024):.1f}".removesuffix(".0") + " MB"
    return f"{max(1, round(n / 1024))} KB" if n >= 512 else f"{n} B"


@dataclass
class Gathered:
    attachments: list[Attachment] = field(default_factory=list)
    #: the pictures among the files named (sent only to a vision model)
    images: list[ImageAttachment] = field(default_factory=list)
    #: (name, why) of every file named but not attached
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def summary(self) -> str:
        """One line on what was attached and what was skipped (and why)."""
        attached: list[Attachment | ImageAttachment] = [*self.attachments, *self.images]
        names = ", ".join(a.name for a in attached[:3])
        if len(attached) > 3:
            names += f" and {len(attached) - 3} more"
        if not self.skipped:
            return f"Attached {names}." if names else "Nothing to attach there (hidden files and folders are skipped)."
        if not attached and len(self.skipped) == 1:
            name, why = self.skipped[0]
            hint = "; attach text, source code, Markdown, JSON/CSV or PDF files" if "binary" in why else ""
            return f"Cannot attach {name}: {why}{hint}."
        shown = ", ".join(f"{name} ({why})" for name, why in self.skipped[:4])
        if len(self.skipped) > 4:
            shown += f" and {len(self.skipped) - 4} more"
        what = f"{len(self.skipped)}: {shown}."
        return f"Attached {names}; skipped {what}" if attached else f"Skipped {what}"


def gather(arg: str, cwd: Path | None = None) -> Gathered:
    """The files `arg` names (paths, globs, directories, shell-quoted), read; what could not be
    attached is in `skipped`. Raises UsageError only for an empty or unparsable argument."""
    cwd = cwd or Path.cwd()
    try:
        words = shlex.split(arg)
    except ValueError as exc:
        raise UsageError(f"cannot read the paths ({exc}); quote a path with spaces in it") from None
    if not words:
        raise UsageError("name a file: /attach PATH (several, globs and directories too)")
    out = Gathered()
    for path, name, reason in _expand(words, cwd):
        if len(out.attachments) + len(out.images) >= MAX_FILES:
            # stops the walk too: /attach ~ must not read a whole home directory
            out.skipped.append((name, f"over {MAX_FILES} files; nothing after it was read"))
            break
        if not reason:
            try:
                if image_type(path):
                    out.images.append(read_image(path, name))
                elif is_audio(path):
                    out.attachments.append(read_audio(path, name))
                else:
                    out.attachments.append(read_file(path, name))
            except UsageError as exc:
                reason = str(exc)
        if reason:
            out.skipped.append((name, reason))
    return out


def _expand(words: list[str], cwd: Path):
    """(path, name, "") for each file the words name, (path, name, why) for a name that is none.
    A file is named as under the working directory, else by its own name; a folder's files by
    their path from the folder's parent (a folder "src" gives "src/app.py")."""
    for word in words:
        pattern = Path(os.path.expanduser(word))
        pattern = pattern if pattern.is_absolute() else cwd / pattern
        if glob.has_magic(word) and not pattern.exists():  # a file named with [ or * is that file
            matches = sorted(glob.glob(str(pattern), recursive=True))
        else:
            matches = [str(pattern)]
        if not matches:
            yield pattern, word, "no file matches"
        for match in matches:
            path = Path(match)
            if path.is_dir():
                yield from ((p, str(p.relative_to(path.parent)), "") for p in _walk(path))
            else:
                yield path, _name(path, cwd), "" if path.is_file() else "no such file"


def _walk(root: Path):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if not name.startswith("."):
                yield Path(dirpath) / name


def _name(path: Path, cwd: Path) -> str:
    try:
        return str(path.resolve().relative_to(cwd.resolve()))
    except ValueError:
        return path.name


def read_file(path: Path, name: str | None = None) -> Attachment:
    """One file as an attachment; UsageError (a short reason) when it is not text or PDF."""
    name = name or path.name
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            is_pdf = head.startswith(b"%PDF-")
            if size > (MAX_PDF_BYTES if is_pdf else MAX_FILE_BYTES):
                raise UsageError(f"over {file_size(MAX_PDF_BYTES if is_pdf else MAX_FILE_BYTES)}")
            data = head + fh.read()
    except FileNotFoundError:
        raise UsageError("no such file") from None
    except OSError as exc:
        raise UsageError(exc.strerror or str(exc)) from None
    if is_pdf:
        text = _pdf_text(path)
        if len(text.encode("utf-8")) > MAX_FILE_BYTES:
            raise UsageError(f"its text is over {file_size(MAX_FILE_BYTES)}")
        return Attachment(name, text, "text")
    if b"\0" in data[:8192]:
        raise UsageError("binary")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise UsageError("binary, or text that is not UTF-8") from None
    return Attachment(name, text, path.suffix.lstrip(".").lower())


def is_audio(path: Path) -> bool:
    return path.suffix.lstrip(".").lower() in AUDIO_SUFFIXES


def names_audio(arg: str) -> bool:
    """Whether an /attach argument names an audio file (writing it down takes seconds)."""
    try:
        return any(is_audio(Path(word)) for word in shlex.split(arg))
    except ValueError:
        return False


@functools.cache
def _listener():
    """The app's speech-to-text model ($EDGECHAT_STT_MODEL, else whisper-base), found once."""
    from edgechat.config import get_paths
    from edgechat.engine.speech.models import speech_models
    from edgechat.models.speech import DEFAULT_STT

    return speech_models(os.environ.get("EDGECHAT_STT_MODEL") or DEFAULT_STT, None, get_paths())


def read_audio(path: Path, name: str | None = None) -> Attachment:
    """An audio file as its transcript; UsageError (a short reason) when it cannot be heard."""
    from edgechat.engine.speech import AudioInputError, VoiceMissingError

    try:
        _, segments = _listener().transcribe_file(path)
    except AudioInputError as exc:
        # "'PATH' is silent: ..." as gather's reason after the file's name: "silent: ..."
        raise UsageError(str(exc).removeprefix(f"'{path}' ").removeprefix("is ")) from None
    except VoiceMissingError:
        raise UsageError("audio is written down by the voice extra: pip install 'edgechat[voice]'") from None
    return Attachment(f"{name or path.name} (transcript)", "".join(s.text for s in segments).strip(), "text")


def image_type(path: Path) -> str | None:
    """The media type of a picture file (by its suffix, else its first bytes), None for others."""
    by_suffix = IMAGE_TYPES.get(path.suffix.lstrip(".").lower())
    if by_suffix:
        return by_suffix
    try:
        with open(path, "rb") as fh:
            return media_type(fh.read(12))
    except OSError:
        return None


def read_image(path: Path, name: str | None = None) -> ImageAttachment:
    """One picture file; UsageError (a short reason) when it cannot be read or is too big.
    Whether the model can decode it is the projector's to say when it is sent."""
    try:
        if path.stat().st_size > MAX_IMAGE_BYTES:
            raise UsageError(f"over {file_size(MAX_IMAGE_BYTES)}")
        data = path.read_bytes()
    except FileNotFoundError:
        raise UsageError("no such file") from None
    except IsADirectoryError:
        raise UsageError("a folder, not an image file") from None
    except OSError as exc:
        raise UsageError(exc.strerror or str(exc)) from None
    kind = media_type(data[:12])
    if kind is None:
        raise UsageError("not a PNG, JPEG, GIF or BMP picture")
    if (why := undecoded(kind)) is not None:
        raise UsageError(why)
    return ImageAttachment(name or path.name, data, kind)


def _pdf_text(path: Path) -> str:
    # Imported here: only a PDF needs it, and it takes a moment to import.
    from pypdf import PdfReader
    from pypdf.errors import PyPdfError

    try:
        reader = PdfReader(path)
        if reader.is_encrypted:
            raise UsageError("an encrypted PDF")
        text = "\n\n".join((page.extract_text() or "").strip() for page in reader.pages).strip()
    except (PyPdfError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"an unreadable PDF ({exc})") from None
    if not text:
        raise UsageError("a PDF without text (a scan?)")
    return text


def pasted_path(text: str) -> Path | None:
    """The file a paste is exactly the path of (as terminals send a dropped file: quoted,
    backslash-escaped or a file:// URL), else None."""
    text = text.strip()
    if not text or "\n" in text or len(text) > 4096:
        return None
    if text.startswith("file://"):
        text = unquote(text[len("file://"):])
    elif len(text) > 1 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]
    elif "\\ " in text:
        text = re.sub(r"\\(.)", r"\1", text)
    path = Path(os.path.expanduser(text))
    # a relative word ("notes") that happens to be a file here is text, not a drop
    return path if path.is_absolute() and path.is_file() else None


def from_paste(text: str, number: int) -> Attachment:
    return Attachment(f"pasted text {number}", text)


def compose(text: str, attachments: list[Attachment]) -> str:
    """A message's content: the attachments' blocks, then what the user typed (the question
    after the material, where small models follow it best)."""
    return "\n\n".join([a.block() for a in attachments] + ([text] if text.strip() else []))


def split(content: str, count: int) -> tuple[list[Attachment], str]:
    """compose() undone for a message stored with `count` attachments: (them, the typed text)."""
    found: list[Attachment] = []
    pos = 0
    while len(found) < count:
        head = _HEADER.match(content, pos)
        if head is None:
            break
        close = content.find("\n" + head["fence"], head.end())
        if close < 0:
            break
        found.append(Attachment(head["name"], content[head.end():close], head["lang"]))
        pos = close + 1 + len(head["fence"])
        if content.startswith("\n\n", pos):
            pos += 2
    return found, content[pos:]


def excerpts(files: list[Attachment], question: str, budget: int, count: Callable[[str], int],
             embed: Callable[[list[str]], Sequence]) -> list[Attachment]:
    """The parts of `files` nearest to `question` that fit in `budget` tokens (as `count` counts
    a text), each file's parts in their own order with a GAP where some were left out. `embed`
    gives unit vectors, so a dot product is the cosine. Files none of whose parts fit are left out."""
    pieces = [(i, n, text) for i, a in enumerate(files) for n, text in enumerate(_pieces(a.text))]
    if not pieces:
        return []
    vectors = embed([question] + [text for _, _, text in pieces])
    near = sorted(range(len(pieces)), key=lambda k: -float(vectors[k + 1] @ vectors[0]))
    chosen, used = set(), 0
    for k in near:
        cost = count(pieces[k][2])
        if used + cost <= budget:
            chosen.add(k)
            used += cost
    out = []
    for i, a in enumerate(files):
        parts = [(n, text) for k, (f, n, text) in enumerate(pieces) if f == i and k in chosen]
        if not parts:
            continue
        body = parts[0][1]
        for (before, _), (n, text) in pairwise(parts):
            body += (GAP if n != before + 1 else "") + text
        out.append(Attachment(f"{a.name} (excerpts)", body, a.lang))
    return out


def _pieces(text: str) -> list[str]:
    """`text` cut into runs of whole lines of about EXCERPT_CHARS, ending at a paragraph's end
    where one comes after a quarter of that (a line longer than EXCERPT_CHARS on its own, cut)."""
    out, run = [], ""
    for line in text.splitlines(keepends=True):
        while len(line) > EXCERPT_CHARS:
            if run:
                out.append(run)
                run = ""
            out.append(line[:EXCERPT_CHARS])
            line = line[EXCERPT_CHARS:]
        run += line
        if len(run) >= EXCERPT_CHARS or (not line.strip() and len(run) >= EXCERPT_CHARS // 4):
            out.append(run)
            run = ""
    if run.strip():
        out.append(run)
    return out
