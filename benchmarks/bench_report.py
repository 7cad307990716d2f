"""`ors-trl report` on a large log: build time and page size for 100,000 episodes.

Generates synthetic but realistic episode records (the shape `Episode.record()` writes: version 2,
turns of tool calls with arguments, outputs, rewards, timings and failures; three environments, one
with a terminal tool; eight runs split over four files, as several training processes write them)
and a trainer_state.json with 500 logged steps of `env/<name>/...` metrics, then times
`write_report` over all of it (the records are streamed; only the sample of episode bodies is kept).
Generation is not timed. Targets (printed beside the figures, not asserted):

    build time   <= 30 s   (on a 2-core machine)
    page size    <= 20 MB

Run: `.venv/bin/python benchmarks/bench_report.py [--episodes 100000] [--max-episodes 2000] [--json]`.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]  # the package, and the suite's fixtures (tests.fixtures)

from ors_trl import write_report  # noqa: E402
from ors_trl.protocol.text import cut  # noqa: E402
from ors_trl.report.tally import DEFAULT_MAX_EPISODES  # noqa: E402

TARGET_SECONDS = 30.0
TARGET_MB = 20.0
ENVIRONMENTS = ("echo", "math", "research")
RUNS = [f"node{n}-{4000 + n}-1767225600" for n in range(8)]
WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu", "nu",
         "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon", "phi", "chi", "psi", "omega")
FAILURES = (("refused", "input_validation", "tool {t!r} was refused (input_validation): 1 validation error for "
             "Input\nanswer\n  Input should be a valid integer [type=int_parsing, input_value='x', input_type=str]"),
            ("failed", None, "tool {t!r} failed: cannot evaluate 'import os': invalid syntax (<unknown>, line 1)"),
            ("refused", "not_found", "Tool {t} not found."),
            ("expired", None, "session expired: the server no longer has session 7f3c... (reaped after idle)"),
            ("timeout", None, "tool call {t!r} timed out after 60.0 s"),
            ("transport", None, "connection reset by peer while streaming {t!r}"))


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def episode(rng: random.Random, n: int) -> dict[str, Any]:
    """One record, as `Episode.record()` writes it (outputs clipped as the episode log's max_text does)."""
    env = rng.choices(ENVIRONMENTS, weights=(5, 3, 2))[0]
    index = rng.randrange(400 if env != "research" else 120)
    prompt = f"Task {index}: " + text(rng, rng.randint(40, 140))
    turns, rewards, calls, failures, reward, finished, final = [], [], 0, 0, None, False, None
    seconds_total = 0.0
    for t in range(rng.choice((1, 1, 2, 3, 4))):
        turn: dict[str, Any] = {"index": t, "assistant": text(rng, rng.randint(5, 60)), "tool_calls": [],
                                "generation_seconds": round(rng.uniform(0.2, 3.0), 4)}
        for k in range(rng.choice((0, 1, 1, 1, 2))):
            name = {"echo": "echo", "math": rng.choice(("calculator", "submit")), "research": "search"}[env]
            args = {"text": text(rng, 2)} if name in ("echo", "search") else (
                {"expression": f"{rng.randrange(99)}+{rng.randrange(99)}"} if name == "calculator"
                else {"answer": rng.randrange(200)})
            seconds = round(rng.lognormvariate(-3.5, 0.8), 4)
            seconds_total += seconds
            entry: dict[str, Any] = {"id": f"call_{t}_{k}", "name": name, "arguments": args, "remote_name": name}
            calls += 1
            if rng.random() < 0.06:
                kind, reason, message = rng.choice(FAILURES)
                entry["error"] = {"kind": kind, "message": message.format(t=name), **({"reason": reason} if reason
                                                                                      else {})}
                entry["seconds"] = seconds
                entry["output"] = str({"error": entry["error"]["message"]})
                failures += 1
                rewards.append(None)
            else:
                size = rng.choice((40, 200, 800, 3000)) if name == "search" else 10
                r = None if name in ("calculator", "search") else float(rng.random() < 0.55)
                done = r == 1.0 or name == "submit"
                entry.update(output=cut(text(rng, size), 8000), reward=r, finished=done,
                             metadata={"target_length": rng.randrange(3, 12)} if r is not None else None,
                             seconds=seconds)
                rewards.append(r)
                if r is not None:
                    reward = r
                finished = finished or done
            turn["tool_calls"].append(entry)
        turns.append(turn)
        if finished:
            break
    error = None
    if rng.random() < 0.01:
        error = {"kind": "transport", "message": "could not open a session: connection refused"}
    if env == "research" and error is None and not finished:
        final = {"message": text(rng, 30), "tool": "answer"}
        if rng.random() < 0.8:
            reward = round(rng.random(), 3)
            final.update(output="graded", reward=reward, finished=True, metadata=None, seconds=0.05)
            finished = True
    end = "error" if error else "finished" if finished else rng.choice(("no_tool_calls", "max_turns", "length"))
    unscored = None if reward is not None else ("error" if error else "cut_off" if env == "research" else "no_reward")
    opened = round(rng.lognormvariate(-2.5, 0.6), 4)
    return {
        "version": 2, "run": RUNS[n % len(RUNS)], "source": "engine", "environment": env, "target":
        "http://10.0.0.7:8000", "split": "train", "task_index": index, "task_spec": None,
        "started_at": f"2026-01-01T{(n // 3600) % 24:02d}:{(n // 60) % 60:02d}:{n % 60:02d}+00:00",
        "system": "You are a careful agent. Use the tools." if env == "research" else None, "prompt": prompt,
        "turns": turns, "final": final, "rewards": rewards, "reward": reward, "group_reward": None,
        "finished": finished, "end_reason": end, "unscored": unscored, "tool_calls": calls, "tool_failures": failures,
        "error": error,
        "timings": {"generation": round(sum(t["generation_seconds"] for t in turns), 4), "tools": round(seconds_total, 4),
                    "open": opened, "prompt": 0.002, "total": round(opened + seconds_total + 2.0, 4)},
    }


def trainer_state(steps: int) -> dict[str, Any]:
    rng = random.Random(1)
    history = []
    for step in range(1, steps + 1):
        entry: dict[str, Any] = {"step": step, "epoch": step / steps, "loss": rng.uniform(0, 0.1),
                                 "reward": min(1.0, 0.2 + step / steps * 0.6 + rng.uniform(-0.05, 0.05))}
        for env in ENVIRONMENTS:
            p = f"env/{env}/"
            entry.update({p + "reward_mean": min(1.0, 0.1 + step / steps * 0.7 + rng.uniform(-0.1, 0.1)),
                          p + "graded_fraction": rng.uniform(0.7, 1.0), p + "finished_fraction": rng.uniform(0.5, 1),
                          p + "tool_calls_per_episode": rng.uniform(1, 3), p + "failures/refused": rng.randrange(3),
                          p + "failures/failed": rng.randrange(2), p + "failures/timeout": 0.0,
                          p + "tool_call_s/p50": rng.uniform(0.02, 0.04), p + "tool_call_s/p95": rng.uniform(0.08, 0.2),
                          p + "session_open_s/p50": rng.uniform(0.05, 0.1), p + "session_open_s/p95": rng.uniform(0.2, 0.5)})
        history.append(entry)
    return {"global_step": steps, "max_steps": steps, "log_history": history}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=100_000, help="episode records to generate (default 100000)")
    parser.add_argument("--max-episodes", type=int, default=DEFAULT_MAX_EPISODES,
                        help=f"episode bodies embedded in the page (default {DEFAULT_MAX_EPISODES})")
    parser.add_argument("--steps", type=int, default=500, help="logged steps in the trainer state (default 500)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args(argv)
    if args.episodes < 1 or args.max_episodes < 0 or args.steps < 0:
        parser.error("--episodes must be >= 1, --max-episodes and --steps >= 0")

    with tempfile.TemporaryDirectory(prefix="bench-report-") as tmp:
        folder = Path(tmp)
        started = time.perf_counter()
        rng = random.Random(0)
        logs = [folder / f"episodes-{k}.jsonl" for k in range(4)]
        handles = [p.open("w", encoding="utf-8") for p in logs]
        try:
            for n in range(args.episodes):
                handles[n % len(handles)].write(json.dumps(episode(rng, n), ensure_ascii=False) + "\n")
        finally:
            for h in handles:
                h.close()
        (folder / "trainer" / "checkpoint-500").mkdir(parents=True)
        (folder / "trainer" / "checkpoint-500" / "trainer_state.json").write_text(
            json.dumps(trainer_state(args.steps), indent=2))
        generated = time.perf_counter() - started
        input_mb = sum(p.stat().st_size for p in logs) / 2**20

        started = time.perf_counter()
        summary = write_report([*logs, folder / "trainer"], folder / "report.html", max_episodes=args.max_episodes)
        seconds = time.perf_counter() - started
    page_mb = summary.bytes / 2**20
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    print(f"ors-trl report: {summary.episodes} synthetic episodes ({input_mb:.0f} MB of JSON lines in {len(logs)} files, "
          f"generated in {generated:.1f} s, not timed) and a trainer state of {summary.log_steps} steps")
    head = f"{'measure':<22} {'value':>10}   target"
    print(head)
    print("-" * len(head))
    ok_time, ok_size = seconds <= TARGET_SECONDS, page_mb <= TARGET_MB
    print(f"{'build time (s)':<22} {seconds:10.2f}   <= {TARGET_SECONDS:.0f}  {'ok' if ok_time else 'MISSED'}")
    print(f"{'page size (MB)':<22} {page_mb:10.2f}   <= {TARGET_MB:.0f}  {'ok' if ok_size else 'MISSED'}")
    print(f"{'episodes embedded':<22} {summary.embedded:10d}   (--max-episodes {args.max_episodes})")
    print(f"{'episodes per second':<22} {summary.episodes / seconds:10.0f}")
    print(f"{'peak RSS (MB)':<22} {peak_mb:10.0f}   (whole process, generation included)")
    if args.json:
        print(json.dumps({"episodes": summary.episodes, "input_mb": round(input_mb, 2), "seconds": round(seconds, 3),
                          "page_mb": round(page_mb, 3), "embedded": summary.embedded, "tasks": summary.tasks,
                          "log_steps": summary.log_steps, "peak_rss_mb": round(peak_mb, 1),
                          "targets": {"seconds": TARGET_SECONDS, "page_mb": TARGET_MB}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
