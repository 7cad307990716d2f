"""Shared pytest fixtures: reference ORS servers on loopback (see ``ors_trl.testing``)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence

import pytest

# The openreward SDK otherwise starts a version-check thread that tries the network.
os.environ["OPENREWARD_DISABLE_UPDATE_CHECK"] = "1"

from ors_trl.testing.server import ReferenceServer


@pytest.fixture(scope="session")
def ref_server() -> Iterator[ReferenceServer]:
    """One reference server with every fixture environment, shared by the whole test session.

    Other tests use it too: compare counters before and after rather than assuming zeros.
    """
    with ReferenceServer(envs="all") as server:
        yield server


MakeServer = Callable[..., ReferenceServer]


@pytest.fixture
def make_server() -> Iterator[MakeServer]:
    """Factory for extra, private reference servers, stopped at the end of the test.

    ``make_server(envs="echo", idle_timeout=3, env={"ORS_TEST_TOOL_LATENCY": "0.2"})`` returns a
    started ``ReferenceServer``; keyword arguments are those of ``ReferenceServer``.
    """
    servers: list[ReferenceServer] = []

    def factory(
        envs: str | Sequence[str] = "all",
        *,
        idle_timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        **kwargs: object,
    ) -> ReferenceServer:
        server = ReferenceServer(envs, idle_timeout=idle_timeout, env=env, **kwargs)  # type: ignore[arg-type]
        servers.append(server)
        return server.start()

    yield factory
    for server in reversed(servers):
        server.close()
