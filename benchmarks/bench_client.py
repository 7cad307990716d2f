"""Client latency and CPU per operation: ors-trl vs the openreward SDK vs a bare keep-alive aiohttp loop (the floor).

One reference-server process (echo environment) on loopback. Each client runs the same sequence,
one operation at a time: open a session and read its prompt, one tool call, close. Clients:

    floor        one aiohttp keep-alive session on an asyncio loop, minimal parsing: the protocol and nothing else
    ours-async   ors_trl.AsyncClient on the caller's loop (what the rollout engine uses)
    ours-sync    ors_trl.Client, driven through the background loop (what environment_factory adapters use)
    sdk          openreward.OpenReward (sync), what trl.experimental.openreward uses

The clients take turns in `--rounds` interleaved rounds (so load from elsewhere on the machine hits
all of them alike), after a warm-up. Reported per operation: median and p90 latency, and client
CPU (this process's `time.process_time()`, all threads, mean per operation). Ratios and targets:

    latency  ours / floor   <= 1.3
    latency  ours / SDK     <= 0.6
    (CPU ratios are printed next to them)

Run: `.venv/bin/python benchmarks/bench_client.py [--iterations 600] [--rounds 6] [--json]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]  # the package, and the suite's fixtures (tests.fixtures)
os.environ.setdefault("OPENREWARD_DISABLE_UPDATE_CHECK", "1")

from tests.fixtures.environments import server as fixture_server  # noqa: E402

OPS = ("open+prompt", "tool call", "close")
CLIENTS = ("floor", "ours-async", "ours-sync", "sdk")
ENV = "echoenvironment"
TARGET_FLOOR = 1.3
TARGET_SDK = 0.6


_CONNECTIONS = [0]


def count_new_connections() -> None:
    """Count the TCP connections aiohttp opens in this process (floor, ours and the SDK all use aiohttp).

    A keep-alive client opens a handful and then reuses them; one that opens a connection per
    operation pays a TCP handshake (and the server's accept) every time. Wraps the connector method
    in this process only; behaviour is unchanged.
    """
    import aiohttp

    inner = aiohttp.TCPConnector._create_connection
    if getattr(inner, "_counted", False):
        return

    async def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        _CONNECTIONS[0] += 1
        return await inner(self, *args, **kwargs)

    counted._counted = True  # type: ignore[attr-defined]
    aiohttp.TCPConnector._create_connection = counted  # type: ignore[method-assign]


class Timer:
    """Collects wall and process-CPU time per operation, and new TCP connections per sequence."""

    def __init__(self) -> None:
        self.wall: dict[str, list[float]] = {op: [] for op in OPS}
        self.cpu: dict[str, list[float]] = {op: [] for op in OPS}
        self.connections = 0
        self.sequences = 0

    def measure(self, op: str, fn: Callable[[], Any]) -> Any:
        c0, t0 = time.process_time(), time.perf_counter()
        out = fn()
        self.wall[op].append(time.perf_counter() - t0)
        self.cpu[op].append(time.process_time() - c0)
        return out

    async def ameasure(self, op: str, coro: Any) -> Any:
        c0, t0 = time.process_time(), time.perf_counter()
        out = await coro
        self.wall[op].append(time.perf_counter() - t0)
        self.cpu[op].append(time.process_time() - c0)
        return out

    def summary(self) -> dict[str, dict[str, float]]:
        out = {}
        for op in OPS:
            wall = sorted(self.wall[op])
            out[op] = {
                "n": len(wall),
                "median_ms": statistics.median(wall) * 1e3,
                "p90_ms": wall[int(0.9 * (len(wall) - 1))] * 1e3,
                "cpu_ms": statistics.fmean(self.cpu[op]) * 1e3,
            }
        out["connections_per_100"] = 100.0 * self.connections / max(self.sequences, 1)  # type: ignore[assignment]
        return out


# -- the clients: each is an object with run(n, timer) (sync) and close() --------------------------------------------


class Floor:
    """The protocol with nothing else: one keep-alive aiohttp session, minimal parsing."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.loop = asyncio.new_event_loop()
        self.http: Any = None
        self.i = 0

    async def _start(self) -> None:
        import aiohttp

        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        async with self.http.get(self.url + "/health") as r:
            await r.read()

    async def _open_prompt(self, i: int) -> str:
        http, url = self.http, self.url
        async with http.post(url + "/create_session", data=b"{}") as r:
            body = await r.text()
        sid = body.split("data: ", 1)[1].split("\r\n", 1)[0].split("\n", 1)[0].strip()
        h = {"X-Session-ID": sid, "Content-Type": "application/json"}
        payload = json.dumps({"split": "train", "index": i % 16, "env_name": ENV})
        async with http.post(url + "/create", data=payload, headers=h) as r:
            await r.read()
        async with http.get(f"{url}/{ENV}/prompt", headers=h) as r:
            await r.json()
        return sid

    async def _call(self, sid: str) -> None:
        h = {"X-Session-ID": sid, "Content-Type": "application/json"}
        async with self.http.post(
            f"{self.url}/{ENV}/call", data=b'{"name":"echo","input":{"text":"nope"}}', headers=h
        ) as r:
            await r.read()

    async def _close(self, sid: str) -> None:
        h = {"X-Session-ID": sid}
        async with self.http.post(self.url + "/delete", headers=h) as r:
            await r.read()
        async with self.http.post(self.url + "/delete_session", headers=h) as r:
            await r.read()

    async def _run(self, n: int, timer: Timer) -> None:
        if self.http is None:
            await self._start()
        for _ in range(n):
            self.i += 1
            sid = await timer.ameasure("open+prompt", self._open_prompt(self.i))
            await timer.ameasure("tool call", self._call(sid))
            await timer.ameasure("close", self._close(sid))

    def run(self, n: int, timer: Timer) -> None:
        self.loop.run_until_complete(self._run(n, timer))

    def close(self) -> None:
        if self.http is not None:
            self.loop.run_until_complete(self.http.close())
        self.loop.close()


class OursAsync:
    def __init__(self, url: str) -> None:
        from ors_trl import AsyncClient

        self.loop = asyncio.new_event_loop()
        self.client = AsyncClient(url, env_name=ENV, keepalive_interval=None)
        self.i = 0

    async def _run(self, n: int, timer: Timer) -> None:
        client = self.client
        await client.num_tasks()  # resolves the environment once, warms the pool
        for _ in range(n):
            self.i += 1
            s = await timer.ameasure("open+prompt", self._open_prompt(self.i))
            await timer.ameasure("tool call", s.call("echo", {"text": "nope"}))
            await timer.ameasure("close", s.close())

    async def _open_prompt(self, i: int) -> Any:
        s = await self.client.open_session(split="train", index=i % 16)
        await s.prompt()
        return s

    def run(self, n: int, timer: Timer) -> None:
        self.loop.run_until_complete(self._run(n, timer))

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
        self.loop.close()


class OursSync:
    def __init__(self, url: str) -> None:
        from ors_trl import Client

        self.client = Client(url, env_name=ENV, keepalive_interval=None)
        self.client.num_tasks()
        self.i = 0

    def _open_prompt(self, i: int) -> Any:
        s = self.client.open_session(split="train", index=i % 16)
        s.prompt()
        return s

    def run(self, n: int, timer: Timer) -> None:
        for _ in range(n):
            self.i += 1
            s = timer.measure("open+prompt", lambda: self._open_prompt(self.i))
            timer.measure("tool call", lambda s=s: s.call("echo", {"text": "nope"}))
            timer.measure("close", s.close)

    def close(self) -> None:
        self.client.close()


class SDK:
    def __init__(self, url: str) -> None:
        # For a loopback URL the SDK would look up sessions.127.0.0.1: point both of its hosts at the server.
        os.environ["OPENREWARD_API_URL"] = url
        os.environ["OPENREWARD_SESSION_URL"] = url
        from openreward import OpenReward

        self.env = OpenReward(api_key="unused", base_url=url).environments.get(ENV)
        self.env.num_tasks("train")
        self.i = 0

    def run(self, n: int, timer: Timer) -> None:
        for _ in range(n):
            self.i += 1
            cm = self.env.session(split="train", index=self.i % 16)

            def open_prompt(cm: Any = cm) -> Any:
                sess = cm.__enter__()
                sess.get_prompt()
                return sess

            sess = timer.measure("open+prompt", open_prompt)
            timer.measure("tool call", lambda sess=sess: sess.call_tool("echo", {"text": "nope"}))
            timer.measure("close", lambda cm=cm: cm.__exit__(None, None, None))

    def close(self) -> None:
        pass


FACTORIES: dict[str, Callable[[str], Any]] = {
    "floor": Floor,
    "ours-async": OursAsync,
    "ours-sync": OursSync,
    "sdk": SDK,
}


def _verdict(ok: bool) -> str:
    return "MET" if ok else "NOT MET"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=600, help="measured sequences per client (default 600)")
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds the iterations are split into")
    parser.add_argument("--warmup", type=int, default=20, help="unmeasured sequences per client first")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args(argv)
    if args.iterations < 1 or args.rounds < 1:
        parser.error("--iterations and --rounds must be >= 1")
    per_round = [args.iterations // args.rounds + (i < args.iterations % args.rounds) for i in range(args.rounds)]
    timers = {name: Timer() for name in CLIENTS}
    count_new_connections()
    with fixture_server("echo") as server:
        clients = {name: FACTORIES[name](server.url) for name in CLIENTS}
        try:
            for client in clients.values():
                client.run(args.warmup, Timer())  # imports, connections, server caches
            for n in per_round:
                for name, client in clients.items():
                    before = _CONNECTIONS[0]
                    client.run(n, timers[name])
                    timers[name].connections += _CONNECTIONS[0] - before
                    timers[name].sequences += n
        finally:
            for client in clients.values():
                client.close()
        time.sleep(0.2)
        leftover = server.stats()["open_sessions"]

    results = {name: timers[name].summary() for name in CLIENTS}
    print(
        f"client latency and CPU per operation: {args.iterations} sequences per client in {args.rounds} interleaved "
        f"rounds, one reference-server process (echo) on loopback"
    )
    head = f"{'operation':<12} {'client':<11} {'median ms':>10} {'p90 ms':>8} {'cpu ms':>7}"
    print(head)
    print("-" * len(head))
    for op in OPS:
        for name in CLIENTS:
            r = results[name][op]
            print(f"{op:<12} {name:<11} {r['median_ms']:10.3f} {r['p90_ms']:8.3f} {r['cpu_ms']:7.3f}")
    print()
    print("ratios (latency: medians; cpu: means)")
    head = (
        f"{'operation':<12} {'ours':<11} {'lat/floor':>9} {'lat/sdk':>8} {'cpu/floor':>9} {'cpu/sdk':>8}   "
        f"targets: lat/floor <= {TARGET_FLOOR}, lat/sdk <= {TARGET_SDK}"
    )
    print(head)
    ratios: dict[str, dict[str, dict[str, float]]] = {}
    for op in OPS:
        f, s = results["floor"][op], results["sdk"][op]
        for name in ("ours-async", "ours-sync"):
            o = results[name][op]
            r = {
                "latency_over_floor": o["median_ms"] / f["median_ms"],
                "latency_over_sdk": o["median_ms"] / s["median_ms"],
                "cpu_over_floor": o["cpu_ms"] / f["cpu_ms"],
                "cpu_over_sdk": o["cpu_ms"] / s["cpu_ms"],
            }
            ratios.setdefault(op, {})[name] = r
            ok_f, ok_s = r["latency_over_floor"] <= TARGET_FLOOR, r["latency_over_sdk"] <= TARGET_SDK
            print(
                f"{op:<12} {name:<11} {r['latency_over_floor']:9.2f} {r['latency_over_sdk']:8.2f}"
                f" {r['cpu_over_floor']:9.2f} {r['cpu_over_sdk']:8.2f}   floor {_verdict(ok_f)}, sdk {_verdict(ok_s)}"
            )
    print()
    print(
        "new TCP connections per 100 sequences (open+prompt, tool call, close): "
        + ", ".join(f"{name} {results[name]['connections_per_100']:.0f}" for name in CLIENTS)
    )
    print(f"sessions left open on the server: {leftover}")
    if args.json:
        print(
            json.dumps(
                {
                    "iterations": args.iterations,
                    "rounds": args.rounds,
                    "results": results,
                    "ratios": ratios,
                    "targets": {"latency_over_floor": TARGET_FLOOR, "latency_over_sdk": TARGET_SDK},
                    "open_sessions_left": leftover,
                }
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
