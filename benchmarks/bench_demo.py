"""The demo's learning, and the controls that prove it comes from the environment's reward and its tool.

For each seed, the full demo pipeline (`ors_trl.demo._main.run_demo`: bundled environment on the
reference server, tiny model, format-only warm start, GRPO through OpenRewardSpec) runs twice:

    reward    the environment's rewards, as `ors-trl demo` trains
    control   the same run, with the rewards shuffled across each batch (same distribution, no
              information about which rollout earned them)

and prints held-out success before/after for both. Learning shows as a gain with the reward and
none with the control. For the look task (the default) it also prints, after training, how often
the model looked before answering, the success of episodes that answered without looking, and the
blind variant's success (`look()` names a decoy independent of the hidden word: any policy scores
1/6 there unless it learned a shortcut around the tool) and how often the answer was the decoy
(the model reads the tool). `--rollout-func` trains through `spec.rollout_func` instead.

`.venv/bin/python benchmarks/bench_demo.py [--task look|echo] [--seeds 0 1 2] [--steps N] [--json]`
(3 seeds x 2 arms: about 20 minutes on 2 cores; each run about 3 minutes).
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


def _fmt(value: object, width: int) -> str:
    return f"{value:>{width}.3f}" if isinstance(value, int | float) else f"{'n/a':>{width}}"


def main(argv: list[str] | None = None) -> int:
    from ors_trl.demo._main import DEFAULT_STEPS, TASKS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=TASKS, default="look")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps (default: the demo's, per task)")
    parser.add_argument("--arms", nargs="+", choices=("reward", "control"), default=["reward", "control"])
    parser.add_argument("--rollout-func", action="store_true", help="train through spec.rollout_func")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args(argv)
    steps = args.steps or DEFAULT_STEPS[args.task]

    import torch

    torch.set_num_threads(1)
    from ors_trl.demo._main import _bundled_class, run_demo
    from ors_trl.testing import ReferenceServer

    look = args.task == "look"
    rows = []
    with ReferenceServer([_bundled_class(args.task)]) as server:
        for seed in args.seeds:
            for arm in args.arms:
                print(f"seed {seed} {arm} ...", file=sys.stderr, flush=True)
                with tempfile.TemporaryDirectory() as out:
                    r = run_demo(task=args.task, url=server.url, steps=steps, seed=seed, control=arm == "control",
                                 rollout_func=args.rollout_func, output_dir=out)
                row = {"seed": seed, "arm": arm, "before": r.before["success_rate"], "after": r.after["success_rate"],
                       "tool_call_rate_after": r.after["tool_call_rate"], "seconds": r.seconds,
                       "curve": [[h["step"], h["reward"]] for h in r.log_history if "reward" in h]}
                if look:
                    row.update(look_rate_before=r.before["look_rate"], look_rate_after=r.after["look_rate"],
                               turns_after=r.after["turns"], no_look_n_after=r.after["no_look_n"],
                               no_look_success_after=r.after["no_look_success"],
                               blind_success_after=r.blind["success_rate"] if r.blind else None,
                               blind_follow_after=r.blind["follow_rate"] if r.blind else None)
                rows.append(row)
                print(f"  held-out success {row['before']:.3f} -> {row['after']:.3f} in {row['seconds']:.0f} s"
                      + (f", blind {row['blind_success_after']:.3f}" if look and r.blind else ""),
                      file=sys.stderr, flush=True)
        leftover = server.stats()["open_sessions"]

    path = "spec.rollout_func" if args.rollout_func else "environment_factory"
    print(f"held-out success rate, {steps} GRPO steps, bundled {args.task} environment, {path}")
    head = f"{'seed':>4}  {'arm':<8}{'before':>8}{'after':>8}{'gain':>8}"
    head += f"{'looked':>8}{'no-look':>9}{'blind':>8}{'decoy':>8}" if look else f"{'calls after':>13}"
    print(head + f"{'seconds':>9}")
    for row in rows:
        line = f"{row['seed']:>4}  {row['arm']:<8}{row['before']:>8.3f}{row['after']:>8.3f}{row['after'] - row['before']:>+8.3f}"
        if look:
            line += (f"{_fmt(row['look_rate_after'], 8)}{_fmt(row['no_look_success_after'], 9)}"
                     f"{_fmt(row['blind_success_after'], 8)}{_fmt(row['blind_follow_after'], 8)}")
        else:
            line += f"{row['tool_call_rate_after']:>13.3f}"
        print(line + f"{row['seconds']:>9.1f}")
    summary = {}
    for arm in args.arms:
        arm_rows = [r for r in rows if r["arm"] == arm]
        gains = [r["after"] - r["before"] for r in arm_rows]
        summary[arm] = {"mean_gain": statistics.fmean(gains), "min_gain": min(gains), "max_gain": max(gains),
                        "min_after": min(r["after"] for r in arm_rows),
                        "mean_seconds": statistics.fmean(r["seconds"] for r in arm_rows)}
        print(f"{arm:<8} mean gain {summary[arm]['mean_gain']:+.3f} (min {summary[arm]['min_gain']:+.3f}, "
              f"max {summary[arm]['max_gain']:+.3f}); lowest held-out success after {summary[arm]['min_after']:.3f}; "
              f"mean {summary[arm]['mean_seconds']:.0f} s per run")
    if look:
        print("columns: looked = looked before answering (after); no-look = success of episodes that answered "
              "without looking; blind = success on the blind variant (chance 1/6 = 0.167); decoy = blind answers "
              "that named the decoy look() showed")
        print("target: every reward seed reaches >= 0.6 held-out; the control does not learn; blind stays at 1/6. "
              f"Sessions left open: {leftover}")
    else:
        print(f"target: every reward seed gains >= +0.15; the control does not. Sessions left open: {leftover}")
    if args.json:
        print(json.dumps({"task": args.task, "steps": steps, "path": path, "runs": rows, "summary": summary,
                          "sessions_left_open": leftover}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
