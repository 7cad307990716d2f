"""The Pillow work on the images a server sends (untrusted): `check` refuses, without decoding a pixel, a type not in
`FORMATS` (opened with its plugin only), base64 past `MAX_IMAGE_CHARS` (`MAX_IMAGE_BYTES`), more than
`MAX_IMAGE_PIXELS`, a `DecompressionBombError` or a failed `verify()`; an answer holds at most `MAX_IMAGES` and
`MAX_ANSWER_PIXELS`. `decode` runs once a model needs them. A refused image (or any, without Pillow) is a `placeholder`
saying why."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from .errors import ImageError
from .text import cut, repair

__all__ = ["FORMATS", "MAX_ANSWER_PIXELS", "MAX_IMAGES", "MAX_IMAGE_BYTES", "MAX_IMAGE_CHARS", "MAX_IMAGE_PIXELS",
           "ImageInfo", "as_bytes", "check", "check_bytes", "data_url", "decode", "placeholder", "thumbnail"]

#: Media types passed to a model, and the one Pillow format each is opened as.
FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/gif": "GIF", "image/webp": "WEBP",
           "image/bmp": "BMP"}
MAX_IMAGE_BYTES = 16 << 20
MAX_IMAGE_CHARS = -(-MAX_IMAGE_BYTES // 3) * 4
MAX_IMAGE_PIXELS = 4096 * 4096
MAX_IMAGES = 64
MAX_ANSWER_PIXELS = 4 * MAX_IMAGE_PIXELS
_EXTENSIONS = {"PNG": "png", "JPEG": "jpg", "GIF": "gif", "WEBP": "webp", "BMP": "bmp"}
_NO_PILLOW = "Pillow is not installed (pip install 'ors-trl[vision]')"
#: The last images `data_url` encoded, by SHA-256 (a conversation is sent whole at every turn).
_URLS: OrderedDict[str, str] = OrderedDict()
_URLS_KEPT = 32


@dataclass(frozen=True, slots=True)
class ImageInfo:
    """What the check found: the SHA-256 of the bytes (of the base64 text where it does not decode), their size, the
    declared dimensions, and why it cannot be shown (None: it can)."""

    sha256: str
    bytes: int
    mime_type: str
    width: int | None = None
    height: int | None = None
    error: str | None = None

    @property
    def pixels(self) -> int:
        return (self.width or 0) * (self.height or 0)

    @property
    def extension(self) -> str:
        return _EXTENSIONS.get(_format(self.mime_type) or "", "bin")


def _format(mime_type: str) -> str | None:
    return FORMATS.get(mime_type.split(";", 1)[0].strip().lower())


def _failed(raw: bytes, mime_type: str, why: str, width: int | None = None, height: int | None = None) -> ImageInfo:
    return ImageInfo(hashlib.sha256(raw).hexdigest(), len(raw), mime_type, width, height, repair(why))


def _pillow() -> Any:
    try:
        from PIL import Image
    except ImportError:
        return None
    return Image


def _why(exc: BaseException) -> str:
    return cut(f"{type(exc).__name__}: {exc}", 200)


def check(data: str, mime_type: str) -> ImageInfo:
    """Check a block's base64 `data` of media type `mime_type` (then as `check_bytes`); never raises."""
    text = data.encode("utf-8", "replace")
    if len(data) > MAX_IMAGE_CHARS:
        return _failed(text, mime_type, f"its {len(data)} characters of base64 are more than the {MAX_IMAGE_CHARS} a "
                       f"{MAX_IMAGE_BYTES >> 20} MiB image takes")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        return _failed(text, mime_type, "its data is not valid base64")
    return check_bytes(raw, mime_type)


def check_bytes(raw: bytes, mime_type: str) -> ImageInfo:
    """Check an image's bytes: its format, its declared size, Pillow's `verify()`. Never raises."""
    fmt = _format(mime_type)
    if fmt is None:
        return _failed(raw, mime_type, f"its media type {cut(mime_type, 60)!r} is not an image type ors-trl passes "
                       f"({', '.join(FORMATS)})")
    if len(raw) > MAX_IMAGE_BYTES:
        return _failed(raw, mime_type, f"its {len(raw)} bytes are more than the {MAX_IMAGE_BYTES >> 20} MiB bound")
    pil = _pillow()
    if pil is None:
        return _failed(raw, mime_type, _NO_PILLOW)
    width = height = None
    try:
        with pil.open(io.BytesIO(raw), formats=[fmt]) as im:
            width, height = im.size
            limit = min(MAX_IMAGE_PIXELS, pil.MAX_IMAGE_PIXELS or MAX_IMAGE_PIXELS)
            if width * height > limit:
                return _failed(raw, mime_type, f"it declares {width}x{height} pixels, more than the {limit} an image "
                               "may have", width, height)
            im.verify()
    except pil.DecompressionBombError as exc:
        return _failed(raw, mime_type, f"Pillow refused it as a decompression bomb ({_why(exc)})", width, height)
    except pil.UnidentifiedImageError:
        return _failed(raw, mime_type, f"it is not a {fmt} file")
    except Exception as exc:  # a hostile file can make a decoder raise almost anything
        return _failed(raw, mime_type, f"it is not a valid {fmt} image ({_why(exc)})", width, height)
    return ImageInfo(hashlib.sha256(raw).hexdigest(), len(raw), mime_type, width, height)


def decode(raw: bytes, info: ImageInfo) -> Any:
    """The pixels of an image that passed `check`, as an RGB `PIL.Image.Image` (the first frame, over white); an
    `ImageError` where they do not decode."""
    pil = _pillow()
    if pil is None:
        raise ImageError(_NO_PILLOW)
    try:
        with pil.open(io.BytesIO(raw), formats=[_format(info.mime_type)]) as im:
            if im.size != (info.width, info.height):
                raise ValueError(f"the image is {im.size}, not the {info.width}x{info.height} it was checked as")
            im.load()
            if im.mode == "RGB":
                image = im.copy()
            else:
                rgba = im.convert("RGBA")
                image = pil.alpha_composite(pil.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    except Exception as exc:
        raise ImageError(f"its pixels do not decode ({_why(exc)})") from None
    image.info = {"ors_sha256": info.sha256}  # identity for whoever holds only the pixels (`data_url`, caches)
    return image


def placeholder(info: ImageInfo) -> str:
    """What a model reads in place of an image that cannot be shown."""
    return f"[image not shown ({cut(info.mime_type, 60)}): {info.error}]"


def data_url(image: Any) -> str:
    """A `PIL.Image` as a PNG `data:` URL; the last `_URLS_KEPT` images decoded here are encoded once."""
    sha = image.info.get("ors_sha256") if isinstance(getattr(image, "info", None), dict) else None
    if sha in _URLS:
        _URLS.move_to_end(sha)
        return _URLS[sha]
    out = io.BytesIO()
    image.save(out, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(out.getvalue()).decode("ascii")
    if sha is not None:
        _URLS[sha] = url
        while len(_URLS) > _URLS_KEPT:
            _URLS.popitem(last=False)
    return url


def thumbnail(raw: bytes, mime_type: str, size: int) -> str | None:
    """A PNG `data:` URL of the image at most `size` pixels on a side, checked as any image a server sends (image
    files beside a log are untrusted too); None where it cannot be shown."""
    info = check_bytes(raw, mime_type)
    try:
        image = decode(raw, info) if info.error is None else None
    except ImageError:
        image = None
    if image is not None:
        image.thumbnail((size, size))
    return None if image is None else data_url(image)


def as_bytes(data: str) -> bytes:
    return base64.b64decode(data)
