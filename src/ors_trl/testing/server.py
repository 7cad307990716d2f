"""Run your ORS environments under the reference server, on loopback, in a subprocess, for tests.

    with ReferenceServer([MyEnvironment], idle_timeout=5) as server:
        spec = OpenRewardSpec(server.url)
        server.stats()  # {"open_sessions": 0, "tool_calls": {...}, ...}
        server.close_sessions()  # delete whatever a failed test left open

The subprocess (`python -m ors_trl.testing.server`, `main`) is the reference `openreward.environments.Server` under
a thin ASGI layer that answers `GET /_test/stats`. Only the standard library is imported here at module level.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import http.client
import importlib
import ipaddress
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
import urllib.request
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

__all__ = ["LOOPBACK", "REFERENCE_IDLE_LIMIT_S", "STATS_PATH", "ReferenceServer", "ServerStartError", "free_port",
           "main"]

#: The only host the launcher binds to by default.
LOOPBACK = "127.0.0.1"
#: The reference server reaps sessions idle for longer than this (`reaper_coro`'s default).
REFERENCE_IDLE_LIMIT_S = 900.0
#: Introspection endpoint answered by the launcher's outer ASGI layer.
STATS_PATH = "/_test/stats"

_UPDATE_CHECK_ENV = "OPENREWARD_DISABLE_UPDATE_CHECK"
_SRC_DIR = str(Path(__file__).resolve().parents[2])  # .../src, so the child finds ors_trl uninstalled


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free on `host` a moment ago (bind to port 0, read it, close).

    Args:
        host (`str`, *optional*, defaults to `"127.0.0.1"`):
            The loopback address to find a port on (another: a `ValueError`).
    """
    _require_loopback(host)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _require_loopback(host: str) -> None:
    with contextlib.suppress(ValueError):  # not an IP address: not loopback
        if host == "localhost" or ipaddress.ip_address(host).is_loopback:
            return
    raise ValueError(f"the test server only binds to loopback addresses, not {host!r}")


class _Loopback:
    """A server on a loopback port (`ReferenceServer`, `FaultProxy`, `Blackhole`): its URL, and `with`."""

    host: str
    port: int | None

    @property
    def url(self) -> str:
        """Its base URL, `http://127.0.0.1:PORT` (no trailing slash; a `RuntimeError` before `start()`)."""
        if self.port is None:
            raise RuntimeError(f"{type(self).__name__} has not been started")
        return f"http://[{self.host}]:{self.port}" if ":" in self.host else f"http://{self.host}:{self.port}"

    def start(self) -> Self:
        """Nothing to start: it serves from construction; returns it."""
        return self

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()  # type: ignore[attr-defined]


# -- server side (runs in the subprocess) ---------------------------------------------------------------------------


def install_idle_timeout(seconds: float) -> None:
    """Make the reference server reap sessions idle for more than `seconds` real seconds (checked every 5 s): its
    reaper compares `time.monotonic()` differences with 900 s, so its module's clock runs `900 / seconds` faster."""
    if seconds <= 0:
        raise ValueError("idle timeout must be positive")
    import openreward.environments.server as server_module

    real = getattr(server_module.time, "_real", server_module.time)
    factor = REFERENCE_IDLE_LIMIT_S / seconds
    clock = {**vars(real), "_real": real, "monotonic": lambda: real.monotonic() * factor}  # the rest is real
    server_module.time = types.SimpleNamespace(**clock)  # type: ignore[assignment]


class _TestRoutes:
    """Outer ASGI layer: answers `/_test/*` itself (the reference app would 308 it), counts pings."""

    def __init__(self, app: Any, server: Any, idle_timeout: float | None) -> None:
        self.app, self.server, self.idle_timeout = app, server, idle_timeout
        self.pings = self.requests = self.peak_sessions = 0  # peak: sessions alive at once, sampled after a /create
        self.session_envs: dict[str, dict[str, str]] = {}  # session id -> its env_overrides, until its /create

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        from ors_trl.testing import counters

        path = scope.get("path", "") if scope["type"] == "http" else None
        if path is not None and path.startswith("/_test/"):
            await self._answer(path, send)
            return
        if path is not None:
            self.requests += 1
            self.pings += path == "/ping"
        if path == "/create_session":
            receive, send = await self._keep_env(receive, send)
        if path == "/create":  # set in this request's own task (uvicorn runs each in one), seen by its setup
            sid = dict(scope.get("headers") or ()).get(b"x-session-id", b"").decode("latin-1").strip()
            counters._session_env.set(self.session_envs.pop(sid, None))
        await self.app(scope, receive, send)
        if path == "/create":
            self.peak_sessions = max(self.peak_sessions, len(self.server._active_envs))

    async def _keep_env(self, receive: Callable[..., Any], send: Callable[..., Any]) -> tuple[Any, Any]:
        """A `/create_session`'s `env` (the platform's env_overrides), kept for the session id its answer names, until
        that session's `/create` hands it to the environment (`counters.session_env`)."""
        messages = [await receive()]
        while messages[-1].get("more_body") and messages[-1]["type"] == "http.request":
            messages.append(await receive())
        try:
            env = json.loads(b"".join(m.get("body", b"") for m in messages) or b"{}").get("env") or None
        except (ValueError, AttributeError):
            env = None
        replay = iter(messages)

        async def again() -> Any:
            return next(replay, None) or await receive()

        async def sent(message: dict[str, Any]) -> None:
            found = re.search(rb"event: task_id\r?\ndata: ([^\r\n]+)", message.get("body", b""))
            if found and isinstance(env, dict):
                self.session_envs[found[1].decode().strip()] = env
            await send(message)

        return again, sent

    def stats(self) -> dict[str, Any]:
        from ors_trl.testing import counters

        sessions = list(self.server._active_envs)
        return {"pid": os.getpid(), "open_sessions": len(sessions), "peak_sessions": self.peak_sessions,
                "sessions": sessions, "pings": self.pings, "requests": self.requests,
                "idle_timeout": self.idle_timeout, "environments": list(self.server._env_classes),
                **counters.snapshot()}

    async def _answer(self, path: str, send: Callable[..., Any]) -> None:
        status, body = (200, self.stats()) if path == STATS_PATH else (404, {"detail": f"unknown test route {path!r}"})
        payload = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


def _load(path: str) -> type:
    """The class a `"module:Class"` path names."""
    module, sep, name = path.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"environment {path!r} is not a 'module:Class' path")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _watch_parent(parent_pid: int) -> None:
    """Shut this server down if the process that launched it dies (no orphaned servers)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os.kill(os.getpid(), 15)  # SIGTERM: uvicorn shuts down gracefully (teardowns run)
        time.sleep(10.0)
        os._exit(1)

    threading.Thread(target=watch, name="ors-test-parent-watch", daemon=True).start()


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m ors_trl.testing.server --port N --env module:Class [--env ...] [--idle-timeout S]`."""
    parser = argparse.ArgumentParser(prog="python -m ors_trl.testing.server", description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default=LOOPBACK, help="loopback address to bind (default 127.0.0.1)")
    parser.add_argument("--env", action="append", required=True, metavar="MODULE:CLASS",
                        help="an environment class to serve (repeatable; the first is the server's default)")
    parser.add_argument("--idle-timeout", type=float, default=None, help="reap sessions idle this many seconds")
    parser.add_argument("--log-level", default="warning", help="server log level (default warning)")
    parser.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        _require_loopback(args.host)
    except ValueError as exc:
        parser.error(str(exc))
    if args.idle_timeout is not None and args.idle_timeout <= 0:
        parser.error("--idle-timeout must be positive")

    os.environ[_UPDATE_CHECK_ENV] = "1"
    # The SDK's loggers read their level when openreward is first imported.
    os.environ.setdefault("OPENREWARD_LOG_LEVEL", args.log_level.upper())
    try:  # the reference Server for the environments, under _TestRoutes
        from openreward.environments import Server

        if args.idle_timeout is not None:
            install_idle_timeout(args.idle_timeout)
        server = Server([_load(path) for path in args.env])
    except (ValueError, ImportError, AttributeError) as exc:
        parser.error(f"cannot load the environments: {exc}")

    import uvicorn

    if args.parent_pid is not None:
        _watch_parent(args.parent_pid)
    app = _TestRoutes(server.app, server, args.idle_timeout)
    uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, timeout_keep_alive=60,
                                  timeout_graceful_shutdown=3, access_log=False, log_level=args.log_level.lower(),
                                  lifespan="on")).run()
    return 0


# -- client side (runs in the test process) -------------------------------------------------------------------------


def _environment_paths(envs: type | str | Sequence[type | str]) -> tuple[list[str], list[str]]:
    """`module:Class` paths for `envs`, and the folders their modules import from."""
    items = [envs] if isinstance(envs, type | str) else list(envs)
    paths: list[str] = []
    roots: list[str] = []
    for item in items:
        if isinstance(item, str):
            paths += [p.strip() for p in item.split(",") if p.strip()]
            continue
        module = sys.modules.get(item.__module__)
        file = getattr(module, "__file__", None)
        if item.__module__ == "__main__" or not file:
            raise ValueError(f"{item.__qualname__} must live in an importable module (not __main__) to be served")
        paths.append(f"{item.__module__}:{item.__qualname__}")
        roots.append(str(Path(file).resolve().parents[item.__module__.count(".")]))
    if not paths or any(":" not in p for p in paths):
        raise ValueError(f"ReferenceServer needs environment classes or 'module:Class' paths, got {envs!r}")
    return paths, roots


class ServerStartError(RuntimeError):
    """The server subprocess exited or did not answer in time; the message ends with its log tail."""


# No proxies: a configured HTTP(S)_PROXY must never see loopback test traffic.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_LIVE: weakref.WeakSet[ReferenceServer] = weakref.WeakSet()


@atexit.register
def _stop_leftovers() -> None:
    for server in list(_LIVE):
        with contextlib.suppress(Exception):
            server.kill()


class ReferenceServer(_Loopback):
    """A reference ORS server in a subprocess on loopback.

    Args:
        envs (`type`, `str` or `Sequence[type | str]`):
            The environment classes (or `"module:Class"` paths) to serve, the first the default one; a class's module
            must be importable from a file (not `__main__`), whose folder goes on the server's `PYTHONPATH`.
        idle_timeout (`float`, *optional*):
            Reap sessions idle for more than this many seconds (checked every 5 s) instead of the reference 900 s.
        env (`Mapping[str, str]`, *optional*):
            Extra environment variables for the server process (e.g. `ORS_TEST_TOOL_LATENCY`).
        port (`int`, *optional*):
            Fixed port; by default a free one is picked (and re-picked if it was taken meanwhile).
        host (`str`, *optional*, defaults to `"127.0.0.1"`):
            Loopback address to bind (another: a `ValueError`).
        startup_timeout (`float`, *optional*, defaults to `30.0`):
            Seconds to wait for the server to answer before raising `ServerStartError`.
        log_level (`str`, *optional*, defaults to `"warning"`):
            The server's log level; its output goes to `log_path`.
    """

    def __init__(self, envs: type | str | Sequence[type | str], idle_timeout: float | None = None,
                 env: Mapping[str, str] | None = None, port: int | None = None, *, host: str = LOOPBACK,
                 startup_timeout: float = 30.0, log_level: str = "warning") -> None:
        _require_loopback(host)
        self.envs, self._paths = _environment_paths(envs)
        self.idle_timeout, self.extra_env, self.host, self.port = idle_timeout, dict(env or {}), host, port
        self.startup_timeout, self.log_level = startup_timeout, log_level
        self._fixed_port = port is not None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_path: str | None = None

    @property
    def pid(self) -> int | None:
        """The server process's id (`None` before `start()`)."""
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        """Whether the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def log_path(self) -> str | None:
        """The file the server's stdout and stderr go to (deleted on `close()`, collection or process exit)."""
        return self._log_path

    def start(self) -> ReferenceServer:
        """Launch the server and wait until it answers `/health` as this process; returns the server (a
        `ServerStartError` if it exits or does not answer in `startup_timeout`; a `RuntimeError` if it is running)."""
        if self.running:
            raise RuntimeError(f"server already running at {self.url}")
        for attempt in range(3):  # a free port re-picked if another process took it meanwhile
            if not self._fixed_port:
                self.port = free_port(self.host)
            self._spawn()
            try:
                self._wait_ready()
                break
            except ServerStartError as exc:
                self.kill()
                if self._fixed_port or attempt == 2 or "address already in use" not in str(exc).lower():
                    raise
        self._fixed_port = True  # restart() comes back on the same port
        _LIVE.add(self)
        return self

    def stop(self, timeout: float = 10.0) -> int | None:
        """Terminate the server (SIGTERM: sessions are torn down), killing it if it outlives `timeout`; returns its
        exit status (`None` if it was never started).

        Args:
            timeout (`float`, *optional*, defaults to `10.0`):
                Seconds to wait for it to exit before killing it.
        """
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout)
        return self.kill()  # what outlived `timeout`

    def kill(self) -> int | None:
        """Kill the server at once (SIGKILL: no teardowns), as a crash would; returns its exit status (or `None`)."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.kill()
            proc.wait(5.0)
        _LIVE.discard(self)
        return proc.returncode

    def restart(self, timeout: float = 10.0) -> ReferenceServer:
        """Stop the server and start a fresh process on the same port (all sessions are lost); returns the server.

        Args:
            timeout (`float`, *optional*, defaults to `10.0`):
                Seconds to wait for the old process to exit before killing it.
        """
        self.stop(timeout)
        return self.start()

    def close(self) -> None:
        """Stop the server and delete its log file."""
        self.stop()
        if self._log_path is not None:
            self._drop_log()
            self._log_path = None

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"ReferenceServer(envs={[e.rsplit(':', 1)[-1] for e in self.envs]}, port={self.port}, {state})"

    def stats(self, timeout: float = 5.0) -> dict[str, Any]:
        """The server's introspection, `GET /_test/stats`: `open_sessions`, `peak_sessions`, `sessions`, `pings`,
        `requests`, `pid`, `idle_timeout`, `environments`, and the `counters` (`tool_calls` as `{"env/tool": n}`, ...).

        Args:
            timeout (`float`, *optional*, defaults to `5.0`):
                Seconds allowed for the request.
        """
        with _OPENER.open(self.url + STATS_PATH, timeout=timeout) as resp:
            return json.loads(resp.read())

    def wait_for_stats(self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 10.0,
                       interval: float = 0.05) -> dict[str, Any]:
        """Poll `stats()` until a condition holds; returns the first stats that met it.

        Args:
            predicate (`Callable[[dict[str, Any]], bool]`):
                The condition, on the stats.
            timeout (`float`, *optional*, defaults to `10.0`):
                Seconds to wait for it (then a `TimeoutError` showing the last stats).
            interval (`float`, *optional*, defaults to `0.05`):
                Seconds between polls.
        """
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if predicate(stats):
                return stats
            if time.monotonic() >= deadline:
                raise TimeoutError(f"stats condition not met within {timeout} s; last stats: {stats}")
            time.sleep(interval)

    def close_sessions(self, timeout: float = 10.0) -> list[str]:
        """Delete every session the server holds (over the protocol, as a client would; a fixture that found some
        left behind leaves the server clean for the next test); returns their ids.

        Args:
            timeout (`float`, *optional*, defaults to `10.0`):
                Seconds allowed for each request.
        """
        sessions = list(self.stats(timeout)["sessions"])
        for sid in sessions:
            request = urllib.request.Request(self.url + "/delete", data=b"{}", method="POST",
                                             headers={"X-Session-ID": sid, "Content-Type": "application/json"})
            with contextlib.suppress(OSError, http.client.HTTPException), _OPENER.open(request, timeout=timeout):
                pass
        return sessions

    def log_tail(self, max_chars: int = 4000) -> str:
        """The end of the server's output (`""` when there is no log).

        Args:
            max_chars (`int`, *optional*, defaults to `4000`):
                How much of it, at most.
        """
        if self._log_path is None:
            return ""
        try:
            with open(self._log_path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - max_chars))
                return fh.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def _spawn(self) -> None:
        if self._log_path is None:
            fd, self._log_path = tempfile.mkstemp(prefix="ors-ref-server-", suffix=".log")
            os.close(fd)
            # Deleted on close(), or when this object is collected or the process exits without one.
            self._drop_log = weakref.finalize(self, Path(self._log_path).unlink, missing_ok=True)
        child_env = {**os.environ, **self.extra_env, _UPDATE_CHECK_ENV: "1", "PYTHONUNBUFFERED": "1"}
        child_env["PYTHONPATH"] = os.pathsep.join(
            dict.fromkeys(p for p in (_SRC_DIR, *self._paths, child_env.get("PYTHONPATH")) if p))
        envs = [arg for env in self.envs for arg in ("--env", env)]
        idle = ["--idle-timeout", repr(float(self.idle_timeout))] if self.idle_timeout is not None else []
        command = [sys.executable, "-m", "ors_trl.testing.server", "--host", self.host, "--port", str(self.port),
                   *envs, "--log-level", self.log_level, "--parent-pid", str(os.getpid()), *idle]
        with open(self._log_path, "ab") as log:
            log.write(f"--- {' '.join(command)}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          env=child_env)

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout
        while not self._answers():
            code = self._proc.poll()
            if code is not None:
                raise ServerStartError(f"server exited with code {code} during startup\n{self.log_tail()}")
            if time.monotonic() >= deadline:
                raise ServerStartError(f"server did not answer on {self.url} within {self.startup_timeout} s\n"
                                       f"{self.log_tail()}")
            time.sleep(0.05)

    def _answers(self) -> bool:
        """True once `/health` is ok and `/_test/stats` reports our child's pid (not a stranger's)."""
        try:
            with _OPENER.open(self.url + "/health", timeout=1.0) as resp:
                if resp.status != 200 or json.loads(resp.read()).get("status") != "ok":
                    return False
            return self.stats(timeout=1.0).get("pid") == self.pid
        except (OSError, ValueError, http.client.HTTPException):
            return False


if __name__ == "__main__":
    sys.exit(main())
