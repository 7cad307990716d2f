"""Paced session creation across processes: when the server sees two processes' sessions created.

Two processes (`tests/fixtures/holder.py --wait-go`) each open `--sessions` sessions at once (one
`asyncio.gather`, as a GRPO step's batch pre-open does) through a `FaultProxy` in front of one reference
server; the proxy stamps every `/create_session` it receives. Configurations:

1. `none`: no pace (the batch opens at once: today's speed-up);
2. `own`: each process its own `max_session_rate=RATE` (two budgets: about 2 x RATE per second in all);
3. `shared`: `ORS_TRL_MAX_SESSION_RATE=RATE` in both (one budget in a lock file: RATE per second in all);
4. `shared+429`: the same, against a platform that takes RATE/2 creations per second: the proxy answers 429
   (`Retry-After: 2/RATE` s) to every `/create_session` that comes within 2/RATE s of the last one it let through.
   Each 429 halves the pace (once per interval, down to RATE/16), and each open that goes through gives a fifth of
   the slow-down back.

Reported per configuration: sessions created, the span from the first creation to the last, the rate seen
((n - 1) / span), the most creations the server saw within any 1 s and any 0.1 s, and the 429s it answered.

Run: `.venv/bin/python benchmarks/bench_pace.py [--sessions 16] [--rate 8] [--json]`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]
os.environ.setdefault("OPENREWARD_DISABLE_UPDATE_CHECK", "1")

from ors_trl.testing.faults import FaultProxy, Status  # noqa: E402
from tests.fixtures.environments import server as fixture_server  # noqa: E402


def most_within(times: list[float], window: float) -> int:
    return max((sum(1 for u in times if t <= u < t + window) for t in times), default=0)


def run(url: str, proxy: FaultProxy, n: int, env: dict[str, str], rate: float | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-pace-") as state:
        return _run(url, proxy, n, {**env, "ORS_TRL_STATE_DIR": state}, rate)


def _run(url: str, proxy: FaultProxy, n: int, env: dict[str, str], rate: float | None) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "tests.fixtures.holder", url, str(n), "--wait-go",
           *(["--rate", str(rate)] if rate else [])]
    procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
                              env={**os.environ, **env,
                                   "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")])})
             for _ in range(2)]
    try:
        for p in procs:
            assert p.stdout is not None and json.loads(p.stdout.readline()) == {"ready": True}
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        for p in procs:
            assert p.stdout is not None
            assert len(json.loads(p.stdout.readline())["sids"]) == n
            p.wait(120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    times = sorted(r.at for r in proxy.requests if r.path == "/create_session" and r.fault is None)
    span = times[-1] - times[0]
    refused = proxy.count("/create_session", fault="status")
    proxy.clear()
    return {"created": len(times), "span_s": round(span, 3), "rate_per_s": round((len(times) - 1) / span, 2)
            if span else None, "most_in_1s": most_within(times, 1.0), "most_in_100ms": most_within(times, 0.1),
            "answered_429": refused}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=16, help="sessions per process (default 16)")
    parser.add_argument("--rate", type=float, default=8.0, help="the pace, sessions per second (default 8)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    shared = {"ORS_TRL_MAX_SESSION_RATE": f"{args.rate:g}"}
    results = {}
    with fixture_server("echo") as server, FaultProxy(server.url) as proxy:
        for name, env, rate in (("none", {}, None), ("own", {}, args.rate), ("shared", shared, None),
                                ("shared+429", shared, None)):
            if name == "shared+429":  # the platform takes RATE / 2 creations per second, and says 429 to more
                def too_soon(seen: Any, gap: float = 2 / args.rate, last: list[float] = [0.0]) -> bool:  # noqa: B006
                    if seen.at - last[0] < gap:
                        return True
                    last[0] = seen.at
                    return False

                proxy.add(Status(429, headers={"Retry-After": f"{2 / args.rate:g}"}), path="/create_session",
                          times=None, when=too_soon)
            results[name] = run(proxy.url, proxy, args.sessions, env, rate)
        server.wait_for_stats(lambda s: s["open_sessions"] == 0, timeout=30)
    if args.json:
        print(json.dumps({"sessions_per_process": args.sessions, "rate": args.rate, "results": results}))
        return
    print(f"2 processes x {args.sessions} sessions opened at once; pace {args.rate:g}/s")
    print(f"{'configuration':<12} {'created':>7} {'span s':>7} {'rate/s':>7} {'max in 1 s':>10} {'max in 0.1 s':>12} "
          f"{'429s':>5}")
    for name, r in results.items():
        print(f"{name:<12} {r['created']:>7} {r['span_s']:>7} {r['rate_per_s']!s:>7} {r['most_in_1s']:>10} "
              f"{r['most_in_100ms']:>12} {r['answered_429']:>5}")


if __name__ == "__main__":
    main()
