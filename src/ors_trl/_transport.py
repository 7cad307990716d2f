"""HTTP and SSE over aiohttp: keep-alive connections, retries, timeouts, error mapping.

What is retried (with exponential backoff and jitter, bounded by `RetryPolicy`):

- connection failures before the request was sent, for every request;
- 429, 502, 503 and 504 answers, for every request, `/call` included: an error status instead of
  an event stream means the tool was not started;
- a 503 carrying `X-Backend-State: starting` (a backend still booting) is waited out, honouring
  `Retry-After`, for up to `RetryPolicy.starting_timeout` seconds;
- connection resets and read timeouts after the request was sent, for idempotent requests only;
- a `/call` stream that drops after the server sent the call's task id is resumed by that id
  (the server replays the result), never re-posted without it.

Not retried: 400/401/402/403/404/422 (the request itself is wrong), 500 (the environment's code
failed and would fail again), and a `/call` stream that drops before any task id arrived (the tool
may be running; re-posting could run it twice) which raises `StreamInterruptedError`.

Credentials: redirects are followed by hand, and a redirect to a host the API key does not belong
to is followed without `X-API-Key` and `X-Secrets` (aiohttp itself would forward every custom
header to any host). Error messages built from what a server said have the API key, the secret
values and the encoded `X-Secrets` header masked as `***`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import logging
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin

import aiohttp

from ._exceptions import (
    APIStatusError,
    AuthenticationError,
    BadRequestError,
    EnvironmentNotFoundError,
    NotFoundError,
    ORSError,
    ORSTimeoutError,
    PaymentRequiredError,
    ProtocolError,
    RateLimitError,
    ServerError,
    ServiceUnavailableError,
    SessionExpiredError,
    StreamInterruptedError,
    ToolFailedError,
    TransportError,
)
from ._target import Target, _host_port
from ._version import __version__

__all__ = ["RetryPolicy", "Timeouts", "Transport"]

logger = logging.getLogger("ors_trl.client")

USER_AGENT = f"ors-trl/{__version__}"
_RETRY_STATUSES = frozenset({429, 502, 503, 504})
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_MAX_REDIRECTS = 10
# Headers that carry credentials: never sent to a host the API key does not belong to.
_CREDENTIAL_HEADERS = ("X-API-Key", "X-Secrets")
# Secret values shorter than this are not masked in error messages: masking "1" or "abc" would garble
# every message, and such values are not secrets worth the name.
_MIN_MASKED_SECRET = 6
_MASK = "***"


@dataclass(frozen=True)
class Timeouts:
    """Deadlines, in seconds. `None` disables one (not recommended).

    Attributes:
        connect: establishing a TCP/TLS connection.
        request: one whole non-streaming request (metadata, create, prompt, ping, delete).
        stream_idle: silence allowed on a `/call` stream; servers send a comment every 10 s while
            a tool runs, so a longer silence means the stream is dead and it is resumed.
        tool_call: one whole tool call, resumes included.
    """

    connect: float | None = 10.0
    request: float | None = 60.0
    stream_idle: float | None = 45.0
    tool_call: float | None = 3600.0


@dataclass(frozen=True)
class RetryPolicy:
    """How hard the client tries before an error reaches the caller.

    Attributes:
        max_attempts: tries per request for network errors and 429/502/503/504 (1 = no retry).
        backoff_initial: first backoff delay; doubled each attempt, with jitter.
        backoff_max: cap on one backoff delay (a server's `Retry-After` is honoured up to this).
        starting_timeout: how long to wait out a backend answering 503 `X-Backend-State: starting`.
        resume_attempts: re-attachments to one dropped `/call` stream by its task id.
    """

    max_attempts: int = 6
    backoff_initial: float = 0.25
    backoff_max: float = 8.0
    starting_timeout: float = 600.0
    resume_attempts: int = 8

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        if retry_after is not None:
            return min(max(retry_after, 0.0), self.backoff_max)
        base = min(self.backoff_initial * (2 ** max(attempt - 1, 0)), self.backoff_max)
        return base * (0.5 + random.random() / 2)


def _retry_after(headers: Any) -> float | None:
    value = headers.get("Retry-After") if headers is not None else None
    if value and value.strip().replace(".", "", 1).isdigit():
        return float(value.strip())
    return None


def _detail_of(text: str) -> str:
    try:
        body = json.loads(text)
    except ValueError:
        return text.strip()[:2000]
    if isinstance(body, dict) and "detail" in body:
        detail = body["detail"]
        return detail if isinstance(detail, str) else json.dumps(detail)[:2000]
    return text.strip()[:2000]


def status_error(status: int, detail: str, path: str, *, session_scoped: bool) -> APIStatusError | EnvironmentNotFoundError:
    """Map an HTTP error status to our exception, with a message that says what to do."""
    kw = {"status_code": status, "detail": detail, "path": path}
    where = f"{path}: " if path else ""
    if status in (400, 422):
        return BadRequestError(f"{where}bad request ({status}): {detail}", **kw)
    if status in (401, 403):
        return AuthenticationError(
            f"{where}the server rejected the credentials ({status}): {detail}. Check OPENREWARD_API_KEY or the "
            "api_key= you passed.",
            **kw,
        )
    if status == 402:
        return PaymentRequiredError(
            f"{where}payment required (402): {detail}. The OpenReward account has no credits left; top up at "
            "https://openreward.ai.",
            **kw,
        )
    if status == 404 and "unknown environment" in detail.lower():
        return EnvironmentNotFoundError(f"{where}{detail}")
    if status == 410 or (status == 404 and session_scoped):
        return SessionExpiredError(
            f"{where}the session no longer exists on the server ({status}: {detail}); it was deleted, reaped "
            "after being idle, or the server restarted.",
            **kw,
        )
    if status == 404:
        return NotFoundError(f"{where}not found (404): {detail}", **kw)
    if status == 429:
        return RateLimitError(f"{where}rate limited (429): {detail}", **kw)
    if status in (502, 503, 504):
        return ServiceUnavailableError(f"{where}service unavailable ({status}): {detail}", **kw)
    if status >= 500:
        return ServerError(f"{where}the environment failed ({status}): {detail}", **kw)
    return APIStatusError(f"{where}unexpected status {status}: {detail}", **kw)


def _masked(method: Any) -> Any:
    """Decorator for Transport's request methods: mask secrets in every ORSError they raise."""

    @functools.wraps(method)
    async def wrapper(self: Transport, *args: Any, **kwargs: Any) -> Any:
        try:
            return await method(self, *args, **kwargs)
        except ORSError as exc:
            self.mask_error(exc)
            raise

    return wrapper


class _Dropped(Exception):
    """Internal: a stream ended without its final event."""


async def iter_sse(resp: aiohttp.ClientResponse, max_bytes: int) -> AsyncIterator[tuple[str, str]]:
    """Yield `(event, data)` per the SSE spec: one space after `data:` stripped, comments skipped.

    Lines are split here rather than with `resp.content.readline()`: aiohttp's readline refuses lines
    longer than its buffer (128-512 KiB, depending on the version) with an exception outside our
    hierarchy, while the protocol lets a server send a whole result as one `data:` line. The only
    bound is `max_bytes` for the whole stream.
    """
    event: str | None = None
    data: list[str] = []
    total = 0
    buf = bytearray()
    while True:
        chunk = await resp.content.readany()
        if not chunk:
            return  # end of stream; an unterminated last line is an incomplete event and is dropped
        total += len(chunk)
        if total > max_bytes:
            raise ProtocolError(f"event stream exceeded {max_bytes} bytes")
        start = len(buf)
        buf += chunk
        lines: list[bytes] = []
        begin = 0
        while (end := buf.find(b"\n", start)) != -1:
            lines.append(bytes(buf[begin:end]))
            begin = start = end + 1
        if begin:
            del buf[:begin]
        for raw in lines:
            line = raw.decode("utf-8", errors="replace")
            if line.endswith("\r"):
                line = line[:-1]
            if not line:
                if data or event is not None:
                    yield (event or "message", "\n".join(data))
                event, data = None, []
                continue
            if line.startswith(":"):
                continue
            name, sep, value = line.partition(":")
            if sep and value.startswith(" "):
                value = value[1:]
            if name == "event":
                event = value
            elif name == "data":
                data.append(value)


class Transport:
    """One aiohttp session (keep-alive pool) bound to the event loop that first uses it."""

    def __init__(
        self,
        target: Target,
        *,
        timeouts: Timeouts,
        retry: RetryPolicy,
        max_connections: int = 0,
        max_response_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        self.target = target
        self.timeouts = timeouts
        self.retry = retry
        self.max_connections = max_connections
        self.max_response_bytes = max_response_bytes
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._request_timeout = aiohttp.ClientTimeout(
            total=timeouts.request, connect=timeouts.connect, sock_connect=timeouts.connect
        )
        self._stream_timeout = aiohttp.ClientTimeout(
            total=None, connect=timeouts.connect, sock_connect=timeouts.connect, sock_read=timeouts.stream_idle
        )
        self.on_request: Callable[[str, str], None] | None = None  # (method, path) hook for tests/metrics
        # Strings masked in error messages: the API key, plus every X-Secrets header sent and its values.
        self._secrets: set[str] = {str(target.api_key)} if target.api_key else set()

    # -- connection pool ---------------------------------------------------------------------

    def _client(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0, keepalive_timeout=30)
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=self._request_timeout,
                headers={"User-Agent": USER_AGENT},
                auto_decompress=True,
                trust_env=False,
            )
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError(
                "This ors-trl client is bound to another event loop; create one client per event loop "
                "(the synchronous Client handles this for you)."
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    # -- headers ---------------------------------------------------------------------------------

    def headers(self, base: str, *, sid: str | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
        h: dict[str, str] = {}
        key = self.target.key_for(base)
        if key:
            h["X-API-Key"] = str(key)
        if self.target.deployment:
            h["X-Deployment"] = self.target.deployment
        if sid:
            h["X-Session-ID"] = sid
        if extra:
            h.update(extra)
            if "X-Secrets" in extra:
                self._learn_secrets(extra["X-Secrets"])
        return h

    # -- masking secrets in errors ---------------------------------------------------------------

    def _learn_secrets(self, header: str) -> None:
        if header in self._secrets:
            return
        self._secrets.add(header)
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            for entry in json.loads(base64.b64decode(header)).values():
                value = entry.get("value") if isinstance(entry, dict) else None
                if isinstance(value, str):
                    self._secrets.add(value)

    def mask(self, text: str) -> str:
        """`text` with every known secret (API key, secret values, X-Secrets header) replaced by `***`."""
        for secret in sorted(self._secrets, key=len, reverse=True):  # longest first: the header contains values
            if len(secret) >= _MIN_MASKED_SECRET and secret in text:
                text = text.replace(secret, _MASK)
        return text

    def mask_error(self, exc: ORSError) -> ORSError:
        """Mask secrets in an error's message (and `detail`) in place; returns it for `raise`."""
        if self._secrets:
            exc.args = tuple(self.mask(a) if isinstance(a, str) else a for a in exc.args)
            if isinstance(getattr(exc, "detail", None), str):
                exc.detail = self.mask(exc.detail)  # type: ignore[attr-defined]
        return exc

    # -- one exchange, redirects followed by hand ----------------------------------------------------

    @contextlib.asynccontextmanager
    async def _send(self, method: str, url: str, *, data: bytes | None, headers: dict[str, str],
                    timeout: aiohttp.ClientTimeout | None = None) -> AsyncIterator[aiohttp.ClientResponse]:
        """One request, following redirects like aiohttp would, except that credentials are dropped
        on a hop to a host the API key does not belong to (aiohttp strips only `Authorization`)."""
        kwargs: dict[str, Any] = {"allow_redirects": False}
        if timeout is not None:
            kwargs["timeout"] = timeout
        for _ in range(_MAX_REDIRECTS + 1):
            resp = await self._client().request(method, url, data=data, headers=headers, **kwargs)
            location = resp.headers.get("Location")
            if resp.status not in _REDIRECT_STATUSES or not location:
                break
            resp.release()
            target = urljoin(url, location)
            if resp.status == 303 or (resp.status in (301, 302) and method == "POST"):
                method, data = "GET", None
                headers = {k: v for k, v in headers.items() if k != "Content-Type"}
            if _host_port(target) != _host_port(url) and self.target.key_for(target) is None:
                dropped = [k for k in _CREDENTIAL_HEADERS if k in headers]
                if dropped:
                    logger.debug("redirected to another host; not sending %s there", ", ".join(dropped))
                    headers = {k: v for k, v in headers.items() if k not in _CREDENTIAL_HEADERS}
            url = target
        else:
            raise TransportError(f"{method} {url.split('?', 1)[0]}: more than {_MAX_REDIRECTS} redirects")
        async with resp:  # release() and wait_for_close(), as aiohttp's own request context manager does
            yield resp

    # -- plain requests --------------------------------------------------------------------------

    @_masked
    async def request(
        self,
        method: str,
        path: str,
        *,
        base: str | None = None,
        body: Any = None,
        sid: str | None = None,
        extra_headers: dict[str, str] | None = None,
        idempotent: bool = True,
        session_scoped: bool = False,
        ok_statuses: tuple[int, ...] = (),
        retry: RetryPolicy | None = None,
    ) -> Any:
        """Send one JSON request with retries; return the decoded JSON (None for an empty body)."""
        policy = retry or self.retry
        base = base or self.target.session_url
        url = base + path
        headers = self.headers(base, sid=sid, extra=extra_headers)
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        attempt = 0
        starting_since: float | None = None
        loop = asyncio.get_running_loop()
        while True:
            attempt += 1
            if self.on_request is not None:
                self.on_request(method, path)
            try:
                async with self._send(method, url, data=data, headers=headers) as resp:
                    if resp.status < 400 or resp.status in ok_statuses:
                        raw = await _read_capped(resp, self.max_response_bytes, path)
                        if resp.status >= 400:
                            return None
                        return _decode_json(raw, path)
                    text = await resp.text(errors="replace")
                    detail = _detail_of(text)
                    if resp.status == 503 and resp.headers.get("X-Backend-State") == "starting":
                        now = loop.time()
                        starting_since = starting_since or now
                        if now - starting_since < policy.starting_timeout:
                            delay = min(_retry_after(resp.headers) or 2.0, policy.backoff_max)
                            logger.debug("%s %s: backend starting, retrying in %.1f s", method, path, delay)
                            await asyncio.sleep(delay)
                            attempt -= 1  # waiting for a boot is not a failed attempt
                            continue
                        raise ServiceUnavailableError(
                            f"{path}: the environment backend was still starting after "
                            f"{policy.starting_timeout:.0f} s ({detail}); raise RetryPolicy.starting_timeout "
                            "if it needs longer.",
                            status_code=503,
                            detail=detail,
                            path=path,
                        )
                    err = status_error(resp.status, detail, path, session_scoped=session_scoped)
                    if resp.status in _RETRY_STATUSES and attempt < policy.max_attempts:
                        delay = policy.delay(attempt, _retry_after(resp.headers))
                        logger.debug("%s %s: %s; retry %d in %.2f s", method, path, resp.status, attempt, delay)
                        await asyncio.sleep(delay)
                        continue
                    if resp.status in _RETRY_STATUSES:
                        err.args = (f"{err.args[0]} (gave up after {attempt} attempts)",)
                    raise err
            except aiohttp.ClientConnectorError as exc:
                # Nothing was sent: always safe to retry.
                if attempt < policy.max_attempts:
                    await asyncio.sleep(policy.delay(attempt))
                    continue
                raise TransportError(
                    f"{method} {path}: cannot connect to {base} after {attempt} attempts ({_describe(exc)}). "
                    "Is the server running and the URL right?"
                ) from None
            except (aiohttp.ClientError, TimeoutError) as exc:
                if idempotent and attempt < policy.max_attempts:
                    await asyncio.sleep(policy.delay(attempt))
                    continue
                if isinstance(exc, TimeoutError):
                    raise ORSTimeoutError(
                        f"{method} {path}: no answer within {self.timeouts.request} s (attempt {attempt}); "
                        "raise Timeouts.request if the server is slow."
                    ) from None
                raise TransportError(f"{method} {path}: connection failed ({_describe(exc)})") from None

    # -- event streams -------------------------------------------------------------------------

    @_masked
    async def events(self, path: str, *, body: Any, sid: str | None = None,
                     extra_headers: dict[str, str] | None = None) -> list[tuple[str, str]]:
        """POST and collect a short SSE answer (e.g. `/create_session`), with request retries."""
        base = self.target.session_url
        headers = self.headers(base, sid=sid, extra=extra_headers)
        headers["Content-Type"] = "application/json"
        headers["Accept"] = "text/event-stream"
        data = json.dumps(body).encode()
        for attempt in range(1, self.retry.max_attempts + 1):
            if self.on_request is not None:
                self.on_request("POST", path)
            try:
                async with self._send("POST", base + path, data=data, headers=headers) as resp:
                    if resp.status >= 400:
                        detail = _detail_of(await resp.text(errors="replace"))
                        err = status_error(resp.status, detail, path, session_scoped=False)
                        if resp.status in _RETRY_STATUSES and attempt < self.retry.max_attempts:
                            await asyncio.sleep(self.retry.delay(attempt, _retry_after(resp.headers)))
                            continue
                        raise err
                    return [ev async for ev in iter_sse(resp, self.max_response_bytes)]
            except (aiohttp.ClientError, TimeoutError) as exc:
                if attempt < self.retry.max_attempts:
                    await asyncio.sleep(self.retry.delay(attempt))
                    continue
                raise TransportError(f"POST {path}: {_describe(exc)} after {attempt} attempts") from None
        raise AssertionError("unreachable")

    @_masked
    async def call_stream(self, path: str, *, body: dict[str, Any], sid: str, tool: str) -> tuple[str, str | None]:
        """Run one `/call`: returns (result JSON text, task id). Resumes a dropped stream by task id."""
        base = self.target.session_url
        headers = self.headers(base, sid=sid)
        headers["Content-Type"] = "application/json"
        headers["Accept"] = "text/event-stream"
        task_id: str | None = None
        resumes = 0
        attempt = 0
        starting_since: float | None = None
        loop = asyncio.get_running_loop()
        while True:
            payload = body if task_id is None else {**body, "task_id": task_id}
            attempt += 1
            if self.on_request is not None:
                self.on_request("POST", path)
            try:
                async with self._send(
                    "POST", base + path, data=json.dumps(payload).encode(), headers=headers,
                    timeout=self._stream_timeout,
                ) as resp:
                    if resp.status >= 400:
                        detail = _detail_of(await resp.text(errors="replace"))
                        if resp.status == 503 and resp.headers.get("X-Backend-State") == "starting":
                            now = loop.time()
                            starting_since = starting_since or now
                            if now - starting_since < self.retry.starting_timeout:
                                await asyncio.sleep(min(_retry_after(resp.headers) or 2.0, self.retry.backoff_max))
                                attempt -= 1
                                continue
                            # Same bound and message as `request()`; falling through to the generic
                            # 503 retries would wait longer than starting_timeout and not say why.
                            raise ServiceUnavailableError(
                                f"{path}: the environment backend was still starting after "
                                f"{self.retry.starting_timeout:.0f} s ({detail}); raise RetryPolicy.starting_timeout "
                                "if it needs longer.",
                                status_code=503,
                                detail=detail,
                                path=path,
                            )
                        err = status_error(resp.status, detail, path, session_scoped=True)
                        if resp.status in _RETRY_STATUSES and attempt < self.retry.max_attempts:
                            await asyncio.sleep(self.retry.delay(attempt, _retry_after(resp.headers)))
                            continue
                        raise err
                    chunks: list[str] = []
                    size = 0
                    async for event, data in iter_sse(resp, self.max_response_bytes):
                        if event == "task_id":
                            task_id = data.strip() or task_id
                        elif event in ("chunk", "end"):
                            chunks.append(data)
                            size += len(data)
                            if size > self.max_response_bytes:
                                raise ProtocolError(f"tool {tool!r}: result larger than {self.max_response_bytes} bytes")
                            if event == "end":
                                await _drain(resp)
                                return "".join(chunks), task_id
                        elif event == "error":
                            if resumes and data.strip() == "unknown task_id":
                                raise StreamInterruptedError(
                                    f"tool {tool!r}: the stream dropped and the server no longer knows the call "
                                    "(results are kept 60 s); its result is lost. The tool was not re-run."
                                )
                            raise ToolFailedError(f"tool {tool!r} raised in the environment: {data}", tool=tool)
                    raise _Dropped()
            except aiohttp.ClientConnectorError as exc:
                if attempt < self.retry.max_attempts:
                    await asyncio.sleep(self.retry.delay(attempt))
                    continue
                raise TransportError(f"tool {tool!r}: cannot connect to {base} ({_describe(exc)})") from None
            except (_Dropped, aiohttp.ClientError, TimeoutError) as exc:
                if task_id is None:
                    raise StreamInterruptedError(
                        f"tool {tool!r}: the connection broke before the server acknowledged the call "
                        f"({_describe(exc)}); it was not retried because the tool may already be running."
                    ) from None
                resumes += 1
                if resumes > self.retry.resume_attempts:
                    raise StreamInterruptedError(
                        f"tool {tool!r}: the result stream kept dropping ({_describe(exc)}); gave up after "
                        f"{resumes - 1} resumes."
                    ) from None
                logger.debug("tool %r: stream dropped (%s); resuming task %s", tool, _describe(exc), task_id)
                await asyncio.sleep(self.retry.delay(resumes))
                attempt = 0


def _describe(exc: BaseException) -> str:
    if isinstance(exc, _Dropped):
        return "stream ended before the result"
    if isinstance(exc, TimeoutError):
        return "timed out"
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:300]


async def _drain(resp: aiohttp.ClientResponse, seconds: float = 1.0) -> None:
    """Read a stream to its end (bounded), so that its connection goes back to the keep-alive pool.

    A response left before its last chunk is closed by aiohttp instead of reused, which would cost the
    next request a new TCP connection.
    """
    try:
        async with asyncio.timeout(seconds):
            while await resp.content.readany():
                pass
    except (TimeoutError, aiohttp.ClientError):
        pass


async def _read_capped(resp: aiohttp.ClientResponse, limit: int, path: str) -> bytes:
    """The whole body, refusing (rather than buffering) more than `limit` bytes."""
    length = resp.content_length
    if length is not None and length > limit:
        raise ProtocolError(f"{path}: response of {length} bytes is larger than the {limit}-byte limit")
    parts: list[bytes] = []
    total = 0
    while True:
        chunk = await resp.content.read(1 << 16)
        if not chunk:
            return b"".join(parts)
        total += len(chunk)
        if total > limit:
            raise ProtocolError(f"{path}: response larger than the {limit}-byte limit")
        parts.append(chunk)


def _decode_json(raw: bytes, path: str) -> Any:
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except ValueError:
        raise ProtocolError(f"{path}: the server answered invalid JSON: {raw[:200]!r}") from None
