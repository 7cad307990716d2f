"""A kit for testing an ORS environment, and code that uses one, against real servers on loopback.

- `ReferenceServer` runs your environment classes under the reference `openreward` server in a
  subprocess on 127.0.0.1 (`GET /_test/stats` for introspection, an optional short idle timeout,
  `close_sessions()` to clean up after a failed test).
- `counters` are what an environment bumps so a test can prove a tool ran exactly once, or that
  work ran concurrently, without timing anything.
- `FaultProxy` sits between a client and a server and injects the faults a test programs (5xx,
  resets, dropped streams, hangs, malformed answers, redirects); `Blackhole` never accepts.

ors-trl's own suite, benchmarks and demo use exactly these. Importing this package is cheap: it
loads neither `openreward` nor `fastapi`; the names are resolved on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from . import counters
    from .faults import Blackhole, FaultProxy
    from .server import ReferenceServer, ServerStartError, free_port

__all__ = ["Blackhole", "FaultProxy", "ReferenceServer", "ServerStartError", "counters", "free_port"]

_HOMES = {"Blackhole": ".faults", "FaultProxy": ".faults", "counters": ".counters"}


def __getattr__(name: str) -> Any:
    # Lazy, so that `python -m ors_trl.testing.server` does not find the module already imported.
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(_HOMES.get(name, ".server"), __name__)
    return module if name == "counters" else getattr(module, name)
