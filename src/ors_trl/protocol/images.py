"""Images a server sends: checked once, where their block is parsed, with Pillow's own guards, and decoded to pixels
once, where a model first needs them.

An image block (`{"type": "image", "data": <base64>, "mimeType": ...}`) is untrusted input. Where it is parsed
(`ors_trl.protocol.types.parse_blocks`) it is checked without decoding a pixel (`check`):

- its media type must be one of `FORMATS` (PNG, JPEG, GIF, WebP, BMP), and it is opened with that format's Pillow
  plugin only (a PNG sent as `image/jpeg` is refused, not sniffed);
- its base64 text is at most `MAX_IMAGE_CHARS` characters (`MAX_IMAGE_BYTES`, 16 MiB, decoded), measured before
  anything is decoded, and must be valid base64;
- its header may declare at most `MAX_IMAGE_PIXELS` pixels (4096 x 4096; Pillow's `Image.MAX_IMAGE_PIXELS` where it
  is lower, and Pillow's `DecompressionBombError`), and the file must pass Pillow's `verify()`;
- one answer (a prompt, a conversation, a tool result) holds at most `MAX_IMAGES` images and `MAX_ANSWER_PIXELS`
  pixels together (`ors_trl.protocol.types`).

An image that fails keeps its reason (`ImageInfo.error`): the model reads a text placeholder in its place
(`placeholder`), the record says why, and the rest of the answer stands. The pixels are decoded once, on first use
(`decode`, RGB), so an image costs at most 3 bytes per pixel (48 MiB at the bound). Without Pillow
(`pip install 'ors-trl[vision]'`) every image is a placeholder. Pillow is imported only when an image arrives.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from .errors import ImageError
from .text import repair, shorten

__all__ = ["FORMATS", "MAX_ANSWER_PIXELS", "MAX_IMAGES", "MAX_IMAGE_BYTES", "MAX_IMAGE_CHARS", "MAX_IMAGE_PIXELS",
           "ImageInfo", "as_bytes", "check", "check_bytes", "data_url", "decode", "placeholder", "thumbnail"]

#: Media types passed to a model, and the one Pillow format each is opened as.
FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/gif": "GIF", "image/webp": "WEBP",
           "image/bmp": "BMP"}
#: The largest image (decoded bytes), and the base64 text that holds it (refused by its length, before decoding).
MAX_IMAGE_BYTES = 16 << 20
MAX_IMAGE_CHARS = -(-MAX_IMAGE_BYTES // 3) * 4
#: The most pixels one image may declare (read from its header, before any pixel is decoded).
MAX_IMAGE_PIXELS = 4096 * 4096
#: Images, and pixels of all of them, one answer (a prompt, a conversation, a tool result) may hold.
MAX_IMAGES = 64
MAX_ANSWER_PIXELS = 4 * MAX_IMAGE_PIXELS
_EXTENSIONS = {"PNG": "png", "JPEG": "jpg", "GIF": "gif", "WEBP": "webp", "BMP": "bmp"}
_NO_PILLOW = "Pillow is not installed (pip install 'ors-trl[vision]')"


@dataclass(frozen=True, slots=True)
class ImageInfo:
    """What the check found: the SHA-256 of the image's bytes (of the base64 text where it does not decode), their
    size, the declared width and height, the media type, and why it cannot be shown (None: it can)."""

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
    return shorten(f"{type(exc).__name__}: {exc}", 200)


def check(data: str, mime_type: str) -> ImageInfo:
    """Check a block's base64 `data` of media type `mime_type` (see the module docstring); never raises."""
    if _format(mime_type) is None:
        return _failed(data.encode("utf-8", "replace"), mime_type, f"its media type {shorten(mime_type, 60)!r} is not "
                       f"an image type ors-trl passes ({', '.join(FORMATS)})")
    if len(data) > MAX_IMAGE_CHARS:
        return _failed(data.encode("utf-8", "replace"), mime_type, f"its {len(data)} characters of base64 are more "
                       f"than the {MAX_IMAGE_CHARS} a {MAX_IMAGE_BYTES >> 20} MiB image takes")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        return _failed(data.encode("utf-8", "replace"), mime_type, "its data is not valid base64")
    return check_bytes(raw, mime_type)


def check_bytes(raw: bytes, mime_type: str) -> ImageInfo:
    """Check an image's bytes: its format, its declared size, Pillow's `verify()`. Never raises."""
    fmt = _format(mime_type)
    if fmt is None:
        return _failed(raw, mime_type, f"its media type {shorten(mime_type, 60)!r} is not an image type")
    if len(raw) > MAX_IMAGE_BYTES:
        return _failed(raw, mime_type, f"its {len(raw)} bytes are more than the {MAX_IMAGE_BYTES >> 20} MiB bound")
    image_module = _pillow()
    if image_module is None:
        return _failed(raw, mime_type, _NO_PILLOW)
    width = height = None
    try:
        with image_module.open(io.BytesIO(raw), formats=[fmt]) as im:
            width, height = im.size
            limit = min(MAX_IMAGE_PIXELS, image_module.MAX_IMAGE_PIXELS or MAX_IMAGE_PIXELS)
            if width * height > limit:
                return _failed(raw, mime_type, f"it declares {width}x{height} pixels, more than the {limit} an image "
                               "may have", width, height)
            im.verify()
    except image_module.DecompressionBombError as exc:
        return _failed(raw, mime_type, f"Pillow refused it as a decompression bomb ({_why(exc)})", width, height)
    except image_module.UnidentifiedImageError:
        return _failed(raw, mime_type, f"it is not a {fmt} file")
    except Exception as exc:  # a hostile file can make a decoder raise almost anything; all mean "not a valid image"
        return _failed(raw, mime_type, f"it is not a valid {fmt} image ({_why(exc)})", width, height)
    return ImageInfo(hashlib.sha256(raw).hexdigest(), len(raw), mime_type, width, height)


def decode(raw: bytes, info: ImageInfo) -> Any:
    """The pixels of an image that passed `check`, as an RGB `PIL.Image.Image` (the first frame; transparency over
    white). Raises `ImageError` for one whose pixels turn out not to decode (a cut file)."""
    image_module = _pillow()
    if image_module is None:
        raise ImageError(_NO_PILLOW)
    try:
        with image_module.open(io.BytesIO(raw), formats=[_format(info.mime_type)]) as im:
            if im.size != (info.width, info.height):
                raise ValueError(f"the image is {im.size}, not the {info.width}x{info.height} it was checked as")
            im.load()
            if im.mode == "RGB":
                image = im.copy()
            else:
                rgba = im.convert("RGBA")
                image = image_module.alpha_composite(image_module.new("RGBA", rgba.size, (255, 255, 255, 255)),
                                                     rgba).convert("RGB")
    except Exception as exc:
        raise ImageError(f"its pixels do not decode ({_why(exc)})") from None
    image.info = {"ors_sha256": info.sha256}  # identity for whoever holds only the pixels (`data_url`, caches)
    return image


def placeholder(info: ImageInfo) -> str:
    """What a model reads in place of an image that cannot be shown."""
    return f"[image not shown ({shorten(info.mime_type, 60)}): {info.error}]"


def data_url(image: Any) -> str:
    """A `PIL.Image` as a PNG `data:` URL (the form OpenAI-style APIs take); the last `_URLS_KEPT` images decoded
    here are encoded once (a conversation is sent whole at every turn)."""
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


_URLS: OrderedDict[str, str] = OrderedDict()
_URLS_KEPT = 32


def thumbnail(raw: bytes, mime_type: str, size: int) -> str | None:
    """A PNG `data:` URL of the image at most `size` pixels on a side, checked and decoded as any image a server
    sends (the report reads image files beside a log: they are untrusted too); None where it cannot be shown."""
    info = check_bytes(raw, mime_type)
    try:
        image = decode(raw, info) if info.error is None else None
    except ImageError:
        return None
    if image is None:
        return None
    image.thumbnail((size, size))
    return data_url(image)


def as_bytes(data: str) -> bytes:
    """The bytes of a block's base64 `data` (checked already)."""
    return base64.b64decode(data)
