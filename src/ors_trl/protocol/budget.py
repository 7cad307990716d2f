"""What a process may open: a cap on open ORS sessions (`set_max_sessions`, `ORS_TRL_MAX_SESSIONS`), and a `Pace` of
session creation (a sandbox platform throttles it), per client (`max_session_rate`) and for every process sharing a
working directory (`ORS_TRL_MAX_SESSION_RATE="RATE[:BURST]"`, one schedule in a lock file)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import ConfigurationError
from .files import open_regular
from .registry import state_dir

__all__ = ["Pace", "get_max_sessions", "process_pace", "set_max_sessions"]

ENV_VAR = "ORS_TRL_MAX_SESSIONS"
RATE_VAR = "ORS_TRL_MAX_SESSION_RATE"
#: A shared pace's moment further ahead than this (seconds) is not one a pace wrote: the file is reset.
_FAR_S = 86_400.0

logger = logging.getLogger("ors_trl")

_lock = threading.Lock()
_limit: int | None = None
_limit_set = False
# One semaphore per event loop (asyncio primitives are loop-bound); gone with their loop.
_semaphores: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()


def set_max_sessions(limit: int | None) -> None:
    """Cap the sessions this process keeps open at once, over all its clients (call before opening sessions).

    Args:
        limit (`int` or `None`):
            The most sessions open at once (`None`: no cap). Overrides `ORS_TRL_MAX_SESSIONS`.
    """
    global _limit, _limit_set
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ConfigurationError(f"the session cap must be a positive int or None, got {limit!r}")
    with _lock:
        _limit, _limit_set = limit, True
        _semaphores.clear()


def get_max_sessions() -> int | None:
    """The process-wide session cap: `set_max_sessions`'s, else `ORS_TRL_MAX_SESSIONS`, else `None` (no cap)."""
    if _limit_set:
        return _limit
    raw = os.environ.get(ENV_VAR, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ConfigurationError(f"{ENV_VAR}={raw!r} is not an integer") from None
    if value < 1:
        raise ConfigurationError(f"{ENV_VAR} must be at least 1, got {value}")
    return value


def process_semaphore() -> asyncio.Semaphore | None:
    limit = get_max_sessions()
    if limit is None:
        return None
    with _lock:
        return _semaphores.setdefault(asyncio.get_running_loop(), asyncio.Semaphore(limit))


class Pace:
    """At most `rate` session opens per second, `burst` at once after a quiet spell: each open takes the next free
    moment of one schedule (the generic cell rate algorithm), in memory or in the lock file `path` processes share. A
    `429` or `503 starting` halves the pace (once per interval, down to 1/16) and restarts the schedule; each open
    that went through gives a fifth of the slow-down back."""

    MAX_SLOWDOWN = 16.0
    #: Bound on the new moments one open takes because the pace slowed while it waited.
    MAX_RETAKES = 64

    def __init__(self, rate: float, burst: int = 1, path: Path | None = None) -> None:
        self.rate, self.burst = parse_rate((rate, burst), "max_session_rate")
        self.path = path
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._pid = os.getpid()
        self._clock, self._sleep = time.time, asyncio.sleep
        # (the schedule's next free moment, the slow-down factor, how many times it slowed down, when it last did)
        self._state: tuple[float, ...] = (0.0, 1.0, 0.0, 0.0)
        self._warned = False

    def __repr__(self) -> str:
        return f"Pace({self.rate:g}/s, burst={self.burst}{', shared' if self.path else ''})"

    def _update(self, change: Callable[..., tuple[Any, ...]]) -> Any:
        """Apply `change(now, *state) -> (*state, result)` under the lock(s); returns its result."""
        with self._lock:
            if self.path is None:
                *state, result = change(self._clock(), *self._state)
                self._state = tuple(state)
                return result
            if self._fd is None or self._pid != os.getpid():  # a forked child must not share the parent's lock
                try:
                    self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                    self._fd = open_regular(self.path, os.O_RDWR | os.O_CREAT)
                except OSError as exc:
                    raise ConfigurationError(f"{RATE_VAR} shares its pace through {self.path}, which cannot be "
                                             f"written ({exc.strerror or exc}); set ORS_TRL_STATE_DIR to a writable "
                                             "folder.") from None
                self._pid = os.getpid()
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                now = self._clock()
                state = self._read(os.pread(self._fd, 128, 0), now)
                *state, result = change(now, *state)
                os.ftruncate(self._fd, 0)
                os.pwrite(self._fd, " ".join(f"{x:.6f}" for x in state).encode(), 0)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            return result

    def _read(self, raw: bytes, now: float) -> tuple[float, ...]:
        """The shared state from the pace file; what no pace wrote is treated as absent (said once)."""
        try:
            state = tuple(float(x) for x in raw.split())
        except ValueError:
            state = ()
        if not raw.strip() or (len(state) == len(self._state) and all(map(math.isfinite, state))
                               and 1.0 <= state[1] <= self.MAX_SLOWDOWN and state[0] - now <= _FAR_S
                               and state[3] - now <= _FAR_S and state[2] >= 0):
            return state or self._state
        if not self._warned:
            self._warned = True
            logger.warning("ors-trl: the shared session pace %s held %r, which no pace wrote; starting its schedule "
                           "afresh", self.path, raw[:64])
        return self._state

    def _take(self, now: float, tat: float, slow: float, epoch: float, last: float) -> tuple[Any, ...]:
        """The next free moment: `(delay from now, the slow-downs so far)` as the result."""
        interval = slow / self.rate
        start = max(tat, now)
        return start + interval, slow, epoch, last, (max(start - (self.burst - 1) * interval, now) - now, epoch)

    async def wait(self) -> None:
        """Wait for this open's moment (reserved now); if the pace slowed meanwhile, take a new one."""
        for _ in range(self.MAX_RETAKES):
            delay, epoch = self._update(self._take)
            if delay > 0:
                await self._sleep(delay)
            if self._update(lambda now, *state: (*state, state[2])) == epoch:
                return

    def throttled(self) -> None:
        """The platform said 429 or `503 starting`: halve the pace (once per interval) and restart its schedule."""
        def slower(now: float, tat: float, slow: float, epoch: float, last: float) -> tuple[Any, ...]:
            if now - last >= slow / self.rate:
                slow, last = min(slow * 2, self.MAX_SLOWDOWN), now
            return now + slow / self.rate, slow, epoch + 1, last, None

        self._update(slower)

    def eased(self) -> None:
        """An open went through: give a fifth of the slow-down back."""
        self._update(lambda now, tat, slow, *rest: (tat, max(1.0, slow * 0.8), *rest, None))


def parse_rate(value: Any, what: str) -> tuple[float, int]:
    """`(opens per second, burst)` from a rate, a `(rate, burst)` pair or `"RATE[:BURST]"`; burst defaults to 1."""
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            rate, _, burst = value.strip().partition(":")
            return parse_rate((float(rate), int(burst) if burst else 1), what)
        raise ConfigurationError(f"{what}={value!r} is not RATE or RATE:BURST (e.g. 4 or 4:16)")
    rate, burst = value if isinstance(value, tuple) else (value, 1)
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not math.isfinite(rate) or rate <= 0 \
            or isinstance(burst, bool) or not isinstance(burst, int) or burst < 1:
        raise ConfigurationError(f"{what} must be a positive number of sessions per second, or (rate, burst) with "
                                 f"an int burst >= 1; got {value!r}")
    return float(rate), burst


def process_pace() -> Pace | None:
    """The pace `ORS_TRL_MAX_SESSION_RATE` sets for every process of this working directory, or None."""
    raw = os.environ.get(RATE_VAR, "").strip()
    return _shared_pace(raw) if raw else None


@functools.lru_cache(maxsize=1)  # one pace while the variable keeps its value
def _shared_pace(raw: str) -> Pace:
    return Pace(*parse_rate(raw, RATE_VAR), path=state_dir() / "session-pace.lock")


def _after_fork_in_child() -> None:
    # A lock another thread held at the fork stays held in the child; the parent's loops do not run there.
    global _lock
    _lock = threading.Lock()
    _semaphores.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
