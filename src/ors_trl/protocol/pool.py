"""The sessions one client keeps open: when one may open (`protocol.budget`), the orphan registry (written before the
create), keepalive (pings also while a tool call runs) and closing (the slot given back at once, the delete waited for
at most `CLOSE_WAIT_S`). A session id is claimed per process: one handed out again meanwhile is refused and replaced.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from .budget import Pace, get_max_sessions, parse_rate, process_pace, process_semaphore
from .errors import ORSError, ORSTimeoutError, ProtocolError
from .registry import Deleter, registry, sweep_in_background, sweeps_done

__all__ = ["CLOSE_WAIT_S", "DUPLICATE_TRIES", "OPENING_WAIT_S", "SessionPool"]

logger = logging.getLogger("ors_trl.client")

_KEEPALIVE_CONCURRENCY = 64
#: How long closing waits for the opens (and deletes) still in flight.
OPENING_WAIT_S = 10.0
#: How long closing one session waits for the server's delete before leaving it to run in the background.
CLOSE_WAIT_S = 1.0
#: Session ids already in use that one open takes from the server before it gives up (a `ProtocolError`).
DUPLICATE_TRIES = 3
#: `(target, session id)` of every session this process is opening, has open or is deleting, over all clients.
_claimed: set[tuple[str, str]] = set()
_claimed_lock = threading.Lock()
Lease = tuple[asyncio.Semaphore, ...]
#: A `client.AsyncSession` (the pool sits below the client: it only pings and closes them).
OpenSession = Any


class SessionPool:
    """The open sessions of one client, under its `options` (a `ClientOptions`). `delete(sid, quiet=...)` deletes a
    session on the server (True once gone; never raises), `delete_orphans` is the sweep's `Deleter`; ids are claimed
    under `target`. `duplicates` counts the ids handed out that were already in use."""

    def __init__(self, delete: Callable[..., Awaitable[bool]], delete_orphans: Deleter, options: Any,
                 target: str = "") -> None:
        self.delete, self.delete_orphans, self.target, self.options = delete, delete_orphans, target, options
        rate = options.max_session_rate
        self.pace = None if rate is None else Pace(*parse_rate(rate, "max_session_rate"))
        self.sessions: set[OpenSession] = set()
        self.closed = False
        self.duplicates = 0
        self._claims: set[str] = set()
        self._deleting: set[asyncio.Task[None]] = set()
        self._opening: set[asyncio.Task[Any]] = set()
        self._slots = None if options.max_sessions is None else asyncio.Semaphore(options.max_sessions)
        self._keepalive_task: asyncio.Task[None] | None = None

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
        """Wait for a slot under `max_sessions` and the process-wide cap, then for this open's moment under the paces;
        the slots taken."""
        wanted = [s for s in (self._slots, process_semaphore()) if s is not None]
        held: list[asyncio.Semaphore] = []
        try:
            async with asyncio.timeout(self.options.session_wait):
                for sem in wanted:
                    await sem.acquire()
                    held.append(sem)
            for pace in self._paces():  # past the slot wait: a pace's moment is not bounded by `session_wait`
                await pace.wait()
        except BaseException as exc:
            self.release(tuple(held))
            if isinstance(exc, TimeoutError):
                raise ORSTimeoutError(f"no session slot freed within {self.options.session_wait} s (max_sessions="
                                      f"{self.options.max_sessions}, process cap={get_max_sessions()}); raise the "
                                      "cap or close sessions sooner.") from None
            raise
        return tuple(held)

    def throttled(self) -> None:
        """The server said 429 or `503 starting`: every pace this pool opens under slows down."""
        for pace in self._paces():
            pace.throttled()

    async def claim(self, sid: str) -> bool:
        """Take `sid` for a session of this pool and write it to the orphan registry (the process's first also starts
        the sweep of dead processes'); False, nothing written, when a session of this process already has it."""
        with _claimed_lock:
            if (self.target, sid) in _claimed:
                return False
            _claimed.add((self.target, sid))
        self._claims.add(sid)
        if (reg := registry()) is not None:
            await asyncio.to_thread(reg.opened, sid, self.target)
            sweep_in_background(self.delete_orphans)
        return True

    def _unclaim(self, sid: str) -> None:
        if sid in self._claims:
            self._claims.discard(sid)
            with _claimed_lock:
                _claimed.discard((self.target, sid))

    def duplicate(self, sid: str, tries: int, *, mine: bool = False) -> None:
        """The server handed out `sid` while it was in use (`mine`: claimed and recorded here, now given up without a
        delete, which would end the other's session). Counted and said; the `DUPLICATE_TRIES`-th `tries` raises."""
        if mine:
            self._unclaim(sid)
            if (reg := registry()) is not None:
                reg.closed(sid)
        self.duplicates += 1
        logger.warning("%s handed out session id %s, which another session already has; %s", self.target,
                       sid[:8], "asking for another" if tries < DUPLICATE_TRIES else "giving up")
        if tries >= DUPLICATE_TRIES:
            raise ProtocolError(
                f"/create_session: {self.target} handed out session ids already in use {tries} times in a row; two "
                "rollouts would share one session. The server is broken: report it to its authors.")

    @staticmethod
    def release(lease: Lease) -> None:
        for sem in lease:
            sem.release()

    def add(self, session: OpenSession) -> None:
        """Track a session that opened (its lease is given back when it closes), keep it alive, ease the paces."""
        for pace in self._paces():
            pace.eased()
        self.sessions.add(session)
        interval = self.options.keepalive_interval
        if interval is not None and (self._keepalive_task is None or self._keepalive_task.done()):
            self._keepalive_task = asyncio.get_running_loop().create_task(self._keepalive(interval))

    def delete_soon(self, sid: str, lease: Lease = (), session: OpenSession | None = None, *,
                    quiet: bool = False) -> asyncio.Task[None]:
        """Give `sid`'s slot back now and delete it on the server in the background (`aclose()` waits for it, bounded);
        the registry forgets it once the server has it gone. Never raises."""
        if session is not None:
            self.sessions.discard(session)
            lease, session._lease = session._lease, ()
        self.release(lease)
        task = asyncio.get_running_loop().create_task(self._delete(sid, session, quiet))
        self._deleting.add(task)
        task.add_done_callback(self._deleting.discard)
        return task

    async def _delete(self, sid: str, session: OpenSession | None, quiet: bool) -> None:
        try:
            if await self.delete(sid, quiet=quiet) and (reg := registry()) is not None:
                reg.closed(sid)
        finally:
            self._unclaim(sid)
            if session is not None:
                session.closed_at = time.monotonic()

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
        """Close every session, after the opens still in flight, and wait (bounded) for their deletes."""
        if self._opening:
            await asyncio.wait(list(self._opening), timeout=OPENING_WAIT_S)
        await asyncio.gather(*(s.close() for s in list(self.sessions)), return_exceptions=True)
        if self._deleting:
            await asyncio.wait(list(self._deleting), timeout=OPENING_WAIT_S)

    async def aclose(self) -> None:
        """Stop keepalive and close every session; the pool opens nothing more. A delete still running after the
        bound is stopped (its session stays in the orphan registry)."""
        self.closed = True
        if self._keepalive_task is not None:
            self._keepalive_task.cancel()
            with contextlib.suppress(BaseException):
                await self._keepalive_task
        await self.close_sessions()
        await sweeps_done(OPENING_WAIT_S)
        for task in list(self._deleting):
            task.cancel()
        if self._deleting:
            await asyncio.wait(list(self._deleting), timeout=OPENING_WAIT_S)


def _after_fork_in_child() -> None:
    global _claimed_lock
    _claimed.clear()  # the parent's sessions are not the child's
    _claimed_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
