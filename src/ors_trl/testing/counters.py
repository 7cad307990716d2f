"""Counters an environment under test bumps, so a test can prove what ran on the server side (no timing).

    counters.count("myenvironment/submit")            # in a tool: exactly once per execution
    with counters.tracked("myenvironment/judge"):     # work in progress: its peak concurrency
        ...

`ReferenceServer.stats()` reports them, read from the server process. Process-global and thread-safe.
`session_env()` is what the platform would put in the environment's sandbox: the session's `env_overrides`.
"""

from __future__ import annotations

import contextvars
import threading
from collections import Counter
from typing import Any

__all__ = ["count", "reset", "session_env", "snapshot", "tracked"]

#: Set by `ReferenceServer` while it creates a session (`/create`): the `env` its `/create_session` carried.
_session_env: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("session_env", default=None)

_lock = threading.Lock()
_counts: dict[str, Counter[str]] = {name: Counter() for name in
                                     ("tool_calls", "setups", "teardowns", "in_flight", "peak_in_flight", "done")}


def count(key: str, kind: str = "tool_calls") -> None:
    """Count one more event.

    Args:
        key (`str`):
            What is counted, e.g. `"env/tool"`.
        kind (`str`, *optional*, defaults to `"tool_calls"`):
            `"tool_calls"`, `"setups"` or `"teardowns"`.
    """
    with _lock:
        _counts[kind][key] += 1


class tracked:
    """Counts one piece of work in progress (`in_flight`, its peak, and `done` when it ends well); a context manager.

    Args:
        key (`str`):
            What is counted, e.g. `"env/judge"`.
    """

    def __init__(self, key: str) -> None:
        self.key = key

    def __enter__(self) -> None:
        with _lock:
            _counts["in_flight"][self.key] += 1
            peak = _counts["peak_in_flight"]
            peak[self.key] = max(peak[self.key], _counts["in_flight"][self.key])

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        with _lock:
            _counts["in_flight"][self.key] -= 1
            if exc_type is None:
                _counts["done"][self.key] += 1


def snapshot() -> dict[str, Any]:
    """Every counter, plus the `setups`/`teardowns` totals (and `setups_by_env`, `teardowns_by_env`)."""
    with _lock:
        out: dict[str, Any] = {name: dict(c) for name, c in _counts.items()}
    out["setups_by_env"], out["teardowns_by_env"] = out["setups"], out["teardowns"]
    out["setups"], out["teardowns"] = sum(out["setups_by_env"].values()), sum(out["teardowns_by_env"].values())
    return out


def reset() -> None:
    """Zero every counter (in-process use; the server never calls it)."""
    with _lock:
        for c in _counts.values():
            c.clear()


def session_env() -> dict[str, str]:
    """In an environment's `__init__` under `ReferenceServer`: the `env_overrides` its session was opened with (the
    variables the platform sets in the environment's sandbox; `{}` for none)."""
    return dict(_session_env.get() or {})
