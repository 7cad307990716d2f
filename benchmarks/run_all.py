"""Run every benchmark, one after another, each in its own process; print their output and a summary of the targets.

Defaults are small so that `make bench` finishes in a few minutes:

    bench_client.py    --iterations 300
    bench_rollouts.py  --quick            (16 rollouts x 2 turns; the headline is 64 x 4: pass --full;
                                           --rollouts-workload heavy: the heavy-tailed workload instead)
    bench_sessions.py  --sessions 1000 --hold 15
    bench_pace.py      --sessions 16 --rate 8  (two processes; about 30 s)

`--full` runs the headline sizes (bench_client 600 iterations, bench_rollouts 64 x 4 with 0.5 s
setup / 0.2 s latency, ~4 minutes on its own). Sizes can also be set one by one. No target is
asserted: missing one is reported, not failed; the exit status is non-zero only when a benchmark
crashed or found a correctness problem (unscored rollouts, leaked sessions, errors).

Run: `.venv/bin/python benchmarks/run_all.py [--full] [--only client,rollouts,sessions,pace] [--json]`
(or `make bench ARGS="--full"`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BENCHES = ("client", "rollouts", "sessions", "pace")


def commands(args: argparse.Namespace) -> dict[str, list[str]]:
    client = ["--iterations", str(args.iterations or (600 if args.full else 300))]
    rollouts: list[str] = [] if args.full else ["--quick"]
    if args.rollouts:
        rollouts += ["--rollouts", str(args.rollouts)]
    if args.turns:
        rollouts += ["--turns", str(args.turns)]
    if args.rollouts_workload != "uniform":
        rollouts += ["--workload", args.rollouts_workload]
    sessions = ["--sessions", str(args.sessions), "--servers", str(args.servers), "--hold", str(args.hold)]
    pace = ["--sessions", str(args.pace_sessions), "--rate", f"{args.pace_rate:g}"]
    return {"client": client, "rollouts": rollouts, "sessions": sessions, "pace": pace}


def run_one(name: str, extra: list[str], timeout: float) -> tuple[int, dict[str, Any] | None, float]:
    cmd = [sys.executable, str(HERE / f"bench_{name}.py"), *extra, "--json"]
    print(f"\n=== {' '.join(['benchmarks/' + Path(cmd[1]).name, *cmd[2:]])}", flush=True)
    t0 = time.perf_counter()
    lines: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, bufsize=1) as proc:
        assert proc.stdout is not None
        try:
            deadline = t0 + timeout
            for line in proc.stdout:
                lines.append(line)
                if not line.startswith("{"):
                    print(line, end="", flush=True)
                if time.perf_counter() > deadline:
                    raise subprocess.TimeoutExpired(cmd, timeout)
            proc.wait(timeout=max(deadline - time.perf_counter(), 1.0))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            print(f"--- {name}: timed out after {timeout:.0f} s", flush=True)
            return 124, None, time.perf_counter() - t0
    summary = None
    for line in reversed(lines):
        if line.startswith("{"):
            summary = json.loads(line)
            break
    return proc.returncode, summary, time.perf_counter() - t0


def _mark(ok: bool) -> str:
    return "met" if ok else "NOT met"


def targets(results: dict[str, dict[str, Any]]) -> list[str]:
    out = []
    client = results.get("client", {}).get("summary")
    if client:
        tf, ts = client["targets"]["latency_over_floor"], client["targets"]["latency_over_sdk"]
        for name in ("ours-sync", "ours-async"):
            r = client["ratios"]["tool call"][name]
            out.append(
                f"client, tool call, {name}: latency {r['latency_over_floor']:.2f}x floor "
                f"({_mark(r['latency_over_floor'] <= tf)}: <= {tf}), {r['latency_over_sdk']:.2f}x SDK "
                f"({_mark(r['latency_over_sdk'] <= ts)}: <= {ts}); CPU {r['cpu_over_floor']:.2f}x floor, "
                f"{r['cpu_over_sdk']:.2f}x SDK"
            )
    roll = results.get("rollouts", {}).get("summary")
    if roll and roll.get("workload") == "heavy" and "ratios" in roll:
        c, r, t = roll["config"], roll["ratios"], roll["targets"]
        size = f"{c['rollouts']}x{c['turns']} heavy"
        if "engine_over_critical_path" in r:
            out.append(
                f"rollouts {size}, barrier-free engine / critical-path limit: {r['engine_over_critical_path']:.2f}x "
                f"({_mark(r['engine_over_critical_path'] <= t['engine_over_critical_path'])}: <= "
                f"{t['engine_over_critical_path']:g}x)"
            )
        if "sync_over_engine" in r:
            headline = (c["rollouts"], c["turns"]) == (64, 4)
            verdict = _mark(r["sync_over_engine"] >= t["sync_over_engine"]) if headline else "n/a"
            out.append(
                f"rollouts {size}, turn-synchronous engine / barrier-free engine: {r['sync_over_engine']:.2f}x "
                f"({verdict}: >= {t['sync_over_engine']:g}x, stated for 64x4: run --full)"
            )
        if "trl_over_engine" in r:
            out.append(f"rollouts {size}, TRL's module / barrier-free engine: {r['trl_over_engine']:.1f}x (no target)")
    elif roll and "ratios" in roll:
        c, r, t = roll["config"], roll["ratios"], roll["targets"]
        size = f"{c['rollouts']}x{c['turns']}"
        if "resets_trl_over_env_cold" in r:
            out.append(
                f"rollouts {size}, resets TRL/ours-env: cold {r['resets_trl_over_env_cold']:.1f}x "
                f"({_mark(r['resets_trl_over_env_cold'] >= t['resets_trl_over_env'])}: >= "
                f"{t['resets_trl_over_env']:g}x)"
                + (
                    f", warm {r['resets_trl_over_env_warm']:.0f}x "
                    f"({_mark(r['resets_trl_over_env_warm'] >= t['resets_trl_over_env'])})"
                    if "resets_trl_over_env_warm" in r
                    else ""
                )
            )
        if "step_trl_over_engine" in r:
            headline = (c["rollouts"], c["turns"], c["setup_delay"], c["tool_latency"]) == (64, 4, 0.5, 0.2)
            verdict = _mark(r["step_trl_over_engine"] >= t["step_trl_over_engine"]) if headline else "n/a"
            out.append(
                f"rollouts {size}, step TRL/engine: {r['step_trl_over_engine']:.1f}x ({verdict}: >= "
                f"{t['step_trl_over_engine']:g}x, stated for 64x4 with 0.5 s setup / 0.2 s latency: run --full)"
            )
        if "engine_over_floor" in r:
            out.append(f"rollouts {size}, engine / raw-aiohttp floor: {r['engine_over_floor']:.2f}x")
        if "step_trl_over_env" in r:
            out.append(f"rollouts {size}, step TRL/ours-env: {r['step_trl_over_env']:.1f}x (no target)")
    sess = results.get("sessions", {}).get("summary")
    if sess:
        out.append(
            f"sessions: {sess['sessions_held']}/{sess['sessions_requested']} held "
            f"({_mark(sess['sessions_held'] >= 1000)}: 1000), {sess['kib_per_session']:.1f} KiB each, "
            f"{sum(sess['errors'].values())} errors, {sum(sess['open_sessions_left'])} left open"
        )
    pace = results.get("pace", {}).get("summary")
    if pace:
        r, rate = pace["results"], pace["rate"]
        seen = ", ".join(f"{name} {res['rate_per_s']}/s" for name, res in r.items())
        most = r["shared"]["most_in_1s"]
        out.append(f"pace, 2 processes x {pace['sessions_per_process']} opens at {rate:g}/s: the server saw {seen}; "
                   f"shared pace, most in any 1 s: {most} ({_mark(most <= int(rate) + 1)}: <= {int(rate) + 1})")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="headline sizes (bench_rollouts 64 x 4)")
    parser.add_argument("--only", default=",".join(BENCHES),
                        help="comma-separated subset of client,rollouts,sessions,pace")
    parser.add_argument("--iterations", type=int, default=None, help="bench_client iterations")
    parser.add_argument("--rollouts", type=int, default=None, help="bench_rollouts rollouts per batch")
    parser.add_argument("--turns", type=int, default=None, help="bench_rollouts turns per rollout")
    parser.add_argument("--rollouts-workload", choices=("uniform", "heavy"), default="uniform",
                        help="bench_rollouts --workload (default uniform)")
    parser.add_argument("--sessions", type=int, default=1000, help="bench_sessions sessions (default 1000)")
    parser.add_argument("--servers", type=int, default=4, help="bench_sessions server processes (default 4)")
    parser.add_argument("--hold", type=float, default=15.0, help="bench_sessions hold seconds (default 15)")
    parser.add_argument("--pace-sessions", type=int, default=16, help="bench_pace sessions per process (default 16)")
    parser.add_argument("--pace-rate", type=float, default=8.0, help="bench_pace pace, sessions per second (default 8)")
    parser.add_argument("--timeout", type=float, default=1200.0, help="per-benchmark time limit, seconds")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args(argv)
    only = [b.strip() for b in args.only.split(",") if b.strip()]
    if not set(only) <= set(BENCHES):
        parser.error(f"--only: choose from {','.join(BENCHES)}")
    cmds = commands(args)
    results: dict[str, dict[str, Any]] = {}
    for name in BENCHES:
        if name in only:
            rc, summary, seconds = run_one(name, cmds[name], args.timeout)
            results[name] = {"returncode": rc, "seconds": seconds, "summary": summary}
    print("\n=== summary")
    for name, res in results.items():
        state = "ok" if res["returncode"] == 0 else f"FAILED (exit {res['returncode']})"
        print(f"  bench_{name}: {state}, {res['seconds']:.0f} s")
    for line in targets(results):
        print(f"  {line}")
    if args.json:
        print(json.dumps(results))
    return 0 if all(res["returncode"] == 0 for res in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
