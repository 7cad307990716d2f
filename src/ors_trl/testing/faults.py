"""Fault injection for reliability tests: a loopback HTTP proxy whose faults a test programs.

    with ReferenceServer([MyEnvironment]) as server, FaultProxy(server.url) as proxy:
        proxy.add(Status(503), path="/num_tasks", times=2)   # two 503s, then requests pass
        Client(proxy.url, ...).num_tasks()
        proxy.count("/num_tasks")                             # 3 requests reached the proxy

Without an upstream it is a misbehaving server of its own (an unmatched request gets a 404). Raw asyncio streams, so
that a fault does exactly what a broken network does (a reset, a stream cut mid-chunk); every wait is bounded.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import http.client
import json
import math
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from ..protocol.loop import BackgroundLoop
from .server import LOOPBACK, _Loopback, _require_loopback

__all__ = ["Blackhole", "Delay", "DropStream", "EchoHeaders", "Fault", "FaultProxy", "Flood", "Forward", "Hang",
           "Pings", "Raw", "Redirect", "Reply", "Reset", "SSEReply", "Seen", "Silent", "Stall", "Status"]

# Headers that describe one hop, not the message: never forwarded as received.
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer",
                         "upgrade", "content-length", "host"})
_MAX_HEAD = 64 * 1024
_MAX_BODY = 64 * 1024 * 1024


@dataclass
class Seen:
    """One request as the proxy received it: `path` without the query string (`target` with it), header names
    lower-cased, `fault` the name of the fault that answered it (None: forwarded untouched), `at` its
    `time.monotonic()` (one clock for every process of the machine)."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    fault: str | None = None
    target: str = ""
    at: float = field(default_factory=time.monotonic)

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


@dataclass
class _Rule:
    fault: Fault
    path: str | None
    method: str | None
    times: int | None
    when: Callable[[Seen], bool] | None
    used: int = 0

    def matches(self, seen: Seen) -> bool:
        return ((self.times is None or self.used < self.times)
                and (self.method is None or seen.method == self.method.upper())
                and (self.path is None or seen.path.endswith(self.path))  # the whole path, or its end
                and (self.when is None or bool(self.when(seen))))


class _Exchange:
    """One request/response on a client connection, with the primitives faults are made of."""

    def __init__(self, proxy: FaultProxy, seen: Seen, writer: asyncio.StreamWriter) -> None:
        self.proxy, self.seen, self.writer = proxy, seen, writer
        self.keep_alive = True
        self._chunked = False

    async def _write(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def _head(self, status: int, framing: str, headers: Sequence[tuple[str, str]], content_type: str | None,
                    body: bytes = b"") -> None:
        head = [f"HTTP/1.1 {status} {http.client.responses.get(status, 'Status')}", framing]
        if content_type and "content-type" not in {k.lower() for k, _ in headers}:
            head.append(f"Content-Type: {content_type}")
        head += [f"{k}: {v}" for k, v in headers]
        await self._write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)

    async def reply(self, status: int, body: bytes = b"", headers: Sequence[tuple[str, str]] = (),
                    content_type: str = "application/json") -> None:
        """A complete response with a Content-Length (the connection stays usable)."""
        await self._head(status, f"Content-Length: {len(body)}", headers, content_type, body)

    async def start_stream(self, status: int = 200, headers: Sequence[tuple[str, str]] = (),
                           content_type: str | None = "text/event-stream") -> None:
        """Response headers of a chunked body; follow with `chunk()` and `end()` (or a fault)."""
        self._chunked = True
        await self._head(status, "Transfer-Encoding: chunked", headers, content_type)

    async def chunk(self, data: bytes) -> None:
        if data:
            await self._write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    async def end(self) -> None:
        await self._write(b"0\r\n\r\n")

    async def close(self) -> None:
        """Close the connection gracefully (FIN) after what was written; a chunked body stays incomplete."""
        self.keep_alive = False
        with contextlib.suppress(Exception):
            await self.writer.drain()
        self.writer.close()

    def reset(self) -> None:
        """Reset the connection (RST): anything not yet delivered is lost."""
        self.keep_alive = False
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.transport.abort()

    async def wait(self, seconds: float) -> None:
        """Sleep up to `seconds`, or less if the proxy is stopping."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.proxy._stopping.wait(), timeout=seconds)

    async def pour(self, piece: Callable[[], bytes], *, pause: float | None = None, seconds: float = math.inf,
                   limit: float = math.inf) -> None:
        """Chunks of `piece()`, `pause` s apart, until `seconds`, `limit` bytes, the proxy's stop, then close."""
        deadline, sent = time.monotonic() + seconds, 0
        try:
            while time.monotonic() < deadline and sent < limit and not self.proxy._stopping.is_set():
                data = piece()
                await self.chunk(data)
                sent += len(data)
                if pause is not None:
                    await self.wait(pause)
        except (ConnectionError, RuntimeError):
            return  # the client went away
        await self.close()

    @contextlib.asynccontextmanager
    async def upstream(self) -> Any:
        """Send the request on to the upstream server; yields the aiohttp response."""
        if self.proxy.upstream is None:
            raise RuntimeError("this FaultProxy has no upstream")
        headers = [(k, v) for k, v in self.seen.headers.items() if k not in _HOP_BY_HOP]
        assert self.proxy._session is not None
        async with self.proxy._session.request(
            self.seen.method, self.proxy.upstream + self.seen.target, data=self.seen.body or None,
            headers=headers, allow_redirects=False,
        ) as resp:
            yield resp

    async def forward(self, *, cut_after: int | None = None, stall_after: int | None = None,
                      stall_seconds: float = 0.0) -> None:
        """Relay the upstream answer, chunked; close after `cut_after` body bytes, pause `stall_seconds` after
        `stall_after`."""
        async with self.upstream() as resp:
            headers = [(k, v) for k, v in resp.headers.items() if k.lower() not in _HOP_BY_HOP]
            await self.start_stream(resp.status, headers, content_type=None)
            sent = 0
            async for data in resp.content.iter_any():
                if stall_after is not None and sent + len(data) > stall_after >= sent:
                    head, data = data[: stall_after - sent], data[stall_after - sent:]
                    await self.chunk(head)
                    sent += len(head)
                    await self.wait(stall_seconds)
                if cut_after is not None and sent + len(data) >= cut_after:
                    await self.chunk(data[: cut_after - sent])
                    await self.close()
                    return
                await self.chunk(data)
                sent += len(data)
            await self.end()


class Fault:
    """A way of answering a request (`name`, a class keyword, is what `Seen.fault` records); subclasses `handle`."""

    name = "fault"

    def __init_subclass__(cls, name: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.name = name or cls.name

    async def handle(self, ex: _Exchange) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Forward(Fault, name="forward"):
    """Pass the request on untouched (the default for unmatched requests when there is an upstream)."""

    async def handle(self, ex: _Exchange) -> None:
        await ex.forward()


@dataclass(repr=False)
class Status(Fault, name="status"):
    """Answer with an HTTP status without reaching the server: `Status(503, headers={"Retry-After": "1"})`."""

    status: int
    detail: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    async def handle(self, ex: _Exchange) -> None:
        detail = self.detail if self.detail is not None else f"injected {self.status}"
        await ex.reply(self.status, json.dumps({"detail": detail}).encode(), list(self.headers.items()))


@dataclass(repr=False)
class Reply(Fault, name="reply"):
    """Answer with exactly this body (bytes or str), e.g. invalid JSON."""

    body: bytes | str
    status: int = 200
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)

    async def handle(self, ex: _Exchange) -> None:
        body = self.body.encode() if isinstance(self.body, str) else self.body
        await ex.reply(self.status, body, list(self.headers.items()), content_type=self.content_type)


class Reset(Fault, name="reset"):
    """Read the request, then reset the connection without answering (the server never sees it)."""

    async def handle(self, ex: _Exchange) -> None:
        ex.reset()


@dataclass(repr=False)
class Hang(Fault, name="hang"):
    """Read the request and never answer (until `max_seconds` or the proxy stops)."""

    max_seconds: float = 120.0

    async def handle(self, ex: _Exchange) -> None:
        await ex.wait(self.max_seconds)
        await ex.close()


@dataclass(repr=False)
class Delay(Fault, name="delay"):
    """Wait `seconds`, then forward: a slow server."""

    seconds: float

    async def handle(self, ex: _Exchange) -> None:
        await ex.wait(self.seconds)
        await ex.forward()


@dataclass(repr=False)
class DropStream(Fault, name="drop"):
    """Forward the request, then close the connection after `after_bytes` bytes of the server's body (mid-chunk).
    With 0, once the server has started answering (so "the tool ran" is deterministic), the client gets the status
    line and headers only (`headers=False`: not even those)."""

    after_bytes: int = 0
    headers: bool = True

    async def handle(self, ex: _Exchange) -> None:
        if self.after_bytes > 0:
            await ex.forward(cut_after=self.after_bytes)
            return
        async with ex.upstream() as resp:
            with contextlib.suppress(asyncio.TimeoutError, aiohttp.ClientError):
                await asyncio.wait_for(resp.content.readany(), timeout=30)  # the server started the call
            if self.headers:
                await ex.start_stream(resp.status)
            await ex.close()


@dataclass(repr=False)
class Stall(Fault, name="stall"):
    """Forward, but go silent for `seconds` after `after_bytes` bytes of the body (then carry on)."""

    after_bytes: int
    seconds: float

    async def handle(self, ex: _Exchange) -> None:
        await ex.forward(stall_after=self.after_bytes, stall_seconds=self.seconds)


@dataclass(repr=False)
class Silent(Hang, name="silent"):
    """Answer 200 with event-stream headers, then send nothing at all (not even comments) as `Hang` does."""

    async def handle(self, ex: _Exchange) -> None:
        await ex.start_stream(200)
        await super().handle(ex)


@dataclass(repr=False)
class Pings(Fault, name="pings"):
    """Answer 200, then only `: ping` comments every `interval` s until `max_seconds` (`task_id`: that event first)."""

    interval: float = 0.1
    task_id: str | None = None
    max_seconds: float = 120.0

    async def handle(self, ex: _Exchange) -> None:
        await ex.start_stream(200)
        if self.task_id is not None:
            await ex.chunk(f"event: task_id\ndata: {self.task_id}\n\n".encode())
        await ex.pour(lambda: f": ping - {time.time():.3f}\n\n".encode(), pause=self.interval,
                      seconds=self.max_seconds)


@dataclass(repr=False)
class SSEReply(Fault, name="sse"):
    """Answer with these SSE `(event, data)` pairs, then "end" (a complete body), "close" or "hang" (silent)."""

    events: list[tuple[str, str]]
    then: str = "end"
    status: int = 200

    async def handle(self, ex: _Exchange) -> None:
        await ex.start_stream(self.status)
        for event, data in self.events:
            lines = "".join(f"data: {line}\n" for line in data.split("\n"))
            await ex.chunk(f"event: {event}\n{lines}\n".encode())
        if self.then == "end":
            await ex.end()
            return
        if self.then == "hang":
            await ex.wait(120.0)
        await ex.close()


@dataclass(repr=False)
class Flood(Fault, name="flood"):
    """Answer 200 with an endless body (with `sse`, an event that never ends; else JSON-ish bytes) up to `limit`."""

    sse: bool = False
    limit: int = 512 * 1024 * 1024
    chunk_size: int = 64 * 1024

    async def handle(self, ex: _Exchange) -> None:
        if self.sse:
            await ex.start_stream(200)
            await ex.chunk(b"event: task_id\ndata: flood\n\n")
            piece = b"event: chunk\ndata: " + b"x" * (self.chunk_size - 32) + b"\n\n"
        else:
            await ex.start_stream(200, content_type="application/json")
            piece = b"[" + b"1," * (self.chunk_size // 2)
        await ex.pour(lambda: piece, limit=self.limit)


@dataclass(repr=False)
class Raw(Fault, name="raw"):
    """Write exactly these bytes as the whole answer (broken HTTP, or not HTTP at all), then close."""

    data: bytes

    async def handle(self, ex: _Exchange) -> None:
        await ex._write(self.data)
        await ex.close()


@dataclass(repr=False)
class Redirect(Fault, name="redirect"):
    """Answer a redirect to `location` (an absolute URL or a path)."""

    location: str
    status: int = 307

    async def handle(self, ex: _Exchange) -> None:
        await ex.reply(self.status, b"", [("Location", self.location)], content_type="")


@dataclass(repr=False)
class EchoHeaders(Fault, name="echo_headers"):
    """Answer `status` with every request header echoed in the error detail (a leaky gateway)."""

    status: int = 400

    async def handle(self, ex: _Exchange) -> None:
        await Status(self.status, "request headers: " + json.dumps(ex.seen.headers, sort_keys=True)).handle(ex)


class FaultProxy(_Loopback):
    """A loopback HTTP proxy (or, without upstream, a fake server) with programmable faults.

    Args:
        upstream (`str`, *optional*):
            Base URL to forward to (`http://127.0.0.1:PORT`); without one, every answer is a programmed fault.
        host (`str`, *optional*, defaults to `"127.0.0.1"`):
            Loopback address to bind (another: a `ValueError`).
        max_log (`int`, *optional*, defaults to `100000`):
            How many of the newest requests `requests` and `count` remember (at least 1; a soak run stays bounded).
    """

    def __init__(self, upstream: str | None = None, *, host: str = LOOPBACK, max_log: int = 100_000) -> None:
        _require_loopback(host)
        if max_log < 1:
            raise ValueError(f"max_log must be at least 1, got {max_log}")
        self.upstream = upstream.rstrip("/") if upstream else None
        self.host, self.port = host, None
        self._rules: list[_Rule] = []
        self._log: collections.deque[Seen] = collections.deque(maxlen=max_log)
        self._lock = threading.Lock()
        self._bg: BackgroundLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._session: aiohttp.ClientSession | None = None
        self._stopping: asyncio.Event
        self._conns: set[asyncio.Task[None]] = set()

    def add(self, fault: Fault, *, path: str | None = None, method: str | None = None, times: int | None = 1,
            when: Callable[[Seen], bool] | None = None) -> FaultProxy:
        """Answer the next `times` matching requests with `fault` (the first rule added that matches and has uses
        left wins); returns the proxy, so that rules can be chained.

        Args:
            fault (`Fault`):
                How to answer (`Status`, `Reset`, `DropStream`, ... from `ors_trl.testing.faults`).
            path (`str`, *optional*):
                The whole request path or its end (`"/call"` matches `/echoenvironment/call`); any path when omitted.
            method (`str`, *optional*):
                The HTTP method; any when omitted.
            times (`int`, *optional*, defaults to `1`):
                How many requests the rule answers (`None`: all of them).
            when (`Callable[[Seen], bool]`, *optional*):
                A further condition on the request.
        """
        with self._lock:
            self._rules.append(_Rule(fault, path, method, times, when))
        return self

    def clear(self) -> None:
        """Forget every rule and the request log."""
        with self._lock:
            self._rules.clear()
            self._log.clear()

    @property
    def requests(self) -> list[Seen]:
        """Every request received so far (the newest `max_log`), in order."""
        with self._lock:
            return list(self._log)

    def count(self, path: str | None = None, method: str | None = None, fault: str | bool | None = False) -> int:
        """How many of the requests received so far (the newest `max_log`) matched.

        Args:
            path (`str`, *optional*):
                The whole request path or its end; any path when omitted.
            method (`str`, *optional*):
                The HTTP method; any when omitted.
            fault (`str`, `bool` or `None`, *optional*, defaults to `False`):
                Only the requests the fault of this name answered (`None`: only forwarded ones; `False`: all).
        """
        matching = _Rule(Forward(), path, method, None, None)  # a rule's own test, never used up
        return sum(1 for seen in self.requests if matching.matches(seen) and (fault is False or seen.fault == fault))

    def start(self) -> FaultProxy:
        """Start serving on a free port, in a thread of its own (a `RuntimeError` if not within 10 s); returns it."""

        async def startup() -> None:
            self._stopping = asyncio.Event()
            timeout = aiohttp.ClientTimeout(total=None, connect=10, sock_read=None)
            self._session = aiohttp.ClientSession(auto_decompress=False, trust_env=False, timeout=timeout)
            self._server = await asyncio.start_server(self._serve, self.host, 0, limit=_MAX_HEAD)
            self.port = self._server.sockets[0].getsockname()[1]

        self._bg = BackgroundLoop()
        self._bg.add_closer(self._shutdown)
        try:
            self._bg.run(startup(), timeout=10)
        except Exception as exc:
            self.close()
            raise RuntimeError(f"fault proxy did not start: {exc!r}") from exc
        return self

    def close(self) -> None:
        """Stop serving: close the connections and stop the thread. Idempotent."""
        bg, self._bg = self._bg, None
        if bg is not None:
            bg.shutdown(15)  # runs `_shutdown`, then stops the loop

    async def _shutdown(self) -> None:
        self._stopping.set()
        if self._server is not None:
            self._server.close()
        for task in list(self._conns):
            task.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    def __repr__(self) -> str:
        return f"FaultProxy(upstream={self.upstream!r}, port={self.port})"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            while not self._stopping.is_set():
                seen = await self._read_request(reader)
                if seen is None:
                    break
                rule = self._pick(seen)
                missing = Status(404, f"no fault rule for {seen.method} {seen.path}")
                fault = rule.fault if rule else Forward() if self.upstream else missing
                seen.fault = fault.name if rule else None
                with self._lock:
                    self._log.append(seen)
                ex = _Exchange(self, seen, writer)
                try:
                    await fault.handle(ex)
                except aiohttp.ClientError as exc:  # upstream unreachable: answer like a gateway would
                    if ex.keep_alive and not ex._chunked:
                        await Status(502, f"upstream: {exc}").handle(ex)
                    else:
                        break
                if not ex.keep_alive or writer.is_closing():
                    break
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError,
                asyncio.CancelledError):
            pass
        finally:
            self._conns.discard(task)
            if not writer.is_closing():
                writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1)

    def _pick(self, seen: Seen) -> _Rule | None:
        with self._lock:
            rule = next((rule for rule in self._rules if rule.matches(seen)), None)
            if rule is not None:
                rule.used += 1
        return rule

    async def _read_request(self, reader: asyncio.StreamReader) -> Seen | None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return None
        lines = head.decode("latin-1").split("\r\n")
        method, target, _ = lines[0].split(" ", 2)
        fields = (line.partition(":") for line in lines[1:] if ":" in line)
        headers = {name.strip().lower(): value.strip() for name, _, value in fields}
        length = int(headers.get("content-length") or 0)
        if length > _MAX_BODY:
            raise ValueError("request body too large")
        body = await reader.readexactly(length) if length else b""
        return Seen(method=method.upper(), path=target.split("?", 1)[0], headers=headers, body=body, target=target)


class Blackhole(_Loopback):
    """A loopback port that accepts TCP connections (the kernel completes them) and never reads or answers.

    Args:
        host (`str`, *optional*, defaults to `"127.0.0.1"`):
            Loopback address to bind (another: a `ValueError`).
    """

    def __init__(self, host: str = LOOPBACK) -> None:
        _require_loopback(host)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind((host, 0))
        self._sock.listen(128)
        self.host, self.port = host, int(self._sock.getsockname()[1])

    def close(self) -> None:
        """Close the port."""
        self._sock.close()
