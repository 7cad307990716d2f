"""A per-process cap on open ORS sessions, shared by every client in the process.

64 training processes x 64 rollouts would otherwise open 4,096 sessions at once against a server
that may not take them. With a cap, opening a session past it waits (queues) for one to close
instead of failing. Set it with `set_max_sessions(n)` or the `ORS_TRL_MAX_SESSIONS` environment
variable; per-client caps (`max_sessions=` on a spec or client) apply on top.
"""

from __future__ import annotations

import asyncio
import os
import threading
import weakref

from ._exceptions import ConfigurationError

__all__ = ["get_max_sessions", "set_max_sessions"]

ENV_VAR = "ORS_TRL_MAX_SESSIONS"

_lock = threading.Lock()
_limit: int | None = None
_limit_set = False
# One semaphore per event loop (asyncio primitives are loop-bound); gone with their loop.
_semaphores: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()


def set_max_sessions(limit: int | None) -> None:
    """Cap the sessions this process keeps open at once (None: no cap). Call before opening sessions."""
    global _limit, _limit_set
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ConfigurationError(f"the session cap must be a positive int or None, got {limit!r}")
    with _lock:
        _limit, _limit_set = limit, True
        _semaphores.clear()


def get_max_sessions() -> int | None:
    """The process-wide cap: `set_max_sessions`, else `ORS_TRL_MAX_SESSIONS`, else None."""
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
    """The running loop's semaphore for the process-wide cap, or None when there is no cap."""
    limit = get_max_sessions()
    if limit is None:
        return None
    loop = asyncio.get_running_loop()
    with _lock:
        sem = _semaphores.get(loop)
        if sem is None:
            sem = _semaphores[loop] = asyncio.Semaphore(limit)
        return sem


def _after_fork_in_child() -> None:
    # A fork while another thread held the lock would leave it held forever in the child; the parent's
    # loops (and so their semaphores) do not run there either.
    global _lock
    _lock = threading.Lock()
    _semaphores.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
