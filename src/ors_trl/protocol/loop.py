"""The one background event loop per process that runs the synchronous facade's I/O. Its closers run at exit from
`threading._register_atexit`, before thread pools shut down (an `atexit` hook is too late); a forked child starts anew.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import concurrent.futures.thread
import contextlib
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from .errors import ORSTimeoutError, UsageError

__all__ = ["BackgroundLoop", "get_loop"]

logger = logging.getLogger("ors_trl")
T = TypeVar("T")

EXIT_TIMEOUT_S = 15.0  # how long interpreter exit may spend closing sessions


class BackgroundLoop:
    """A daemon thread running an asyncio loop, plus ordered async closers run at exit."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self._closers: list[Callable[[], Awaitable[None]]] = []
        self._lock = threading.Lock()
        self._closed = False
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.call_soon(ready.set)
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, name="ors-trl-loop", daemon=True)
        self.thread.start()
        if not ready.wait(10):
            raise RuntimeError("ors-trl background event loop did not start")

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if self._closed:
            coro.close()
            raise UsageError("the ors-trl background loop is shut down (interpreter exiting)")
        if os.getpid() != self.pid:  # inherited across fork(): no thread runs this loop here, the work would never run
            coro.close()
            raise UsageError("This ors-trl object was created in another process (before a fork); its sessions belong "
                             "to that process. Create the spec or client again in this process.")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and wait for it, from any thread but the loop's own."""
        if threading.get_ident() == self.thread.ident:
            coro.close()
            raise UsageError("A synchronous ors-trl call was made from inside its own event loop; use the async API "
                             "(AsyncClient / AsyncSession) from coroutines.")
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            # Also a TimeoutError the coroutine raised: only a wait that ran out is ours to translate.
            if fut.done():
                return fut.result()
            fut.cancel()
            raise ORSTimeoutError(f"operation did not finish within {timeout} s") from None
        except BaseException:  # KeyboardInterrupt in the waiting thread: stop the work instead of leaving it running
            fut.cancel()
            raise

    def add_closer(self, closer: Callable[[], Awaitable[None]]) -> None:
        """Register an async callable run once on the loop at shutdown (newest first)."""
        with self._lock:
            self._closers.append(closer)

    def remove_closer(self, closer: Callable[[], Awaitable[None]]) -> None:
        with self._lock, contextlib.suppress(ValueError):
            self._closers.remove(closer)

    async def _run_closers(self) -> None:
        with self._lock:
            closers = list(reversed(self._closers))
            self._closers.clear()
        for closer in closers:
            try:
                await closer()
            except Exception as exc:  # a failing closer must not stop the others
                logger.warning("ors-trl: cleanup at exit failed: %s", exc)

    def shutdown(self, timeout: float = EXIT_TIMEOUT_S) -> None:
        """Run the closers, then stop the loop. Idempotent; bounded by `timeout`."""
        if self._closed or os.getpid() != self.pid or not self.thread.is_alive():
            return
        try:
            fut = asyncio.run_coroutine_threadsafe(self._run_closers(), self.loop)
            fut.result(timeout)
        except concurrent.futures.TimeoutError:
            logger.warning("ors-trl: closing sessions at exit took longer than %.0f s; giving up", timeout)
        except Exception as exc:
            logger.warning("ors-trl: cleanup at exit failed: %s", exc)
        finally:
            self._closed = True
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(2)
            if not self.thread.is_alive():
                self.loop.close()


_current: BackgroundLoop | None = None
_current_lock = threading.Lock()


def get_loop() -> BackgroundLoop:
    """The process's background loop, started on first use (and again in a forked child)."""
    global _current
    with _current_lock:
        cur = _current
        if cur is None or cur.pid != os.getpid():
            cur = _current = BackgroundLoop()
        elif cur._closed:
            raise UsageError("the ors-trl background loop is shut down (interpreter exiting)")
        return cur


def _shutdown_at_exit() -> None:
    cur = _current
    if cur is not None and cur.pid == os.getpid():
        cur.shutdown()


def _reset_after_fork() -> None:  # the child has no loop thread, and must not close the parent's sessions
    global _current, _current_lock
    _current, _current_lock = None, threading.Lock()


# Before thread pools shut down: `threading._shutdown` calls these hooks newest first, and concurrent.futures.thread
# registered its own on import above.
threading._register_atexit(_shutdown_at_exit)  # type: ignore[attr-defined]
os.register_at_fork(after_in_child=_reset_after_fork)
