"""A kit for testing an ORS environment, and code that uses one, against real servers on loopback.

`ReferenceServer` serves your environment classes under the reference `openreward` server in a subprocess;
`counters` are what an environment bumps so a test can prove what ran, without timing anything; `FaultProxy`
injects the faults a test programs between a client and a server (`Blackhole` never accepts). ors-trl's own
suite, benchmarks and demo use exactly these. Importing it is cheap: the names load on first use.
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
    # lazy: `python -m ors_trl.testing.server` must not find the module already imported
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(_HOMES.get(name, ".server"), __name__)
    return module if name == "counters" else getattr(module, name)
