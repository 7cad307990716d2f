"""Chaos soak: thousands of GRPO episodes against reference servers that fail in combination; nothing may be lost.

One reference-server process hosts `ChaosEnvironment` (tests/fixtures/environments.py): `work(step, call_id)`
finishes a task with reward 1.0 on its `--turns`-th step, and every execution is counted on the server by the
caller's call id (`ors_trl.testing.counters`, plus an append-only log file that survives restarts). A
`FaultProxy` sits in front of it; its rules' `when=` predicates draw from one seeded RNG and inject, per
request:

    gateway_5xx        bursts of 1-3 answers 502/503/504 (every route)
    reset              the connection reset before the request reached the server (every route)
    answer_lost        the server answered, the answer was cut before its body (every route but /call)
    slow_answer        the answer stalls past Timeouts.request (every route but /call)
    drop_before_id     a /call stream cut before its task id arrived (the tool did start)
    drop_after_id      a /call stream cut after its task id, inside the result (resumed by task id)
    stall_before_id    a /call stream silent past Timeouts.stream_idle before its task id
    stall_after_id     a /call stream silent past Timeouts.stream_idle after its task id (resumed)
    starting           a period of `503` + `X-Backend-State: starting` on every route (waited out)
    restart            the server process restarted mid-step (all its sessions lost): the engine path gets a
                       graceful `ReferenceServer.restart()` behind a `starting` period, the environment_factory
                       path a hard kill (SIGKILL) with the proxy answering 502 until the new process is up

Two paths, each through a real `GRPOTrainer` whose generation is a scripted model (on turn k it calls
`work(step=k, call_id=<fresh id>)`, after `--turns` calls it says "Done."), one full generate-and-score of the
batch per step (`tests.fixtures.generation`), as bench_rollouts.py does:

    engine   `spec.rollout_func` (the RolloutEngine)
    env      `spec.environment_factory` (TRL's own tool loop)

Counted, from the episode records (`episode_log=`) and the server, not from hopes:

    lost                 episodes with no record, plus records that are unscored with nothing to say why
                         (no error, no failed call, no timeout)
    duplicated           call ids the server executed more than once (a retry or resume re-ran a tool)
    ok_not_executed      calls the client reports as successful that the server never executed
    orphan_executions    executions of call ids no record mentions
    sessions_left        sessions open on the server after `spec.close()` (the restarted process's stats; the
                         killed process's sessions died with it)
    steps_crashed        training steps that raised
    peak RSS             of this process (trainer, client, proxy)

Full: `.venv/bin/python benchmarks/bench_chaos.py` (2,000 episodes, two restarts; ~2.5 minutes on 2 cores)
Quick: `.venv/bin/python benchmarks/bench_chaos.py --quick` (112 episodes, one restart; ~20-30 s)
`--json` prints one JSON object as the last line. Exit status 1 when any check failed.
"""

from __future__ import annotations

import argparse
import copy
import faulthandler
import itertools
import json
import logging
import os
import random
import resource
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]  # the package, and the suite's fixtures (tests.fixtures)
os.environ.setdefault("OPENREWARD_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from ors_trl import RetryPolicy, Timeouts  # noqa: E402
from ors_trl.testing import FaultProxy, ReferenceServer, free_port  # noqa: E402
from ors_trl.testing.faults import DropStream, Fault, Reset, Seen, Stall, Status  # noqa: E402
from tests.fixtures.generation import (  # noqa: E402
    build_tiny_model,
    cpu_grpo_trainer,
    generate_and_score,
    replace_generation,
    tool_call_text,
)

ENV = "chaosenvironment"
#: The suite's fixture environment, imported by the server process only (importing `openreward` here would add
#: ~3 s to every run); the two settings it reads at import (`tests.fixtures.environments.CHAOS_LOG_ENV`, `STEPS_ENV`).
ENV_CLASS = "tests.fixtures.environments:ChaosEnvironment"
CHAOS_LOG_ENV, STEPS_ENV = "ORS_TEST_CHAOS_LOG", "ORS_TEST_STEPS"
PATHS = ("engine", "env")
LABELS = {"engine": "rollout_func (engine)", "env": "environment_factory (TRL loop)"}
KINDS = ("gateway_5xx", "reset", "answer_lost", "slow_answer", "drop_before_id", "drop_after_id",
         "stall_before_id", "stall_after_id", "starting", "restart")
#: Deadlines the soak runs under: small, so that every slow fault costs well under a second.
TIMEOUTS = Timeouts(connect=2.0, request=1.5, stream_idle=0.6, tool_call=20.0)
RETRY = RetryPolicy(max_attempts=6, backoff_initial=0.02, backoff_max=0.25, starting_timeout=30.0, resume_attempts=4)
STARTING_HEADERS = {"X-Backend-State": "starting", "Retry-After": "1"}
#: A step that takes longer than this is a hang: the traceback of every thread is printed and the run exits.
STEP_LIMIT_S = 240.0


@dataclass
class Rates:
    """Per-request fault probabilities (a `starting` period and a burst each begin with their rate)."""

    gateway_5xx: float = 0.008
    reset: float = 0.01
    answer_lost: float = 0.008
    slow_answer: float = 0.004
    drop_before_id: float = 0.015
    drop_after_id: float = 0.03
    stall_before_id: float = 0.006
    stall_after_id: float = 0.012
    starting: float = 0.0015


class Gateway(Fault):
    """A 502, 503 or 504 (without `starting`), chosen by the chaos RNG."""

    name = "gateway_5xx"

    def __init__(self, pick: Callable[[], int]) -> None:
        self.pick = pick

    async def handle(self, ex: Any) -> None:
        await Status(self.pick()).handle(ex)


class Chaos:
    """The seeded fault plan: FaultProxy rules whose `when=` predicates draw from one RNG (thread-safe), and
    the count of every fault injected, by kind (a predicate that says yes is exactly one injection)."""

    def __init__(self, seed: int, rates: Rates) -> None:
        self.rng = random.Random(seed)
        self.rates = rates
        self.lock = threading.Lock()
        self.injected: Counter[str] = Counter()
        self.enabled = False
        self.starting_until = 0.0
        self.gate = False  # a forced `starting` period (while a server restarts)
        self.burst = 0
        self.requests = 0
        self.calls = 0

    # -- predicates -------------------------------------------------------------------------------

    def _draw(self, kind: str, seen: Seen, *, call: bool | None = None) -> bool:
        if not self.enabled or (call is not None and seen.path.endswith("/call") != call):
            return False
        with self.lock:
            if self.rng.random() < getattr(self.rates, kind):
                self.injected[kind] += 1
                return True
        return False

    def _starting(self, seen: Seen) -> bool:
        with self.lock:
            self.requests += 1
            self.calls += seen.path.endswith("/call")
            if self.gate:
                self.injected["starting_answers"] += 1
                return True
            if not self.enabled:
                return False
            now = time.monotonic()
            if now >= self.starting_until and self.rng.random() < self.rates.starting:
                self.starting_until = now + self.rng.uniform(0.3, 1.2)
                self.injected["starting"] += 1
            if now < self.starting_until:
                self.injected["starting_answers"] += 1
                return True
        return False

    def _gateway(self, seen: Seen) -> bool:
        if not self.enabled:
            return False
        with self.lock:
            if self.burst == 0 and self.rng.random() < self.rates.gateway_5xx:
                self.burst = self.rng.randint(1, 3)
                self.injected["gateway_5xx_bursts"] += 1
            if self.burst:
                self.burst -= 1
                self.injected["gateway_5xx"] += 1
                return True
        return False

    def _status(self) -> int:
        with self.lock:
            return self.rng.choice((502, 503, 504))

    def install(self, proxy: FaultProxy) -> None:
        """Program `proxy`: first match wins, so the order is the precedence of the faults."""
        slow = TIMEOUTS.stream_idle * 2.5
        proxy.add(Status(503, "Environment still starting.", headers=STARTING_HEADERS), times=None,
                  when=self._starting)
        proxy.add(Gateway(self._status), times=None, when=self._gateway)
        proxy.add(Reset(), times=None, when=lambda s: self._draw("reset", s))
        proxy.add(DropStream(after_bytes=0), times=None, when=lambda s: self._draw("answer_lost", s, call=False))
        proxy.add(Stall(after_bytes=0, seconds=(TIMEOUTS.request or 1.0) * 1.5), times=None,
                  when=lambda s: self._draw("slow_answer", s, call=False))
        proxy.add(DropStream(after_bytes=0), times=None, when=lambda s: self._draw("drop_before_id", s, call=True))
        for cut in range(62, 151, 22):  # the task-id event is 59 bytes, a result ~170: cut inside the result
            proxy.add(DropStream(after_bytes=cut), times=None,
                      when=lambda s, c=cut: self._pick_cut(s, c))
        proxy.add(Stall(after_bytes=0, seconds=slow), times=None,
                  when=lambda s: self._draw("stall_before_id", s, call=True))
        proxy.add(Stall(after_bytes=70, seconds=slow), times=None,
                  when=lambda s: self._draw("stall_after_id", s, call=True))

    def _pick_cut(self, seen: Seen, cut: int) -> bool:
        """`drop_after_id` at one of the cut points (the first rule whose draw hits takes it)."""
        if not self.enabled or not seen.path.endswith("/call"):
            return False
        with self.lock:
            if self.rng.random() < self.rates.drop_after_id / 5:
                self.injected["drop_after_id"] += 1
                return True
        return False


# -- the scripted model and the trainer -------------------------------------------------------------------------------


def chaos_generation(tokenizer: Any, turns: int, prefix: str, issued: list[str]) -> Callable[..., Any]:
    """On turn k (k tool responses so far) call `work(step=k, call_id=<fresh>)`; after `turns` calls, "Done."."""
    done = tokenizer.encode("Done.<|im_end|>", add_special_tokens=False)
    response_id = tokenizer.convert_tokens_to_ids("<tool_response>")
    ids = itertools.count()

    def generate(prompt_ids: list[list[int]], *args: Any, **kwargs: Any) -> tuple[list[list[int]], None]:
        out = []
        for prompt in prompt_ids:
            k = list(prompt).count(response_id)
            if k < turns:
                call_id = f"{prefix}-{next(ids)}"
                issued.append(call_id)
                text = tool_call_text("work", {"step": k, "call_id": call_id}) + "<|im_end|>"
                out.append(tokenizer.encode(text, add_special_tokens=False))
            else:
                out.append(list(done))
        return out, None

    return generate


#: `work` as the chat template shows it (what the spec binds; building the model needs no server).
WORK_TOOL = {"type": "function", "function": {
    "name": "work", "description": "Do one step of work; `call_id` names this call.",
    "parameters": {"type": "object", "properties": {
        "step": {"type": "integer", "description": "Step number, starting at 0."},
        "call_id": {"type": "string", "description": "A fresh id for this call."}},
        "required": ["step", "call_id"]}}}


def build_model_dir(turns: int, workdir: str) -> str:
    """The harness's tiny random Qwen3 + byte-level BPE tokenizer, trained on ChaosEnvironment conversations."""
    prompt = f"Call `work` with step=0, then 1, and so on up to step={turns - 1}, each with a new call_id."

    def episode(task: dict[str, Any], rng: random.Random) -> tuple[str, dict[str, Any], str]:
        step, call_id = rng.randrange(max(turns, 1)), f"engine-{rng.randrange(1000)}"
        return "work", {"step": step, "call_id": call_id}, f"step {step} done ({call_id})"

    return build_tiny_model(os.path.join(workdir, "tiny-model"), [WORK_TOOL], lambda task: prompt, episode, copies=8,
                            positions=1 << 13)


def make_trainer(model_dir: str, out_dir: str, spec: Any, mode: str, args: argparse.Namespace) -> Any:
    return cpu_grpo_trainer(model_dir, out_dir, batch=args.rollouts, generations=args.generations, turns=args.turns,
                            completion_length=48 * args.turns + 64, spec=spec, mode=mode)


# -- measuring --------------------------------------------------------------------------------------------------------


class Memory:
    """Samples this process's RSS (every 0.1 s, in a daemon thread) and keeps the peak."""

    def __init__(self) -> None:
        self.start = self.peak = self.now()
        self.ready = self.start  # once torch, TRL and the model are loaded: what the run itself adds is above it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    @staticmethod
    def now() -> int:
        try:
            with open("/proc/self/statm") as fh:
                return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:  # not Linux: the high-water mark is all there is
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.peak = max(self.peak, self.now())

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join(2)
        end = self.now()
        self.peak = max(self.peak, end)
        mib = 1024 * 1024
        return {"start_mib": round(self.start / mib, 1), "ready_mib": round(self.ready / mib, 1),
                "peak_mib": round(self.peak / mib, 1), "end_mib": round(end / mib, 1),
                "growth_mib": round((self.peak - self.ready) / mib, 1)}


class Restarter:
    """Restarts the server once the proxy has seen `at_calls` /call requests (mid-step), in its own thread."""

    def __init__(self, server: ReferenceServer, chaos: Chaos, at_calls: int, *, hard: bool) -> None:
        self.server, self.chaos, self.at_calls, self.hard = server, chaos, at_calls, hard
        self.done = threading.Event()
        self.info: dict[str, Any] = {"kind": "kill" if hard else "graceful", "at_calls": at_calls}
        self._cancel = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-restarter", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._cancel.is_set() and self.chaos.calls < self.at_calls:
            self._cancel.wait(0.02)
        if self._cancel.is_set():
            return
        try:
            t0 = time.monotonic()
            if self.hard:
                self._snapshot()
                self.server.kill()  # SIGKILL: no teardowns; the proxy answers 502 until the new process is up
                self.server.start()
            else:
                with self.chaos.lock:
                    self.chaos.gate = True  # a gateway would say "starting" while the backend boots
                try:
                    self._snapshot()
                    self.server.restart()
                finally:
                    with self.chaos.lock:
                        self.chaos.gate = False
            self.info["seconds"] = round(time.monotonic() - t0, 2)
            with self.chaos.lock:
                self.chaos.injected["restart"] += 1
        except Exception as exc:  # reported; the run's own checks then fail
            self.info["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            self.done.set()

    def _snapshot(self) -> None:
        """What the process about to go knows: its sessions (lost with it) and its execution counters."""
        stats = self.server.stats()
        self.info["sessions_lost"] = stats["open_sessions"]
        self.info["tool_calls"] = stats["tool_calls"]

    def finish(self) -> dict[str, Any]:
        self._cancel.set()
        self._thread.join(60)
        self.info["happened"] = self.done.is_set() and "error" not in self.info
        return self.info


@dataclass
class PathResult:
    """What one path did and what its records and the server say about it."""

    episodes: int = 0
    records: int = 0
    scored: int = 0
    unscored: dict[str, int] = field(default_factory=dict)
    lost: int = 0
    lost_examples: list[str] = field(default_factory=list)
    calls_issued: int = 0
    calls_sent: int = 0
    calls_ok: int = 0
    call_failures: dict[str, int] = field(default_factory=dict)
    steps: int = 0
    steps_crashed: int = 0
    crash_messages: list[str] = field(default_factory=list)
    sessions_left: int = 0
    restart: dict[str, Any] | None = None
    wall_s: float = 0.0
    step_s_max: float = 0.0
    rss_mib: list[float] = field(default_factory=list)  # after each step: a leak shows as a slope


def read_records(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def call_id_of(entry: dict[str, Any]) -> str | None:
    args = entry.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return args.get("call_id") if isinstance(args, dict) else None


def account(records: list[dict[str, Any]], result: PathResult, outcomes: dict[str, str]) -> None:
    """Fill `result` from the episode records; `outcomes[call_id]` = "ok" or the failure kind."""
    unscored: Counter[str] = Counter()
    failures: Counter[str] = Counter()
    for rec in records:
        calls = [c for turn in rec.get("turns") or [] for c in turn.get("tool_calls") or []
                 if c.get("status") != "not_run"]  # not sent: after a failure, past a limit (the model's, not run)
        kinds = []
        for c in calls:
            cid = call_id_of(c)
            error = c.get("error")
            kind = error.get("kind", "error") if isinstance(error, dict) else None
            if cid is not None:
                outcomes[cid] = kind or "ok"
            if kind:
                failures[kind] += 1
                kinds.append(kind)
            else:
                result.calls_ok += 1
        result.calls_sent += len(calls)
        if rec.get("reward") is not None:
            result.scored += 1
            continue
        reason = rec.get("unscored")
        error = rec.get("error")
        why = (error or {}).get("kind") if isinstance(error, dict) else None
        why = why or (kinds[-1] if kinds else None) or ("timeout" if reason == "timeout" else None)
        if reason is None or why is None:  # unscored with nothing to say why: silently lost
            result.lost += 1
            if len(result.lost_examples) < 3:
                result.lost_examples.append(json.dumps({k: rec.get(k) for k in
                                                        ("task_index", "end_reason", "unscored", "error")}))
            continue
        unscored[f"{reason}/{why}"] += 1
    result.records = len(records)
    result.unscored = dict(sorted(unscored.items()))
    result.call_failures = dict(sorted(failures.items()))
    missing = result.episodes - result.records
    if missing:
        result.lost += abs(missing)
        result.lost_examples.append(f"{result.records} records for {result.episodes} episodes")


def executions(log_path: str) -> Counter[str]:
    if not os.path.exists(log_path):
        return Counter()
    with open(log_path, encoding="utf-8") as fh:
        return Counter(line.strip() for line in fh if line.strip())


def settle(server: ReferenceServer, timeout: float = 15.0) -> int:
    try:
        return server.wait_for_stats(lambda s: s["open_sessions"] == 0, timeout=timeout)["open_sessions"]
    except TimeoutError:
        return int(server.stats()["open_sessions"])


def run_path(mode: str, server: ReferenceServer, proxy: FaultProxy, chaos: Chaos, model_dir: str, workdir: str,
             args: argparse.Namespace, n_episodes: int, restart_at: float | None, issued: list[str],
             log: Callable[[str], None]) -> PathResult:
    from ors_trl import OpenRewardSpec

    steps = max(1, -(-n_episodes // args.rollouts))
    n_tasks = min(512, steps * args.rollouts // args.generations)
    record_path = os.path.join(workdir, f"{mode}-episodes.jsonl")
    spec = OpenRewardSpec(proxy.url, env_name=ENV, num_tasks=n_tasks, timeouts=TIMEOUTS, retry=RETRY,
                          keepalive_interval=0.5, episode_log=record_path,
                          episode_timeout=60.0 if mode == "engine" else None)
    result = PathResult(episodes=steps * args.rollouts, steps=steps)
    trainer = make_trainer(model_dir, os.path.join(workdir, mode), spec, mode, args)  # discovery: no faults yet
    replace_generation(trainer, chaos_generation(trainer.processing_class, args.turns, mode, issued))
    dataset = spec.train_dataset
    per_step = args.rollouts // args.generations
    restarter = None
    if restart_at is not None:
        expected_calls = result.episodes * args.turns
        restarter = Restarter(server, chaos, chaos.calls + int(expected_calls * restart_at), hard=mode == "env")
    t0 = time.monotonic()
    chaos.enabled = True
    try:
        for step in range(steps):
            tasks = [(step * per_step + j) % n_tasks for j in range(per_step)]
            rows = [copy.deepcopy(dataset[i]) for i in tasks for _ in range(args.generations)]
            if args.hang_guard:
                faulthandler.dump_traceback_later(STEP_LIMIT_S, exit=True)
            s0 = time.monotonic()
            try:
                generate_and_score(trainer, rows)
            except Exception as exc:  # a crashed step is what this run must never see
                result.steps_crashed += 1
                if len(result.crash_messages) < 3:
                    result.crash_messages.append(f"step {step}: {type(exc).__name__}: {exc}"[:500])
            finally:
                if args.hang_guard:
                    faulthandler.cancel_dump_traceback_later()
            result.step_s_max = max(result.step_s_max, time.monotonic() - s0)
            if mode == "env":
                for callback in spec.callbacks:  # what GRPOTrainer(callbacks=spec.callbacks) does at step end
                    callback.on_step_end(None, None, None)
            proxy.clear()  # its request log grows ~2 KB a request: not the client's memory, so dropped each step
            chaos.install(proxy)
            result.rss_mib.append(round(Memory.now() / 2**20, 1))
            log(f"  {mode} step {step + 1}/{steps}: {time.monotonic() - s0:.1f} s")
    finally:
        chaos.enabled = False
        if restarter is not None:
            result.restart = restarter.finish()
        log(f"  {mode}: closing")
        spec.close()
    result.wall_s = round(time.monotonic() - t0, 2)
    result.sessions_left = settle(server)
    log(f"  {mode}: closed, {result.sessions_left} sessions left")
    return result


# -- the run ------------------------------------------------------------------------------------------------------


def _call_counts(tool_calls: dict[str, int]) -> Counter[str]:
    """The per-call-id execution counters out of a server's `stats()["tool_calls"]`."""
    prefix = f"{ENV}/call/"
    return Counter({k.removeprefix(prefix): v for k, v in tool_calls.items() if k.startswith(prefix)})


def run(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    """The whole soak; returns the summary (what `--json` prints)."""
    memory = Memory()
    t0 = time.monotonic()
    chaos = Chaos(args.seed, Rates())
    results: dict[str, PathResult] = {}
    issued: list[str] = []
    levels = {name: logging.getLogger(name).level for name in ("ors_trl", "trl")}
    with tempfile.TemporaryDirectory(prefix="ors-chaos-") as workdir:
        exec_log = os.path.join(workdir, "executions.log")
        server_env = {CHAOS_LOG_ENV: exec_log, STEPS_ENV: str(args.turns),
                      "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
        server = ReferenceServer(ENV_CLASS, env=server_env, port=free_port())
        failure: list[BaseException] = []

        def start() -> None:
            try:
                server.start()
            except BaseException as exc:  # reported below
                failure.append(exc)

        starter = threading.Thread(target=start, name="server-start", daemon=True)
        starter.start()  # the server boots while torch, transformers and TRL load and the model is built
        try:
            import torch
            from transformers.utils import logging as hf_logging

            torch.set_num_threads(1)
            hf_logging.disable_progress_bar()
            # Thousands of expected warnings (ours: a call failed, a session could not be deleted; TRL's: all of a
            # rollout's rewards are None): the records and the table say it all.
            for name in levels:
                logging.getLogger(name).setLevel(logging.ERROR)
            with FaultProxy(server.url) as proxy:
                chaos.install(proxy)
                log(f"server {server.url} starting, proxy {proxy.url}; building the tiny model")
                model_dir = build_model_dir(args.turns, workdir)
                starter.join(60)
                if failure or not server.running:
                    raise RuntimeError(f"the reference server did not start: {failure[:1]}")
                log("server up")
                from trl import GRPOTrainer  # noqa: F401  (loaded now, so that `ready` counts it)

                memory.ready = memory.now()
                split = {"engine": args.episodes // 2, "env": args.episodes - args.episodes // 2}
                for mode in args.paths:
                    restart_at = args.restart_at if mode in args.restart_paths else None
                    log(f"running {LABELS[mode]}: {split[mode]} episodes")
                    results[mode] = run_path(mode, server, proxy, chaos, model_dir, workdir, args, split[mode],
                                             restart_at, issued, log)
                counted = _call_counts(server.stats()["tool_calls"])
                for res in results.values():  # the counters of the processes that were restarted away
                    counted.update(_call_counts((res.restart or {}).pop("tool_calls", {})))
                outcomes: dict[str, str] = {}
                for mode, res in results.items():
                    account(read_records(os.path.join(workdir, f"{mode}-episodes.jsonl")), res, outcomes)
                    res.calls_issued = sum(1 for c in issued if c.startswith(f"{mode}-"))
                ran = executions(exec_log)
        finally:
            server.close()
            for name, level in levels.items():
                logging.getLogger(name).setLevel(level)
    log("server stopped")
    duplicated = sorted(cid for cid in set(ran) | set(counted) if max(ran[cid], counted[cid]) > 1)
    ok_not_executed = sorted(cid for cid, kind in outcomes.items() if kind == "ok" and ran[cid] == 0)
    orphans = sorted(cid for cid in ran if cid not in outcomes)
    ambiguous = Counter(kind for cid, kind in outcomes.items() if kind != "ok" and ran[cid] == 1)
    mem = memory.stop()
    totals = {
        "episodes": sum(r.episodes for r in results.values()),
        "scored": sum(r.scored for r in results.values()),
        "lost": sum(r.lost for r in results.values()),
        "tool_calls_sent": sum(r.calls_sent for r in results.values()),
        "tool_executions": sum(ran.values()),
        "tool_executions_counters": sum(counted.values()),
        "duplicated_executions": len(duplicated),
        "ok_not_executed": len(ok_not_executed),
        "orphan_executions": len(orphans),
        "failed_calls_that_ran": dict(ambiguous),
        "sessions_left": sum(r.sessions_left for r in results.values()),
        "steps_crashed": sum(r.steps_crashed for r in results.values()),
        "restarts": chaos.injected.get("restart", 0),
    }
    checks = {
        "lost": totals["lost"] == 0,
        "duplicated_executions": not duplicated,
        "ok_not_executed": not ok_not_executed,
        "orphan_executions": not orphans,
        "counters_within_log": totals["tool_executions_counters"] <= totals["tool_executions"],
        "sessions_left": totals["sessions_left"] == 0,
        "steps_crashed": totals["steps_crashed"] == 0,
        "restarted": all((r.restart or {}).get("happened", True) for r in results.values()),
        "scored_most": totals["scored"] >= 0.5 * totals["episodes"],
    }
    return {
        "config": {"episodes": args.episodes, "rollouts": args.rollouts, "generations": args.generations,
                   "turns": args.turns, "seed": args.seed, "paths": list(args.paths),
                   "timeouts": asdict(TIMEOUTS), "retry": asdict(RETRY), "rates": asdict(Rates())},
        "faults": {k: chaos.injected.get(k, 0) for k in (*KINDS, "gateway_5xx_bursts", "starting_answers")},
        "proxy_requests": chaos.requests,
        "paths": {mode: asdict(res) for mode, res in results.items()},
        "totals": totals,
        "examples": {"duplicated": duplicated[:5], "ok_not_executed": ok_not_executed[:5], "orphans": orphans[:5]},
        "memory": mem,
        "wall_s": round(time.monotonic() - t0, 1),
        "checks": checks,
        "ok": all(checks.values()),
    }


def report(summary: dict[str, Any]) -> None:
    cfg, tot, paths = summary["config"], summary["totals"], summary["paths"]
    print()
    print(f"Chaos soak: {tot['episodes']} episodes ({cfg['rollouts']} rollouts/step, {cfg['turns']} tool calls each), "
          f"seed {cfg['seed']}, {summary['proxy_requests']} requests through the fault proxy")
    faults = summary["faults"]
    print("faults injected: " + ", ".join(f"{k} {faults[k]}" for k in KINDS)
          + f" ({faults['gateway_5xx_bursts']} 5xx bursts, {faults['starting_answers']} `starting` answers)")
    cols = [m for m in PATHS if m in paths]
    head = f"{'':<30}" + "".join(f"{LABELS[m]:>32}" for m in cols) + f"{'total':>10}"
    print(head)
    print("-" * len(head))

    def row(label: str, values: list[Any], total: Any = "") -> None:
        print(f"{label:<30}" + "".join(f"{v!s:>32}" for v in values) + f"{total!s:>10}")

    row("episodes", [paths[m]["episodes"] for m in cols], tot["episodes"])
    row("scored", [paths[m]["scored"] for m in cols], tot["scored"])
    reasons = sorted({k for m in cols for k in paths[m]["unscored"]})
    for reason in reasons:
        values = [paths[m]["unscored"].get(reason, 0) for m in cols]
        row(f"unscored: {reason}", values, sum(values))
    row("LOST", [paths[m]["lost"] for m in cols], tot["lost"])
    row("tool calls sent (client)", [paths[m]["calls_sent"] for m in cols],
        sum(paths[m]["calls_sent"] for m in cols))
    row("  of them ok", [paths[m]["calls_ok"] for m in cols], sum(paths[m]["calls_ok"] for m in cols))
    kinds = sorted({k for m in cols for k in paths[m]["call_failures"]})
    for kind in kinds:
        values = [paths[m]["call_failures"].get(kind, 0) for m in cols]
        row(f"  failed: {kind}", values, sum(values))
    row("tool executions (server log)", ["" for _ in cols], tot["tool_executions"])
    row("  (server counters)", ["" for _ in cols], tot["tool_executions_counters"])
    row("DUPLICATED executions", ["" for _ in cols], tot["duplicated_executions"])
    row("ok calls never executed", ["" for _ in cols], tot["ok_not_executed"])
    row("executions of unknown calls", ["" for _ in cols], tot["orphan_executions"])
    row("SESSIONS LEFT open", [paths[m]["sessions_left"] for m in cols], tot["sessions_left"])
    row("steps / CRASHED", [f"{paths[m]['steps']} / {paths[m]['steps_crashed']}" for m in cols],
        tot["steps_crashed"])
    row("restart (sessions lost, s)",
        [(f"{r['kind']} ({r.get('sessions_lost', '?')}, {r.get('seconds', '?')})" if (r := paths[m]["restart"])
          else "-") for m in cols], tot["restarts"])
    row("wall s / slowest step s", [f"{paths[m]['wall_s']} / {paths[m]['step_s_max']:.1f}" for m in cols],
        summary["wall_s"])
    row("RSS MiB after step 1 / last", [f"{r[0]} / {r[-1]}" if (r := paths[m]["rss_mib"]) else "-" for m in cols])
    mem = summary["memory"]
    print(f"memory (RSS of this process): {mem['ready_mib']} MiB with torch, TRL and the model loaded, "
          f"peak {mem['peak_mib']} MiB (+{mem['growth_mib']} MiB during the run), end {mem['end_mib']} MiB")
    if tot["failed_calls_that_ran"]:
        print("failed calls the server did run once (the tool may have started; never re-run): "
              + ", ".join(f"{k} {v}" for k, v in sorted(tot["failed_calls_that_ran"].items())))
    for mode in cols:
        for msg in paths[mode]["crash_messages"] + paths[mode]["lost_examples"]:
            print(f"  {mode}: {msg}")
    failed = [k for k, ok in summary["checks"].items() if not ok]
    print("checks: " + ("all passed (lost 0, duplicated 0, sessions left 0, steps crashed 0)" if not failed
                        else "FAILED: " + ", ".join(failed)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with the defaults `--quick` implies filled in (tests call `run(parse_args([...]))`)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", "-N", type=int, default=None, help="episodes in all (default 2000; quick 112)")
    parser.add_argument("--rollouts", "-R", type=int, default=None, help="rollouts per step (default 40; quick 28)")
    parser.add_argument("--generations", "-G", type=int, default=4, help="GRPO num_generations (default 4)")
    parser.add_argument("--turns", "-T", type=int, default=3, help="tool calls per episode (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault plan (default 0)")
    parser.add_argument("--paths", default=",".join(PATHS), help="comma-separated subset of engine,env")
    parser.add_argument("--restart-at", type=float, default=0.45,
                        help="fraction of a path's tool calls after which its server restart happens (default 0.45)")
    parser.add_argument("--no-restart", action="store_true", help="no server restarts")
    parser.add_argument("--quick", action="store_true", help="112 episodes, 28 per step, one restart (engine path)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args(argv)
    args.episodes = args.episodes if args.episodes is not None else (112 if args.quick else 2000)
    args.rollouts = args.rollouts if args.rollouts is not None else (28 if args.quick else 40)
    args.paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if not set(args.paths) <= set(PATHS) or not args.paths:
        parser.error(f"--paths: choose from {','.join(PATHS)}")
    if args.rollouts % args.generations or args.turns < 1 or args.episodes < 1:
        parser.error("--rollouts must be a multiple of --generations; --turns and --episodes must be >= 1")
    args.restart_paths = () if args.no_restart else (("engine",) if args.quick else PATHS)
    args.hang_guard = False  # main() turns it on; a caller in-process bounds the run its own way
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.hang_guard = True  # a step past STEP_LIMIT_S prints every thread's stack and ends the run
    started = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {msg}", file=sys.stderr, flush=True)

    summary = run(args, log)
    report(summary)
    if args.json:
        print(json.dumps(summary))
    log("done")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
