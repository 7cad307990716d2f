"""The sessions one client keeps open: when one may open, keeping it alive, the orphan registry, closing.

`AsyncClient` speaks the endpoints; its `SessionPool` decides the rest. An open waits for a free slot
under the client's and the process's caps, then for its moment under the client's and the processes'
creation paces (`ors_trl._budget`; a 429 or `503 starting` slows them). Each session id is written to
the orphan registry (`ors_trl._registry`) before the session is created on the server and marked
closed once the server deleted it; the first one a process writes starts the sweep of dead processes'
orphans. Every open session is pinged on a timer, also while a tool call is running, so an episode
longer than the server's idle limit (900 s on the reference server) survives; closing the client waits
(bounded) for the opens still in flight and deletes every session that is still open.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from ._budget import Pace, get_max_sessions, parse_rate, process_pace, process_semaphore
from ._exceptions import ConfigurationError, ORSError, ORSTimeoutError
from ._registry import Deleter, registry, sweep_in_background, sweeps_done

__all__ = ["OPENING_WAIT_S", "SessionPool"]

logger = logging.getLogger("ors_trl.client")

_KEEPALIVE_CONCURRENCY = 64
#: How long closing waits for session opens still in flight, so it can delete what they create.
OPENING_WAIT_S = 10.0
Lease = tuple[asyncio.Semaphore, ...]
#: An `ors_trl._client.AsyncSession` (the pool sits below the client: it only pings and closes them).
OpenSession = Any


class SessionPool:
    """The open sessions of one client: caps, keepalive, closing.

    Args:
        delete (`Callable[..., Awaitable[bool]]`):
            deletes a session id on the server (the client's `/delete` + `/delete_session`; `quiet=True` logs
            failures at debug level); True once the server has it gone; never raises.
        delete_orphans (`Callable[[str, list[str]], Awaitable[list[bool]]]`):
            deletes session ids of a target (for the sweep of dead processes' orphans).
        max_sessions (`int`, *optional*):
            sessions open at once through this pool; an open past it waits for a slot.
        session_wait (`float`, *optional*, defaults to `1800.0`):
            how long an open may wait for a slot (None: no limit).
        keepalive_interval (`float`, *optional*, defaults to `10.0`):
            seconds between pings of an idle open session; None disables keepalive.
        max_session_rate (`float` or `tuple[float, int]`, *optional*):
            sessions this pool creates per second, or `(rate, burst)`; None: no pace of its own.
    """

    def __init__(self, delete: Callable[..., Awaitable[bool]], delete_orphans: Deleter, *,
                 max_sessions: int | None = None, session_wait: float | None = 1800.0,
                 keepalive_interval: float | None = 10.0,
                 max_session_rate: float | tuple[float, int] | None = None) -> None:
        if keepalive_interval is not None and keepalive_interval <= 0:
            raise ConfigurationError("keepalive_interval must be positive, or None to disable keepalive")
        if max_sessions is not None and max_sessions < 1:
            raise ConfigurationError("max_sessions must be at least 1, or None for no cap")
        self.delete, self.delete_orphans = delete, delete_orphans
        self.pace = None if max_session_rate is None else Pace(*parse_rate(max_session_rate, "max_session_rate"))
        self.max_sessions = max_sessions
        self.session_wait = session_wait
        self.keepalive_interval = keepalive_interval
        self.sessions: set[OpenSession] = set()
        self.closed = False
        self._opening: set[asyncio.Task[Any]] = set()
        self._slots: asyncio.Semaphore | None = None
        self._keepalive_task: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self.sessions)

    @contextlib.asynccontextmanager
    async def opening(self) -> AsyncIterator[None]:
        """Mark the running task as an open in flight (closing waits for it, then deletes what it made)."""
        task = asyncio.current_task()
        assert task is not None
        self._opening.add(task)
        try:
            yield
        finally:
            self._opening.discard(task)

    def _paces(self) -> list[Pace]:
        return [p for p in (self.pace, process_pace()) if p is not None]

    async def acquire(self) -> Lease:
        """Wait for a free slot under this pool's `max_sessions` and the process-wide cap, then for this open's moment
        under the paces; return the slots taken."""
        wanted = []
        if self.max_sessions is not None:
            if self._slots is None:
                self._slots = asyncio.Semaphore(self.max_sessions)
            wanted.append(self._slots)
        if (process := process_semaphore()) is not None:
            wanted.append(process)
        held: list[asyncio.Semaphore] = []
        try:
            async with asyncio.timeout(self.session_wait):
                for sem in wanted:
                    await sem.acquire()
                    held.append(sem)
            for pace in self._paces():  # past the slot wait: a pace's moment is not bounded by `session_wait`
                await pace.wait()
        except BaseException as exc:
            self.release(tuple(held))
            if isinstance(exc, TimeoutError):
                raise ORSTimeoutError(
                    f"no session slot freed within {self.session_wait} s (max_sessions={self.max_sessions}, "
                    f"process cap={get_max_sessions()}); raise the cap or close sessions sooner."
                ) from None
            raise
        return tuple(held)

    def throttled(self) -> None:
        """The server said 429 or `503 starting`: every pace this pool opens under slows down."""
        for pace in self._paces():
            pace.throttled()

    def opened(self) -> None:
        """A session was created: the paces recover a little."""
        for pace in self._paces():
            pace.eased()

    async def record(self, sid: str, target: str) -> None:
        """Write `sid` to the orphan registry, on disk before the session is created on the server; the process's
        first also starts the sweep of dead processes' orphans."""
        reg = registry()
        if reg is not None:
            await asyncio.to_thread(reg.opened, sid, target)
            sweep_in_background(self.delete_orphans)

    @staticmethod
    def release(lease: Lease) -> None:
        for sem in lease:
            sem.release()

    def add(self, session: OpenSession) -> None:
        """Track a session that opened (its lease is given back when it closes) and keep it alive."""
        self.sessions.add(session)
        if self.keepalive_interval is not None and (self._keepalive_task is None or self._keepalive_task.done()):
            self._keepalive_task = asyncio.get_running_loop().create_task(self._keepalive(self.keepalive_interval))

    async def discard(self, sid: str, lease: Lease = (), session: OpenSession | None = None, *,
                      quiet: bool = False) -> None:
        """Delete `sid` on the server, then forget it (in the registry too, once the server has it gone) and give its
        lease back. Never raises."""
        try:
            if await self.delete(sid, quiet=quiet) and (reg := registry()) is not None:
                reg.closed(sid)
        finally:
            if session is not None:
                self.sessions.discard(session)
                session.closed_at = time.monotonic()
                lease, session._lease = session._lease, ()
            self.release(lease)

    async def _keepalive(self, interval: float) -> None:
        gate = asyncio.Semaphore(_KEEPALIVE_CONCURRENCY)

        async def ping(session: OpenSession) -> None:
            async with gate:
                try:
                    if not await session.ping():
                        logger.warning("session %s expired on the server", session.sid[:8])
                except ORSError as exc:
                    logger.debug("keepalive ping of %s failed: %s", session.sid[:8], exc)

        while self.sessions and not self.closed:
            await asyncio.sleep(interval / 2)
            now = time.monotonic()
            due = [s for s in list(self.sessions) if not s.closed and not s.expired and now - s.last_activity >= interval]
            if due:
                await asyncio.gather(*(ping(s) for s in due))

    async def close_sessions(self) -> None:
        """Close every session of the pool, after the opens still in flight (bounded)."""
        if self._opening:
            await asyncio.wait(list(self._opening), timeout=OPENING_WAIT_S)
        await asyncio.gather(*(s.close() for s in list(self.sessions)), return_exceptions=True)

    async def aclose(self) -> None:
        """Stop keepalive and close every session; the pool opens nothing more."""
        self.closed = True
        if self._keepalive_task is not None:
            self._keepalive_task.cancel()
            with contextlib.suppress(BaseException):
                await self._keepalive_task
        await self.close_sessions()
        await sweeps_done(OPENING_WAIT_S)
