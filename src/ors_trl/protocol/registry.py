"""The orphan registry: the session ids a process has open, in `<state>/sessions/<host>-<pid>-<start>.sessions`
(fsync'd before each create, a shared `flock` held while it lives), so that `sweep()` deletes what dead processes of
this host left, each orphan once, never a live one's. The folder is untrusted; `ORS_TRL_SESSION_REGISTRY=0`: off."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import fcntl
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .files import create_temp, open_regular

__all__ = ["MAX_BYTES", "RUN_ID", "STALE_S", "Registry", "Sweep", "enabled", "registry", "state_dir", "sweep",
           "sweep_in_background", "sweeps_done"]

logger = logging.getLogger("ors_trl")

#: Tells one process run from another: in the registry's header, and in every episode record (`core.records`).
RUN_ID = f"{socket.gethostname()}-{os.getpid()}-{int(time.time())}"
DIR_VAR = "ORS_TRL_STATE_DIR"
SWITCH_VAR = "ORS_TRL_SESSION_REGISTRY"
#: A registry file is compacted (only the open sessions kept) when it grows past this, or past twice what is open.
MAX_BYTES = 1 << 20
#: A dead process's file whose sessions could not be deleted for this long is given up (the server reaped them).
STALE_S = 86_400.0
_SUFFIX = ".sessions"
_READ_LIMIT = 64 << 20


def state_dir() -> Path:
    """Where the registry and the shared pace live: `ORS_TRL_STATE_DIR`, else `.ors-trl` in the working directory."""
    return Path(os.environ.get(DIR_VAR) or ".ors-trl").absolute()


def enabled() -> bool:
    """False when `ORS_TRL_SESSION_REGISTRY` is 0, off, false or no."""
    return os.environ.get(SWITCH_VAR, "").strip().lower() not in ("0", "off", "false", "no")


def _boot_id() -> str:
    with contextlib.suppress(OSError):
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return ""


def _started(pid: int) -> str | None:
    """When process `pid` started (clock ticks after boot, `/proc/<pid>/stat` field 22); None: no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        if Path("/proc/self/stat").exists():
            return None
    try:
        with contextlib.suppress(PermissionError):  # no /proc: the pid alone (another user's process is alive too)
            os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return None
    return "?"


def _header(raw: bytes) -> dict[str, Any] | None:
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    ok = (isinstance(header, dict) and isinstance(header.get("host"), str) and isinstance(header.get("boot"), str)
          and type(header.get("pid")) is int and header["pid"] > 0 and isinstance(header.get("start"), str | None))
    return header if ok else None


def _owner_alive(header: dict[str, Any]) -> bool | None:
    """Whether the process that wrote `header` still runs; None for another host's file (it cannot be told here)."""
    if header["host"] != socket.gethostname():
        return None
    started = _started(header["pid"]) if header["boot"] == _boot_id() else None
    return started is not None and started in (header["start"], "?")


class Registry:
    """This process's file of open session ids in `folder` (`<state>/sessions`), created at the first one."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.pid = os.getpid()
        self.path = folder / f"{socket.gethostname()}-{self.pid}-{_started(self.pid)}{_SUFFIX}"
        self.swept = False
        self.broken = False  # the file could not be written: the process goes on without a registry
        self._fd: int | None = None
        self._open: dict[str, bytes] = {}  # sid -> its line
        self._size = 0
        self._lock = threading.Lock()

    def _header(self) -> bytes:
        return (json.dumps({"host": socket.gethostname(), "boot": _boot_id(), "pid": self.pid,
                            "start": _started(self.pid), "run": RUN_ID}) + "\n").encode()

    def _new_file(self, body: bytes) -> int:
        """Write the file whole under a temporary name, take the shared lock (held for the process's life), then move
        it in place: a sweep never sees it half written."""
        fd, tmp = create_temp(self.folder, self.path.name)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.write(fd, self._header() + body)
            os.fsync(fd)
            os.replace(tmp, self.path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        self._size = os.fstat(fd).st_size
        return fd

    def opened(self, sid: str, target: str) -> None:
        """Record `sid` (of `target`) and fsync, before the session is created (blocks). A folder that cannot be
        written is said once; the process then goes on without a registry."""
        line = (json.dumps({"sid": sid, "target": target}) + "\n").encode()
        with self._lock:
            if self.broken:
                return
            try:
                if self._fd is None:
                    self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
                    self._fd = self._new_file(b"")
                self._append(line)
                os.fsync(self._fd)
            except OSError as exc:
                self.broken = True
                logger.warning("ors-trl: cannot write the session registry in %s (%s): the sessions of this process "
                               "are not deleted if it is killed. Set %s to a writable folder, or %s=0.", self.folder,
                               exc.strerror or exc, DIR_VAR, SWITCH_VAR)
                return
            self._open[sid] = line

    def closed(self, sid: str) -> None:
        """Mark `sid` deleted on the server (not fsync'd: a lost mark costs one more delete, no more)."""
        with self._lock, contextlib.suppress(OSError):
            if self._open.pop(sid, None) is not None and self._fd is not None:
                self._append((json.dumps({"closed": sid}) + "\n").encode())

    def _append(self, line: bytes) -> None:
        assert self._fd is not None
        if self._size + len(line) > max(MAX_BYTES, 2 * sum(map(len, self._open.values()))):
            old, self._fd = self._fd, self._new_file(b"".join(self._open.values()))  # compact: the open ones only
            os.close(old)
        os.write(self._fd, line)
        self._size += len(line)

    def finish(self) -> None:
        with self._lock:
            if self._fd is not None and not self._open:
                with contextlib.suppress(OSError):
                    self.path.unlink()
                os.close(self._fd)
                self._fd = None


_registry: Registry | None = None
_registry_lock = threading.Lock()
_sweeps: set[asyncio.Task[Any]] = set()


def registry() -> Registry | None:
    """This process's registry (None when `ORS_TRL_SESSION_REGISTRY` turns it off)."""
    global _registry
    if not enabled():
        return None
    with _registry_lock:
        if _registry is None or _registry.pid != os.getpid():
            _registry = Registry(state_dir() / "sessions")
        return _registry


@dataclass
class Sweep:
    """What a sweep did: sessions `deleted`, `failed` (kept for the next sweep) and `dropped` (older than `STALE_S`, or
    their loopback server is gone); dead `processes` handled; files left alone: `live`, of `other_hosts`, and
    `skipped` (no registry file), with why."""

    deleted: int = 0
    failed: int = 0
    dropped: int = 0
    processes: int = 0
    live: int = 0
    other_hosts: int = 0
    skipped: dict[str, str] = field(default_factory=dict)


#: Deletes session ids of one target: per id, whether the server has it gone, or None where the server is gone itself.
Deleter = Callable[[str, list[str]], Awaitable[list[bool | None]]]


async def sweep(deleter: Deleter, folder: Path | None = None, *, any_host: bool = False) -> Sweep:
    """Delete the sessions left open by dead processes in `folder` (default: this working directory's registry);
    `any_host`: also other hosts' (a shared disk whose nodes are gone)."""
    folder = folder if folder is not None else state_dir() / "sessions"
    out = Sweep()
    own = _registry.path if _registry is not None and _registry.pid == os.getpid() else None
    for path in sorted(folder.glob("*" + _SUFFIX)) if folder.is_dir() else []:
        if path == own:
            continue
        try:
            fd = open_regular(path, os.O_RDWR | os.O_APPEND)
        except FileNotFoundError:
            continue  # swept meanwhile
        except OSError as exc:  # a symlink, a FIFO, a folder, no permission: not ours to read
            out.skipped[str(path)] = exc.strerror or str(exc)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            await _sweep_file(path, fd, deleter, out, any_host)
        except BlockingIOError:  # its process still holds it, or another sweep does
            out.live += 1
        except OSError as exc:
            out.skipped[str(path)] = exc.strerror or str(exc)
        finally:
            os.close(fd)
    for path, why in out.skipped.items():
        logger.debug("ors-trl: %s in the session registry skipped: %s", path, why)
    return out


async def _sweep_file(path: Path, fd: int, deleter: Deleter, out: Sweep, any_host: bool) -> None:
    first, *rest = os.pread(fd, min(os.fstat(fd).st_size, _READ_LIMIT), 0).splitlines() or [b""]
    header = _header(first)
    if header is None and (first.strip() or rest):
        out.skipped[str(path)] = "its first line is not a session registry header"
        return
    alive = header is not None and _owner_alive(header)  # an empty file: nothing to delete
    if alive is None and not any_host:
        out.other_hosts += 1
        return
    if alive:
        out.live += 1
        return
    left: dict[str, str] = {}
    for raw in rest:
        try:
            entry = json.loads(raw)
        except (ValueError, RecursionError):
            continue  # a line cut short by a crash
        if isinstance(entry, dict) and isinstance(entry.get("sid"), str) and isinstance(entry.get("target"), str):
            left[entry["sid"]] = entry["target"]
        elif isinstance(entry, dict) and isinstance(entry.get("closed"), str):
            left.pop(entry["closed"], None)
    stale = time.time() - os.fstat(fd).st_mtime > STALE_S
    out.processes += 1
    failed = 0
    for target in sorted(set(left.values())):
        sids = [sid for sid, t in left.items() if t == target]
        try:
            done = await deleter(target, sids)
        except Exception as exc:  # a target that cannot be reached or resolved (a missing API key): kept
            logger.warning("ors-trl: could not delete %d orphaned session(s) of %s: %s", len(sids), target, exc)
            done = [False] * len(sids)
        os.write(fd, b"".join((json.dumps({"closed": sid}) + "\n").encode()
                              for sid, ok in zip(sids, done, strict=True) if ok is not False))
        out.deleted += done.count(True)
        out.dropped += done.count(None)
        failed += done.count(False)
    if failed and not stale:
        out.failed += failed
        return
    out.dropped += failed
    with contextlib.suppress(OSError):
        path.unlink()  # still under our lock: a sweep that opened it before finds every session closed


def sweep_in_background(deleter: Deleter) -> None:
    """Once per process, at its first session open: sweep this working directory's registry on the running loop."""
    reg = registry()
    if reg is None or reg.swept:
        return
    reg.swept = True

    async def run() -> None:
        result = await sweep(deleter, reg.folder)
        if result.deleted or result.failed or result.dropped:  # only dropped ones (a test server gone): said quietly
            (logger.warning if result.deleted or result.failed else logger.info)(
                "ors-trl: %d session(s) left open by %d dead process(es) deleted from %s (%d could not be deleted yet, "
                "%d given up: a day old, or their loopback server is gone); `ors-trl cleanup` does this by hand",
                result.deleted, result.processes, reg.folder, result.failed, result.dropped)

    task = asyncio.get_running_loop().create_task(run())
    _sweeps.add(task)
    task.add_done_callback(_sweeps.discard)


async def sweeps_done(timeout: float) -> None:
    """Wait (bounded) for the sweeps running on this loop, so that a short process still deletes the orphans it found
    (a sweep's own clients do not wait for it)."""
    loop, current = asyncio.get_running_loop(), asyncio.current_task()
    if running := [t for t in _sweeps if t.get_loop() is loop and t is not current]:
        await asyncio.wait(running, timeout=timeout)


def _finish_at_exit() -> None:
    if _registry is not None and _registry.pid == os.getpid():
        _registry.finish()


def _after_fork_in_child() -> None:
    # The parent's file and lock stay the parent's: this process gets its own file at its first open.
    global _registry, _registry_lock
    if _registry is not None and _registry._fd is not None:
        with contextlib.suppress(OSError):
            os.close(_registry._fd)
    _registry, _registry_lock = None, threading.Lock()


atexit.register(_finish_at_exit)  # after the background loop's closers (they run before thread shutdown)
os.register_at_fork(after_in_child=_after_fork_in_child)
