"""HTTP and SSE over aiohttp, for the ORS client and JSON APIs (`Transport.for_url`): the one retry loop (`retrying`),
redirects followed by hand (credentials dropped on a hop to another host), `/call` streams resumed by task id, and
`Decoder`, the one way a server's untrusted bytes become values. Errors raised here carry no chain (secrets)."""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import email.utils
import functools
import json
import logging
import math
import random
import re
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urljoin

import aiohttp
from aiohttp.http_exceptions import ContentEncodingError

from .._version import __version__
from .errors import (
    ConfigurationError,
    ORSError,
    ORSTimeoutError,
    ProtocolError,
    ServiceUnavailableError,
    StreamInterruptedError,
    ToolFailedError,
    TransportError,
    UsageError,
    status_error,
)
from .target import Target, _host_port, _validate_url
from .text import JSON_ESCAPES, clean_json, cut, escape_controls, readable, repair, unescape_json
from .types import MASK

__all__ = ["DECODE_BYTES_PER_CHAR", "DECODE_MIN_BYTES", "Decoder", "RetryPolicy", "Timeouts", "Transport", "masked"]

logger = logging.getLogger("ors_trl.client")
T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Awaitable[Any]])

USER_AGENT = f"ors-trl/{__version__}"
_RETRY_STATUSES = frozenset({429, 502, 503, 504})
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
#: The `Content-Encoding`s aiohttp decodes (or that need none).
_DECODED = frozenset({"", "identity", "gzip", "deflate", "br", "zstd"})
_MAX_REDIRECTS = 10
_CREDENTIAL_HEADERS = ("X-API-Key", "X-Secrets", "Authorization")
#: Shorter secret values are not masked: masking "1" or "abc" would garble every message, and they are no secrets.
_MIN_MASKED_SECRET = 6
_MASK = "***"
#: How much of an error answer's body is read for its detail, and of an answer that is not JSON for the message.
_ERROR_BODY_LIMIT = _QUOTE_HEAD = 64 * 1024
#: JSON's short escapes: a secret holding one of these characters may be spelled with its escape in an answer.
_SHORT_ESCAPES = {char: "\\" + letter for letter, char in JSON_ESCAPES.items()}
_ESCAPE = re.compile(r"\\u")  # a regex: with many backslashes in a text, `"\\u" in text` is slower
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
#: In JSON text: an escaped backslash (kept, so that the text "backslash, ud800" stays text), a surrogate pair (kept:
#: one character), or a lone surrogate (written as U+FFFD). Repaired before decoding: a scan of the text, not a walk.
_SURROGATE_ESCAPES = re.compile(r"\\(?:(\\)|u[dD][89abAB][0-9a-fA-F]{2}(\\u[dD][c-fC-F][0-9a-fA-F]{2})?|"
                                r"u[dD][c-fC-F][0-9a-fA-F]{2})")  # one literal first: the regex engine skips ahead
#: What decoding an answer may build, estimated before decoding (`_decoded_size`): `DECODE_BYTES_PER_CHAR` bytes per
#: character, at least `DECODE_MIN_BYTES`. 40 MB of tiny blocks or empty lists once cost 0.7-1.1 GB to decode.
DECODE_BYTES_PER_CHAR = 8
DECODE_MIN_BYTES = 16 << 20
#: What CPython spends per `{` (a small dict), `[` (an empty list), `:` (a dict entry), `,` (a slot) and string value.
#: Numbers, `true` and `null` cost at most 9 bytes per character: left out.
_COSTS = ((",", 8), (":", 48), ("[", 64), ("{", 184))
_STRING_COST = 56
_CLASSES = bytes(c if c in b'",:[{' else ord("w") if c in b" \t\r\n" else ord("x") for c in range(256))
_WINDOW = 1 << 18
_DELAY_SECONDS = re.compile(r"[0-9]+(?:\.[0-9]*)?")


@dataclass(frozen=True)
class Timeouts:
    """Deadlines, in seconds; `None` disables one (not recommended).

    Args:
        connect (`float`, *optional*, defaults to `10.0`):
            Establishing a TCP/TLS connection.
        request (`float`, *optional*, defaults to `60.0`):
            One whole non-streaming request.
        stream_idle (`float`, *optional*, defaults to `45.0`):
            Silence allowed on a `/call` stream (servers send a comment every 10 s) before it is resumed.
        tool_call (`float`, *optional*, defaults to `3600.0`):
            One whole tool call, resumes included.
    """

    connect: float | None = 10.0
    request: float | None = 60.0
    stream_idle: float | None = 45.0
    tool_call: float | None = 3600.0


@dataclass(frozen=True)
class RetryPolicy:
    """How hard the client tries before an error reaches the caller; a `ConfigurationError` for values that cannot
    work.

    Args:
        max_attempts (`int`, *optional*, defaults to `6`):
            Tries per request for network errors and 429/502/503/504 (1 = no retry).
        backoff_initial (`float`, *optional*, defaults to `0.25`):
            First backoff delay, in seconds, doubled each attempt, with jitter; also the floor of every wait.
        backoff_max (`float`, *optional*, defaults to `8.0`):
            Cap on one backoff delay, in seconds (a server's `Retry-After` is honoured up to this).
        starting_timeout (`float`, *optional*, defaults to `600.0`):
            Seconds to wait out a backend answering 503 `X-Backend-State: starting`.
        resume_attempts (`int`, *optional*, defaults to `8`):
            Re-attachments to one dropped `/call` stream by its task id.
    """

    max_attempts: int = 6
    backoff_initial: float = 0.25
    backoff_max: float = 8.0
    starting_timeout: float = 600.0
    resume_attempts: int = 8

    def __post_init__(self) -> None:
        first, cap, start = self.backoff_initial, self.backoff_max, self.starting_timeout
        if not (_number(first) and _number(cap) and 0 < first <= cap):
            raise ConfigurationError(f"RetryPolicy: backoff_initial and backoff_max must be positive seconds with "
                                     f"backoff_initial <= backoff_max, got {first!r} and {cap!r}")
        if not (_number(start) and start >= 0):
            raise ConfigurationError(f"RetryPolicy: starting_timeout must be seconds >= 0, got {start!r}")
        for name, low in (("max_attempts", 1), ("resume_attempts", 0)):
            if isinstance(value := getattr(self, name), bool) or not isinstance(value, int) or value < low:
                raise ConfigurationError(f"RetryPolicy: {name} must be an int >= {low}, got {value!r}")

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        """Seconds to wait before the next try: the backoff of `attempt` (plus up to half again of jitter), or the
        server's `Retry-After` where longer; at most `backoff_max`.

        Args:
            attempt (`int`):
                The attempt that just failed (or the poll that was answered `starting`), from 1.
            retry_after (`float`, *optional*):
                The server's `Retry-After`, in seconds.
        """
        wait = self.backoff_initial * 2.0 ** min(max(attempt - 1, 0), 64) * (1 + random.random() / 2)
        if retry_after is not None and not math.isnan(retry_after):
            wait = max(wait, retry_after)
        return min(wait, self.backoff_max)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _attempts(n: int) -> str:
    return "1 attempt" if n == 1 else f"{n} attempts"


def _retry_after(headers: Any) -> float | None:
    """A `Retry-After` header in seconds from now (delay-seconds or an HTTP-date); None when absent or unreadable."""
    value = (headers.get("Retry-After") or "").strip()[:100] if headers is not None else ""
    if _DELAY_SECONDS.fullmatch(value):
        return float(value)
    try:
        return max(email.utils.parsedate_to_datetime(value).timestamp() - time.time(), 0.0)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None


class Decoder:
    """The one way a server's bytes become Python values: invalid UTF-8 and lone surrogates as U+FFFD, every known
    secret (`add`) masked as `***` in every string and key, also where the JSON spells it with escapes. Each step runs
    only when a scan of the raw text finds something to fix: a plain answer costs one `json.loads`."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self._held: Counter[str] = Counter()  # each secret, with how many adds hold it
        self._secrets: tuple[str, ...] = ()  # longest first: the X-Secrets header contains the values
        self._probes: tuple[str, ...] = ()  # what in raw JSON text can spell a secret
        for secret in secrets:
            self.add(secret)

    def add(self, secret: str) -> None:
        """Mask `secret` from now on (one shorter than 6 characters is no secret worth garbling text for)."""
        if len(secret) >= _MIN_MASKED_SECRET:
            self._held[secret] += 1
            self._set()

    def discard(self, secret: str) -> None:
        """Undo one `add` of `secret` (a session's own value, once the session is closed): masked while others hold it."""
        if self._held[secret] > 1:
            self._held[secret] -= 1
        elif self._held.pop(secret, None):
            self._set()

    def _set(self) -> None:
        self._secrets = tuple(sorted(self._held, key=len, reverse=True))
        escapes = (_SHORT_ESCAPES[c] for s in self._secrets for c in s if c in _SHORT_ESCAPES)
        self._probes = tuple(dict.fromkeys([*self._secrets, *escapes]))

    def mask(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, _MASK)
        return text

    def text(self, raw: str | bytes) -> str:
        """Server text that is not JSON (an SSE field, an error body): invalid UTF-8 replaced, repaired, masked."""
        if not isinstance(raw, str):
            raw = bytes(raw).decode("utf-8", errors="replace")
        return self.mask(repair(raw))

    def quote(self, raw: str | bytes, limit: int = 2000) -> str:
        """What a server said, for a message (`text`, then `readable`); a secret spelled with JSON escapes is masked
        too, the quote then showing the escapes written out."""
        text = self.text(raw)
        if self._secrets and "\\" in text:
            plain = self.mask(unescape_json(text))
            if plain.count(_MASK) > text.count(_MASK):
                text = plain
        return readable(text, limit)

    def decode(self, raw: str | bytes, what: str) -> Any:
        """A JSON answer as values (None for an empty body); a `ProtocolError` for one that is not JSON, nested too
        deeply, or holding more objects than its size allows (refused before decoding)."""
        text = raw if isinstance(raw, str) else bytes(raw).decode("utf-8-sig", errors="replace")
        if not text.strip():
            return None
        _check_size(text, what)
        escaped = _ESCAPE.search(text) is not None  # stops at the first escape: most answers have one early or none
        if escaped and _SURROGATE_ESCAPE.search(text) is not None:  # decoded UTF-8 holds none: only escapes make them
            text = _SURROGATE_ESCAPES.sub(lambda m: m[0] if m[1] or m[2] else "\\ufffd", text)
        try:
            value = json.loads(text)
        except RecursionError:
            raise ProtocolError(f"{what}: the server answered JSON nested too deeply to decode") from None
        except ValueError:
            shown = self.quote(text.lstrip()[:_QUOTE_HEAD], 200)
            raise ProtocolError(f"{what}: the server answered invalid JSON: {shown!r}") from None
        if self._secrets and (escaped or any(p in text for p in self._probes)):
            value = clean_json(value, self.mask)
        return value


def _check_size(text: str, what: str) -> None:
    """Refuse JSON text whose objects would take more than `DECODE_BYTES_PER_CHAR` per character: a few `str.count`s,
    and only when those say it may, a count outside its strings (a text full of commas is no dense JSON)."""
    limit = DECODE_BYTES_PER_CHAR * len(text) + DECODE_MIN_BYTES
    if len(text) * _COSTS[-1][1] <= limit:
        return
    upper = sum(cost * text.count(c) for c, cost in _COSTS) + _STRING_COST * (text.count('"') // 2)
    if upper <= limit or (size := _decoded_size(text)) <= limit:
        return
    raise ProtocolError(f"{what}: decoding the answer's {len(text)} characters would take about {size >> 20} MiB of "
                        f"memory, more than the {DECODE_BYTES_PER_CHAR} bytes per character (and "
                        f"{DECODE_MIN_BYTES >> 20} MiB) an answer may: it holds too many containers, keys or strings "
                        "for its size")


def _decoded_size(text: str) -> int:
    """About the most the objects `json.loads(text)` builds take (`_COSTS`): the `,:[{` outside strings counted a
    window at a time, plus the non-empty strings that are no keys; no object is made per string."""
    data = text.encode("utf-8", "replace")
    if b"\\" in data:
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    data = data.translate(_CLASSES)
    strings = data.count(b'"') // 2 - data.count(b'""')  # empty ones cost nothing
    data = data.translate(None, b"w")  # so that a key's colon follows it
    size, keys, inside = 0, 0, False
    for start in range(0, len(data), _WINDOW):
        parts = data[start:start + _WINDOW].split(b'"')
        outside = b'"'.join(parts[inside::2])  # a quote where each string was
        size += sum(cost * outside.count(c.encode()) for c, cost in _COSTS)
        keys += outside.count(b'":')
        inside ^= len(parts) % 2 == 0
    return size + _STRING_COST * max(strings - keys, 0)


def _detail_of(decoder: Decoder, body: bytes) -> str:
    """The `detail` of an error answer (FastAPI's `{"detail": ...}`), else its body."""
    with contextlib.suppress(ProtocolError, ValueError, RecursionError):  # not JSON; a detail JSON cannot write
        value = decoder.decode(body, "")
        if isinstance(value, dict) and "detail" in value:
            detail = value["detail"]
            return detail if isinstance(detail, str) else json.dumps(detail, ensure_ascii=False)
    return decoder.text(body)


def masked(method: F) -> F:
    """Decorator for a call that talks to a server (of a `Transport`, or of an object with a `_transport`): secrets
    masked in the ORSErrors it raises (chain dropped) and in what `types.quoted` shows meanwhile."""

    @functools.wraps(method)
    async def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        transport = getattr(self, "_transport", self)
        token = MASK.set(transport.mask)
        try:
            return await method(self, *args, **kwargs)
        except ORSError as exc:
            transport.mask_error(exc)
            raise
        finally:
            MASK.reset(token)

    return wrapper  # type: ignore[return-value]


async def iter_sse(resp: aiohttp.ClientResponse, max_bytes: int, what: str) -> AsyncIterator[tuple[str, str]]:
    """Yield `(event, data)` per the SSE spec, at most `max_bytes` in all. Lines are split here, not by aiohttp's
    `readline()`, which refuses a line longer than its buffer (a whole result may be one `data:` line)."""
    _check_length(resp, max_bytes, what)
    event: str | None = None
    data: list[str] = []
    total = 0
    buf = bytearray()  # the unfinished line: never holds a line end
    after_cr = False  # the last line ended with CR at the end of a read: an LF opening the next read belongs to it
    first = True
    while True:
        chunk = await resp.content.readany()
        if not chunk:
            return  # end of stream; an unterminated last line is an incomplete event and is dropped
        total += len(chunk)
        if total > max_bytes:
            raise ProtocolError(f"event stream exceeded {max_bytes} bytes")
        if after_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]
        start = len(buf)
        buf += chunk
        end = max(buf.rfind(b"\n", start), buf.rfind(b"\r", start))  # only the new bytes can hold a line end
        after_cr = end == len(buf) - 1 and buf.endswith(b"\r")
        if end == -1:
            continue
        block, buf = bytes(buf[:end + 1]), buf[end + 1:]
        lines = block.splitlines()[::-1]  # at CRLF, LF or CR alone, as an event stream's lines end
        del block
        while lines:  # popped, so that neither a line nor an event's data is still held while the caller decodes it
            line = lines.pop().decode("utf-8", errors="replace")
            if first:
                line, first = line.removeprefix("\ufeff"), False
            if not line:
                if data or event is not None:
                    out, event, data = (event or "message", "\n".join(data)), None, []
                    yield out
                event = None
                continue
            if line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "event":
                event = value
            elif name == "data":
                data.append(value)


class Transport:
    """One aiohttp session (keep-alive pool) to `target`'s hosts, bound to the event loop that first uses it. With
    `error` (`for_url`) every failure is that class and any 5xx is retried; without, ORS's errors (`status_error`)."""

    def __init__(self, target: Target, *, timeouts: Timeouts | None = None, retry: RetryPolicy | None = None,
                 max_connections: int = 0, max_response_bytes: int = 64 * 1024 * 1024,
                 headers: Mapping[str, str] | None = None, error: type[ORSError] | None = None) -> None:
        self.target, self.error, self._headers = target, error, dict(headers or {})
        self.timeouts = timeouts = timeouts or Timeouts()
        self.retry = retry or RetryPolicy()
        self.max_connections, self.max_response_bytes = max_connections, max_response_bytes
        self._retried = _RETRY_STATUSES if error is None else frozenset({429, *range(500, 600)})
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        connect = {"connect": timeouts.connect, "sock_connect": timeouts.connect}
        self._request_timeout = aiohttp.ClientTimeout(total=timeouts.request, **connect)
        self._stream_timeout = aiohttp.ClientTimeout(total=None, sock_read=timeouts.stream_idle, **connect)
        self.on_request: Callable[[str, str], None] | None = None  # (method, path) hook for tests/metrics
        self.on_throttle: Callable[[], None] | None = None  # told of each 429 and `503 starting`
        self.decoder = Decoder([str(target.api_key)] if target.api_key else [])

    @classmethod
    def for_url(cls, base_url: str, *, error: type[ORSError], headers: Mapping[str, str] | None = None,
                secrets: Iterable[str] = (), timeouts: Timeouts | None = None,
                retry: RetryPolicy | None = None) -> Transport:
        """A transport to a JSON API at `base_url` (request paths appended) for `post_json`: every failure an `error`,
        `secrets` (the key in `headers`, which an endpoint may reflect) masked."""
        url = _validate_url(base_url, "base_url")
        if "?" in base_url or "#" in base_url:  # not sent, yet named in every record and error: refused, unshown
            raise ConfigurationError("base_url must not carry a query or fragment (it would not be sent); pass the "
                                     "API key as api_key=")
        transport = cls(Target("url", base_url, url, url), timeouts=timeouts, retry=retry, headers=headers,
                        error=error)
        transport.decoder = Decoder(secrets)  # a URL target has no API key of its own
        return transport

    def _client(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0, keepalive_timeout=30),
                timeout=self._request_timeout, headers={"User-Agent": USER_AGENT}, auto_decompress=True,
                trust_env=False)
            self._loop = loop
        elif self._loop is not loop:
            raise UsageError("This ors-trl client is bound to another event loop; create one client per event loop "
                             "(the synchronous Client handles this for you).")
        return self._session

    async def aclose(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    def headers(self, base: str, *, sid: str | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The headers of a request to `base`: the API key where it belongs, the deployment, the session."""
        key = self.target.key_for(base)
        own = {"X-API-Key": key and str(key), "X-Deployment": self.target.deployment, "X-Session-ID": sid}
        return {**self._headers, **{k: v for k, v in own.items() if v}, **(extra or {})}

    def mask(self, text: str) -> str:
        return self.decoder.mask(text)

    def mask_error(self, exc: ORSError) -> ORSError:
        """Mask secrets in an error's message and `detail` in place, and drop its chain; returns it for `raise`."""
        exc.args = tuple(self.mask(a) if isinstance(a, str) else a for a in exc.args)
        if isinstance(getattr(exc, "detail", None), str):
            exc.detail = self.mask(exc.detail)  # type: ignore[attr-defined]
        exc.__cause__ = exc.__context__ = None
        exc.__suppress_context__ = True
        return exc

    def _holds_secret(self, body: bytes) -> bool:
        """Whether a request body holds a known secret (also spelled with JSON escapes)."""
        text = unescape_json(body.decode("utf-8", errors="replace"))
        return self.mask(text) != text

    @contextlib.asynccontextmanager
    async def _send(self, method: str, url: str, *, data: bytes | None, headers: dict[str, str],
                    timeout: aiohttp.ClientTimeout | None = None) -> AsyncIterator[aiohttp.ClientResponse]:
        """One request, following redirects; on a hop to a host the API key is not for, credentials are dropped
        (aiohttp drops only `Authorization`) and a body holding one is not re-sent."""
        for _ in range(_MAX_REDIRECTS + 1):
            where = f"{method} {url.split('?', 1)[0]}"
            try:
                resp = await self._client().request(method, url, data=data, headers=headers, allow_redirects=False,
                                                    timeout=timeout or self._request_timeout)
            except aiohttp.ClientError as exc:
                raise _undecodable(exc, where) or exc from None
            except ValueError as exc:  # a header or URL HTTP cannot carry (aiohttp checks, untyped)
                raise ProtocolError(f"{where}: the request cannot be sent ({self.decoder.quote(str(exc), 200)})"
                                    ) from None
            location = resp.headers.get("Location")
            if resp.status not in _REDIRECT_STATUSES or not location:
                break
            resp.release()
            try:
                target = urljoin(url, location)
                same_host = _host_port(target) == _host_port(url)
            except ValueError:  # a port out of range, a broken IPv6 literal: nothing to follow
                raise TransportError(f"{where}: redirected to an invalid URL {readable(self.mask(location), 200)!r}"
                                     ) from None
            if resp.status == 303 or (resp.status in (301, 302) and method == "POST"):
                method, data = "GET", None
                headers = {k: v for k, v in headers.items() if k != "Content-Type"}
            if not same_host and self.target.key_for(target) is None:
                if data is not None and self._holds_secret(data):  # a body cannot be followed without what it says
                    raise TransportError(
                        f"{where}: redirected to another host ({readable(_host_port(target), 200)}); not followed, "
                        "since the request's body holds a credential (a secret or an env override) that host was not "
                        "given")
                if dropped := [k for k in _CREDENTIAL_HEADERS if k in headers]:
                    logger.debug("redirected to another host; not sending %s there", ", ".join(dropped))
                    headers = {k: v for k, v in headers.items() if k not in _CREDENTIAL_HEADERS}
            url = target
        else:
            raise TransportError(f"{method} {url.split('?', 1)[0]}: more than {_MAX_REDIRECTS} redirects")
        try:
            async with resp:  # release() and wait_for_close(), as aiohttp's own request context manager does
                yield resp
        except aiohttp.ClientError as exc:  # raised while the caller read the body
            raise _undecodable(exc, where) or exc from None

    def _prepared(self, body: Any, *, sid: str | None, extra: dict[str, str] | None,
                  stream: bool = False, api: bool = False) -> tuple[str, dict[str, str], bytes | None]:
        base = self.target.api_url if api else self.target.session_url
        headers = self.headers(base, sid=sid, extra=extra)
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if stream:
            headers["Accept"] = "text/event-stream"
        return base, headers, data

    async def _status(self, resp: aiohttp.ClientResponse, path: str, *, session_scoped: bool) -> _Again:
        """An error answer as the exception to raise, wrapped as `_Again` for `retrying`."""
        head = await _read_head(resp, _ERROR_BODY_LIMIT, self.timeouts.request)
        starting = resp.status == 503 and resp.headers.get("X-Backend-State") == "starting"
        if (starting or resp.status == 429) and self.on_throttle is not None:
            self.on_throttle()
        if self.error is not None:
            err = self.error(f"HTTP {resp.status} from {self.target.session_url}{path}: {self.decoder.quote(head, 300)}")
        else:
            detail = self.decoder.quote(_detail_of(self.decoder, head))
            err = status_error(resp.status, detail, path, session_scoped=session_scoped)
        return _Again(err, retry_after=_retry_after(resp.headers), starting=starting,
                      final=resp.status not in self._retried)

    def _json(self, resp: aiohttp.ClientResponse, raw: bytes, what: str) -> Any:
        """A JSON answer's body as values, in its declared charset, else the UTF JSON's detection finds. In an
        encoding aiohttp left undecoded, an answer that is no JSON names the encoding rather than quoting bytes."""
        try:
            return self.decoder.decode(_unless_utf8(raw, resp.charset), what)
        except ProtocolError:
            encoding = resp.headers.get("Content-Encoding", "")
            if encoding.strip().lower() in _DECODED:
                raise
            raise ProtocolError(f"{what}: the answer is in Content-Encoding {readable(encoding, 100)!r}, which this "
                                "client cannot decode (it asks for gzip or deflate)") from None

    @masked
    async def request(self, method: str, path: str, *, body: Any = None, sid: str | None = None,
                      extra_headers: dict[str, str] | None = None, session_scoped: bool = False,
                      ok_statuses: tuple[int, ...] = (), retry: RetryPolicy | None = None, api: bool = False,
                      on_attempt: Callable[[], None] | None = None, on_event: Callable[[str, str], None] | None = None,
                      idempotent: bool = True) -> Any:
        """Send one JSON request with retries; the decoded JSON (None for an empty or `ok_statuses` body). `api`: to
        `Target.api_url`. With `on_event`, the answer is an event stream (`/create_session`): its events, each told to
        `on_event` as it arrives, of every attempt. One not `idempotent` is never re-posted once it may have landed."""
        base, headers, data = self._prepared(body, sid=sid, extra=extra_headers, api=api, stream=on_event is not None)

        async def attempt() -> Any:
            self._count(method, path)
            if on_attempt is not None:
                on_attempt()
            # One deadline for the whole exchange, redirects included.
            async with asyncio.timeout(self.timeouts.request), \
                    self._send(method, base + path, data=data, headers=headers) as resp:
                if resp.status >= 400 and resp.status not in ok_statuses:
                    raise await self._status(resp, path, session_scoped=session_scoped)
                if on_event is not None:
                    events = []
                    async for event in iter_sse(resp, self.max_response_bytes, path):
                        events.append(event)
                        on_event(*event)
                    return events
                raw = await _read_capped(resp, self.max_response_bytes, path)
                return None if resp.status >= 400 else self._json(resp, raw, path)

        return await retrying(retry or self.retry, attempt, what=f"{method} {path}", base=base,
                              sent_is_safe=idempotent, timeout=self.timeouts.request, mask=self.mask)

    async def post_json(self, path: str, body: Any) -> Any:
        """POST `body` as JSON to `path` (`"/chat/completions"`) under the base URL: the decoded answer; every failure
        an `error` (`for_url`)."""
        error_class = self.error or ORSError
        try:
            return await self.request("POST", path, body=body)
        except ORSError as exc:  # an error answer, the network, an answer past the cap or not JSON
            error = exc if isinstance(exc, error_class) else error_class(str(exc))
        raise self.mask_error(error)  # outside the `except`: no chain

    @masked
    async def stream(self, path: str, *, body: dict[str, Any], sid: str, what: str, tool: str
                     ) -> tuple[Any, str | None]:
        """One streamed call (`/call`, `/score_group`): (the decoded result, task id), resumed by its task id where the
        stream drops."""
        base, headers, _ = self._prepared(None, sid=sid, extra={"Content-Type": "application/json"}, stream=True)
        task_id: str | None = None
        resumes = 0

        async def attempt() -> Any:
            nonlocal resumes
            payload = body if task_id is None else {**body, "task_id": task_id}
            self._count("POST", path)
            try:
                async with self._send("POST", base + path, data=json.dumps(payload).encode(), headers=headers,
                                      timeout=self._stream_timeout) as resp:
                    if resp.status >= 400:
                        raise await self._status(resp, path, session_scoped=True)
                    return await self._result(resp, what, tool, resumed=resumes > 0, on_task_id=remember)
            except aiohttp.ClientConnectorError:
                raise  # nothing was sent: `retrying` tries again
            except (_Dropped, aiohttp.ClientError, TimeoutError) as exc:  # broken after it began: not re-sent
                why = _describe(exc, self.mask)
            if task_id is None:
                raise StreamInterruptedError(f"{what}: the connection broke before the server acknowledged the call "
                                             f"({why}); it was not retried because it may already be running.")
            resumes += 1
            if resumes > self.retry.resume_attempts:
                raise StreamInterruptedError(f"{what}: the result stream kept dropping ({why}); gave up after "
                                             f"{resumes - 1} resumes.")
            logger.debug("%s: stream dropped (%s); resuming task %s", what, why, readable(task_id, 80))
            raise _Again(StreamInterruptedError(f"{what}: {why}"), resume=self.retry.delay(resumes))

        def remember(value: str) -> None:
            nonlocal task_id
            if task_id is not None and value and value != task_id:  # another call's stream: not this call's result
                raise ProtocolError(
                    f"{what}: the server answered the stream of task {readable(task_id, 80)!r} with another task's "
                    f"({readable(value, 80)!r}); its result is not this call's, and the call was not re-run.")
            task_id = value or task_id

        return await retrying(self.retry, attempt, what=what, base=base, sent_is_safe=False,
                              timeout=self.timeouts.stream_idle, mask=self.mask), task_id

    async def _result(self, resp: aiohttp.ClientResponse, what: str, tool: str, *, resumed: bool,
                      on_task_id: Callable[[str], None]) -> Any:
        """One call's event stream (`task_id`, `chunk`... `end`, or `error`) to its decoded result."""
        chunks: list[str] = []
        size = 0
        unknown: dict[str, None] = {}  # names of events the protocol has not, the first few, in order
        async for event, data in iter_sse(resp, self.max_response_bytes, what):
            if event == "task_id":
                on_task_id(self.decoder.text(data).strip())
            elif event in ("chunk", "end"):
                chunks.append(data)
                size += len(data)
                if size > self.max_response_bytes:
                    raise ProtocolError(f"{what}: result larger than {self.max_response_bytes} bytes")
                if event == "end":
                    await _drain(resp)
                    text = "".join(chunks)
                    chunks.clear()  # not held twice while it is decoded
                    return self.decoder.decode(text, what)
            elif event == "error":
                if resumed and data.strip() == "unknown task_id":
                    raise StreamInterruptedError(
                        f"{what}: the stream dropped and the server no longer knows the call (results are kept "
                        "60 s); its result is lost. It was not re-run.")
                raise ToolFailedError(f"{what} raised in the environment: {self.decoder.quote(data)}", tool=tool)
            elif len(unknown) < 3:
                unknown[event] = None
        raise _Dropped(*unknown)

    def _count(self, method: str, path: str) -> None:
        if self.on_request is not None:
            self.on_request(method, path)


class _Again(Exception):
    """An attempt failed with `error`; `retrying` decides whether to try again. `resume`: a stream re-attached by its
    task id after that many seconds, the attempts counted afresh."""

    def __init__(self, error: ORSError, *, retry_after: float | None = None, starting: bool = False,
                 final: bool = False, resume: float | None = None) -> None:
        self.error, self.retry_after, self.starting, self.final = error, retry_after, starting, final
        self.resume = resume


class _Dropped(Exception):
    """A stream ended without its final event; `args`: events it sent that the protocol has not (an `END`)."""


async def retrying(policy: RetryPolicy, attempt: Callable[[], Awaitable[T]], *, what: str, base: str = "",
                   sent_is_safe: bool = True, timeout: float | None = None,
                   mask: Callable[[str], str] = lambda text: text) -> T:
    """Run `attempt()` until it succeeds, under `policy`: the one retry loop. A reset or timeout after sending is
    retried only when `sent_is_safe`; a `starting` poll or a stream's resume is no attempt. `mask` hides secrets in an
    aiohttp error."""
    loop = asyncio.get_running_loop()
    attempts = polls = 0
    starting_since: float | None = None
    while True:
        attempts += 1
        try:
            return await attempt()
        except _Again as again:
            err, delay = again.error, policy.delay(attempts, again.retry_after)
            if again.resume is not None:
                attempts, polls, starting_since, delay = 0, 0, None, again.resume
            elif again.starting:
                starting_since = starting_since or loop.time()
                if loop.time() - starting_since >= policy.starting_timeout:
                    raise ServiceUnavailableError(
                        f"{what}: the environment backend was still starting after {policy.starting_timeout:.0f} s "
                        f"({getattr(err, 'detail', err)}); raise RetryPolicy.starting_timeout if it needs longer.",
                        status_code=503, detail=getattr(err, "detail", ""), path=getattr(err, "path", "")) from None
                attempts, polls = attempts - 1, polls + 1  # waiting for a boot is not a failed attempt
                delay = policy.delay(polls, again.retry_after)
            elif again.final:
                raise err from None
            elif attempts >= policy.max_attempts:
                err.args = (f"{err.args[0]} (gave up after {_attempts(attempts)})", *err.args[1:])
                raise err from None
        except (aiohttp.ClientError, TimeoutError) as exc:
            unsent = isinstance(exc, aiohttp.ClientConnectorError)  # nothing was sent: always safe to retry
            if attempts >= policy.max_attempts or not (unsent or sent_is_safe):
                if unsent:
                    raise TransportError(f"{what}: cannot connect to {base} after {_attempts(attempts)} ("
                                         f"{_describe(exc, mask)}). Is the server running and the URL right?"
                                         ) from None
                if isinstance(exc, TimeoutError):
                    raise ORSTimeoutError(f"{what}: no answer within {timeout} s (attempt {attempts}); raise "
                                          "Timeouts.request if the server is slow.") from None
                raise TransportError(f"{what}: connection failed after {_attempts(attempts)} ({_describe(exc, mask)})"
                                     ) from None
            delay = policy.delay(attempts)
        logger.debug("%s: attempt %d failed; retrying in %.2f s", what, attempts, delay)
        await asyncio.sleep(delay)


def _unless_utf8(raw: bytes, charset: str | None) -> bytes | str:
    """`raw` as text when it is not UTF-8 (in its `charset`, else what `json.detect_encoding` finds); else bytes."""
    codec = json.detect_encoding(raw)
    if charset:
        with contextlib.suppress(LookupError):
            codec = codecs.lookup(charset).name
    return raw if codec in ("utf-8", "utf-8-sig", "ascii") else raw.decode(codec, errors="replace")


def _undecodable(exc: BaseException, where: str) -> ProtocolError | None:
    """A `ProtocolError` for an aiohttp error that is a body it could not decompress (malformed, not a network failure:
    retrying would fetch the same bytes), else None."""
    cause: BaseException | None = exc
    for _ in range(4):  # ClientResponseError -> HttpProcessingError -> ContentEncodingError, at most
        if isinstance(cause, ContentEncodingError):
            return ProtocolError(f"{where}: the answer's body cannot be decoded ({readable(str(cause.message), 200)}): "
                                 "compressed data that is corrupt, or in an encoding this client did not ask for")
        cause = getattr(cause, "__cause__", None)
    return None


def _describe(exc: BaseException, mask: Callable[[str], str] = lambda text: text) -> str:
    if isinstance(exc, _Dropped):
        unknown = ", ".join(repr(escape_controls(cut(mask(name), 40, ""))) for name in exc.args)
        return "stream ended before the result" + (f"; it sent events this client does not know: {unknown}"
                                                   if unknown else "")
    if isinstance(exc, TimeoutError):
        return "timed out"
    return readable(mask(f"{type(exc).__name__}: {str(exc) or type(exc).__name__}"), 300)


async def _drain(resp: aiohttp.ClientResponse, seconds: float = 1.0) -> None:
    """Read a stream to its end (bounded), so that its connection goes back to the keep-alive pool."""
    with contextlib.suppress(TimeoutError, aiohttp.ClientError):
        async with asyncio.timeout(seconds):
            while await resp.content.readany():
                pass


def _check_length(resp: aiohttp.ClientResponse, limit: int, path: str) -> None:
    length = resp.content_length
    if length is not None and length > limit:
        raise ProtocolError(f"{path}: response of {length} bytes is larger than the {limit}-byte limit")


async def _read_head(resp: aiohttp.ClientResponse, limit: int, seconds: float | None = None) -> bytes:
    """At most the first `limit` bytes of the body, and what came within `seconds` (an error body may trickle)."""
    body = bytearray()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            while len(body) < limit and (chunk := await resp.content.read(limit - len(body))):
                body += chunk
    return bytes(body)


async def _read_capped(resp: aiohttp.ClientResponse, limit: int, path: str) -> bytes:
    """The whole body, refusing (rather than buffering) more than `limit` bytes."""
    _check_length(resp, limit, path)
    body = bytearray()
    while chunk := await resp.content.read(1 << 16):
        body += chunk
        if len(body) > limit:
            raise ProtocolError(f"{path}: response larger than the {limit}-byte limit")
    return bytes(body)
