"""Environment wall time of one GRPO step: TRL's `trl.experimental.openreward` vs ors-trl (factory and engine).

One reference-server process hosts `SlowEnvironment` (session setup sleeps `--setup-delay` s, every
`work` call sleeps `--tool-latency` s, a task finishes with reward 1.0 on its `--turns`-th call).
A batch is `--rollouts` R rollouts = R / `--generations` G tasks, each repeated G times (as GRPO
does), and every rollout makes `--turns` T tool calls. Three paths, each through a real
`GRPOTrainer` and one full `trainer._generate_and_score_completions(rows)` per step:

    (a) trl     `trl.experimental.openreward.OpenRewardSpec(url)`   environment_factory (openreward SDK)
    (b) env     `ors_trl.OpenRewardSpec(url)`                       environment_factory (TRL's own loop; ors-trl
                                                                    opens the batch's sessions and starts each
                                                                    turn's tool calls together)
    (c) engine  `ors_trl.OpenRewardSpec(url)`                       rollout_func (the RolloutEngine)
    (d) floor   raw aiohttp, no trainer: every session and call of the batch at once (what the server allows)

Each path first runs a one-task warm-up step on a task outside the measured ones. (a) is measured
for one step (`--trl-steps`); (b) for two (`--steps`): step 2 repeats the tasks, as a later epoch
does, with its prompt cache warm; (c) and (d) for `--engine-steps` (median reported).

In (a)-(c), `trainer._generate_single_turn` is replaced by the same scripted double: on turn k
the "model" emits `work(step=k)` until T calls were made, then "Done.". Model compute is therefore
~0 and the step time is environment wait plus client/trainer overhead. Also measured: the time in
`reset()` (a, b: the factory's instances are wrapped so every `reset` is timed; c: the engine's
session-open phase), the time in tool calls, and this process's CPU time.

Checked while measuring: every rollout scored (all rewards 1.0), the server ran exactly R x T
tool calls, and no session is left open on the server (ors-trl: after `spec.close()`; TRL's module
keeps its last sessions open until its adapters are reset again, reported, then cleaned up by
stopping the server).

Targets (issue 5), 64 x 4, 0.5 s setup, 0.2 s latency:
    resets: ors-trl environment_factory >= 5x faster than TRL's module
    step:   engine >= 30x faster than TRL's module

Headline: `.venv/bin/python benchmarks/bench_rollouts.py` (R=64, T=4, G=4; ~4 minutes, ~85 s of it TRL's module)
Quick:    `.venv/bin/python benchmarks/bench_rollouts.py --quick` (R=16, T=2)

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
from tests.fixtures.environments import server as fixture_server  # noqa: E402
from tests.fixtures.generation import work_turn_by_turn  # noqa: E402

ENV = "slowenvironment"
TOOL_KEY = f"{ENV}/work"
PATHS = ("trl", "env", "engine", "floor")
LABELS = {
    "trl": "(a) trl.experimental.openreward",
    "env": "(b) ors-trl environment_factory",
    "engine": "(c) ors-trl rollout_func (engine)",
    "floor": "(d) floor: raw aiohttp, no trainer",
}
TARGET_RESETS = 5.0
TARGET_ENGINE = 30.0


@dataclass
class Probe:
    """What one trainer step spent where."""

    reset_s: float = 0.0
    resets: int = 0
    tool_s: float = 0.0
    tool_calls: int = 0
    close_s: float = 0.0
    rewards: list[list[Any]] = field(default_factory=list)

    def clear(self) -> None:
        self.reset_s = self.tool_s = self.close_s = 0.0
        self.resets = self.tool_calls = 0
        self.rewards.clear()


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

    def as_dict(self) -> dict[str, Any]:
        scored = sum(1 for r in self.rewards if r == 1.0)
        return {
            "wall_s": self.wall_s,
            "cpu_s": self.cpu_s,
            "reset_s": self.reset_s,
            "resets": self.resets,
            "tool_s": self.tool_s,
            "tool_calls_server": self.tool_calls_server,
            "scored": scored,
            "rollouts": len(self.rewards),
            "open_sessions_after_step": self.open_after,
        }


# -- the tiny model and the scripted generation --------------------------------------------------------------------


def build_model_dir(url: str, turns: int, workdir: str) -> str:
    """A tiny random Qwen3 + BPE tokenizer trained on SlowEnvironment conversations (as tests/conftest.py does)."""
    import random

    from ors_trl import OpenRewardSpec
    from ors_trl.demo._model import build_model, build_tokenizer, render_corpus

    spec = OpenRewardSpec(url, env_name=ENV, num_tasks=1, keepalive_interval=None)
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

    tokenizer = build_tokenizer(render_corpus([{}], tools, lambda task: prompt, episode, copies=16))
    positions = 1 << 15  # rotary positions cost nothing; leaves room for long multi-turn episodes
    model = build_model(tokenizer, seed=0, max_position_embeddings=positions)
    tokenizer.model_max_length = positions
    path = os.path.join(workdir, "tiny-model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_trainer(
    model_dir: str, out_dir: str, dataset: Any, reward: Callable[..., Any], args: argparse.Namespace, **kwargs: Any
) -> Any:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    config = GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=args.rollouts,
        num_generations=args.generations,
        max_completion_length=64 * args.turns + 256,
        max_tool_calling_iterations=args.turns,
        beta=0.0,
        report_to="none",
        use_cpu=True,
        max_steps=1,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        args=config,
        train_dataset=dataset,
        reward_funcs=reward,
        **kwargs,
    )
    # the scripted model: work(step=k) on turn k, then "Done." (tests.fixtures.generation)
    trainer._generate_single_turn = work_turn_by_turn(trainer.processing_class, args.turns)
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


def instrument_engine(engine: Any, probe: Probe) -> None:
    """Time the engine's phases: session opens (its 'resets'), tool turns, closes."""

    def wrap(name: str, attr: str) -> None:
        inner = getattr(engine, name)

        async def timed(episodes: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await inner(episodes)
            finally:
                setattr(probe, attr, getattr(probe, attr) + time.perf_counter() - t0)
                if name == "_open_all":
                    probe.resets += len(episodes)

        setattr(engine, name, timed)

    wrap("_open_all", "reset_s")
    wrap("_run_tools", "tool_s")
    wrap("_finish_all", "close_s")


def capture_rewards(fn: Callable[..., Any], probe: Probe) -> Callable[..., Any]:
    def outcome_reward(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        probe.rewards.append(list(out))
        return out

    return outcome_reward


def batch_rows(dataset: Any, indices: list[int], generations: int) -> list[dict[str, Any]]:
    return [copy.deepcopy(dataset[i]) for i in indices for _ in range(generations)]


def run_step(trainer: Any, rows: list[dict[str, Any]], probe: Probe, server: ReferenceServer) -> StepResult:
    probe.clear()
    before = server.stats()["tool_calls"].get(TOOL_KEY, 0)
    c0, t0 = time.process_time(), time.perf_counter()
    trainer._generate_and_score_completions(copy.deepcopy(rows))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    stats = server.stats()
    rewards = probe.rewards[-1] if probe.rewards else []
    return StepResult(
        wall,
        cpu,
        probe.reset_s,
        probe.resets,
        probe.tool_s,
        probe.tool_calls,
        stats["tool_calls"].get(TOOL_KEY, 0) - before,
        rewards,
        stats["open_sessions"],
    )


# -- the three paths -------------------------------------------------------------------------------------------------


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
    spec = TRLSpec(server.url, num_tasks=len(tasks) + (warm is not None), env_name=ENV)
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


async def _floor_batch(url: str, rows: list[int], turns: int) -> tuple[float, float, list[Any]]:
    """The environment side of one batch with nothing else: raw aiohttp, every session and call at once."""
    import aiohttp

    env = f"/{ENV}"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

        async def open_one(index: int) -> dict[str, str]:
            async with http.post(url + "/create_session", data=b"{}") as r:
                body = await r.text()
            sid = body.split("data:", 1)[1].split("\n", 1)[0].strip()
            h = {"X-Session-ID": sid, "Content-Type": "application/json"}
            payload = json.dumps({"split": "train", "index": index, "env_name": ENV})
            async with http.post(url + "/create", data=payload, headers=h) as r:
                await r.read()
            async with http.get(url + env + "/prompt", headers=h) as r:
                await r.json()
            return h

        async def call(h: dict[str, str], step: int) -> Any:
            payload = json.dumps({"name": "work", "input": {"step": step}})
            async with http.post(url + env + "/call", data=payload, headers=h) as r:
                text = await r.text()
            event, data = "", []
            for line in text.splitlines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:") and event in ("chunk", "end"):
                    data.append(line[6:] if line.startswith("data: ") else line[5:])
            return json.loads("".join(data))["output"]["reward"]

        async def close(h: dict[str, str]) -> None:
            for path in ("/delete", "/delete_session"):
                async with http.post(url + path, headers=h) as r:
                    await r.read()

        t0 = time.perf_counter()
        heads = await asyncio.gather(*(open_one(i) for i in rows))
        t1 = time.perf_counter()
        rewards: list[Any] = [None] * len(rows)
        for step in range(turns):
            rewards = await asyncio.gather(*(call(h, step) for h in heads))
        t2 = time.perf_counter()
        await asyncio.gather(*(close(h) for h in heads))
    return t1 - t0, t2 - t1, list(rewards)


def run_floor(
    server: ReferenceServer, args: argparse.Namespace, tasks: list[int], log: Callable[[str], None]
) -> dict[str, Any]:
    rows = [i for i in tasks for _ in range(args.generations)]
    asyncio.run(_floor_batch(server.url, rows[: args.generations], args.turns))  # warm-up
    steps = []
    for i in range(args.engine_steps):
        before = server.stats()["tool_calls"].get(TOOL_KEY, 0)
        c0, t0 = time.process_time(), time.perf_counter()
        open_s, tool_s, rewards = asyncio.run(_floor_batch(server.url, rows, args.turns))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        stats = server.stats()
        calls = stats["tool_calls"].get(TOOL_KEY, 0) - before
        steps.append(StepResult(wall, cpu, open_s, len(rows), tool_s, calls, calls, rewards, stats["open_sessions"]))
        log(f"  floor step {i + 1}: {wall:.2f} s (opens {open_s:.2f} s, tools {tool_s:.2f} s)")
    return {"steps": steps, "open_sessions_before_close": 0, "open_sessions_left": server.stats()["open_sessions"]}


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
    spec = OpenRewardSpec(server.url, num_tasks=len(tasks) + (warm is not None), env_name=ENV)
    reward = capture_rewards(spec.reward_funcs, probe)
    if mode == "env":
        factory = timed_factory(spec.environment_factory, probe, "_call_tool")
        trainer = make_trainer(
            model_dir, os.path.join(workdir, mode), spec.train_dataset, reward, args, environment_factory=factory
        )
    else:
        instrument_engine(spec.rollout_func, probe)
        trainer = make_trainer(
            model_dir, os.path.join(workdir, mode), spec.train_dataset, reward, args, rollout_func=spec.rollout_func
        )
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
        run_step(trainer, batch_rows(dataset, [warm], args.generations), probe, server)
    rows = batch_rows(dataset, tasks, args.generations)
    out = []
    for i in range(n_steps):
        result = run_step(trainer, rows, probe, server)
        log(
            f"  {name} step {i + 1}: {result.wall_s:.2f} s (resets {result.reset_s:.2f} s, tools {result.tool_s:.2f} s)"
        )
        out.append(result)
    return out


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
        if name != "trl" and res["open_sessions_left"] != 0:
            problems.append(f"{name}: {res['open_sessions_left']} sessions left open after spec.close()")
    return problems


def _verdict(value: float, target: float) -> str:
    return "MET" if value >= target else "NOT MET"


def report(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    r, t, g = args.rollouts, args.turns, args.generations
    headline = (r, t, args.setup_delay, args.tool_latency) == (64, 4, 0.5, 0.2)
    print()
    print(
        f"GRPO step environment time: {r} rollouts x {t} turns ({r // g} tasks x {g} generations), "
        f"setup {args.setup_delay:g} s, tool latency {args.tool_latency:g} s, one reference-server process"
    )
    print(
        f"lower bounds: fully serial {r * (args.setup_delay + t * args.tool_latency):.1f} s, "
        f"fully concurrent {args.setup_delay + t * args.tool_latency:.2f} s"
    )
    head = f"{'path':<36} {'step':>4} {'wall s':>8} {'resets s':>9} {'tools s':>8} {'cpu s':>7} {'scored':>8} {'calls':>6}"
    print(head)
    print("-" * len(head))
    for name in PATHS:
        if name not in results:
            continue
        for i, step in enumerate(results[name]["steps"]):
            scored = sum(1 for x in step.rewards if x == 1.0)
            print(
                f"{LABELS[name]:<36} {i + 1:>4} {step.wall_s:8.2f} {step.reset_s:9.2f} {step.tool_s:8.2f}"
                f" {step.cpu_s:7.2f} {scored:>4}/{len(step.rewards):<3} {step.tool_calls_server:>6}"
            )
    print(
        "(resets: time inside reset() for (a)/(b); the concurrent session-open phase for (c), (d). "
        "(b) step 2: the same tasks again, prompt cache warm; (c), (d): repeated steps, the median is used)"
    )
    summary: dict[str, Any] = {
        "config": {
            "rollouts": r,
            "turns": t,
            "generations": g,
            "setup_delay": args.setup_delay,
            "tool_latency": args.tool_latency,
        }
    }
    summary["paths"] = {name: [s.as_dict() for s in res["steps"]] for name, res in results.items()}
    if "trl" in results:
        trl = results["trl"]["steps"][0]
        print()
        print("ratios (TRL's module step 1 / ors-trl)")
        ratios: dict[str, float] = {}
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
            ratios["resets_trl_over_engine"] = trl.reset_s / statistics.median(x.reset_s for x in eng_steps)
            verdict = _verdict(ratios["step_trl_over_engine"], TARGET_ENGINE) if headline else "stated for 64 x 4"
            print(
                f"  step,   engine:                      {ratios['step_trl_over_engine']:7.1f}x   "
                f"(target >= {TARGET_ENGINE:g}x: {verdict}; median of {len(walls)} steps, range "
                f"{ratios['step_trl_over_engine_worst']:.1f}x-{ratios['step_trl_over_engine_best']:.1f}x)"
            )
            print(f"  resets, engine (session-open phase): {ratios['resets_trl_over_engine']:7.1f}x")
        summary["ratios"] = ratios
        summary["targets"] = {"resets_trl_over_env": TARGET_RESETS, "step_trl_over_engine": TARGET_ENGINE}
    if "engine" in results and "floor" in results:
        eng, flo = results["engine"]["steps"], results["floor"]["steps"]
        med_eng, med_floor = statistics.median(x.wall_s for x in eng), statistics.median(x.wall_s for x in flo)
        over = med_eng / med_floor
        summary.setdefault("ratios", {})["engine_over_floor"] = over
        print(
            f"  engine / floor (median steps, {med_eng:.2f} s / {med_floor:.2f} s): {over:.2f}x "
            "(the floor is what this server and machine allow with no client or trainer at all)"
        )
    print()
    for name in PATHS:
        if name not in results:
            continue
        res = results[name]
        if name == "floor":
            continue
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
            "every path scored every rollout 1.0, the server ran R x T tool calls, ors-trl left no session open"
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
    parser.add_argument("--rollouts", "-R", type=int, default=None, help="rollouts per batch (default 64; quick 16)")
    parser.add_argument("--turns", "-T", type=int, default=None, help="tool calls per rollout (default 4; quick 2)")
    parser.add_argument("--generations", "-G", type=int, default=4, help="GRPO num_generations (default 4)")
    parser.add_argument("--setup-delay", type=float, default=0.5, help="session setup seconds (default 0.5)")
    parser.add_argument("--tool-latency", type=float, default=0.2, help="seconds per tool call (default 0.2)")
    parser.add_argument(
        "--steps",
        type=int,
        default=2,
        help="measured steps of the environment_factory path (step 2+ repeats the tasks: warm prompt cache)",
    )
    parser.add_argument(
        "--engine-steps", type=int, default=5, help="measured steps of the engine and the floor (median is used)"
    )
    parser.add_argument("--trl-steps", type=int, default=1, help="measured steps for TRL's module (default 1)")
    parser.add_argument("--paths", default=",".join(PATHS), help="comma-separated subset of trl,env,engine,floor")
    parser.add_argument("--no-warmup", action="store_true", help="skip the one-task warm-up step per path")
    parser.add_argument("--quick", action="store_true", help="small defaults: R=16, T=2")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args(argv)
    if args.rollouts is None:
        args.rollouts = 16 if args.quick else 64
    if args.turns is None:
        args.turns = 2 if args.quick else 4
    if (
        args.rollouts % args.generations
        or args.turns < 1
        or args.steps < 1
        or args.trl_steps < 1
        or args.engine_steps < 1
    ):
        parser.error("--rollouts must be a multiple of --generations; --turns/--steps must be >= 1")
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if not set(paths) <= set(PATHS):
        parser.error(f"--paths: choose from {','.join(PATHS)}")

    import torch

    torch.set_num_threads(1)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    n_tasks = args.rollouts // args.generations
    tasks = list(range(n_tasks))
    warm = None if args.no_warmup else n_tasks
    server_env = {
        "ORS_TEST_SETUP_DELAY": repr(args.setup_delay),
        "ORS_TEST_TOOL_LATENCY": repr(args.tool_latency),
        "ORS_TEST_STEPS": str(args.turns),
    }
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ors-bench-") as workdir:
        server = fixture_server("slow", env=server_env).start()
        try:
            log(f"server {server.url}; building the tiny model")
            model_dir = build_model_dir(server.url, args.turns, workdir)
            # ors-trl first: TRL's module leaves its sessions open, which would load the server under the others.
            if "floor" in paths:
                log(f"running {LABELS['floor']}")
                results["floor"] = run_floor(server, args, tasks, log)
            for name in ("engine", "env"):
                if name in paths:
                    log(f"running {LABELS[name]}")
                    results[name] = run_ours(name, server, model_dir, workdir, args, tasks, warm, log)
            if "trl" in paths:
                log(f"running {LABELS['trl']}")
                results["trl"] = run_trl(server, model_dir, workdir, args, tasks, warm, log)
        finally:
            server.close()  # SIGTERM: the reference server tears down whatever is still open
    summary = report(results, args)
    if args.json:
        print(json.dumps(summary))
    return 1 if summary["problems"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
