"""Files brought into a message: which files a command names, which of them are text, and the
fenced blocks the model is given them in (and read back from, to edit a sent message)."""

from __future__ import annotations

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

#: the most text one file may bring (a PDF: its extracted text); far beyond any small context
MAX_FILE_BYTES = 512 * 1024
#: a PDF is mostly fonts and images: its file may be this big before its text is read
MAX_PDF_BYTES = 32 * 1024 * 1024
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


@dataclass
class Gathered:
    attachments: list[Attachment] = field(default_factory=list)
    #: (name, why) of every file named but not attached
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def summary(self) -> str:
        """One line on what was attached and what was skipped (and why)."""
        names = ", ".join(a.name for a in self.attachments[:3])
        if len(self.attachments) > 3:
            names += f" and {len(self.attachments) - 3} more"
        if not self.skipped:
            return f"Attached {names}." if names else "Nothing to attach there (hidden files and folders are skipped)."
        if not self.attachments and len(self.skipped) == 1:
            name, why = self.skipped[0]
            hint = "; attach text, source code, Markdown, JSON/CSV or PDF files" if "binary" in why else ""
            return f"Cannot attach {name}: {why}{hint}."
        shown = ", ".join(f"{name} ({why})" for name, why in self.skipped[:4])
        if len(self.skipped) > 4:
            shown += f" and {len(self.skipped) - 4} more"
        what = f"{len(self.skipped)}: {shown}."
        return f"Attached {names}; skipped {what}" if self.attachments else f"Skipped {what}"


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
        if len(out.attachments) >= MAX_FILES:
            # stops the walk too: /attach ~ must not read a whole home directory
            out.skipped.append((name, f"over {MAX_FILES} files; nothing after it was read"))
            break
        if not reason:
            try:
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
                raise UsageError(f"over {_kb(MAX_PDF_BYTES if is_pdf else MAX_FILE_BYTES)}")
            data = head + fh.read()
    except FileNotFoundError:
        raise UsageError("no such file") from None
    except OSError as exc:
        raise UsageError(exc.strerror or str(exc)) from None
    if is_pdf:
        text = _pdf_text(path)
        if len(text.encode("utf-8")) > MAX_FILE_BYTES:
            raise UsageError(f"its text is over {_kb(MAX_FILE_BYTES)}")
        return Attachment(name, text, "text")
    if b"\0" in data[:8192]:
        raise UsageError("binary")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise UsageError("binary, or text that is not UTF-8") from None
    return Attachment(name, text, path.suffix.lstrip(".").lower())


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


def _kb(n: int) -> str:
    return f"{n // (1024 * 1024)} MB" if n >= 1024 * 1024 else f"{n // 1024} KB"


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
