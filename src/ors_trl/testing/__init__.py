"""Test fixtures: reference ORS environments and a launcher for the reference server.

Tests, benchmarks and the demo all use these, so there is one definition of "a real ORS peer":

- ``ors_trl.testing.server.ReferenceServer`` runs ``openreward.environments.Server`` with the
  fixture environments in a subprocess on 127.0.0.1 (also ``python -m ors_trl.testing.server``),
  with ``GET /_test/stats`` for introspection and an optional short idle timeout.
- ``ors_trl.testing.environments`` holds the environments (echo, task tools, images, long output,
  rich schemas, sparse reward, slow) and helpers such as ``long_text``.
- ``ors_trl.testing.generation`` holds scripted stand-ins for TRL's generation backend
  (``work_turn_by_turn``, ``tool_call_text``) for tests and benchmarks that drive a real trainer.

Importing this package is cheap: it loads neither ``openreward`` nor ``fastapi``. The names below
are resolved on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .server import ReferenceServer, ServerStartError, free_port

__all__ = ["ReferenceServer", "ServerStartError", "free_port"]


def __getattr__(name: str) -> Any:
    # Lazy, so that `python -m ors_trl.testing.server` does not find the module already imported.
    if name in __all__:
        return getattr(importlib.import_module(".server", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
