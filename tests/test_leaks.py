"""No leaked sessions (issue 7), whatever happens, and a bounded-memory load run.

The only witness that counts is the server: ``stats()["open_sessions"]`` after the run, after an
error, after Ctrl-C, after the interpreter exited. Every test here uses a private server (or
compares with a baseline) so the count is exact.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from ors_trl import (
    AsyncClient,
    OpenRewardSpec,
    RetryPolicy,
    ToolFailedError,
    ToolRefusedError,
)
from ors_trl.testing.faults import DropStream, FaultProxy, Status

SRC = str(Path(__file__).resolve().parents[1] / "src")
FAST = RetryPolicy(max_attempts=2, backoff_initial=0.01, backoff_max=0.02)
#: Bound on any subprocess in this file (it only proves "not forever"; normal runs take a few seconds).
SUBPROCESS_LIMIT_S = 90


def settle(server, expected: int = 0, timeout: float = 10.0) -> int:
    """Wait (bounded) for the server's open-session count to reach `expected`; return the final count."""
    try:
        return server.wait_for_stats(lambda s: s["open_sessions"] == expected, timeout=timeout)["open_sessions"]
    except TimeoutError:
        return server.stats()["open_sessions"]


# --------------------------------------------------------------------------------------------------
# 12. In process: a training-like run, failures in the loop, discovery probes
# --------------------------------------------------------------------------------------------------


def test_a_training_like_run_leaves_no_session_behind(make_server) -> None:
    server = make_server("sparse")
    spec = OpenRewardSpec(server.url, num_tasks=4)
    rows = spec.train_dataset
    callback = spec.callbacks[0]
    envs = [spec.environment_factory() for _ in range(8)]
    peak = 0
    failures = 0
    for step in range(6):
        for i, env in enumerate(envs):  # 2 tasks x 4 generations per step, like GRPO
            row = rows[(2 * step + i // 4) % 4]
            env.reset(**row)
            env.calculator(expression=f"{row['a']} + {row['b']}")
            try:
                if i % 4 == 0:
                    env.calculator(expression="1 / 0")  # the tool raises
                elif i % 4 == 1:
                    env.submit(answer="not a number")  # refused
                else:
                    env.submit(answer=row["a"] + row["b"])
            except (ToolFailedError, ToolRefusedError):
                failures += 1
        peak = max(peak, server.stats()["open_sessions"])
        rewards = spec.reward_funcs(envs)
        assert rewards == [None, None, 1.0, 1.0] * 2
        callback.on_step_end(None, None, None)  # what GRPOTrainer(callbacks=spec.callbacks) does
    callback.on_train_end(None, None, None)
    assert failures == 6 * 4
    assert peak <= len(envs)  # replaced sessions were closed, not accumulated
    stats = server.stats()
    assert stats["open_sessions"] == 0
    assert stats["setups"] == stats["teardowns"] == 1 + 6 * 8  # discovery probe + rollouts, all torn down
    assert spec.client.open_sessions == 0


def test_failures_halfway_through_opening_leave_nothing_behind(make_server) -> None:
    server = make_server("echo")
    with FaultProxy(server.url) as proxy:
        spec = OpenRewardSpec(proxy.url, num_tasks=4, retry=RetryPolicy(max_attempts=1))
        rows = spec.train_dataset
        env = spec.environment_factory()
        created = server.stats()["setups"]
        # the server created the session, then its prompt failed: the half-open session is deleted
        proxy.add(Status(500, "prompt exploded"), path="/messages", times=1)
        assert "failed to start" in env.reset(**rows[0]) and "prompt exploded" in env.error
        # the server created the session but its answer to /create was lost on the way back
        proxy.add(DropStream(after_bytes=0), path="/create", times=1)
        assert "failed to start" in env.reset(**rows[1]) and "/create" in env.error
        assert server.stats()["setups"] == created + 2  # both sessions really existed on the server
        assert settle(server, 0) == 0
        env.reset(**rows[2])  # and the next rollout works
        assert env.echo(text="x") == "x"
        spec.close()
    assert settle(server, 0) == 0


def test_tool_discovery_sessions_are_closed_even_when_discovery_fails(make_server) -> None:
    server = make_server("tasktools")
    with FaultProxy(server.url) as proxy:
        proxy.add(Status(500, "task_tools exploded"), path="/task_tools", times=2)
        spec = OpenRewardSpec(proxy.url, indices=[0, 1, 2, 3])
        cls = spec.environment_factory  # two probes fail, two succeed
        names = {n for n in dir(cls) if n.startswith(("look", "open_"))}
        assert "look" in names and names & {"open_door", "open_window"}
        assert proxy.count("/create") == 4
    assert server.stats()["open_sessions"] == 0
    assert server.stats()["teardowns"] == 4


# --------------------------------------------------------------------------------------------------
# 12. Across process exit: normal exit, an uncaught exception, Ctrl-C while a tool call runs
# --------------------------------------------------------------------------------------------------

SCRIPT = textwrap.dedent('''
    import os, sys, time
    os.environ["OPENREWARD_DISABLE_UPDATE_CHECK"] = "1"
    import aiohttp
    from ors_trl import OpenRewardSpec

    # Every request opens a connection and resolves the host name afresh, as it does at the end of a real run
    # (aiohttp caches names for 10 s): resolving needs a thread pool, which a plain atexit hook can no longer use.
    _init = aiohttp.TCPConnector.__init__

    def _fresh(self, *args, **kwargs):
        kwargs.pop("keepalive_timeout", None)
        _init(self, *args, **{**kwargs, "use_dns_cache": False, "force_close": True})

    aiohttp.TCPConnector.__init__ = _fresh

    mode, url = sys.argv[1], sys.argv[2]
    probe = OpenRewardSpec(url, env_name="tasktoolsenvironment", indices=[0, 1, 2])
    probe.environment_factory  # discovery sessions only
    spec = OpenRewardSpec(url, env_name="slowenvironment", keepalive_interval=0.5)
    envs = [spec.environment_factory() for _ in range(6)]
    for i, env in enumerate(envs):
        env.reset(task_index=i // 3)  # the second reset of a task returns at once, its session opens in the background
    for env in envs[:3]:
        env.work(step=0)
    print("READY", flush=True)
    if mode == "raise":
        raise RuntimeError("the training loop crashed")
    if mode == "sigint":
        envs[0].sleep(seconds=60)  # Ctrl-C arrives while this waits
        print("NOT INTERRUPTED", flush=True)
    # mode == "exit": leave without closing anything
''')


@pytest.mark.parametrize("mode", ["exit", "raise", "sigint"])
def test_sessions_are_closed_when_the_process_ends(make_server, tmp_path, mode) -> None:
    server = make_server("slow,tasktools")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p)}
    # By host name, not IP: see the connector patch in SCRIPT.
    url = server.url.replace("127.0.0.1", "localhost")
    proc = subprocess.Popen([sys.executable, str(script), mode, url], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        ready = proc.stdout.readline()  # blocks until READY (or the script died)
        assert ready.strip() == "READY", proc.stderr.read() if proc.stderr else ""
        if mode == "sigint":
            server.wait_for_stats(lambda s: s["tool_calls"].get("slowenvironment/sleep", 0) == 1, timeout=20)
            assert server.stats()["open_sessions"] == 6
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=SUBPROCESS_LIMIT_S)
    finally:
        if proc.poll() is None:  # pragma: no cover - only if the bound above was hit
            proc.kill()
            proc.wait(10)
    assert "NOT INTERRUPTED" not in out
    if mode == "raise":
        assert proc.returncode != 0 and "the training loop crashed" in err
    if mode == "sigint":
        assert proc.returncode != 0 and "KeyboardInterrupt" in err
    if mode == "exit":
        assert proc.returncode == 0, err
    stats = server.stats()
    assert stats["open_sessions"] == 0, err
    assert stats["setups"] == stats["teardowns"] == 3 + 1 + 6  # discovery probes (3 + 1), 6 rollouts
    assert "could not delete" not in err


# --------------------------------------------------------------------------------------------------
# 13. Load: 1,000 concurrent sessions through one process
# --------------------------------------------------------------------------------------------------

SERVERS = 2
PER_SERVER = 500


def rss_kib() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")  # pragma: no cover


@pytest.mark.slow
def test_a_thousand_concurrent_sessions(make_server, record_property) -> None:
    t_start = time.perf_counter()
    servers: list = []
    lock = threading.Lock()

    def start() -> None:
        s = make_server("echo")
        with lock:
            servers.append(s)

    starters = [threading.Thread(target=start) for _ in range(SERVERS)]
    for t in starters:
        t.start()
    for t in starters:
        t.join(120)
    assert len(servers) == SERVERS
    t_servers = time.perf_counter()
    targets = ["hello", "world", "trl", "openreward"]

    async def run() -> dict[str, float]:
        clients = [AsyncClient(s.url, keepalive_interval=1.0) for s in servers]
        gates = [asyncio.Semaphore(64) for _ in servers]
        # warm up: resolve environments and open connections, so the baseline includes the fixed costs
        for c in clients:
            async with await c.open_session(split="train", index=0) as s:
                await s.call("echo", {"text": "hello"})
        base = rss_kib()

        async def rollout(k: int):
            c, gate = clients[k % SERVERS], gates[k % SERVERS]
            async with gate:
                session = await c.open_session(split="train", index=k % 4)
                result = await session.call("echo", {"text": targets[k % 4]})
            return session, result.reward

        t0 = time.perf_counter()
        opened = await asyncio.gather(*(rollout(k) for k in range(SERVERS * PER_SERVER)), return_exceptions=True)
        t_open = time.perf_counter() - t0
        errors = [r for r in opened if isinstance(r, BaseException)]
        assert not errors, f"{len(errors)} errors, first: {errors[0]!r}"
        assert [r for _, r in opened] == [1.0] * (SERVERS * PER_SERVER)
        peak = rss_kib()
        open_now = await asyncio.to_thread(lambda: [s.stats()["open_sessions"] for s in servers])


        def pings_now() -> int:
            return sum(s.stats()["pings"] for s in servers)

        # Hold all 1,000 open while keepalive pings them: at least 2 s, until every session could have been
        # pinged once (bounded: 30 s, so a keepalive that stopped working fails below instead of hanging).
        pings_before = await asyncio.to_thread(pings_now)
        t_hold = time.perf_counter()
        pings = 0
        def held() -> float:
            return time.perf_counter() - t_hold

        while (pings < SERVERS * PER_SERVER or held() < 2.0) and held() < 30:
            await asyncio.sleep(0.5)
            pings = await asyncio.to_thread(pings_now) - pings_before
        assert not [s for s, _ in opened if s.expired]
        t0 = time.perf_counter()
        await asyncio.gather(*(c.aclose() for c in clients))
        t_close = time.perf_counter() - t0
        return {"open_now": sum(open_now), "pings": pings, "rss_base_kib": base, "rss_peak_kib": peak,
                "t_open_s": t_open, "t_close_s": t_close}

    numbers = asyncio.run(run())
    assert numbers["open_now"] == SERVERS * PER_SERVER  # they really were open at once
    assert numbers["pings"] >= SERVERS * PER_SERVER  # keepalive covered every session at least once
    for s in servers:
        stats = s.stats()
        assert stats["open_sessions"] == 0
        assert stats["setups"] == stats["teardowns"] == PER_SERVER + 1
    per_session = (numbers["rss_peak_kib"] - numbers["rss_base_kib"]) / (SERVERS * PER_SERVER)
    numbers.update(per_session_kib=per_session, t_servers_s=t_servers - t_start,
                   t_total_s=time.perf_counter() - t_start)
    for key, value in numbers.items():
        record_property(key, value)
    print("\nload:", {k: round(v, 2) for k, v in numbers.items()})
    assert per_session < 256  # KiB of client memory per open session: bounded, no per-session buffers kept


# --------------------------------------------------------------------------------------------------
# Opens still in flight when the process ends
# --------------------------------------------------------------------------------------------------

CACHED_RESET = textwrap.dedent('''
    import os, sys
    os.environ["OPENREWARD_DISABLE_UPDATE_CHECK"] = "1"
    from ors_trl import OpenRewardSpec

    spec = OpenRewardSpec(sys.argv[1], num_tasks=1, discover_task_tools=False)
    first, second = spec.environment_factory(), spec.environment_factory()
    first.reset(task_index=0)           # waits for its session and caches the task's prompt
    print(second.reset(task_index=0))   # the cached prompt, at once: this session is still opening
    # and the script ends right here
''')


def test_an_open_in_flight_at_exit_is_closed(make_server, tmp_path) -> None:
    """A reset answered from the prompt cache returns while its session is still opening; the process exits at
    once. The exit hook waits for that open and deletes the session (it used to stay open, every time)."""
    server = make_server("slow", env={"ORS_TEST_SETUP_DELAY": "1.5"})
    script = tmp_path / "cached.py"
    script.write_text(CACHED_RESET)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, str(script), server.url], capture_output=True, text=True, env=env,
                          timeout=SUBPROCESS_LIMIT_S)
    assert proc.returncode == 0, proc.stderr
    assert "Call `work`" in proc.stdout  # the second reset was answered from the cache
    stats = server.stats()
    assert stats["setups"] == 2 and stats["open_sessions"] == 0, (stats, proc.stderr)
    assert stats["teardowns"] == 2


def test_ctrl_c_in_eval_while_sessions_are_opening(make_server, tmp_path) -> None:
    """`ors-trl eval` interrupted while its sessions are still opening (the environments are setting up):
    exit 130 and every session it created is deleted."""
    server = make_server("slow", env={"ORS_TEST_SETUP_DELAY": "3"})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, "-m", "ors_trl", "eval", server.url, "--base-url", "http://127.0.0.1:9/v1", "--model",
           "m", "--num-tasks", "4", "--concurrency", "4", "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        server.wait_for_stats(lambda s: s["in_flight"].get("slowenvironment/setup", 0) >= 4, timeout=30)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=SUBPROCESS_LIMIT_S)
    finally:
        if proc.poll() is None:  # pragma: no cover - only if the bound above was hit
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 130, err
    assert settle(server, 0) == 0, err
    stats = server.stats()
    assert stats["setups"] == stats["teardowns"] == 4 + 1  # the episodes, and the tool discovery probe
