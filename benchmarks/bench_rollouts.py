"""Environment wall time of one GRPO step: TRL's `trl.experimental.openreward` vs ors-trl (factory and engine).

One reference-server process hosts the workload's environment. A batch is `--rollouts` R rollouts
= R / `--generations` G tasks, each repeated G times (as GRPO does), and every rollout makes
`--turns` T tool calls (`work(step=k)` on turn k; the task finishes with reward 1.0 on its T-th call).

Workloads (`--workload`):

    uniform  (default) `SlowEnvironment`: session setup sleeps `--setup-delay` s, every call sleeps
             `--tool-latency` s. Every rollout takes the same time, so every schedule ties.
    heavy    `HeavyTailEnvironment` (tests/fixtures/environments.py, `HeavyTail`): setup sleeps
             `--setup-delay` s; a call's latency is a deterministic function of (`--seed`, task,
             the session's replica number among its task's G sessions, step): log-normal with median
             `--median-latency` and p99/p50 = 20 (capped at 40x the median), and `--slow-calls`
             rollouts (default T) make one very slow call (60x the median), each on a different turn.
             From the same seeded latencies the benchmark computes the bounds a schedule can reach:
               critical-path limit  setup + the slowest single rollout's own tool latencies: the lower
                                    bound of any schedule (generation is a scripted double, ~0)
               turn-synchronous     setup + the sum over turns of each turn's slowest call: what a
                                    schedule with a barrier after every turn pays (TRL's loop)

Paths, each through a real `GRPOTrainer` and one full generate-and-score of the batch per step
(`tests.fixtures.generation.generate_and_score`; but (d)), printed in this order:

    (a) trl     `trl.experimental.openreward.OpenRewardSpec(url)`  environment_factory (openreward SDK)
    (b) env     `ors_trl.OpenRewardSpec(url)`                      environment_factory (TRL's own loop; ors-trl
                                                                   opens the batch's sessions and starts each
                                                                   turn's tool calls together, but TRL's loop
                                                                   waits for every rollout after each turn)
    (e) sync    `ors_trl.OpenRewardSpec(url).rollout_func` with `turn_barrier=True`: the engine on the
                turn-synchronous schedule of the previous release (every rollout waits for the slowest)
    (c) engine  `ors_trl.OpenRewardSpec(url).rollout_func`         the RolloutEngine: every rollout
                                                                   advances on its own, no turn barrier
    (d) floor   raw aiohttp, no trainer: every rollout opens, calls T times and closes on its own, all
                rollouts at once (what this server and machine allow with no client or trainer)

Each path first runs a one-task warm-up step on a task outside the measured ones. (a) is measured
for one step (`--trl-steps`); (b) for two (`--steps`): step 2 repeats the tasks, as a later epoch
does, with its prompt cache warm; (c), (d) and (e) for `--engine-steps` (median reported).

In (a), (b), (c), (e), TRL's generation is replaced by the same scripted double
(tests.fixtures.generation.work_turn_by_turn): on turn k the "model" emits `work(step=k)` until T
calls were made, then "Done.". Model compute is therefore ~0 and the step time is environment
wait plus client/trainer overhead. Columns besides the step's wall time and this process's CPU time:

    opens s    (a), (b): total time inside `reset()` (each factory instance is wrapped);
               (c), (e): from the engine's episodes (`rollout_func.last_episodes[i].timings`): the longest
               open + prompt of any rollout (every rollout starts opening at once, so this is the span
               of the opens); (d): the longest open of any rollout
    tools s    (a), (b): total time inside the tool methods TRL calls (for (b), the first call of a turn
               waits for the turn's calls, which ors-trl started together; the others are answered at once);
               (c), (e): the longest time any single rollout spent in tool calls (`timings["tools"]`); (d) same
    slowest s  (c), (d), (e): the slowest rollout's own environment time (open + prompt + tools): the
               critical path as it happened, client overhead included; "-" for (a), (b)

Checked while measuring: every rollout scored (all rewards 1.0), the server ran exactly R x T tool
calls and opened R sessions per step, and no session is left open on the server (ors-trl: after
`spec.close()`; TRL's module keeps its last sessions open until its adapters are reset again,
reported, then cleaned up by stopping the server). On the heavy workload the replica numbers line up
with the computed bounds only when every step opens exactly G sessions per task (R per step, checked).

Targets (no assertion on time; a missed target is reported):
    uniform, 64 x 4, 0.5 s setup, 0.2 s latency (issue 5):
        resets: ors-trl environment_factory >= 5x faster than TRL's module
        step:   engine >= 30x faster than TRL's module
    heavy, 64 x 4, 0.5 s setup, 0.05 s median, 4 slow calls:
        barrier-free engine (c) <= 1.15x the critical-path limit
        barrier-free engine (c) a clear multiple (>= 2x) faster than the turn-synchronous engine (e)

Headline: `.venv/bin/python benchmarks/bench_rollouts.py` (uniform, R=64, T=4, G=4; ~4 minutes, ~85 s of it TRL's module)
          `.venv/bin/python benchmarks/bench_rollouts.py --workload heavy` (R=64, T=4; ~5 minutes, TRL's
          module one step of ~1-2 minutes: `--skip trl` leaves it out)
Quick:    `.venv/bin/python benchmarks/bench_rollouts.py --quick [--workload heavy]` (R=16, T=2)

Loopback notes: TRL's module passes the URL to `openreward.OpenReward(base_url=url)`, and the SDK
derives its hosts from it as `api.<host>` and `sessions.<host>` (`openreward/client.py`,
`_prepend_subdomain`), so for `http://127.0.0.1:PORT` it calls `sessions.127.0.0.1:PORT`, which does
not resolve (MaxRetriesError on /create_session, ClientConnectorDNSError). The benchmark sets
`OPENREWARD_API_URL` and `OPENREWARD_SESSION_URL` to the URL (and a dummy `OPENREWARD_API_KEY`)
before TRL's module builds its client; nothing installed is patched.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import inspect
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]  # the package, and the suite's fixtures (tests.fixtures)
os.environ.setdefault("OPENREWARD_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from ors_trl.testing import ReferenceServer  # noqa: E402
from tests.fixtures.environments import HeavyTail, HeavyTailEnvironment, SlowEnvironment  # noqa: E402
from tests.fixtures.environments import server as fixture_server  # noqa: E402
from tests.fixtures.generation import (  # noqa: E402
    build_tiny_model,
    cpu_grpo_trainer,
    generate_and_score,
    replace_generation,
    work_turn_by_turn,
)

#: workload -> (fixture short name, environment key on the wire)
WORKLOADS = {"uniform": ("slow", SlowEnvironment.key()), "heavy": ("heavy", HeavyTailEnvironment.key())}
PATHS = ("trl", "env", "sync", "engine", "floor")  # the order of the tables
LABELS = {
    "trl": "(a) trl.experimental.openreward",
    "env": "(b) ors-trl environment_factory",
    "sync": "(e) ors-trl engine, turn_barrier=True",
    "engine": "(c) ors-trl rollout_func (engine)",
    "floor": "(d) floor: raw aiohttp, no trainer",
}
WIDTH = 38
TARGET_RESETS = 5.0
TARGET_ENGINE = 30.0
TARGET_CRITICAL = 1.15  # heavy: barrier-free engine / critical-path limit, at most
TARGET_SYNC = 2.0  # heavy: turn-synchronous engine / barrier-free engine, at least ("a clear multiple")
HEADLINE = {"uniform": (64, 4, 0.5, 0.2), "heavy": (64, 4, 0.5, 0.05)}


@dataclass
class Probe:
    """What one trainer step spent where."""

    reset_s: float = 0.0
    resets: int = 0
    tool_s: float = 0.0
    tool_calls: int = 0
    rewards: list[list[Any]] = field(default_factory=list)
    engine: Any = None  # the RolloutEngine whose episodes to read after each step, if any
    rollout_func_s: float | None = None  # time inside the trainer's rollout_func call (engine paths)

    def clear(self) -> None:
        self.reset_s = self.tool_s = 0.0
        self.resets = self.tool_calls = 0
        self.rewards.clear()
        self.rollout_func_s = None


@dataclass
class StepResult:
    wall_s: float
    cpu_s: float
    reset_s: float
    resets: int
    tool_s: float
    tool_calls_client: int
    tool_calls_server: int
    rewards: list[Any]
    open_after: int
    sessions_opened: int
    slowest_s: float | None = None  # the slowest rollout's own environment time (engine, floor)
    rollout_func_s: float | None = None  # the engine's whole call; the rest of wall_s is TRL's own scoring work

    def as_dict(self) -> dict[str, Any]:
        scored = sum(1 for r in self.rewards if r == 1.0)
        return {
            "wall_s": self.wall_s,
            "cpu_s": self.cpu_s,
            "reset_s": self.reset_s,
            "resets": self.resets,
            "tool_s": self.tool_s,
            "slowest_rollout_s": self.slowest_s,
            "rollout_func_s": self.rollout_func_s,
            "tool_calls_server": self.tool_calls_server,
            "sessions_opened": self.sessions_opened,
            "scored": scored,
            "rollouts": len(self.rewards),
            "open_sessions_after_step": self.open_after,
        }


def _median(steps: list[StepResult]) -> float:
    return statistics.median(s.wall_s for s in steps)


# -- the tiny model and the scripted generation --------------------------------------------------------------------


def build_model_dir(url: str, env: str, turns: int, workdir: str) -> str:
    """The harness's tiny random Qwen3 + BPE tokenizer, trained on `work` conversations."""
    import random

    from ors_trl import OpenRewardSpec

    spec = OpenRewardSpec(url, env_name=env, num_tasks=1, keepalive_interval=None)
    tools = [
        f
        for n, f in inspect.getmembers(spec.environment_factory, inspect.isfunction)
        if not n.startswith("_") and n != "reset"
    ]
    spec.close()
    prompt = f"Call `work` with step=0, then 1, and so on up to step={turns - 1}."

    def episode(task: dict[str, Any], rng: random.Random) -> tuple[str, dict[str, Any], str]:
        step = rng.randrange(max(turns, 1))
        return "work", {"step": step}, f"step {step} done"

    # 2**15 positions: room for long multi-turn episodes
    return build_tiny_model(os.path.join(workdir, "tiny-model"), tools, lambda task: prompt, episode, copies=16,
                            positions=1 << 15)


def make_trainer(
    model_dir: str, out_dir: str, dataset: Any, reward: Callable[..., Any], args: argparse.Namespace, **kwargs: Any
) -> Any:
    trainer = cpu_grpo_trainer(model_dir, out_dir, batch=args.rollouts, generations=args.generations,
                               turns=args.turns, completion_length=64 * args.turns + 256, train_dataset=dataset,
                               reward_funcs=reward, **kwargs)
    # the scripted model: work(step=k) on turn k, then "Done." (tests.fixtures.generation)
    replace_generation(trainer, work_turn_by_turn(trainer.processing_class, args.turns))
    return trainer


# -- instrumentation -------------------------------------------------------------------------------------------------


def timed_factory(factory: Callable[[], Any], probe: Probe, tool_attr: str) -> Callable[[], Any]:
    """The same factory, whose instances time `reset` and every remote tool call (instance attributes only:
    the class TRL inspects for tools is untouched)."""

    def make() -> Any:
        env = factory()
        reset, call = env.reset, getattr(env, tool_attr)

        def timed_reset(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return reset(*a, **kw)
            finally:
                probe.reset_s += time.perf_counter() - t0
                probe.resets += 1

        def timed_call(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return call(*a, **kw)
            finally:
                probe.tool_s += time.perf_counter() - t0
                probe.tool_calls += 1

        env.reset = timed_reset
        setattr(env, tool_attr, timed_call)
        return env

    return make


def engine_timings(engine: Any) -> tuple[float, float, float, int, int]:
    """From the engine's last batch (its episodes' timings): the longest open + prompt, the longest time one
    rollout spent in tool calls, the slowest rollout's open + prompt + tools, the episodes, their tool calls."""
    episodes = list(engine.last_episodes)
    if not episodes:
        return 0.0, 0.0, 0.0, 0, 0
    opens = [ep.timings.get("open", 0.0) + ep.timings.get("prompt", 0.0) for ep in episodes]
    tools = [ep.timings.get("tools", 0.0) for ep in episodes]
    own = [o + t for o, t in zip(opens, tools, strict=True)]
    return max(opens), max(tools), max(own), len(episodes), sum(ep.tool_calls for ep in episodes)


def capture_rewards(fn: Callable[..., Any], probe: Probe) -> Callable[..., Any]:
    def outcome_reward(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        probe.rewards.append(list(out))
        return out

    return outcome_reward


def batch_rows(dataset: Any, indices: list[int], generations: int) -> list[dict[str, Any]]:
    return [copy.deepcopy(dataset[i]) for i in indices for _ in range(generations)]


def _server_counts(server: ReferenceServer, args: argparse.Namespace) -> tuple[int, int, int]:
    stats = server.stats()
    return (stats["tool_calls"].get(args.tool_key, 0), stats["setups_by_env"].get(args.env_key, 0),
            stats["open_sessions"])


def run_step(trainer: Any, rows: list[dict[str, Any]], probe: Probe, server: ReferenceServer,
             args: argparse.Namespace) -> StepResult:
    probe.clear()
    calls0, setups0, _ = _server_counts(server, args)
    c0, t0 = time.process_time(), time.perf_counter()
    generate_and_score(trainer, rows)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    calls1, setups1, open_after = _server_counts(server, args)
    rewards = probe.rewards[-1] if probe.rewards else []
    slowest = None
    if probe.engine is not None:
        probe.reset_s, probe.tool_s, slowest, probe.resets, probe.tool_calls = engine_timings(probe.engine)
    return StepResult(wall, cpu, probe.reset_s, probe.resets, probe.tool_s, probe.tool_calls, calls1 - calls0,
                      rewards, open_after, setups1 - setups0, slowest, probe.rollout_func_s)


# -- the paths -------------------------------------------------------------------------------------------------------


def run_trl(
    server: ReferenceServer,
    model_dir: str,
    workdir: str,
    args: argparse.Namespace,
    tasks: list[int],
    warm: int | None,
    log: Callable[[str], None],
) -> dict[str, Any]:
    os.environ["OPENREWARD_API_URL"] = server.url  # see the module docstring: the SDK's host derivation
    os.environ["OPENREWARD_SESSION_URL"] = server.url
    os.environ.setdefault("OPENREWARD_API_KEY", "unused-on-loopback")
    from trl.experimental.openreward import OpenRewardSpec as TRLSpec

    probe = Probe()
    spec = TRLSpec(server.url, num_tasks=len(tasks) + (warm is not None), env_name=args.env_key)
    trainer = make_trainer(
        model_dir,
        os.path.join(workdir, "trl"),
        spec.train_dataset,
        capture_rewards(spec.reward_funcs, probe),
        args,
        environment_factory=timed_factory(spec.environment_factory, probe, "_call_ors_tool"),
    )
    steps = _measure(trainer, spec.train_dataset, probe, server, args, tasks, warm, args.trl_steps, "trl", log)
    held = server.stats()["open_sessions"]
    return {
        "steps": steps,
        "open_sessions_left": held,
        "cleanup": "TRL's adapters keep their last sessions until the next reset(); the server is stopped",
    }


async def _floor_batch(url: str, env: str, rows: list[int], turns: int) -> list[tuple[float, float, Any]]:
    """The environment side of one batch with nothing else: raw aiohttp, every rollout on its own, all at once.

    Returns (open seconds, tool seconds, last reward) per rollout."""
    import aiohttp

    path = f"/{env}"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

        async def open_one(index: int) -> dict[str, str]:
            async with http.post(url + "/create_session", data=b"{}") as r:
                body = await r.text()
            sid = body.split("data:", 1)[1].split("\n", 1)[0].strip()
            h = {"X-Session-ID": sid, "Content-Type": "application/json"}
            payload = json.dumps({"split": "train", "index": index, "env_name": env})
            async with http.post(url + "/create", data=payload, headers=h) as r:
                await r.read()
            async with http.get(url + path + "/prompt", headers=h) as r:
                await r.json()
            return h

        async def call(h: dict[str, str], step: int) -> Any:
            payload = json.dumps({"name": "work", "input": {"step": step}})
            async with http.post(url + path + "/call", data=payload, headers=h) as r:
                text = await r.text()
            event, data = "", []
            for line in text.splitlines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:") and event in ("chunk", "end"):
                    data.append(line[6:] if line.startswith("data: ") else line[5:])
            return json.loads("".join(data))["output"]["reward"]

        async def close(h: dict[str, str]) -> None:
            for p in ("/delete", "/delete_session"):
                async with http.post(url + p, headers=h) as r:
                    await r.read()

        async def rollout(index: int) -> tuple[float, float, Any]:
            t0 = time.perf_counter()
            h = await open_one(index)
            t1 = time.perf_counter()
            reward = None
            for step in range(turns):
                reward = await call(h, step)
            t2 = time.perf_counter()
            await close(h)
            return t1 - t0, t2 - t1, reward

        return list(await asyncio.gather(*(rollout(i) for i in rows)))


def run_floor(
    server: ReferenceServer, args: argparse.Namespace, tasks: list[int], warm: int | None, log: Callable[[str], None]
) -> dict[str, Any]:
    rows = [i for i in tasks for _ in range(args.generations)]
    if warm is not None:
        asyncio.run(_floor_batch(server.url, args.env_key, [warm] * args.generations, args.turns))
    steps = []
    for i in range(args.engine_steps):
        calls0, setups0, _ = _server_counts(server, args)
        c0, t0 = time.process_time(), time.perf_counter()
        per = asyncio.run(_floor_batch(server.url, args.env_key, rows, args.turns))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        calls1, setups1, open_after = _server_counts(server, args)
        open_s, tool_s = max(p[0] for p in per), max(p[1] for p in per)
        slowest = max(p[0] + p[1] for p in per)
        steps.append(StepResult(wall, cpu, open_s, len(rows), tool_s, calls1 - calls0, calls1 - calls0,
                                [p[2] for p in per], open_after, setups1 - setups0, slowest))
        log(f"  floor step {i + 1}: {wall:.2f} s (opens {open_s:.2f} s, tools {tool_s:.2f} s, "
            f"slowest rollout {slowest:.2f} s)")
    return {"steps": steps, "open_sessions_left": server.stats()["open_sessions"]}


def run_ours(
    mode: str,
    server: ReferenceServer,
    model_dir: str,
    workdir: str,
    args: argparse.Namespace,
    tasks: list[int],
    warm: int | None,
    log: Callable[[str], None],
) -> dict[str, Any]:
    from ors_trl import OpenRewardSpec

    probe = Probe()
    spec = OpenRewardSpec(server.url, num_tasks=len(tasks) + (warm is not None), env_name=args.env_key)
    reward = capture_rewards(spec.reward_funcs, probe)
    if mode == "env":
        factory = timed_factory(spec.environment_factory, probe, "_call_tool")
        trainer = make_trainer(
            model_dir, os.path.join(workdir, mode), spec.train_dataset, reward, args, environment_factory=factory
        )
    else:
        engine = spec.rollout_func
        engine.turn_barrier = mode == "sync"  # (e): the turn-synchronous schedule of the previous release
        probe.engine = engine
        trainer = make_trainer(
            model_dir, os.path.join(workdir, mode), spec.train_dataset, reward, args, rollout_func=engine
        )

        def timed_rollout_func(*a: Any, **kw: Any) -> Any:  # the engine's own span within the step
            t0 = time.perf_counter()
            try:
                return engine(*a, **kw)
            finally:
                probe.rollout_func_s = time.perf_counter() - t0

        trainer.rollout_func = timed_rollout_func
    try:
        n_steps = args.steps if mode == "env" else args.engine_steps
        steps = _measure(trainer, spec.train_dataset, probe, server, args, tasks, warm, n_steps, mode, log)
        held = server.stats()["open_sessions"]
    finally:
        spec.close()
    left = server.stats()["open_sessions"]
    return {"steps": steps, "open_sessions_before_close": held, "open_sessions_left": left}


def _measure(
    trainer: Any,
    dataset: Any,
    probe: Probe,
    server: ReferenceServer,
    args: argparse.Namespace,
    tasks: list[int],
    warm: int | None,
    n_steps: int,
    name: str,
    log: Callable[[str], None],
) -> list[StepResult]:
    if warm is not None:  # imports, first-call costs; a task outside the measured ones (its prompt cache stays cold)
        run_step(trainer, batch_rows(dataset, [warm], args.generations), probe, server, args)
    rows = batch_rows(dataset, tasks, args.generations)
    out = []
    for i in range(n_steps):
        result = run_step(trainer, rows, probe, server, args)
        slowest = f", slowest rollout {result.slowest_s:.2f} s" if result.slowest_s is not None else ""
        log(f"  {name} step {i + 1}: {result.wall_s:.2f} s (opens {result.reset_s:.2f} s, "
            f"tools {result.tool_s:.2f} s{slowest})")
        out.append(result)
    return out


# -- bounds of the heavy workload ------------------------------------------------------------------------------------


def heavy_profile(args: argparse.Namespace) -> HeavyTail:
    return HeavyTail(seed=args.seed, median=args.median_latency, replicas=args.generations,
                     tasks=args.rollouts // args.generations, slow_calls=args.slow_calls, steps=args.turns,
                     setup_delay=args.setup_delay)


def heavy_bounds(profile: HeavyTail, n_tasks: int) -> dict[str, Any]:
    """From the seeded latencies of the measured batch: the critical-path limit and what a turn barrier pays."""
    rollouts = {(t, r): [profile.latency(t, r, k) for k in range(profile.steps)]
                for t in range(n_tasks) for r in range(profile.replicas)}
    slowest = max(rollouts, key=lambda key: sum(rollouts[key]))
    turn_max = [max(lat[k] for lat in rollouts.values()) for k in range(profile.steps)]
    every = sorted(x for lat in rollouts.values() for x in lat)
    slow = {key: k for key, k in profile.slow().items() if key in rollouts}
    drawn = sorted(lat[k] for key, lat in rollouts.items() for k in range(profile.steps) if slow.get(key) != k)
    q = statistics.quantiles(drawn, n=100, method="inclusive") if len(drawn) > 1 else [drawn[0]] * 99
    return {
        "critical_path_s": profile.setup_delay + sum(rollouts[slowest]),
        "critical_rollout": {"task": slowest[0], "replica": slowest[1], "latencies_s": rollouts[slowest]},
        "turn_synchronous_s": profile.setup_delay + sum(turn_max),
        "turn_max_s": turn_max,
        "serial_s": len(rollouts) * profile.setup_delay + sum(every),
        "slow_calls": [{"task": t, "replica": r, "turn": k, "latency_s": rollouts[(t, r)][k]}
                       for (t, r), k in sorted(slow.items())],
        "lognormal_draws": len(drawn),
        "latency_p50_s": q[49],
        "latency_p99_s": q[98],
        "latency_max_s": drawn[-1],
    }


# -- report ----------------------------------------------------------------------------------------------------------


def _check(results: dict[str, Any], args: argparse.Namespace) -> list[str]:
    problems = []
    for name, res in results.items():
        for i, step in enumerate(res["steps"]):
            if len(step.rewards) != args.rollouts or any(r != 1.0 for r in step.rewards):
                bad = [r for r in step.rewards if r != 1.0]
                problems.append(f"{name} step {i + 1}: {len(step.rewards)} rewards, {len(bad)} not 1.0 ({bad[:4]})")
            if step.tool_calls_server != args.rollouts * args.turns:
                problems.append(
                    f"{name} step {i + 1}: server ran {step.tool_calls_server} tool calls, "
                    f"expected {args.rollouts * args.turns}"
                )
            if args.workload == "heavy" and step.sessions_opened != args.rollouts:
                problems.append(
                    f"{name} step {i + 1}: server opened {step.sessions_opened} sessions, expected {args.rollouts} "
                    "(the replica numbers no longer match the computed bounds)"
                )
        if name != "trl" and res["open_sessions_left"] != 0:
            problems.append(f"{name}: {res['open_sessions_left']} sessions left open after spec.close()")
    return problems


def _verdict(value: float, target: float, *, at_most: bool = False) -> str:
    return "MET" if (value <= target if at_most else value >= target) else "NOT MET"


def _print_table(results: dict[str, Any]) -> None:
    head = (f"{'path':<{WIDTH}} {'step':>4} {'wall s':>8} {'opens s':>8} {'tools s':>8} {'slowest s':>9} "
            f"{'cpu s':>7} {'scored':>8} {'calls':>6} {'opened':>6}")
    print(head)
    print("-" * len(head))
    for name in PATHS:
        if name not in results:
            continue
        for i, step in enumerate(results[name]["steps"]):
            scored = sum(1 for x in step.rewards if x == 1.0)
            slowest = f"{step.slowest_s:9.2f}" if step.slowest_s is not None else f"{'-':>9}"
            print(
                f"{LABELS[name]:<{WIDTH}} {i + 1:>4} {step.wall_s:8.2f} {step.reset_s:8.2f} {step.tool_s:8.2f}"
                f" {slowest} {step.cpu_s:7.2f} {scored:>4}/{len(step.rewards):<3} {step.tool_calls_server:>6}"
                f" {step.sessions_opened:>6}"
            )
    print(
        "(opens/tools: (a), (b) total time inside reset() / the tool methods; (c), (e) from the episodes' timings:\n"
        " the longest open+prompt / the longest time one rollout spent in tool calls; (d) the same, measured per\n"
        " rollout. slowest: the slowest rollout's own open+prompt+tools. opened: sessions the server set up.\n"
        " (b) step 2: the same tasks again, prompt cache warm; (c), (d), (e): repeated steps, the median is used)"
    )


def _report_uniform(results: dict[str, Any], args: argparse.Namespace, summary: dict[str, Any]) -> None:
    r, t, g = args.rollouts, args.turns, args.generations
    headline = (r, t, args.setup_delay, args.tool_latency) == HEADLINE["uniform"]
    ratios: dict[str, float] = summary.setdefault("ratios", {})
    if "trl" in results:
        trl = results["trl"]["steps"][0]
        print()
        print("ratios (TRL's module step 1 / ors-trl)")
        if "env" in results:
            env_steps = results["env"]["steps"]
            ratios["step_trl_over_env"] = trl.wall_s / env_steps[0].wall_s
            ratios["resets_trl_over_env_cold"] = trl.reset_s / max(env_steps[0].reset_s, 1e-9)
            print(
                f"  step,   environment_factory:         {ratios['step_trl_over_env']:7.1f}x   (no target: TRL's loop asks for "
                "the tool calls one rollout after another; ors-trl starts each turn's calls at once)"
            )
            print(
                f"  resets, environment_factory, cold:   {ratios['resets_trl_over_env_cold']:7.1f}x   "
                f"(target >= {TARGET_RESETS:g}x: {_verdict(ratios['resets_trl_over_env_cold'], TARGET_RESETS)})"
            )
            if len(env_steps) > 1:
                ratios["step_trl_over_env_warm"] = trl.wall_s / env_steps[1].wall_s
                ratios["resets_trl_over_env_warm"] = trl.reset_s / max(env_steps[1].reset_s, 1e-9)
                print(
                    f"  resets, environment_factory, warm:   {ratios['resets_trl_over_env_warm']:7.1f}x   "
                    f"(target >= {TARGET_RESETS:g}x: {_verdict(ratios['resets_trl_over_env_warm'], TARGET_RESETS)})"
                )
            print(
                f"    cold: the batch's first reset starts opening all {r} sessions at once; each of the {r // g} "
                f"tasks' first resets waits for its own (already running) open, the other {g - 1} return the cached "
                "prompt; warm: step 2 repeats the tasks (a later epoch), every prompt is cached"
            )
        if "engine" in results:
            eng_steps = results["engine"]["steps"]
            walls = sorted(x.wall_s for x in eng_steps)
            ratios["step_trl_over_engine"] = trl.wall_s / statistics.median(walls)
            ratios["step_trl_over_engine_worst"] = trl.wall_s / walls[-1]
            ratios["step_trl_over_engine_best"] = trl.wall_s / walls[0]
            ratios["resets_trl_over_engine"] = trl.reset_s / max(statistics.median(x.reset_s for x in eng_steps), 1e-9)
            verdict = _verdict(ratios["step_trl_over_engine"], TARGET_ENGINE) if headline else "stated for 64 x 4"
            print(
                f"  step,   engine:                      {ratios['step_trl_over_engine']:7.1f}x   "
                f"(target >= {TARGET_ENGINE:g}x: {verdict}; median of {len(walls)} steps, range "
                f"{ratios['step_trl_over_engine_worst']:.1f}x-{ratios['step_trl_over_engine_best']:.1f}x)"
            )
            print(f"  resets, engine (longest open+prompt): {ratios['resets_trl_over_engine']:6.1f}x   "
                  "(TRL's total time in reset() / the engine's span of concurrent opens)")
        summary["targets"] = {"resets_trl_over_env": TARGET_RESETS, "step_trl_over_engine": TARGET_ENGINE}
    elif args.skipped:
        print()
        print(f"ratios against TRL's module: not measured (skipped: {', '.join(args.skipped)})")
    if "engine" in results and "sync" in results:
        med_eng, med_sync = _median(results["engine"]["steps"]), _median(results["sync"]["steps"])
        ratios["sync_over_engine"] = med_sync / med_eng
        print(f"  turn-synchronous engine / engine (median steps, {med_sync:.2f} s / {med_eng:.2f} s): "
              f"{ratios['sync_over_engine']:.2f}x (uniform latency: every schedule ties, ~1x expected)")
    if "engine" in results and "floor" in results:
        med_eng, med_floor = _median(results["engine"]["steps"]), _median(results["floor"]["steps"])
        ratios["engine_over_floor"] = med_eng / med_floor
        print(
            f"  engine / floor (median steps, {med_eng:.2f} s / {med_floor:.2f} s): {ratios['engine_over_floor']:.2f}x "
            "(the floor is what this server and machine allow with no client or trainer at all)"
        )


def _report_heavy(results: dict[str, Any], args: argparse.Namespace, summary: dict[str, Any]) -> None:
    bounds = summary["bounds"]
    crit, sync_bound = bounds["critical_path_s"], bounds["turn_synchronous_s"]
    headline = (args.rollouts, args.turns, args.setup_delay, args.median_latency) == HEADLINE["heavy"] and \
        args.slow_calls == 4
    ratios: dict[str, float] = summary.setdefault("ratios", {})
    med = {name: _median(res["steps"]) for name, res in results.items()}
    print()
    print("heavy-tailed step, side by side (median of each path's measured steps; step wall time)")
    rows: list[tuple[str, str, str]] = []
    for name in ("trl", "env", "sync", "engine", "floor"):
        label = LABELS[name]
        if name in results:
            n = len(results[name]["steps"])
            extra = f"x critical path {med[name] / crit:5.2f}   ({n} step{'s' if n > 1 else ''})"
            rows.append((label, f"{med[name]:8.2f} s", extra))
        elif name in args.skipped:
            rows.append((label, f"{'skipped':>10}", f"(--skip {name})"))
    rows.append(("turn-synchronous bound (setup + sum of", f"{sync_bound:8.2f} s",
                 f"x critical path {sync_bound / crit:5.2f}"))
    rows.append(("  each turn's slowest call)", "", ""))
    rows.append(("critical-path limit (setup + slowest", f"{crit:8.2f} s", "lower bound of any schedule"))
    rows.append(("  rollout's own calls)", "", ""))
    for label, value, extra in rows:
        print(f"  {label:<{WIDTH}} {value:>10}   {extra}".rstrip())
    print()
    if "engine" in results:
        ratios["engine_over_critical_path"] = med["engine"] / crit
        print(f"  barrier-free engine / critical-path limit:    {ratios['engine_over_critical_path']:7.3f}x  "
              f"(target <= {TARGET_CRITICAL:g}x: "
              f"{_verdict(ratios['engine_over_critical_path'], TARGET_CRITICAL, at_most=True)})")
        slowest = statistics.median(s.slowest_s for s in results["engine"]["steps"] if s.slowest_s is not None)
        ratios["engine_slowest_rollout_over_critical_path"] = slowest / crit
        print(f"    its slowest rollout's own environment time: {slowest:.2f} s = "
              f"{ratios['engine_slowest_rollout_over_critical_path']:.2f}x the limit "
              "(the rest of the step: generation, scheduling, closes and the trainer's own work)")
        spans = [s.rollout_func_s for s in results["engine"]["steps"] if s.rollout_func_s is not None]
        if spans:
            ratios["engine_rollout_func_over_critical_path"] = statistics.median(spans) / crit
            print(f"    inside rollout_func (the engine's whole call, without TRL's scoring after it): "
                  f"{statistics.median(spans):.2f} s = {ratios['engine_rollout_func_over_critical_path']:.2f}x the limit")
    if "engine" in results and "sync" in results:
        ratios["sync_over_engine"] = med["sync"] / med["engine"]
        verdict = _verdict(ratios["sync_over_engine"], TARGET_SYNC) if headline else "stated for 64 x 4"
        print(f"  turn-synchronous engine / barrier-free engine: {ratios['sync_over_engine']:5.2f}x   "
              f"(target: a clear multiple, >= {TARGET_SYNC:g}x: {verdict}; the bounds' own ratio is "
              f"{sync_bound / crit:.2f}x)")
    if "sync" in results:
        ratios["sync_over_turn_synchronous_bound"] = med["sync"] / sync_bound
        print(f"  turn-synchronous engine / its bound:          {ratios['sync_over_turn_synchronous_bound']:6.2f}x")
    if "env" in results and "engine" in results:
        ratios["env_over_engine"] = med["env"] / med["engine"]
        print(f"  environment_factory / barrier-free engine:    {ratios['env_over_engine']:6.2f}x   (TRL's loop is "
              "turn-synchronous by construction: expected near the turn-synchronous figure)")
    if "trl" in results and "engine" in results:
        ratios["trl_over_engine"] = med["trl"] / med["engine"]
        print(f"  TRL's module / barrier-free engine:           {ratios['trl_over_engine']:6.2f}x")
    elif "trl" in args.skipped:
        print("  TRL's module: skipped (--skip trl), not measured")
    if "engine" in results and "floor" in results:
        ratios["engine_over_floor"] = med["engine"] / med["floor"]
        print(f"  barrier-free engine / floor:                  {ratios['engine_over_floor']:6.2f}x   (the floor "
              f"runs every rollout on its own too: {med['floor']:.2f} s)")
    summary["targets"] = {"engine_over_critical_path": TARGET_CRITICAL, "sync_over_engine": TARGET_SYNC}


def report(results: dict[str, Any], args: argparse.Namespace, bounds: dict[str, Any] | None) -> dict[str, Any]:
    r, t, g = args.rollouts, args.turns, args.generations
    print()
    config: dict[str, Any] = {"workload": args.workload, "rollouts": r, "turns": t, "generations": g,
                              "setup_delay": args.setup_delay}
    if args.workload == "uniform":
        config["tool_latency"] = args.tool_latency
        print(
            f"GRPO step environment time: {r} rollouts x {t} turns ({r // g} tasks x {g} generations), "
            f"setup {args.setup_delay:g} s, tool latency {args.tool_latency:g} s, one reference-server process"
        )
        print(
            f"lower bounds: fully serial {r * (args.setup_delay + t * args.tool_latency):.1f} s, "
            f"fully concurrent {args.setup_delay + t * args.tool_latency:.2f} s"
        )
    else:
        assert bounds is not None
        config.update(seed=args.seed, median_latency=args.median_latency, slow_calls=args.slow_calls)
        print(
            f"GRPO step environment time, heavy-tailed workload: {r} rollouts x {t} turns ({r // g} tasks x {g} "
            f"generations), setup {args.setup_delay:g} s, seed {args.seed}, log-normal tool latency median "
            f"{args.median_latency:g} s (p99/p50 = 20, capped at 40x), {args.slow_calls} rollouts with one "
            f"60x call, one reference-server process"
        )
        slow = ", ".join(f"task {s['task']} replica {s['replica']} turn {s['turn']} ({s['latency_s']:.2f} s)"
                         for s in bounds["slow_calls"])
        cr = bounds["critical_rollout"]
        print(
            f"this batch's {bounds['lognormal_draws']} log-normal draws: p50 {bounds['latency_p50_s']:.3f} s, "
            f"p99 {bounds['latency_p99_s']:.3f} s ({bounds['latency_p99_s'] / bounds['latency_p50_s']:.1f}x), "
            f"max {bounds['latency_max_s']:.2f} s; slow calls: {slow or 'none'}"
        )
        print(
            f"bounds: critical path {bounds['critical_path_s']:.2f} s (task {cr['task']} replica {cr['replica']}: "
            + " + ".join(f"{x:.2f}" for x in cr["latencies_s"])
            + f"), turn-synchronous {bounds['turn_synchronous_s']:.2f} s (turn maxima "
            + " + ".join(f"{x:.2f}" for x in bounds["turn_max_s"])
            + f"), fully serial {bounds['serial_s']:.1f} s (setup {args.setup_delay:g} s included in each)"
        )
    if args.skipped:
        print(f"skipped: {', '.join(LABELS[s] for s in args.skipped)} (--skip)")
    _print_table(results)
    summary: dict[str, Any] = {"workload": args.workload, "config": config, "skipped": list(args.skipped)}
    if bounds is not None:
        summary["bounds"] = bounds
    summary["paths"] = {name: [s.as_dict() for s in res["steps"]] for name, res in results.items()}
    if args.workload == "uniform":
        _report_uniform(results, args, summary)
    else:
        _report_heavy(results, args, summary)
    print()
    for name in PATHS:
        if name not in results or name == "floor":
            continue
        res = results[name]
        if name == "trl":
            print(
                f"sessions: {LABELS[name]}: {res['open_sessions_left']} still open after its step ({res['cleanup']})"
            )
        else:
            print(
                f"sessions: {LABELS[name]}: {res['open_sessions_before_close']} open after the step, "
                f"{res['open_sessions_left']} after spec.close()"
            )
    problems = _check(results, args)
    print(
        "correctness: "
        + (
            "every path scored every rollout 1.0, the server ran R x T tool calls"
            + (" and opened R sessions per step" if args.workload == "heavy" else "")
            + ", ors-trl left no session open"
            if not problems
            else "PROBLEMS"
        )
    )
    for p in problems:
        print(f"  - {p}")
    summary["problems"] = problems
    summary["sessions"] = {name: {k: v for k, v in res.items() if k != "steps"} for name, res in results.items()}
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=tuple(WORKLOADS), default="uniform",
                        help="uniform: every call takes --tool-latency (default); heavy: seeded heavy-tailed latencies")
    parser.add_argument("--rollouts", "-R", type=int, default=None, help="rollouts per batch (default 64; quick 16)")
    parser.add_argument("--turns", "-T", type=int, default=None, help="tool calls per rollout (default 4; quick 2)")
    parser.add_argument("--generations", "-G", type=int, default=4, help="GRPO num_generations (default 4)")
    parser.add_argument("--setup-delay", type=float, default=0.5, help="session setup seconds (default 0.5)")
    parser.add_argument("--tool-latency", type=float, default=0.2, help="uniform: seconds per tool call (default 0.2)")
    parser.add_argument("--median-latency", type=float, default=0.05,
                        help="heavy: median seconds per tool call (default 0.05)")
    parser.add_argument("--slow-calls", type=int, default=None,
                        help="heavy: rollouts with one very slow call, each on a different turn (default: --turns)")
    parser.add_argument("--seed", type=int, default=0, help="heavy: seed of the latencies (default 0)")
    parser.add_argument(
        "--steps",
        type=int,
        default=2,
        help="measured steps of the environment_factory path (step 2+ repeats the tasks: warm prompt cache)",
    )
    parser.add_argument("--engine-steps", type=int, default=None,
                        help="measured steps of the engines and the floor, median used (default 5; quick heavy 3)")
    parser.add_argument("--trl-steps", type=int, default=1, help="measured steps for TRL's module (default 1)")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated subset of {','.join(PATHS)}")
    parser.add_argument("--skip", default="", help="comma-separated paths to leave out, e.g. --skip trl")
    parser.add_argument("--no-warmup", action="store_true", help="skip the one-task warm-up step per path")
    parser.add_argument("--quick", action="store_true", help="small defaults: R=16, T=2")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args(argv)
    if args.rollouts is None:
        args.rollouts = 16 if args.quick else 64
    if args.turns is None:
        args.turns = 2 if args.quick else 4
    if args.engine_steps is None:
        args.engine_steps = 3 if args.quick and args.workload == "heavy" else 5
    if args.slow_calls is None:
        args.slow_calls = args.turns
    if (
        args.rollouts % args.generations
        or args.turns < 1
        or args.steps < 1
        or args.trl_steps < 1
        or args.engine_steps < 1
        or args.slow_calls < 0
    ):
        parser.error("--rollouts must be a multiple of --generations; --turns/--steps must be >= 1")
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    skip = [p.strip() for p in args.skip.split(",") if p.strip()]
    if not set(paths) <= set(PATHS) or not set(skip) <= set(PATHS):
        parser.error(f"--paths/--skip: choose from {','.join(PATHS)}")
    args.skipped = [p for p in PATHS if p in skip and p in paths]
    paths = [p for p in paths if p not in skip]
    fixture, args.env_key = WORKLOADS[args.workload]
    args.tool_key = f"{args.env_key}/work"

    import torch

    torch.set_num_threads(1)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    n_tasks = args.rollouts // args.generations
    tasks = list(range(n_tasks))
    warm = None if args.no_warmup else n_tasks
    bounds = None
    if args.workload == "uniform":
        server_env = {
            "ORS_TEST_SETUP_DELAY": repr(args.setup_delay),
            "ORS_TEST_TOOL_LATENCY": repr(args.tool_latency),
            "ORS_TEST_STEPS": str(args.turns),
        }
    else:
        profile = heavy_profile(args)
        server_env = profile.env()
        bounds = heavy_bounds(profile, n_tasks)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ors-bench-") as workdir:
        server = fixture_server(fixture, env=server_env).start()
        try:
            log(f"server {server.url} ({args.workload} workload); building the tiny model")
            model_dir = build_model_dir(server.url, args.env_key, args.turns, workdir)
            # ors-trl first: TRL's module leaves its sessions open, which would load the server under the others.
            if "floor" in paths:
                log(f"running {LABELS['floor']}")
                results["floor"] = run_floor(server, args, tasks, warm, log)
            for name in ("engine", "sync", "env"):
                if name in paths:
                    log(f"running {LABELS[name]}")
                    results[name] = run_ours(name, server, model_dir, workdir, args, tasks, warm, log)
            if "trl" in paths:
                log(f"running {LABELS['trl']}")
                results["trl"] = run_trl(server, model_dir, workdir, args, tasks, warm, log)
        finally:
            server.close()  # SIGTERM: the reference server tears down whatever is still open
    summary = report(results, args, bounds)
    if args.json:
        print(json.dumps(summary))
    return 1 if summary["problems"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
