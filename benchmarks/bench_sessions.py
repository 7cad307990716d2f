"""How many concurrent ORS sessions one process sustains, with keepalive on: ors-trl's AsyncClient on one event loop.

The reference server keeps every session in one process, so the sessions are spread over
`--servers` reference-server processes (echo environment) on different loopback ports, one
`AsyncClient` per server, all on this process's single event loop. The benchmark:

1. opens `--sessions` sessions (round-robin over the servers, at most `--open-concurrency` opens in
   flight) and reads each prompt;
2. holds them for `--hold` seconds with keepalive every `--keepalive` seconds (several ping rounds),
   while a ticker measures event-loop lag and the servers count the pings they receive;
3. makes one tool call in every session (proves each one is still alive and usable);
4. closes everything and checks that every server reports zero open sessions.

Reported: sessions held, open throughput, errors per phase, pings per session, event-loop lag,
client CPU while holding, and memory per session (growth of this process's RSS, from
/proc/self/status, divided by the sessions held).

Run: `.venv/bin/python benchmarks/bench_sessions.py [--sessions 1000] [--servers 4] [--hold 15] [--json]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]  # the package, and the suite's fixtures (tests.fixtures)
os.environ.setdefault("OPENREWARD_DISABLE_UPDATE_CHECK", "1")

from ors_trl.testing import ReferenceServer  # noqa: E402
from tests.fixtures.environments import server as fixture_server  # noqa: E402

ENV = "echoenvironment"


def rss_kib() -> int:
    """This process's resident set size (VmRSS), in KiB."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


async def _ticker(stop: asyncio.Event, lags: list[float], period: float = 0.1) -> None:
    """Event-loop lag: how late a `period`-second sleep wakes up."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        t0 = loop.time()
        await asyncio.sleep(period)
        lags.append(loop.time() - t0 - period)


async def run(urls: list[str], servers: list[ReferenceServer], args: argparse.Namespace) -> dict[str, Any]:
    from ors_trl import AsyncClient, Timeouts

    timeouts = Timeouts(connect=30.0, request=120.0)
    clients = [AsyncClient(url, env_name=ENV, keepalive_interval=args.keepalive, timeouts=timeouts) for url in urls]
    for c in clients:
        await c.num_tasks()  # resolve the environment, warm a connection
    pings_before = [s.stats()["pings"] for s in servers]
    rss0 = rss_kib()
    errors: dict[str, list[str]] = {"open": [], "call": [], "close": []}
    gate = asyncio.Semaphore(args.open_concurrency)

    async def open_one(i: int) -> Any:
        async with gate:
            try:
                s = await clients[i % len(clients)].open_session(split="train", index=i % 16)
                await s.prompt()
                return s
            except Exception as exc:
                errors["open"].append(f"{type(exc).__name__}: {exc}"[:200])
                return None

    t0 = time.perf_counter()
    opened = await asyncio.wait_for(
        asyncio.gather(*(open_one(i) for i in range(args.sessions))), timeout=args.phase_timeout
    )
    open_s = time.perf_counter() - t0
    sessions = [s for s in opened if s is not None]
    rss_open = rss_kib()
    on_server = [s.stats()["open_sessions"] for s in servers]

    # Hold: keepalive pings run on the clients' own timers; measure lag and CPU meanwhile.
    stop = asyncio.Event()
    lags: list[float] = []
    ticker = asyncio.create_task(_ticker(stop, lags))
    c0 = time.process_time()
    await asyncio.sleep(args.hold)
    hold_cpu = time.process_time() - c0
    stop.set()
    await ticker
    rss_hold = rss_kib()
    pings = sum(s.stats()["pings"] for s in servers) - sum(pings_before)
    alive_on_server = [s.stats()["open_sessions"] for s in servers]
    expired = sum(1 for s in sessions if s.expired)

    async def call_one(s: Any) -> None:
        async with gate:
            try:
                await s.call("echo", {"text": "still here"})
            except Exception as exc:
                errors["call"].append(f"{type(exc).__name__}: {exc}"[:200])

    t0 = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(call_one(s) for s in sessions)), timeout=args.phase_timeout)
    call_s = time.perf_counter() - t0

    async def close_client(c: Any) -> None:
        try:
            await c.aclose()
        except Exception as exc:
            errors["close"].append(f"{type(exc).__name__}: {exc}"[:200])

    t0 = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(close_client(c) for c in clients)), timeout=args.phase_timeout)
    close_s = time.perf_counter() - t0
    n = max(len(sessions), 1)
    lags.sort()
    return {
        "sessions_requested": args.sessions,
        "sessions_held": len(sessions),
        "servers": len(servers),
        "open_s": open_s,
        "opens_per_s": len(sessions) / open_s if open_s else 0.0,
        "open_sessions_on_servers_after_open": on_server,
        "open_sessions_on_servers_after_hold": alive_on_server,
        "expired_during_hold": expired,
        "hold_s": args.hold,
        "keepalive_s": args.keepalive,
        "pings": pings,
        "pings_per_session": pings / n,
        "loop_lag_p50_ms": lags[len(lags) // 2] * 1e3 if lags else 0.0,
        "loop_lag_max_ms": lags[-1] * 1e3 if lags else 0.0,
        "hold_cpu_s": hold_cpu,
        "hold_cpu_pct": 100.0 * hold_cpu / args.hold,
        "call_s": call_s,
        "close_s": close_s,
        "rss_before_mib": rss0 / 1024,
        "rss_open_mib": rss_open / 1024,
        "rss_after_hold_mib": rss_hold / 1024,
        "kib_per_session": (rss_open - rss0) / n,
        "kib_per_session_after_hold": (rss_hold - rss0) / n,
        "errors": {k: len(v) for k, v in errors.items()},
        "error_samples": {k: v[:3] for k, v in errors.items() if v},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=1000, help="sessions to hold at once (default 1000)")
    parser.add_argument("--servers", type=int, default=4, help="reference-server processes (default 4)")
    parser.add_argument("--hold", type=float, default=15.0, help="seconds to hold them (default 15)")
    parser.add_argument("--keepalive", type=float, default=2.0, help="keepalive_interval in seconds (default 2)")
    parser.add_argument("--open-concurrency", type=int, default=128, help="opens/calls in flight at once")
    parser.add_argument("--phase-timeout", type=float, default=300.0, help="bound on each phase, seconds")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args(argv)
    if args.sessions < 1 or args.servers < 1 or args.hold <= 0 or args.keepalive <= 0 or args.open_concurrency < 1:
        parser.error("--sessions, --servers, --open-concurrency must be >= 1; --hold and --keepalive > 0")

    servers: list[ReferenceServer] = []
    try:
        for _ in range(args.servers):
            servers.append(fixture_server("echo").start())
        result = asyncio.run(run([s.url for s in servers], servers, args))
        time.sleep(0.2)
        left = [s.stats()["open_sessions"] for s in servers]
    finally:
        for s in servers:
            s.close()
    result["open_sessions_left"] = left
    r = result
    errors = sum(r["errors"].values())
    print(
        f"concurrent sessions in one process: {r['sessions_held']}/{r['sessions_requested']} held over "
        f"{r['servers']} reference-server processes, one event loop, keepalive every {r['keepalive_s']:g} s"
    )
    print(
        f"  open + prompt:   {r['open_s']:.2f} s ({r['opens_per_s']:.0f} sessions/s); on the servers: "
        f"{sum(r['open_sessions_on_servers_after_open'])} {r['open_sessions_on_servers_after_open']}"
    )
    print(
        f"  hold {r['hold_s']:g} s:       {r['pings']} pings = {r['pings_per_session']:.1f} per session; "
        f"{sum(r['open_sessions_on_servers_after_hold'])} still open on the servers; "
        f"{r['expired_during_hold']} expired"
    )
    print(
        f"                   client CPU {r['hold_cpu_s']:.2f} s ({r['hold_cpu_pct']:.1f}% of one core); event-loop lag "
        f"p50 {r['loop_lag_p50_ms']:.1f} ms, max {r['loop_lag_max_ms']:.1f} ms"
    )
    print(f"  one tool call in every session: {r['call_s']:.2f} s; close all: {r['close_s']:.2f} s")
    print(
        f"  memory: RSS {r['rss_before_mib']:.1f} MiB before, {r['rss_open_mib']:.1f} MiB with the sessions open, "
        f"{r['rss_after_hold_mib']:.1f} MiB after the hold: {r['kib_per_session']:.1f} KiB per session "
        f"({r['kib_per_session_after_hold']:.1f} KiB after the hold)"
    )
    print(f"  errors: {r['errors']}" + (f" e.g. {r['error_samples']}" if errors else ""))
    print(f"  sessions left open on the servers after close: {sum(left)} {left}")
    ok = (
        r["sessions_held"] == r["sessions_requested"]
        and not errors
        and sum(left) == 0
        and sum(r["open_sessions_on_servers_after_hold"]) == r["sessions_held"]
        and r["expired_during_hold"] == 0
    )
    print(f"  result: {'all sessions held, used and closed' if ok else 'PROBLEMS (see above)'}")
    if args.json:
        print(json.dumps(r))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
