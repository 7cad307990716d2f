"""The demo's learning, and the control that proves it comes from the environment's reward.

For each seed, the full demo pipeline (`ors_trl.demo._main.run_demo`: bundled environment on the
reference server, tiny model, format-only warm start, GRPO through OpenRewardSpec) runs twice:

    reward    the environment's rewards, as `ors-trl demo` trains
    control   the same run, with the rewards shuffled across each batch (same distribution, no
              information about which rollout earned them)

and prints held-out success before/after for both. Learning shows as a gain with the reward and
none with the control. A full run (3 seeds x 2 arms x ~3 minutes) takes about 20 minutes on
2 cores: `.venv/bin/python benchmarks/bench_demo.py [--seeds 0 1 2] [--steps 150] [--json]`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]  # the package, and the suite's fixtures (tests.fixtures)
os.environ.setdefault("OPENREWARD_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from ors_trl.demo._main import run_demo
    from tests.fixtures.environments import server as fixture_server

    rows = []
    with fixture_server("demo") as server:
        for seed in args.seeds:
            for control in (False, True):
                arm = "control" if control else "reward"
                print(f"seed {seed} {arm} ...", file=sys.stderr, flush=True)
                with tempfile.TemporaryDirectory() as out:
                    r = run_demo(url=server.url, steps=args.steps, seed=seed, control=control, output_dir=out)
                rows.append({"seed": seed, "arm": arm, "before": r.before["success_rate"],
                             "after": r.after["success_rate"], "tool_call_rate_after": r.after["tool_call_rate"],
                             "seconds": r.seconds})
        leftover = server.stats()["open_sessions"]

    print(f"held-out success rate, {args.steps} GRPO steps, bundled demo environment")
    print(f"{'seed':>4}  {'arm':<8}{'before':>8}{'after':>8}{'gain':>8}{'calls after':>13}{'seconds':>9}")
    for row in rows:
        print(f"{row['seed']:>4}  {row['arm']:<8}{row['before']:>8.3f}{row['after']:>8.3f}"
              f"{row['after'] - row['before']:>+8.3f}{row['tool_call_rate_after']:>13.3f}{row['seconds']:>9.1f}")
    summary = {}
    for arm in ("reward", "control"):
        gains = [r["after"] - r["before"] for r in rows if r["arm"] == arm]
        summary[arm] = {"mean_gain": statistics.fmean(gains), "min_gain": min(gains), "max_gain": max(gains)}
        print(f"{arm:<8} mean gain {summary[arm]['mean_gain']:+.3f} (min {summary[arm]['min_gain']:+.3f}, "
              f"max {summary[arm]['max_gain']:+.3f})")
    print(f"target: every reward seed gains >= +0.15; the control does not. Sessions left open: {leftover}")
    if args.json:
        print(json.dumps({"runs": rows, "summary": summary, "sessions_left_open": leftover}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
