"""Task selection, side by side in one run: where each way of choosing tasks spends its environment episodes.

The bundled look environment's pools of mixed difficulty (`ors_trl.demo._task.pool_tasks`) on the reference server:
free tasks (any answer solves them), locked ones (none does), coin tasks (half the answers do) and look tasks
(the answer `look()` shows does). Three ways to choose, same policy, same seed:

    uniform    TRL's behaviour: every task once per pass, in a seeded order
    adaptive   OpenRewardSpec(task_sampling="adaptive"): unseen tasks first, all-equal tasks down-weighted
    static     OpenRewardSpec(difficulty=(0.01, 0.99), difficulty_from=<a probe eval, 4 attempts per task>), then
               uniform over the tasks kept; the probe's episodes are counted

Part A, a scripted policy (look, then answer: the shown word with probability `--skill`, else a random word),
driven through the spec's own stream, adapters and reward function (groups of 4, 8 groups drawn at a time as a
GRPO step draws them, the rewards reaching the sampler before the next draw): the share of groups whose rewards
were all equal (zero advantage: GRPO learns nothing from them) after a warm-up of one pass over the pool, and the
informative groups per 100 environment episodes. Two pools: `third` (free, locked and coin tasks, a third each: the
design's target pool) and `kinds` (all four kinds).

Part B (`--train`), the demo's tiny model trained with each way of choosing on two of the demo's pools: `mixed` (a
third look tasks, a third free, a third locked) and `sparse` (a fifth look tasks: as on most real environments,
most tasks are already solved or beyond reach). Per pool and arm, over `--seeds`: environment episodes until
held-out success first reaches 0.8 (measured every `--eval-every` steps; the median over seeds, a run that never
reached it counting as never), the held-out success after, and the training's zero-spread share (TRL's
`frac_reward_zero_std`).

`.venv/bin/python benchmarks/bench_task_selection.py [--groups 900] [--skip-a] [--json]
[--train [--pools mixed sparse] [--seeds 0 1 2] [--arms ...] [--jobs 2]]`
(part A: about half a minute per arm and pool; part B: about 3.5 minutes per run on one core, `--jobs` at a time).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]
os.environ.setdefault("OPENREWARD_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

GROUP = 4  # rollouts per group
PER_STEP = 8  # groups drawn before any of their rewards come back (one GRPO step)
ARMS = ("uniform", "adaptive", "static")
TRAIN_POOLS = ("mixed", "sparse")  # part B
TARGET = 0.8


def answer(reply: str, skill: float, rng: random.Random) -> str:
    from ors_trl.demo import _task

    shown = [w for w in _task.TARGETS if w in reply]
    return shown[0] if shown and rng.random() < skill else rng.choice(_task.TARGETS)


def play(spec: Any, rows: list[dict[str, Any]], skill: float, seed: str,
         pool: concurrent.futures.ThreadPoolExecutor) -> list[float | None]:
    """One episode per row, all at once, through the spec's adapters (reset, look, then the final answer graded by
    the terminal tool in the reward function); returns their rewards. Episode i answers with its own generator,
    seeded with `seed` and i, whatever order the threads run in."""
    answers: list[str] = [""] * len(rows)
    adapters = [spec.environment_factory() for _ in rows]

    def one(i: int) -> None:
        adapters[i].reset(**rows[i])
        answers[i] = answer(adapters[i].look(), skill, random.Random(f"{seed}/{i}"))

    list(pool.map(one, range(len(rows))))
    completions = [[{"role": "assistant", "content": "",
                     "tool_calls": [{"type": "function", "function": {"name": "look", "arguments": {}}}]},
                    {"role": "tool", "name": "look", "content": ""},
                    {"role": "assistant", "content": a}] for a in answers]
    rewards = spec.reward_funcs(environments=adapters, completions=completions)
    for adapter in adapters:
        adapter.close()
    return rewards


def drive(url: str, indices: list[int], arm: str, groups: int, skill: float, seed: int) -> dict[str, Any]:
    """Part A for one arm: `groups` groups drawn `PER_STEP` at a time from the spec's stream."""
    from ors_trl import OpenRewardSpec, UniformSampler

    probe_episodes = 0
    options: dict[str, Any] = {"split": "kinds", "indices": indices, "unscored_reward": 0.0}
    with tempfile.TemporaryDirectory() as tmp, concurrent.futures.ThreadPoolExecutor(PER_STEP * GROUP) as pool:
        if arm == "static":  # the probe: 4 attempts per task, in an episode log the spec then reads
            out = Path(tmp) / "probe.jsonl"
            probe = OpenRewardSpec(url, **options, episode_log=str(out))
            rows = [dict(r) for r in probe.train_dataset for _ in range(4)]
            play(probe, rows, skill, f"{seed}/probe", pool)
            probe.close()
            probe_episodes = len(rows)
            options.update(difficulty=(0.01, 0.99), difficulty_from=out)
        spec = OpenRewardSpec(url, **options,
                              task_sampling="adaptive" if arm == "adaptive" else UniformSampler(seed=seed))
        stream = iter(spec.train_dataset)
        pool_size = len(spec.train_dataset.source.where)
        flat: list[bool] = []
        started = time.perf_counter()
        while len(flat) < groups:
            drawn = [next(stream) for _ in range(PER_STEP)]
            rewards = play(spec, [row for row in drawn for _ in range(GROUP)], skill, f"{seed}/{len(flat)}", pool)
            for k in range(PER_STEP):
                group = [r for r in rewards[k * GROUP:(k + 1) * GROUP] if r is not None]
                flat.append(max(group) == min(group))
        seconds = time.perf_counter() - started
        spec.close()
    warm = flat[pool_size:] if arm != "static" else flat
    episodes = len(flat) * GROUP + probe_episodes
    return {"arm": arm, "tasks": pool_size, "groups": len(flat), "episodes": episodes,
            "zero_spread_after_warmup": sum(warm) / max(len(warm), 1),
            "informative_per_100_episodes": 100 * (len(flat) - sum(flat)) / episodes, "seconds": seconds}


def part_a(args: argparse.Namespace) -> list[dict[str, Any]]:
    from ors_trl.demo import _task
    from ors_trl.demo._environments import LookEnvironment
    from ors_trl.testing import ReferenceServer

    kinds = [t["kind"] for t in _task.pool_tasks("kinds")]
    pools = {"third": [i for i, k in enumerate(kinds) if k in ("free", "locked", "coin")],
             "kinds": list(range(len(kinds)))}
    results = []
    with ReferenceServer([LookEnvironment]) as server:
        for name, indices in pools.items():
            for arm in ARMS:
                result = {"pool": name, **drive(server.url, indices, arm, args.groups, args.skill, args.seed)}
                results.append(result)
                print(f"  {name:6} {arm:9} zero-spread {result['zero_spread_after_warmup']:.3f}  informative/100 "
                      f"{result['informative_per_100_episodes']:5.1f}  ({result['seconds']:.0f} s)", flush=True)
    return results


def train_one(arm: str, seed: int, steps: int, eval_every: int, pool: str) -> dict[str, Any]:
    """Part B for one arm and seed: the demo's tiny model on a pool, its own reference server."""
    import torch

    from ors_trl.demo._environments import LookEnvironment
    from ors_trl.demo._main import run_demo
    from ors_trl.testing import ReferenceServer

    torch.set_num_threads(1)
    with ReferenceServer([LookEnvironment]) as server, tempfile.TemporaryDirectory() as out:
        result = run_demo(task="look", url=server.url, steps=steps, seed=seed, output_dir=out, pool=pool,
                          task_sampling="adaptive" if arm == "adaptive" else "uniform",
                          difficulty=(0.01, 0.99) if arm == "static" else None, eval_every=eval_every,
                          report=False, blind=False)
    spread = [h["frac_reward_zero_std"] for h in result.log_history if "frac_reward_zero_std" in h]
    return {"arm": arm, "seed": seed, "pool": pool, "episodes_to_target": result.episodes_to(TARGET),
            "success_after": result.after["success_rate"], "curve": result.curve,
            "zero_spread": statistics.fmean(spread) if spread else None, "seconds": result.seconds}


def part_b(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (pool, arm, seed) run, `--jobs` at a time in spawned processes (one torch thread each)."""
    runs = [(pool, arm, seed) for pool in args.pools for seed in args.seeds for arm in args.arms]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=context) as executor:
        futures = [executor.submit(train_one, arm, seed, args.steps, args.eval_every, pool) for pool, arm, seed in runs]
        for future in concurrent.futures.as_completed(futures):
            row = future.result()
            print(f"  {row['pool']:7}{row['arm']:9} seed {row['seed']}: episodes to {TARGET}: "
                  f"{row['episodes_to_target']}  held-out after {row['success_after']:.3f}  zero-spread "
                  f"{row['zero_spread']:.3f}  ({row['seconds']:.0f} s)", flush=True)
        return [future.result() for future in futures]


def summary(b: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per pool and arm, over its seeds: the median of the episodes to the target (a run that did not reach it
    counts as never: None when half or more did not), how many reached it, the mean held-out success after, and the
    mean zero-spread share."""
    rows = []
    for pool, arm in dict.fromkeys((r["pool"], r["arm"]) for r in b):
        mine = [r for r in b if r["pool"] == pool and r["arm"] == arm]
        spent = [r["episodes_to_target"] if r["episodes_to_target"] is not None else math.inf for r in mine]
        median = statistics.median_high(spent)
        rows.append({"pool": pool, "arm": arm, "median_episodes": None if median == math.inf else median,
                     "per_seed": [r["episodes_to_target"] for r in mine], "reached": sum(s < math.inf for s in spent),
                     "runs": len(mine), "success_after": statistics.fmean(r["success_after"] for r in mine),
                     "zero_spread": statistics.fmean(r["zero_spread"] or 0.0 for r in mine)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=900, help="part A: groups per arm and pool (default 900)")
    parser.add_argument("--skill", type=float, default=0.5, help="part A: how often the policy reads look() right")
    parser.add_argument("--seed", type=int, default=0, help="part A: seed of the draws and the scripted answers")
    parser.add_argument("--train", action="store_true", help="also part B: the tiny model trained with each arm")
    parser.add_argument("--steps", type=int, default=150, help="part B: GRPO steps per run (default 150)")
    parser.add_argument("--eval-every", type=int, default=10, help="part B: held-out evaluation every N steps")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="part B: one run per arm and seed")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), help="part B: the arms to train")
    parser.add_argument("--pools", nargs="+", choices=TRAIN_POOLS, default=list(TRAIN_POOLS),
                        help="part B: the demo's pools to train on")
    parser.add_argument("--jobs", type=int, default=2, help="part B: runs at a time (one CPU thread each)")
    parser.add_argument("--skip-a", action="store_true", help="part B only")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args(argv)
    a: list[dict[str, Any]] = []
    if not args.skip_a:
        print(f"part A: scripted policy (skill {args.skill}), {args.groups} groups of {GROUP} per arm, {PER_STEP} "
              "drawn at a time", flush=True)
        a = part_a(args)
    b: list[dict[str, Any]] = []
    if args.train:
        print(f"part B: the demo's tiny model, {args.steps} GRPO steps per run, pools {args.pools}, seeds "
              f"{args.seeds}, {args.jobs} at a time", flush=True)
        b = part_b(args)
    if a:
        print()
        print(f"{'pool':7}{'arm':10}{'tasks':>6}{'episodes':>9}{'zero-spread':>12}{'informative/100 ep':>19}"
              f"{'vs uniform':>11}")
        for row in a:
            base = next(r for r in a if r["pool"] == row["pool"] and r["arm"] == "uniform")
            ratio = row["informative_per_100_episodes"] / max(base["informative_per_100_episodes"], 1e-9)
            print(f"{row['pool']:7}{row['arm']:10}{row['tasks']:>6}{row['episodes']:>9}"
                  f"{row['zero_spread_after_warmup']:>12.3f}{row['informative_per_100_episodes']:>19.1f}"
                  f"{ratio:>10.2f}x")
    if b:
        print()
        print(f"{'pool':7}{'arm':10}{'median episodes to ' + str(TARGET):>24}{'reached':>9}{'per seed':>22}"
              f"{'held-out after':>16}{'zero-spread':>13}")
        for row in summary(b):
            shown = row["median_episodes"] if row["median_episodes"] is not None else "not reached"
            seeds = " ".join("-" if e is None else str(e) for e in row["per_seed"])
            print(f"{row['pool']:7}{row['arm']:10}{shown:>24}{row['reached']:>6}/{row['runs']:<2}{seeds:>22}"
                  f"{row['success_after']:>16.3f}{row['zero_spread']:>13.3f}")
    if args.json:
        print(json.dumps({"part_a": a, "part_b": b}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
