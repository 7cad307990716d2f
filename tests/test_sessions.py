"""Sessions at sandbox scale (issue 27): nothing orphaned after a killed worker, creation paced, cost visible,
toolsets and env overrides. Against the reference server; faults and timings through `FaultProxy`.

The processes that hold sessions are `tests/fixtures/holder.py`, each with the test's own state folder
(`ORS_TRL_STATE_DIR`), so that what they register and sweep is only theirs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import select
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ors_trl import (
    AsyncClient,
    ConfigurationError,
    OpenRewardSpec,
    ORSTimeoutError,
    ProtocolError,
    RetryPolicy,
    Timeouts,
)
from ors_trl.cli import main
from ors_trl.protocol.budget import Pace
from ors_trl.protocol.registry import Registry, _boot_id, _started, sweep
from ors_trl.testing import ReferenceServer
from ors_trl.testing.faults import Fault, FaultProxy, Status
from tests.fixtures.environments import EchoEnvironment, SandboxEnvironment

ROOT = Path(__file__).resolve().parents[1]
ECHO = "echoenvironment"
SANDBOX = "sandboxenvironment"
#: Bound on a holder's start (a trainer's imports on a busy machine) and on every wait of these tests.
START_S = 120.0


# --------------------------------------------------------------------------------------------------
# Processes that hold sessions


def _env(state: Path) -> dict[str, str]:
    return {**os.environ, "ORS_TRL_STATE_DIR": str(state), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")])}


class Holder:
    """One `tests.fixtures.holder` process: `start()` waits (bounded) for its line; `stop()` lets it close its
    sessions and exit; `kill()` is SIGKILL. Its stderr goes to a file (`log`)."""

    def __init__(self, url: str, n: int, state: Path, *args: str) -> None:
        self.log = state.parent / f"holder-{id(self)}.log"
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.fixtures.holder", url, str(n), *args],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                         cwd=ROOT, env=_env(state))
        self.sids: list[str] = []
        self.opened: list[float] = []

    def send(self, line: str = "") -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def read(self) -> dict[str, Any]:
        """The holder's next line (bounded)."""
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], START_S)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.kill()
            pytest.fail(f"the holder did not report:\n{self.log.read_text()[-3000:]}")
        return json.loads(line)

    def start(self) -> Holder:
        report = self.read()
        self.sids, self.opened = report["sids"], report["opened"]
        return self

    def stop(self) -> str:
        if self.proc.poll() is None:
            with contextlib.suppress(BrokenPipeError):
                self.send()
            try:
                self.proc.wait(START_S)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.log.read_text()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


@pytest.fixture
def holders():
    started: list[Holder] = []

    def make(*args: Any) -> Holder:
        started.append(Holder(*args))
        return started[-1]

    yield make
    for holder in started:  # a failing test must not leave a process behind
        holder.kill()


def sessions(server: ReferenceServer) -> set[str]:
    return set(server.stats()["sessions"])


def wait_sessions(server: ReferenceServer, expected: set[str]) -> None:
    try:
        server.wait_for_stats(lambda s: set(s["sessions"]) == expected, timeout=30)
    except TimeoutError:
        pytest.fail(f"the server holds {sorted(sessions(server))}, expected {sorted(expected)}")


def registry_files(state: Path) -> list[Path]:
    return sorted((state / "sessions").glob("*.sessions"))


# --------------------------------------------------------------------------------------------------
# 1. The orphan registry


def test_a_killed_training_process_orphans_are_deleted_by_the_next_start(make_server, holders, tiny_model_dir,
                                                                        tmp_path) -> None:
    server = make_server("echo")
    state = tmp_path / "state"
    live = holders(server.url, 2, state).start()
    trainer = holders(server.url, 4, state, "--trainer", tiny_model_dir).start()  # mid-step: 4 rollouts' sessions
    assert sessions(server) == set(live.sids) | set(trainer.sids) and len(trainer.sids) == 4
    trainer.kill()
    assert set(trainer.sids) <= sessions(server)  # SIGKILL ran no exit hook: its sessions are orphans
    assert len(registry_files(state)) == 2  # the dead one's, and the live one's

    nxt = holders(server.url, 1, state).start()  # the next start in this working directory
    wait_sessions(server, set(live.sids) | set(nxt.sids))  # exactly the orphans went; the live process kept its own
    assert "4 session(s) left open by 1 dead process(es) deleted" in nxt.stop()
    live.stop()
    wait_sessions(server, set())
    assert registry_files(state) == []  # clean exits leave nothing behind


def test_a_killed_harness_runs_sessions_are_orphans_like_any_other(make_server, holders, tmp_path) -> None:
    """Harness episodes (`ors_trl.Harness`) open their sessions through the same client: a SIGKILLed run's are in
    the registry, and the next start deletes them."""
    server = make_server("echo")
    state = tmp_path / "state"
    run = holders(server.url, 3, state, "--harness").start()
    assert len(run.sids) == 3 and set(run.sids) <= sessions(server)
    run.kill()
    assert set(run.sids) <= sessions(server)  # SIGKILL: no exit hook ran
    nxt = holders(server.url, 1, state).start()
    wait_sessions(server, set(nxt.sids))
    assert "3 session(s) left open by 1 dead process(es) deleted" in nxt.stop()
    wait_sessions(server, set())


def test_cleanup_deletes_what_two_killed_processes_left_and_nothing_else(make_server, holders, tmp_path,
                                                                        capsys) -> None:
    server = make_server("echo")
    state = tmp_path / "state"
    live = holders(server.url, 3, state).start()
    killed = [holders(server.url, n, state).start() for n in (2, 3)]
    for holder in killed:
        holder.kill()
    orphans = {sid for holder in killed for sid in holder.sids}
    assert sessions(server) == orphans | set(live.sids)

    assert main(["cleanup", str(state), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["deleted"], result["processes"], result["live"], result["failed"]) == (5, 2, 1, 0)
    assert sessions(server) == set(live.sids)
    assert main(["cleanup", str(state)]) == 0  # nothing left to do
    assert "Deleted 0 session(s)" in capsys.readouterr().out
    live.stop()
    wait_sessions(server, set())


def test_two_processes_starting_at_once_delete_each_orphan_once(make_server, holders, tmp_path) -> None:
    server = make_server("echo")
    state = tmp_path / "state"
    killed = [holders(server.url, n, state).start() for n in (2, 3)]
    for holder in killed:
        holder.kill()
    starting = [holders(server.url, 1, state), holders(server.url, 1, state)]  # both before either reports
    for holder in starting:
        holder.start()
    wait_sessions(server, {sid for holder in starting for sid in holder.sids})
    logs = [holder.stop() for holder in starting]
    deleted = [int(line.split(" session(s) left open")[0].rsplit(" ", 1)[-1])
               for log in logs for line in log.splitlines() if "left open by" in line]
    assert sum(deleted) == 5, logs  # the lock files: each orphan deleted by one of them, none twice
    wait_sessions(server, set())


def test_no_registry_for_a_process_without_sessions_nor_with_the_switch_off(ref_server, tmp_path) -> None:
    code = ("import sys; from ors_trl import Client; c = Client(sys.argv[1], env_name='echoenvironment'); "
            "c.num_tasks(); (c.open_session(index=0) if sys.argv[2] == 'open' else None); c.close()")
    runs = {"no session": ("none", {}), "switched off": ("open", {"ORS_TRL_SESSION_REGISTRY": "0"}),
            "with a session": ("open", {})}
    for what, (mode, extra) in runs.items():
        state = tmp_path / what.replace(" ", "-")
        subprocess.run([sys.executable, "-c", code, ref_server.url, mode], env={**_env(state), **extra},
                       check=True, timeout=START_S)
        assert state.exists() == (what == "with a session"), what
    assert list((tmp_path / "with-a-session" / "sessions").iterdir()) == []  # closed cleanly: its file is gone


def test_the_registry_file_is_private_synced_first_and_bounded(tmp_path, monkeypatch) -> None:
    import ors_trl.protocol.registry as registry_module

    monkeypatch.setattr(registry_module, "MAX_BYTES", 4096)
    reg = Registry(tmp_path / "sessions")
    reg.opened("sid-0", "http://127.0.0.1:1")
    assert (tmp_path / "sessions").stat().st_mode & 0o777 == 0o700
    assert reg.path.stat().st_mode & 0o777 == 0o600
    header, line = (json.loads(x) for x in reg.path.read_text().splitlines())
    assert (header["pid"], header["host"], header["boot"]) == (os.getpid(), socket.gethostname(), _boot_id())
    assert line == {"sid": "sid-0", "target": "http://127.0.0.1:1"}
    for i in range(1, 500):  # a long run: many sessions opened and deleted, a few open at any time
        reg.opened(f"sid-{i}", "http://127.0.0.1:1")
        reg.closed(f"sid-{i - 1}")
    assert reg.path.stat().st_size <= 4096 + 100  # compacted: the file does not grow with the run
    kept = [json.loads(x) for x in reg.path.read_text().splitlines()[1:]]
    assert {e.get("sid") for e in kept} - {None} - {e.get("closed") for e in kept} == {"sid-499"}
    reg.finish()
    assert reg.path.exists()  # sid-499 is still open: kept for the next sweep
    reg.closed("sid-499")
    reg.finish()
    assert not reg.path.exists()


def test_a_registry_that_cannot_be_written_is_said_once_and_opens_go_on(tmp_path, caplog) -> None:
    (tmp_path / "not-a-folder").write_text("")
    reg = Registry(tmp_path / "not-a-folder" / "sessions")
    caplog.set_level(logging.WARNING, logger="ors_trl")
    for i in range(3):
        reg.opened(f"sid-{i}", "t")  # does not raise: the session opens anyway
        reg.closed(f"sid-{i}")
    assert reg.broken and sum("cannot write the session registry" in r.getMessage() for r in caplog.records) == 1


def _fake_registry(folder: Path, name: str, header: dict[str, Any], sids: list[str], age: float = 0.0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.sessions"
    path.write_text("\n".join(json.dumps(x) for x in [header, *({"sid": s, "target": "t"} for s in sids)]) + "\n")
    os.utime(path, (time.time() - age, time.time() - age))
    return path


def test_the_sweep_tells_dead_from_live_processes(tmp_path) -> None:
    """Who is dead: a pid that is gone, another boot of this host; alive: this process (pid and start time match);
    unknown: another host's file. A deletion that fails is kept, unless the file is a day old."""
    me = {"host": socket.gethostname(), "boot": _boot_id(), "pid": os.getpid(), "start": _started(os.getpid())}
    folder = tmp_path / "sessions"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)
    files = {
        "alive": _fake_registry(folder, "alive", me, ["a1"]),
        "gone": _fake_registry(folder, "gone", {**me, "pid": gone.pid, "start": "1"}, ["g1", "g2"]),
        "rebooted": _fake_registry(folder, "rebooted", {**me, "boot": "another-boot"}, ["r1"]),
        "reused": _fake_registry(folder, "reused", {**me, "start": "0"}, ["u1"]),  # our pid, another process
        "elsewhere": _fake_registry(folder, "elsewhere", {**me, "host": "another-host"}, ["e1"]),
        "unreachable": _fake_registry(folder, "unreachable", {**me, "pid": gone.pid}, ["x1"]),
        "stale": _fake_registry(folder, "stale", {**me, "pid": gone.pid}, ["s1"], age=2 * 86_400),
    }
    asked: list[str] = []

    async def deleter(target: str, sids: list[str]) -> list[bool]:
        asked.extend(sids)
        return [not sid.startswith(("x", "s")) for sid in sids]

    result = asyncio.run(sweep(deleter, folder))
    assert sorted(asked) == ["g1", "g2", "r1", "s1", "u1", "x1"]
    assert (result.deleted, result.failed, result.dropped, result.processes, result.live, result.other_hosts) == \
        (4, 1, 1, 5, 1, 1)
    assert sorted(p.stem for p in folder.glob("*.sessions")) == ["alive", "elsewhere", "unreachable"]
    assert "x1" in files["unreachable"].read_text()
    asked.clear()
    assert asyncio.run(sweep(deleter, folder, any_host=True)).deleted == 1 and sorted(asked) == ["e1", "x1"]


# --------------------------------------------------------------------------------------------------
# 1b. State folders that someone else wrote to, and registries of servers that are gone


def _victim(tmp_path: Path) -> tuple[Path, bytes]:
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious bytes\n")
    return victim, victim.read_bytes()


def _dead_header() -> dict[str, Any]:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)
    return {"host": socket.gethostname(), "boot": _boot_id(), "pid": gone.pid, "start": "1"}


def test_no_state_file_is_written_through_a_planted_symlink(tmp_path, monkeypatch) -> None:
    """Symlinks planted at every name a registry, a shared pace and an image store write: the target keeps its bytes
    (the registry's temporary name was predictable, the pace file was opened through the link and truncated)."""
    import base64
    import io

    from PIL import Image

    from ors_trl.core.records import RecordWriter
    from ors_trl.protocol.types import parse_blocks

    victim, original = _victim(tmp_path)
    folder = tmp_path / "state" / "sessions"
    folder.mkdir(parents=True)
    reg = Registry(folder)
    for name in (reg.path.with_suffix(".tmp"), folder / f".{reg.path.name}.tmp"):
        name.symlink_to(victim)
    for i in range(3):
        reg.opened(f"sid-{i}", "http://127.0.0.1:1")
    assert reg.path.is_file() and not reg.path.is_symlink() and "sid-2" in reg.path.read_text()
    reg.closed("sid-0")
    # the shared pace: a link at its name is refused (typed), never written through
    (tmp_path / "state" / "session-pace.lock").symlink_to(victim)
    with pytest.raises(ConfigurationError, match=r"session-pace\.lock"):
        asyncio.run(Pace(1000.0, 1, path=tmp_path / "state" / "session-pace.lock").wait())
    # the image store: links at the old temporary name and at the image's own name
    buf = io.BytesIO()
    Image.new("RGB", (4, 4), "red").save(buf, format="PNG")
    [block] = parse_blocks([{"type": "image", "data": base64.b64encode(buf.getvalue()).decode(), "mimeType":
                             "image/png"}], where="test")
    sha = block.info().sha256
    images = tmp_path / "log.jsonl.images"
    images.mkdir()
    (images / f".{sha}.png.{os.getpid()}.tmp").symlink_to(victim)
    (images / f"{sha}.png").symlink_to(victim)
    writer = RecordWriter(tmp_path / "log.jsonl")
    writer.write({"images": {sha: {"mime_type": "image/png"}}}, images={sha: block})
    assert (images / f"{sha}.png").read_bytes() == buf.getvalue() and not (images / f"{sha}.png").is_symlink()
    assert victim.read_bytes() == original


@pytest.mark.parametrize("content", [b"not a number at all", b"nan nan nan nan", b"1 2 3", b"1e300 1 0 0",
                                     b"0 99 0 0", b"\xff\xfe garbage"])
def test_a_pace_file_with_bad_content_starts_afresh_with_a_warning(tmp_path, caplog, content) -> None:
    path = tmp_path / "session-pace.lock"
    path.write_bytes(content)
    caplog.set_level(logging.WARNING, logger="ors_trl")
    pace = Pace(1000.0, 1, path=path)

    async def opens() -> None:
        for _ in range(3):
            await asyncio.wait_for(pace.wait(), 30)  # not a wait of 1e300 s: the file's moment was not trusted
        pace.throttled()
        pace.eased()

    asyncio.run(opens())
    assert sum("no pace wrote" in r.getMessage() for r in caplog.records) == 1
    state = [float(x) for x in path.read_text().split()]
    assert len(state) == 4 and 1.0 <= state[1] <= Pace.MAX_SLOWDOWN


def test_cleanup_deletes_every_good_orphan_and_reports_what_it_skipped(ref_server, tmp_path, capsys,
                                                                        monkeypatch) -> None:
    """Beside a good orphan: a file whose header is malformed (a pid that is text, a header that is a list), a FIFO,
    a symlink to a registry outside the folder, a folder. The orphan is deleted, the rest is skipped, listed and left
    as it was; the exit code is 0 (nothing could not be deleted)."""
    monkeypatch.setenv("ORS_TRL_SESSION_REGISTRY", "0")  # the session below is an orphan only by the fake file
    async def orphan() -> str:
        client = AsyncClient(ref_server.url, env_name=ECHO, keepalive_interval=None)
        session = await client.open_session(split="train", index=0)
        client._pool.sessions.clear()  # forgotten, as by a process killed with SIGKILL
        await client._transport.aclose()
        return session.sid

    sid = asyncio.run(orphan())
    assert sid in sessions(ref_server)
    monkeypatch.delenv("ORS_TRL_SESSION_REGISTRY")
    state = tmp_path / "state"
    folder = state / "sessions"
    dead = _dead_header()
    good = _fake_registry(folder, "good", dead, [])
    good.write_text(json.dumps(dead) + "\n" + json.dumps({"sid": sid, "target": ref_server.url}) + "\n")
    outside = _fake_registry(tmp_path / "outside", "elsewhere", dead, ["never-asked"])
    before = outside.read_bytes()
    bad = {
        "text-pid": _fake_registry(folder, "text-pid", {**dead, "pid": "12x"}, ["b1"]),
        "list-header": _fake_registry(folder, "list-header", [1, 2], ["b2"]),  # type: ignore[arg-type]
        "not-json": _fake_registry(folder, "not-json", {}, ["b3"]),
    }
    bad["not-json"].write_text("\x00garbage\n" + bad["not-json"].read_text())
    os.mkfifo(folder / "fifo.sessions")
    (folder / "link.sessions").symlink_to(outside)
    (folder / "dir.sessions").mkdir()
    assert main(["cleanup", str(state), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["deleted"] == 1 and report["failed"] == 0
    assert sid not in sessions(ref_server)
    assert not good.exists()
    skipped = {Path(p).name for p in report["skipped"]}
    assert skipped == {"text-pid.sessions", "list-header.sessions", "not-json.sessions", "fifo.sessions",
                       "link.sessions", "dir.sessions"}, report["skipped"]
    assert all(p.exists() for p in bad.values()) and outside.read_bytes() == before
    assert main(["cleanup", str(state)]) == 0
    err = capsys.readouterr().err
    assert "skipped" in err and "fifo.sessions" in err


def test_a_gone_loopback_server_costs_one_sweep_and_no_request(tmp_path) -> None:
    """A dead process's sessions on a loopback server that refuses connections (killed, or a test server on a random
    port): the first sweep drops them without a request, the file goes, later sweeps ask nothing, cleanup says 0."""
    from ors_trl.protocol.client import delete_orphans
    from ors_trl.testing.server import free_port

    folder = tmp_path / "state" / "sessions"
    url = f"http://127.0.0.1:{free_port()}"
    path = _fake_registry(folder, "gone", _dead_header(), [])
    path.write_text(json.dumps(_dead_header()) + "\n" +
                    "".join(json.dumps({"sid": f"s{i}", "target": url}) + "\n" for i in range(3)))
    with FaultProxy(None) as witness:  # a live loopback target in the same file: still asked
        path.write_text(path.read_text() + json.dumps({"sid": "w1", "target": witness.url}) + "\n")
        witness.add(Status(200), times=None)
        asked: list[tuple[str, int]] = []

        async def deleter(target: str, sids: list[str]) -> list[bool | None]:
            asked.append((target, len(sids)))
            return await delete_orphans(target, sids)

        result = asyncio.run(sweep(deleter, folder))
        assert (result.deleted, result.dropped, result.failed) == (1, 3, 0)
        assert witness.count("/delete") == 1 and witness.count() == 2  # /delete, /delete_session of w1 only
    assert not path.exists()
    asked.clear()
    assert asyncio.run(sweep(deleter, folder)).processes == 0 and asked == []
    assert main(["cleanup", str(tmp_path / "state")]) == 0


def test_a_client_whose_loopback_server_died_leaves_no_registry_entry(make_server, caplog) -> None:
    """The demo's own server stopped (Ctrl-C) before its client closed: the deletes are refused, and the sessions
    died with the server, so the registry forgets them (it kept them a day, and `cleanup` exited 1 meanwhile)."""
    from ors_trl import Client
    from ors_trl.protocol.registry import registry

    server = make_server("echo")
    c = Client(server.url, env_name=ECHO, retry=RetryPolicy(max_attempts=2, backoff_initial=0.01))
    sids = [c.open_session(split="train", index=i).sid for i in range(2)]
    reg = registry()
    assert reg is not None and set(sids) <= set(reg._open)
    server.kill()
    caplog.set_level(logging.WARNING, logger="ors_trl")
    c.close()
    assert not set(sids) & set(reg._open)
    assert not [r for r in caplog.records if "could not delete" in r.getMessage()]


def test_a_sweep_does_not_wait_for_itself(tmp_path, monkeypatch) -> None:
    """The clients a sweep deletes orphans with wait, when they close, for the process's sweeps: not for the sweep
    they run in (that cost every process with orphans the whole bound, 10 s, at exit)."""
    import ors_trl.protocol.registry as registry_module

    folder = tmp_path / "sessions"
    _fake_registry(folder, "gone", _dead_header(), ["s1"])
    monkeypatch.setattr(registry_module, "_registry", Registry(folder))

    async def deleter(target: str, sids: list[str]) -> list[bool | None]:
        await registry_module.sweeps_done(120)  # what a sweep's own AsyncClient does in aclose()
        return [True] * len(sids)

    async def run() -> None:
        registry_module.sweep_in_background(deleter)
        [task] = registry_module._sweeps
        await asyncio.wait_for(asyncio.shield(task), 60)  # bounds the test only: done at once when correct

    asyncio.run(run())
    assert list(folder.glob("*.sessions")) == []


# --------------------------------------------------------------------------------------------------
# 1c. Sessions never shared, never left behind, never waited on


class Gate(Fault):
    """Hold every request it answers until `open()` (bounded), then forward it: a `/delete` that does not answer."""

    name = "gate"

    def __init__(self) -> None:
        import threading

        self.event = threading.Event()

    def open(self) -> None:
        self.event.set()

    async def handle(self, ex: Any) -> None:
        await asyncio.to_thread(self.event.wait, START_S)
        await ex.forward()


def _prompt_word(text: str) -> str:
    return text.split('"')[1]


def test_a_session_id_handed_out_twice_is_never_shared(ref_server) -> None:
    """`/create_session` answers the id of a session that is open (here, in this process): the second rollout gets
    a fresh one, counted; each reads its own task's prompt."""
    from ors_trl import Client
    from ors_trl.testing.faults import SSEReply

    with FaultProxy(ref_server.url) as proxy, Client(proxy.url, env_name=ECHO, retry=RetryPolicy(max_attempts=2,
                                                                                                backoff_initial=0.01)) as c:
        proxy.add(SSEReply([("task_id", "twice-handed-out"), ("end", "")]), path="/create_session", times=2)
        first = c.open_session(split="train", index=0)
        second = c.open_session(split="train", index=1)
        assert first.sid == "twice-handed-out" and second.sid != first.sid
        assert c.async_client.duplicate_sessions == 1 and proxy.count("/create_session") == 3
        words = [_prompt_word(s.prompt()[0].text) for s in (first, second)]
        assert words == [c.task("train", i)["target"] for i in (0, 1)]
        first.close()
        second.close()
        # every id the server hands out is in use: a typed error after a bounded number of tries, nothing deleted
        third = c.open_session(split="train", index=0)
        proxy.add(SSEReply([("task_id", third.sid), ("end", "")]), path="/create_session", times=None)
        with pytest.raises(ProtocolError, match="already in use 3 times"):
            c.open_session(split="train", index=1)
        assert _prompt_word(third.prompt()[0].text) == c.task("train", 0)["target"]  # still its own, still open
        deletes = [r.headers.get("x-session-id") for r in proxy.requests if r.path.endswith("/delete")]
        assert third.sid not in deletes
        third.close()


def test_a_session_id_another_process_has_is_given_up_not_deleted(ref_server) -> None:
    """The server gives an id to this process that a session of another process (another client, target) has: its
    `/create` finds the session there at the first try. The id is dropped without a delete (which would end the
    other's session) and a fresh one asked for."""
    from ors_trl import Client
    from ors_trl.testing.faults import SSEReply

    with Client(ref_server.url, env_name=ECHO) as other, other.open_session(split="train", index=2) as theirs, \
            FaultProxy(ref_server.url) as proxy, Client(proxy.url, env_name=ECHO) as c:
        proxy.add(SSEReply([("task_id", theirs.sid), ("end", "")]), path="/create_session", times=1)
        with c.open_session(split="train", index=0) as mine:
            assert mine.sid != theirs.sid and c.async_client.duplicate_sessions == 1
            assert _prompt_word(mine.prompt()[0].text) == c.task("train", 0)["target"]
        assert _prompt_word(theirs.prompt()[0].text) == c.task("train", 2)["target"]  # the other's session lives
        deletes = [r.headers.get("x-session-id") for r in proxy.requests if r.path.endswith("/delete")]
        assert theirs.sid not in deletes and deletes == [mine.sid]


@pytest.mark.parametrize("recovers", [True, False])
def test_a_create_session_that_names_its_session_then_stalls_deletes_it(ref_server, recovers) -> None:
    """The answer names the session, then never ends: the attempt times out (typed when no retry recovers), and the
    session it named is deleted, since the server may have allocated it."""
    from ors_trl.protocol.registry import registry
    from ors_trl.testing.faults import SSEReply

    stalled = f"stalled-{recovers}"
    with FaultProxy(ref_server.url) as proxy:
        proxy.add(SSEReply([("task_id", stalled)], then="hang"), path="/create_session",
                  times=1 if recovers else None)

        async def run() -> None:
            async with AsyncClient(proxy.url, env_name=ECHO, timeouts=Timeouts(request=0.5),
                                    retry=RetryPolicy(max_attempts=2, backoff_initial=0.01)) as c:
                if recovers:
                    async with await c.open_session(split="train", index=0) as s:
                        assert s.sid != stalled
                else:
                    with pytest.raises(ORSTimeoutError, match="create_session"):
                        await c.open_session(split="train", index=0)

        asyncio.run(run())
        deleted = [r.headers.get("x-session-id") for r in proxy.requests if r.path == "/delete"]
        assert deleted.count(stalled) == 1
        reg = registry()
        assert reg is None or stalled not in reg._open  # the server has it gone: no orphan left


def test_a_delete_that_never_answers_holds_neither_environment_factory_nor_reset(make_server) -> None:
    """`/delete` held (a dead sandbox): `environment_factory` (its discovery probe) and `reset()` (under
    `max_sessions=1`, whose slot the closing session held) return while no delete has finished; the sessions stay
    in the orphan registry until the server has them gone; closing the spec waits for the deletes."""
    from ors_trl.protocol.registry import registry

    server = make_server("echo")
    gate = Gate()
    with FaultProxy(server.url) as proxy:
        proxy.add(gate, path="/delete", times=None)
        spec = OpenRewardSpec(proxy.url, num_tasks=3, max_sessions=1, timeouts=Timeouts(request=30.0),
                              retry=RetryPolicy(max_attempts=2, backoff_initial=0.01))
        rows = spec.train_dataset
        try:
            env = spec.environment_factory()
            prompts = [env.reset(**rows[i]) for i in range(3)]
            assert proxy.count("/delete_session") == 0  # no delete got past its held /delete, yet nothing waited
            assert [_prompt_word(p) for p in prompts] == [r["target"] for r in rows]
            held = {r.headers["x-session-id"] for r in proxy.requests if r.path == "/delete"}
            reg = registry()
            assert reg is not None and held and held <= set(reg._open)
        finally:
            gate.open()
        spec.close()
        assert not held & set(reg._open)
    assert server.stats()["open_sessions"] == 0


def test_closing_a_client_is_bounded_by_a_delete_that_never_answers(make_server, monkeypatch) -> None:
    """At exit a delete that never answers is given up after the bound; the session stays in the orphan registry,
    for the next sweep."""
    import ors_trl.protocol.pool as pool_module
    from ors_trl.protocol.registry import registry

    monkeypatch.setattr(pool_module, "OPENING_WAIT_S", 0.5)
    server = make_server("echo")
    gate = Gate()
    with FaultProxy(server.url) as proxy:
        proxy.add(gate, path="/delete", times=None)

        async def run() -> str:
            c = AsyncClient(proxy.url, env_name=ECHO, timeouts=Timeouts(request=60.0))
            s = await c.open_session(split="train", index=0)
            await c.aclose()  # bounded by OPENING_WAIT_S, not by the 60 s request deadline
            assert c.open_sessions == 0 and proxy.count("/delete_session") == 0
            return s.sid

        try:
            sid = asyncio.run(run())
            reg = registry()
            assert reg is not None and sid in reg._open
        finally:
            gate.open()
    reg.closed(sid)  # (the next sweep's part; this test's server goes with it)


# --------------------------------------------------------------------------------------------------
# 2. Paced creation


class Barrier(Fault):
    """Hold each request until `n` have arrived (bounded by `seconds`), then forward them all: they were in flight
    at once. `released` says whether the count was reached."""

    name = "barrier"

    def __init__(self, n: int, seconds: float) -> None:
        self.n, self.seconds, self.arrived, self.released = n, seconds, 0, False
        self._event: asyncio.Event | None = None

    async def handle(self, ex: Any) -> None:
        self._event = self._event or asyncio.Event()
        self.arrived += 1
        if self.arrived >= self.n:
            self.released = True
            self._event.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event.wait(), self.seconds)
        await ex.forward()


def _open_together(url: str, state: Path, holders: Any) -> list[Holder]:
    """Two processes that each open 4 sessions at once, told to go at the same moment (once both are ready)."""
    procs = [holders(url, 4, state, "--wait-go") for _ in range(2)]
    assert [p.read() for p in procs] == [{"ready": True}] * 2
    for p in procs:
        p.send("go")
    return [p.start() for p in procs]


def test_a_shared_pace_spreads_two_processes_opens_and_no_pace_opens_at_once(make_server, holders, tmp_path,
                                                                             monkeypatch) -> None:
    server = make_server("echo")
    with FaultProxy(server.url) as proxy:
        # Without a pace: both processes' 8 sessions are created at once (the barrier lets them through only then).
        barrier = Barrier(8, seconds=60)
        proxy.add(barrier, path="/create", times=None)
        monkeypatch.delenv("ORS_TRL_MAX_SESSION_RATE", raising=False)
        _open_together(proxy.url, tmp_path / "free", holders)
        assert barrier.released and barrier.arrived == 8
        proxy.clear()

        # With ORS_TRL_MAX_SESSION_RATE=4 in both: one budget, 4 opens per second across the two.
        monkeypatch.setenv("ORS_TRL_MAX_SESSION_RATE", "4")
        paced = _open_together(proxy.url, tmp_path / "paced", holders)
        created = sorted(r.at for r in proxy.requests if r.path == "/create_session")
    assert [len(p.sids) for p in paced] == [4, 4] and len(created) == 8
    # 8 opens at 4/s, burst 1: at least 1.75 s from the first to the last (a pace per process would take 0.75 s)
    assert created[-1] - created[0] >= 0.9 * 7 / 4
    wait_sessions(server, set())


def test_the_pace_schedule_burst_and_slow_down() -> None:
    clock = [100.0]
    pace = Pace(2.0, burst=3)
    pace._clock = lambda: clock[0]
    delays = [pace._update(pace._take)[0] for _ in range(5)]  # five opens asked for at t=100
    assert delays == [0.0, 0.0, 0.0, 0.5, 1.0]  # a burst of 3, then one every 1/rate
    pace.throttled()
    pace.throttled()  # a batch refused at once halves the pace once
    assert pace._state[1:3] == (2.0, 2.0)
    assert [pace._update(pace._take)[0] for _ in range(3)] == [0.0, 0.0, 1.0]  # a new schedule, at 1/s
    clock[0] += 1.5
    pace.throttled()  # one more interval later: halved again
    assert pace._state[1] == 4.0
    pace.eased()
    assert pace._state[1] == pytest.approx(3.2)
    for _ in range(20):
        clock[0] += 10
        pace.throttled()
    assert pace._state[1] == Pace.MAX_SLOWDOWN


def test_opens_already_waiting_slow_down_with_the_pace() -> None:
    """A 429 while opens wait for their moments: they take new ones, at the slower pace."""
    clock, slept = [100.0], []
    pace = Pace(2.0)

    async def sleep(seconds: float) -> None:
        if not slept:
            pace.throttled()  # the platform said 429 while the second open waited
        slept.append(seconds)
        clock[0] += seconds

    pace._clock, pace._sleep = (lambda: clock[0]), sleep

    async def opens() -> list[float]:
        moments = []
        for _ in range(3):
            await pace.wait()
            moments.append(clock[0])
        return moments

    assert asyncio.run(opens()) == [100.0, 101.0, 102.0]  # not 100.5, 101.0: one per second once slowed


def test_429_and_starting_slow_the_pace_down(ref_server, tmp_path, monkeypatch) -> None:
    fast = RetryPolicy(max_attempts=4, backoff_initial=0.01, backoff_max=0.02)
    monkeypatch.setenv("ORS_TRL_MAX_SESSION_RATE", "1000:4")  # the shared one too, in a lock file of the state dir
    monkeypatch.setenv("ORS_TRL_STATE_DIR", str(tmp_path))
    with FaultProxy(ref_server.url) as proxy:
        proxy.add(Status(429), path="/create_session", times=1)
        proxy.add(Status(503, headers={"X-Backend-State": "starting", "Retry-After": "0"}), path="/create_session",
                  times=1)

        async def run() -> Any:
            async with AsyncClient(proxy.url, env_name=ECHO, retry=fast, max_session_rate=1000.0) as client:
                await client.open_session(index=0)
                return client._pool.pace._state

        state = asyncio.run(run())
    assert state[1] == pytest.approx(4 * 0.8)  # halved twice, then a fifth back for the open that went through
    assert float((tmp_path / "session-pace.lock").read_text().split()[1]) == pytest.approx(3.2)
    assert (tmp_path / "session-pace.lock").stat().st_mode & 0o777 == 0o600


# --------------------------------------------------------------------------------------------------
# 3. Cost


def test_session_seconds_are_counted_logged_recorded_and_reported(make_server, tmp_path) -> None:
    from ors_trl import EvalReport, write_report

    log = tmp_path / "episodes.jsonl"
    spec = OpenRewardSpec(make_server("echo").url, env_name=ECHO, num_tasks=4, episode_log=str(log))
    rows = spec.train_dataset
    envs = [spec.environment_factory() for _ in range(4)]
    for env, row in zip(envs, rows, strict=True):
        env.reset(task_index=row["task_index"])
    for env, row in zip(envs[:2], list(rows)[:2], strict=True):  # two scored, two never call a tool (scored None)
        env.echo(text=row["target"])
    logged: dict[str, float] = {}
    rewards = spec.reward_funcs(environments=envs, completions=[[{"role": "assistant", "content": "x"}]] * 4,
                                log_metric=logged.__setitem__)
    assert rewards == [1.0, 1.0, None, None]
    assert logged[f"env/{ECHO}/sessions_opened"] == 4
    assert 0 < logged[f"env/{ECHO}/session_seconds_unscored"] < logged[f"env/{ECHO}/session_seconds"]
    spec.close()  # the rest of each session's life is counted in the next window
    rest = spec.metrics.flush()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    total = sum(r["timings"]["session"] for r in records)
    unscored = sum(r["timings"]["session"] for r in records if r["reward"] is None)
    assert logged[f"env/{ECHO}/session_seconds"] + rest[f"env/{ECHO}/session_seconds"] == pytest.approx(total, abs=1e-3)
    assert logged[f"env/{ECHO}/session_seconds_unscored"] + rest[f"env/{ECHO}/session_seconds_unscored"] == \
        pytest.approx(unscored, abs=1e-3)

    report = EvalReport.from_episodes(records, target="t", environment=ECHO, split="train", policy="p",
                                      num_resumed=0, seconds=1.0)
    assert (report.sessions_opened, report.session_seconds) == (4, pytest.approx(total, abs=1e-3))
    assert "session-seconds" in report.summary()
    write_report([str(log)], str(tmp_path / "report.html"))
    assert "session-seconds" in (tmp_path / "report.html").read_text()


# --------------------------------------------------------------------------------------------------
# 4. Session options: toolsets, env overrides, and the CLI


@pytest.fixture(scope="module")
def sandbox_server():
    with ReferenceServer([SandboxEnvironment, EchoEnvironment]) as server:
        yield server


def test_a_toolset_is_bound_and_runs_in_the_session(sandbox_server) -> None:
    spec = OpenRewardSpec(sandbox_server.url, env_name=SANDBOX, toolset="codex", discover_task_tools=False)
    assert [t.name for t in spec.tool_specs] == ["echo", "bash"]  # probed although discovery is off: only a
    env = spec.environment_factory()  # session shows a toolset's tools
    env.reset(task_index=0)
    assert "ran: ls" in env.bash(command="ls")
    spec.close()
    assert sandbox_server.stats()["open_sessions"] == 0


def test_a_refused_toolset_is_a_configuration_error_or_falls_back_once(sandbox_server, caplog) -> None:
    with pytest.raises(ConfigurationError, match=r"refused toolset 'codex' at session open: Toolset CodexToolset "
                                                 r"requires `env.sandbox`.*toolset_fallback=True"):
        _ = OpenRewardSpec(sandbox_server.url, env_name=ECHO, toolset="codex").environment_factory
    with pytest.raises(ConfigurationError, match="unknown toolset 'nope'; valid options are"):
        _ = OpenRewardSpec(sandbox_server.url, env_name=SANDBOX, toolset="nope").tool_specs
    assert sandbox_server.stats()["open_sessions"] == 0

    caplog.set_level(logging.WARNING, logger="ors_trl")
    spec = OpenRewardSpec(sandbox_server.url, env_name=ECHO, toolset="codex", toolset_fallback=True, num_tasks=3)
    envs = [spec.environment_factory() for _ in range(3)]
    for i, env in enumerate(envs):
        env.reset(task_index=i)
        env.echo(text="x")
    assert [t.name for t in spec.tool_specs] == ["echo"]
    assert sum("opening sessions without it" in r.getMessage() for r in caplog.records) == 1
    spec.close()
    assert sandbox_server.stats()["open_sessions"] == 0


def test_env_overrides_travel_with_the_session_masked(ref_server) -> None:
    key = "sk-test-override-9f8e7d"
    overrides = {"OPENAI_BASE_URL": "http://127.0.0.1:9/v1", "OPENAI_API_KEY": key}
    with FaultProxy(ref_server.url) as proxy:
        async def run(refuse: bool) -> None:
            if refuse:
                proxy.add(Status(400, f"OPENAI_API_KEY={key}: only the owner may set MY_VAR"), path="/create_session")
            async with AsyncClient(proxy.url, env_name=ECHO, env_overrides=overrides) as client:
                session = await client.open_session(index=0)
                assert await session.call("echo", {"text": "hello"})  # the reference server ignores them

        asyncio.run(run(False))
        sent = next(r for r in proxy.requests if r.path == "/create_session").json()
        assert sent == {"env": overrides}
        with pytest.raises(ConfigurationError, match="refused the session's env_overrides") as caught:
            asyncio.run(run(True))
    assert "OPENAI_API_KEY" in str(caught.value) and key not in str(caught.value)
    assert ref_server.stats()["open_sessions"] == 0


def test_cli_inspect_and_eval_take_a_toolset_and_a_tool_call_cap(sandbox_server, capsys) -> None:
    from tests.test_eval import FakeOpenAI

    assert main(["inspect", sandbox_server.url, "--env-name", SANDBOX, "--toolset", "codex", "--tasks", "0"]) == 0
    out = capsys.readouterr().out
    assert "with toolset 'codex'" in out and "bash(" in out
    assert main(["inspect", sandbox_server.url, "--env-name", SANDBOX, "--toolset", "nope"]) == 2
    assert "unknown toolset 'nope'" in capsys.readouterr().err

    model = FakeOpenAI().start()
    try:
        args = ["eval", sandbox_server.url, "--env-name", SANDBOX, "--base-url", model.url, "--model", "scripted",
                "--num-tasks", "2", "--no-progress", "--toolset", "codex"]
        assert main([*args, "--max-tool-calls", "0"]) == 0  # every call refused: nothing scored
        out = capsys.readouterr().out
        assert "bash" in {t["function"]["name"] for t in model.requests[0]["tools"]}
        assert "mean reward           n/a" in out and "tool failures / ep.   1.00" in out
        assert "session-seconds" in out and "2 sessions" in out
        assert main([*args, "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["mean_reward"] == 1.0 and data["sessions_opened"] == 2 and data["session_seconds"] > 0
    finally:
        model.stop()
    assert sandbox_server.stats()["open_sessions"] == 0


def test_cli_env_overrides_reach_the_server_masked_and_a_refused_toolset_falls_back(sandbox_server, capsys,
                                                                                    tmp_path) -> None:
    from tests.test_eval import FakeOpenAI

    key = "sk-cli-override-5c4b3a"
    overrides = {"OPENAI_API_KEY": key, "OPENAI_BASE_URL": "http://127.0.0.1:9/v1"}
    given = [a for k, v in overrides.items() for a in ("--env-override", f"{k}={v}")]
    output = tmp_path / "eval.jsonl"
    shown: list[str] = []  # everything the commands printed
    with FaultProxy(sandbox_server.url) as proxy:
        model = FakeOpenAI().start()
        try:  # the echo environment has no sandbox: the server refuses the codex toolset
            assert main(["eval", proxy.url, "--env-name", ECHO, "--base-url", model.url, "--model", "scripted",
                         "--num-tasks", "1", "--no-progress", "-v", "--output", str(output), "--toolset", "codex",
                         "--toolset-fallback", *given]) == 0
        finally:
            model.stop()
        captured = capsys.readouterr()
        shown += [captured.out, captured.err]
        assert "mean reward           1.0000" in captured.out
        assert captured.err.count("opening sessions without it (--toolset-fallback)") == 1  # the flag, on the CLI
        assert main(["inspect", proxy.url, "--env-name", ECHO, "--tasks", "0", "--toolset", "codex",
                     "--toolset-fallback", *given]) == 0
        captured = capsys.readouterr()
        shown += [captured.out, captured.err]
        assert "without toolset 'codex': the server refused it" in captured.out
        assert main(["inspect", proxy.url, "--env-name", ECHO, "--tasks", "0", "--json", *given]) == 0
        captured = capsys.readouterr()
        shown += [captured.out, captured.err]
        assert json.loads(captured.out)["env_overrides"] == sorted(overrides)
        opened = [r.json() for r in proxy.requests if r.path == "/create_session"]
        assert opened == [{"env": overrides}] * 4  # eval: its tool probe and its episode; inspect: a probe each
        toolsets = [(r.json() or {}).get("toolset_name") for r in proxy.requests if r.path.endswith("/create")]
        assert toolsets == ["codex", None, None, "codex", None, None]  # refused once each, then without it

        proxy.add(Status(400, f"OPENAI_API_KEY={key}: only the owner may set it"), path="/create_session")
        assert main(["inspect", proxy.url, "--env-name", ECHO, "--tasks", "0", *given]) == 2
        captured = capsys.readouterr()
        shown += [captured.out, captured.err]
        assert "refused the session's env_overrides (OPENAI_API_KEY, OPENAI_BASE_URL)" in captured.err
    shown.append(output.read_text())
    assert all(key not in text for text in shown)
    assert sandbox_server.stats()["open_sessions"] == 0

    base = ["inspect", sandbox_server.url, "--no-probe"]
    twice = [f"OPENAI_API_KEY={key}", "--env-override", "OPENAI_API_KEY=y"]
    for bad, said in (([key], "expected KEY=VALUE (no '='"), ([f"1{key}=x"], "KEY an environment variable name"),
                      (twice, "OPENAI_API_KEY is given twice")):
        assert main([*base, "--env-override", *bad]) == 2
        err = capsys.readouterr().err
        assert said in err and key not in err
    assert main([*base, "--toolset-fallback"]) == 2
    assert "--toolset-fallback needs --toolset" in capsys.readouterr().err
