"""Images in request bodies: each API's reference to a picture (a data URL, a file:// URL, raw
base64) into the engine's ImageInput, within the server's limits, every refusal a 400 naming
the field. The server is offline: remote URLs are never fetched.

One ImageReader per request: it counts the request's images against --max-images.
"""

from __future__ import annotations

import base64
import binascii
import urllib.parse
import urllib.request
from pathlib import Path

from edgechat.engine.types.request import ImageInput
from edgechat.images import image_size, undecoded
from edgechat.server.errors import ApiError, bad_request
from edgechat.server.settings import ServerSettings

#: what to send instead of a URL the server will not read
DATA_URL_HINT = "send the image as a data URL (data:image/png;base64,...)"


def content(parts: list) -> str | list:
    """A message's content from its parts in order (str and ImageInput): text alone as one
    string, as text-only messages have always been; with images, a list with adjacent text joined."""
    if not any(isinstance(p, ImageInput) for p in parts):
        return "".join(parts)
    out: list = []
    for part in parts:
        if isinstance(part, str) and out and isinstance(out[-1], str):
            out[-1] += part
        elif not (isinstance(part, str) and not part):
            out.append(part)
    return out


class ImageReader:
    """One request's images, read and checked against the server's settings."""

    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self.count = 0

    def url(self, where: str, value: object) -> ImageInput:
        """An image URL: a data URL, or a file:// URL under --image-dir; remote ones refused."""
        if not isinstance(value, str):
            got = "null" if value is None else type(value).__name__
            raise bad_request(f"'{where}' must be an image URL string, not {got}", param=where, code="invalid_type")
        head = value[:8]  # a data URL may be megabytes: its scheme is in the first few characters
        scheme = head.partition(":")[0].lower() if ":" in head else ""
        if scheme == "data":
            return self._data_url(where, value)
        if scheme == "file":
            return self._file(where, value)
        if scheme in ("http", "https"):
            raise bad_request(f"{where}: remote image URLs are not fetched (this server works offline); {DATA_URL_HINT}",
                              param=where, code="invalid_value")
        raise bad_request(f"{where}: not an image URL this server reads; {DATA_URL_HINT}", param=where, code="invalid_value")

    def base64(self, where: str, value: object) -> ImageInput:
        """An image's bytes as base64 text (Anthropic's `data`, Ollama's `images`)."""
        if not isinstance(value, str):
            got = "null" if value is None else type(value).__name__
            raise bad_request(f"'{where}' must be the image's bytes as a base64 string, not {got}", param=where, code="invalid_type")
        return self.check(where, self._decode(where, value))

    def _decode(self, where: str, text: str) -> bytes:
        # base64 is 4 characters for 3 bytes: a body far over the limit is refused undecoded
        if len(text) // 4 * 3 > self.settings.max_image_bytes + 3:
            raise self._too_big(where, len(text) // 4 * 3)
        text = "".join(text.split())  # line breaks some encoders put in
        try:
            return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
        except (binascii.Error, ValueError):
            raise bad_request(f"{where}: the image data is not valid base64", param=where, code="invalid_value") from None

    def _data_url(self, where: str, url: str) -> ImageInput:
        header, comma, payload = url.partition(",")
        if not comma:
            raise bad_request(f"{where}: the data URL has no ',' before its data; {DATA_URL_HINT}", param=where, code="invalid_value")
        if header.lower().endswith(";base64"):
            return self.check(where, self._decode(where, payload))
        data = urllib.parse.unquote_to_bytes(payload)
        if len(data) > self.settings.max_image_bytes:
            raise self._too_big(where, len(data))
        return self.check(where, data)

    def _file(self, where: str, url: str) -> ImageInput:
        folder = self.settings.image_dir
        if folder is None:
            raise bad_request(f"{where}: file:// image URLs are read only from the server's image folder, and it has none "
                              f"(start it with --image-dir FOLDER); or {DATA_URL_HINT}", param=where, code="invalid_value")
        parsed = urllib.parse.urlsplit(url)
        if parsed.netloc not in ("", "localhost"):
            raise bad_request(f"{where}: a file URL names a path on this machine, file:///path/to/image.png, not a host",
                              param=where, code="invalid_value")
        try:
            path = Path(urllib.request.url2pathname(parsed.path)).resolve()
        except (OSError, ValueError):
            path = None
        if path is None or not path.is_relative_to(Path(folder).resolve()):
            # resolved, so neither '..' nor a link leads out of the folder
            raise bad_request(f"{where}: the file is not inside the server's --image-dir; put it there or {DATA_URL_HINT}",
                              param=where, code="invalid_value")
        try:
            size = path.stat().st_size
            if size > self.settings.max_image_bytes:
                raise self._too_big(where, size)
            data = path.read_bytes()
        except OSError as exc:
            raise bad_request(f"{where}: cannot read the file: {exc.strerror or exc}", param=where, code="invalid_value") from None
        return self.check(where, data)

    def _too_big(self, where: str, size: int) -> ApiError:
        limit = self.settings.max_image_bytes
        return bad_request(f"{where}: the image is {size / 2**20:.1f} MiB, more than the {limit / 2**20:g} MiB this server takes "
                           "per image (--max-image-mib); send a smaller one", param=where, code="image_too_large")

    def check(self, where: str, data: bytes) -> ImageInput:
        """The image `data` as the engine takes it, once its size, pixels and the request's
        count are within the limits."""
        s = self.settings
        self.count += 1
        if self.count > s.max_images:
            raise bad_request(f"{where}: the request holds more than the {s.max_images} images this server takes in one "
                              "request (--max-images); send fewer", param=where, code="too_many_images")
        if len(data) > s.max_image_bytes:
            raise self._too_big(where, len(data))
        try:
            media_type, width, height = image_size(data)
        except ValueError as exc:
            raise bad_request(f"{where}: {exc}", param=where, code="invalid_image") from None
        if (why := undecoded(media_type)) is not None:
            raise bad_request(f"{where}: {why}", param=where, code="invalid_image")
        megapixels = width * height / 1e6
        if megapixels > s.max_image_megapixels:
            raise bad_request(f"{where}: the image is {width}x{height} ({megapixels:.1f} megapixels), more than the "
                              f"{s.max_image_megapixels:g} this server takes (--max-image-megapixels); send a smaller one",
                              param=where, code="image_too_large")
        return ImageInput(data, media_type)
