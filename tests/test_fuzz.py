"""Fuzzing against a hostile ORS server (``tests/fixtures/hostile_server.py``): the client, the spec (dataset,
environment_factory, tool calls, reward_funcs), the episode core as the engine drives it, ``inspect`` and
``eval``, for a bounded, seeded number of requests.

Every failure must be a typed ``ORSError`` with a readable message (or a rollout scored None with a reason),
nothing may run past the deadlines it was configured with, no credential may appear in any message, exception
chain, record, report, log line or text the model is shown, no text may hold a lone surrogate (what a tokenizer
or a file write dies of), and a 64 MiB+ answer is refused rather than buffered. Task fields named like what TRL
passes itself are kept under renamed columns, and TRL's calls with the row's columns as keywords work; every episode
run is a line of the episode log or eval output (or counted as dropped by the writer); the text ``inspect`` prints
holds no terminal control character; and ``write_report`` on the logs the run wrote writes a page that counts what it
skipped and holds neither a credential nor a lone surrogate. The run's figures are printed (``pytest -s``) and kept
in ``FIGURES`` for whoever wants them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import glob
import inspect
import json
import logging
import math
import os
import random
import re
import threading
import time
import traceback
import tracemalloc
import unicodedata
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from ors_trl import (
    AsyncClient,
    OpenRewardSpec,
    ORSError,
    PolicyReply,
    ProtocolError,
    RetryPolicy,
    ServerError,
    Timeouts,
    write_report,
)
from ors_trl.cli.inspect import inspect_target, render_text
from ors_trl.core.episode import Task, score_groups
from ors_trl.protocol.loop import get_loop
from ors_trl.protocol.target import encode_secrets
from ors_trl.tasks.selection import RESERVED_COLUMNS
from tests.fixtures.hostile_server import BIG, COLLIDE_MARK, DEEP_NAN_KEY, ENV, SLOW_S, HostileServer

KEY = "sk-fuzz-APIKEY-7f3a9c2e1b4d"
SECRET_A = "hunter2-SECRET-9d8e7f6a"
SECRET_B = "tok-SECRET-5a4b3c2d1e"
SECRETS: dict[str, Any] = {"db_password": SECRET_A, "search_token": (SECRET_B, ["example.com"])}
LEAKS = (KEY, SECRET_A, SECRET_B, encode_secrets(SECRETS))

TIMEOUTS = Timeouts(connect=1.0, request=0.5, stream_idle=0.3, tool_call=1.5)
RETRY = RetryPolicy(max_attempts=2, backoff_initial=0.01, backoff_max=0.05, starting_timeout=0.3, resume_attempts=2)
#: The longest one request may take under these settings: every attempt, every backoff, the `starting` wait.
REQUEST_BOUND_S = RETRY.max_attempts * (TIMEOUTS.request + RETRY.backoff_max) + RETRY.starting_timeout + 0.1
CALL_BOUND_S = TIMEOUTS.tool_call + 0.1
#: Scheduling noise on a loaded 2-core machine (never a performance claim: only "bounded").
SLACK_S = 3.0
#: Requests the random run sends the hostile server (seeded; a few hundred). A longer hunt:
#: `ORS_FUZZ_SEED=7 ORS_FUZZ_REQUESTS=3000 pytest tests/test_fuzz.py -k every -s`.
TARGET_REQUESTS = int(os.environ.get("ORS_FUZZ_REQUESTS", "320"))
MAX_OPS = max(400, TARGET_REQUESTS)
WORKERS = 4
MAX_MESSAGE = 5000
KINDS = {"configuration", "usage", "not_found", "http", "auth", "expired", "refused", "failed", "transport",
         "timeout", "protocol", "policy", "context_length", "error"}
UNSCORED = {"timeout", "error", "cut_off", "no_reward"}
#: The figures of the last run (filled by `test_fuzz_every_entry_point`).
FIGURES: dict[str, Any] = {}
#: The columns ors-trl itself puts into a training dataset; every other name in `RESERVED_COLUMNS` is a task field's,
#: which must have been renamed.
OWN_COLUMNS = frozenset({"prompt", "task_index"})
#: A surrogate escape of JSON with no partner: what a page must not hold (`json.loads` would make it a lone one).
LONE_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])"
                                   r"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}")


# --------------------------------------------------------------------------------------------------
# Checking what came back
# --------------------------------------------------------------------------------------------------


def leaked(text: str, window: int = 12) -> str | None:
    """The first piece of a credential in `text` (any `window` characters of one: a cut secret leaks too)."""
    for secret in LEAKS:
        for i in range(max(len(secret) - window, 0) + 1):
            if secret[i:i + window] in text:
                return secret[i:i + window]
    return None


class Tally:
    """Outcomes by entry point and kind, and every problem found (crashes, hangs, leaks, unreadable errors)."""

    def __init__(self) -> None:
        self.outcomes: Counter[str] = Counter()
        self.problems: list[str] = []
        self.hangs = 0
        self.crashes = 0
        self.lock = threading.Lock()

    def problem(self, text: str) -> None:
        with self.lock:
            self.problems.append(text[:600])

    def ok(self, what: str) -> None:
        with self.lock:
            self.outcomes[f"{what}: ok"] += 1

    def error(self, what: str, exc: BaseException) -> None:
        """Tally a failure; anything but a typed ORSError with a readable, secret-free message is a problem."""
        if not isinstance(exc, ORSError):
            with self.lock:
                self.crashes += 1
                self.outcomes[f"{what}: CRASH {type(exc).__name__}"] += 1
            self.problem(f"{what}: untyped {type(exc).__name__}: {str(exc)[:300]}")
            return
        with self.lock:
            self.outcomes[f"{what}: {exc.kind}"] += 1
        message = str(exc)
        if exc.kind not in KINDS:
            self.problem(f"{what}: unknown kind {exc.kind!r}")
        if not message.strip() or len(message) > MAX_MESSAGE:
            self.problem(f"{what}: unreadable message of {len(message)} chars ({type(exc).__name__}): "
                         f"{message[:200]!r}")
        if any(ord(c) < 32 and c not in "\n\t" for c in message):
            self.problem(f"{what}: control characters in the message: {message[:200]!r}")
        self.scan(f"{what} error {type(exc).__name__}", message + repr(exc.args) + str(getattr(exc, "detail", "")))
        self.scan(f"{what} traceback {type(exc).__name__}", "".join(traceback.format_exception(exc)))

    def scan(self, where: str, text: str) -> None:
        if (piece := leaked(text)) is not None:
            self.problem(f"{where}: a credential leaked: ...{text[max(0, text.find(piece) - 80):][:200]!r}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            self.problem(f"{where}: text a tokenizer or a file cannot take ({exc.reason}): {text[:200]!r}")

    def record(self, where: str, rec: dict[str, Any]) -> None:
        """An episode record: scored with a finite reward, or unscored with a reason; typed errors; no secret."""
        reward = rec.get("reward")
        if reward is not None and not (isinstance(reward, float | int) and math.isfinite(reward)):
            self.problem(f"{where}: record reward {reward!r}")
        if reward is None and rec.get("unscored") not in UNSCORED:
            self.problem(f"{where}: unscored record without a reason: {rec.get('unscored')!r}")
        errors = [rec.get("error")] + [c.get("error") for t in rec.get("turns") or [] for c in t.get("tool_calls") or []]
        errors += [(rec.get("final") or {}).get("error")]
        for error in errors:
            if error is not None and error.get("kind") not in KINDS:
                self.problem(f"{where}: record error of kind {error.get('kind')!r}: {error}")
        self.scan(f"{where} record", json.dumps(rec, default=str, ensure_ascii=False))
        with self.lock:
            self.outcomes[f"{where} records: " + ("scored" if reward is not None else f"unscored/{rec.get('unscored')}")] += 1


def controls(text: str) -> str:
    """The characters of `text` a terminal obeys rather than shows: C0 and C1 controls and Unicode format characters
    (categories Cc and Cf: escape sequences, bidi overrides), newline and tab excepted."""
    return "".join(sorted({c for c in text if c not in "\n\t" and unicodedata.category(c) in ("Cc", "Cf")}))


def collisions(row: dict[str, Any]) -> int:
    """How many values of a dataset row the hostile server sent under a name TRL passes itself."""
    return sum(isinstance(v, str) and v.startswith(COLLIDE_MARK) for v in row.values())


def check_columns(dataset: Any, tally: Tally) -> None:
    """No column of a training dataset has a name TRL or ors-trl passes itself, except ors-trl's own; a task field
    sent under such a name (its value says which) is kept under `task_<name>`."""
    for column in dataset.column_names:
        if column not in OWN_COLUMNS and (column in RESERVED_COLUMNS or column.startswith("ors_")):
            tally.problem(f"spec.train_dataset: a column named {column!r}, a name TRL or ors-trl passes itself")
        for value in dataset[column]:
            if not (isinstance(value, str) and value.startswith(COLLIDE_MARK) and ";" in value):
                continue
            sent = value[len(COLLIDE_MARK):value.index(";")]
            bare = column
            while bare.startswith("task_") and bare != sent:
                bare = bare[len("task_"):]
            if column == sent:
                tally.problem(f"spec.train_dataset: task field {sent!r} kept under its own name")
            elif bare == sent:
                tally.ok("spec.renamed task field")


def call_like_trl(reward_func: Callable[..., Any], row: dict[str, Any], environments: list[Any],
                  completions: list[Any]) -> Any:
    """`reward_func` called as `GRPOTrainer._calculate_rewards` calls it (TRL 1.16): every column of the row but
    `prompt`, `completion` and `completion_ids` as a keyword, TRL's own keywords set over them."""
    kwargs: dict[str, Any] = {k: [v] for k, v in row.items() if k not in ("prompt", "completion", "completion_ids")}
    kwargs.update(trainer_state=None, log_extra=lambda column, values: None, log_metric=lambda name, value: None,
                  environments=environments)
    return reward_func(prompts=[row.get("prompt")], completions=completions, completion_ids=[[0]], **kwargs)


def count_lines(path: str, tally: Tally | None = None, where: str = "") -> int:
    """The records a JSON-lines file holds (each checked by `tally.record` when given); 0 if it does not exist."""
    if not os.path.exists(path):
        return 0
    n = 0
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                n += 1
                if tally is not None:
                    tally.record(where, json.loads(line))
    return n


class Captured(logging.Handler):
    """Every log line of ors-trl and asyncio during the run: scanned for credentials and background crashes."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[str, int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            self.lines.append((record.name, record.levelno, record.getMessage()
                               + (logging.Formatter().formatException(record.exc_info) if record.exc_info else "")))


@contextlib.contextmanager
def captured_logs() -> Any:
    handler = Captured()
    loggers = [logging.getLogger(n) for n in ("ors_trl", "asyncio")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.removeHandler(handler)
            lg.setLevel(level)


# --------------------------------------------------------------------------------------------------
# What a model would send
# --------------------------------------------------------------------------------------------------


def texts(value: Any) -> str:
    """Every string in what a call returned (dataclasses, lists, dicts), joined: what a model or a record gets."""
    out: list[str] = []
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            out.append(node)
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list | tuple):
            stack.extend(node)
        elif dataclasses.is_dataclass(node):
            stack.extend(getattr(node, f.name) for f in dataclasses.fields(node))
    return "\n".join(out)


def example_value(schema: Any) -> Any:
    kind = schema.get("type") if isinstance(schema, dict) else None
    kind = kind[0] if isinstance(kind, list) and kind else kind
    return {"integer": 0, "number": 0.5, "boolean": True, "array": [], "object": {}, "null": None}.get(kind, "x")


def example_arguments(schema: Any) -> dict[str, Any]:
    """Arguments for a JSON schema: every required property, a value of its type."""
    if not isinstance(schema, dict) or not isinstance(schema.get("properties"), dict):
        return {}
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    return {k: example_value(v) for k, v in schema["properties"].items() if k in required}


def keyword_arguments(function: Any) -> dict[str, Any]:
    """Arguments for a bound tool method: every parameter without a default, a value of its annotation."""
    out: dict[str, Any] = {}
    for name, param in list(inspect.signature(function).parameters.items())[1:]:
        if param.default is not inspect.Parameter.empty or param.kind in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
            continue
        origin = getattr(param.annotation, "__origin__", param.annotation)
        out[name] = {int: 0, float: 0.5, bool: True, str: "x", list: [], dict: {}}.get(origin)
    return out


class ScriptedPolicy:
    """`eval`'s policy: first turn calls the first tool with schema-shaped arguments, then answers in plain text."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    async def respond(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> PolicyReply:
        turns = sum(1 for m in messages if m.get("role") == "assistant")
        if tools and turns == 0:
            fn = tools[0].get("function", tools[0]) if isinstance(tools[0], dict) else {}
            return PolicyReply(content="", tool_calls=[{"id": "call_0", "name": str(fn.get("name")),
                                                        "arguments": example_arguments(fn.get("parameters"))}])
        return PolicyReply(content=self.rng.choice(["final answer", "", "Paris."]))


# --------------------------------------------------------------------------------------------------
# The entry points
# --------------------------------------------------------------------------------------------------


def spec_for(url: str, tmp: str, **kwargs: Any) -> OpenRewardSpec:
    return OpenRewardSpec(url, num_tasks=2, api_key=KEY, secrets=SECRETS, timeouts=TIMEOUTS, retry=RETRY,
                          keepalive_interval=0.2, **kwargs)


async def op_client(url: str, rng: random.Random, tally: Tally) -> None:
    """Metadata calls of `AsyncClient`, each tallied."""
    async with AsyncClient(url, api_key=KEY, secrets=SECRETS, timeouts=TIMEOUTS, retry=RETRY,
                           keepalive_interval=0.2) as client:
        calls: list[tuple[str, Callable[[], Any]]] = [
            ("list_environments", client.list_environments), ("environment", client.environment),
            ("health", client.health), ("splits", client.splits), ("num_tasks", lambda: client.num_tasks("train")),
            ("task", lambda: client.task("train", 1)), ("task_range", lambda: client.task_range("train", 0, 2)),
            ("tasks", lambda: client.tasks("train")), ("tools", client.tools)]
        for name, call in rng.sample(calls, 4):
            try:
                value = await call()
            except BaseException as exc:
                tally.error(f"client.{name}", exc)
            else:
                tally.scan(f"client.{name}", texts(value))
                tally.ok(f"client.{name}")


async def op_session(url: str, rng: random.Random, tally: Tally) -> None:
    """A session's whole life on `AsyncSession`: open, prompt, messages, tools, calls, group score, ping, close."""
    async with AsyncClient(url, env_name=ENV, api_key=KEY, secrets=SECRETS, timeouts=TIMEOUTS, retry=RETRY,
                           keepalive_interval=0.2) as client:
        try:
            session = await client.open_session(split="train", index=rng.randrange(3))
        except BaseException as exc:
            tally.error("session.open", exc)
            return
        tally.ok("session.open")
        steps: list[tuple[str, Callable[[], Any]]] = [
            ("prompt", session.prompt), ("messages", session.messages), ("tools", session.tools),
            ("call", lambda: session.call("work", {"step": rng.randrange(3)})),
            ("call", lambda: session.call("work", {"step": 1})),
            ("score_group", lambda: session.score_group([{"messages": [], "metadata": {"i": 0}}] * 2)),
            ("ping", session.ping)]
        try:
            for name, step in rng.sample(steps, 5):
                try:
                    value = await step()
                except BaseException as exc:
                    tally.error(f"session.{name}", exc)
                else:
                    tally.scan(f"session.{name}", texts(value))
                    tally.ok(f"session.{name}")
        finally:
            await session.close()


def op_spec(url: str, rng: random.Random, tally: Tally, tmp: str) -> None:
    """The spec as TRL uses it: dataset, environment_factory, `reset(**row)`, tool methods, reward_funcs with the
    row's columns as keywords, close; then every episode run is a line of the episode log, or counted as dropped."""
    log = os.path.join(tmp, f"spec-{rng.getrandbits(32):x}.jsonl")
    spec = spec_for(url, tmp, episode_log=log)
    episodes = 0
    try:
        dataset = spec.train_dataset
        check_columns(dataset, tally)
        rows = [dataset[i] for i in range(len(dataset))]
        row = max(rows, key=collisions, default={"task_index": 0})  # the row with the most colliding fields
        factory = spec.environment_factory
        env = factory()
        text = env.reset(**row)  # as TRL calls it: a column named like a parameter is a TypeError
        episodes += 1
        tally.scan("spec.reset prompt", texts(text))
        for bound in list(spec.binding.tools.values())[:2]:
            method = getattr(env, bound.attribute)
            try:
                shown = method(**keyword_arguments(method))  # what TRL hands the model
            except BaseException as exc:
                tally.error("spec.tool", exc)
            else:
                tally.scan("spec.tool output", texts(shown))
                tally.ok("spec.tool")
        rewards = call_like_trl(spec.reward_funcs, row, [env], [[{"role": "assistant", "content": "done"}]])
        if not (len(rewards) == 1 and (rewards[0] is None or math.isfinite(rewards[0]))):
            tally.problem(f"spec.reward_funcs returned {rewards!r}")
        tally.ok("spec")
    except BaseException as exc:
        tally.error("spec", exc)
    finally:
        spec.close()
    lines = count_lines(log, tally, "spec")
    recorder = spec._runtime.recorder
    dropped = recorder.dropped if recorder is not None else 0
    if lines + dropped != episodes:
        tally.problem(f"spec: {episodes} episode(s) run, {lines} record(s) in the episode log and {dropped} counted "
                      "as dropped")


def op_engine(url: str, rng: random.Random, tally: Tally, tmp: str) -> None:
    """The episode core as the engine drives it: open, the turn rule on a reply with calls, then on a plain (or
    cut-off) reply, group score, close.

    As in the engine, the tool schemas are rendered in the calling thread, never on the event loop."""
    from ors_trl.core.episode import Reply, Rules

    spec = spec_for(url, tmp)
    episodes: list[Any] = []
    try:
        _ = spec.environment_factory  # binds the tools, as `rollout_func` does
        runtime = spec._runtime

        async def open_two() -> list[Any]:
            eps = [runtime.episode(Task("train", 0), source="fuzz", rules=Rules(max_replies=3)) for _ in range(2)]
            episodes.extend(eps)
            await asyncio.gather(*(ep.open() for ep in eps))
            return [ep for ep in eps if ep.prompt is not None]

        opened = spec.run(open_two())
        plans = []
        for ep in opened:
            rendered = ep.toolset.schemas if ep.toolset is not None else []  # what the engine renders
            schemas = {s["function"]["name"]: s["function"].get("parameters") for s in rendered}
            calls = [{"type": "function", "function": {"name": n, "arguments": example_arguments(schemas[n])}}
                     for n in list(schemas)[:2]] or [{"type": "function", "function": {"name": "work", "arguments": {}}}]
            plans.append((ep, calls))

        async def play() -> None:
            async def one(ep: Any, calls: list[dict[str, Any]]) -> None:
                await ep.reply(Reply(None, calls))
                final = rng.choice(["final answer", None])
                await ep.reply(Reply(final, truncated=final is None))

            await asyncio.gather(*(one(ep, calls) for ep, calls in plans))
            if runtime.supports_score_group and opened:
                await score_groups(opened)
            await asyncio.gather(*(ep.close() for ep in episodes))

        spec.run(play())
        tally.ok("engine")
    except BaseException as exc:
        tally.error("engine", exc)
    finally:
        spec.close()
    for ep in episodes:
        tally.record("engine", ep.record())


def op_eval(url: str, rng: random.Random, tally: Tally, tmp: str) -> None:
    """`spec.evaluate` with a scripted policy."""
    spec = spec_for(url, tmp)
    output = os.path.join(tmp, f"eval-{rng.getrandbits(32):x}.jsonl")
    report = None
    try:
        report = spec.evaluate(ScriptedPolicy(rng), num_tasks=2, concurrency=2, max_turns=2, progress=False,
                               output=output)
        tally.scan("eval summary", report.summary())
        for rec in report.episodes:
            tally.record("eval", rec)
        tally.ok("eval")
    except BaseException as exc:
        tally.error("eval", exc)
    finally:
        spec.close()
    if os.path.exists(output):
        with open(output, encoding="utf-8") as fh:
            tally.scan("eval --output", fh.read())
    lines = count_lines(output)
    if report is not None and lines != report.num_episodes:  # its writer has no size bound: nothing may be dropped
        tally.problem(f"eval: {report.num_episodes} episode(s) run, {lines} record(s) in --output")


def op_inspect(url: str, rng: random.Random, tally: Tally, tmp: str) -> None:
    """`ors-trl inspect`'s core and its text rendering, which must hold no character a terminal obeys."""
    try:
        info = inspect_target(url, api_key=KEY, timeouts=TIMEOUTS, retry=RETRY, tasks=rng.randrange(4))
        shown = render_text(info)
        tally.scan("inspect", json.dumps(info, default=str) + shown)
        if found := controls(shown):
            tally.problem(f"inspect prints control or format characters {found!r}: {shown[:300]!r}")
        if controls(json.dumps(info, ensure_ascii=False, default=str)):
            tally.ok("inspect.escaped")  # the server sent some: the check above had something to find
        tally.ok("inspect")
    except BaseException as exc:
        tally.error("inspect", exc)


#: entry point -> (runner, its bound: requests it may make, tool calls it may make).
OPS: dict[str, tuple[Callable[..., Any], int, int]] = {
    "client": (op_client, 4 * 5, 0),
    "session": (op_session, 7 + 5, 3),
    "spec": (op_spec, 32, 4),
    "engine": (op_engine, 36, 8),
    "eval": (op_eval, 30, 6),
    "inspect": (op_inspect, 20, 0),
}


def bound_s(op: str) -> float:
    _, requests, calls = OPS[op]
    return requests * REQUEST_BOUND_S + calls * CALL_BOUND_S + SLACK_S


def run_op(op: str, url: str, seed: int, tally: Tally, tmp: str) -> tuple[float, int]:
    """Run one entry point in a thread, bounded by its wall-clock guard; returns its seconds (a hang is tallied)."""
    rng = random.Random(seed)
    runner = OPS[op][0]
    started = time.monotonic()
    done = threading.Event()

    def target() -> None:
        try:
            if asyncio.iscoroutinefunction(runner):
                get_loop().run(runner(url, rng, tally))
            else:
                runner(url, rng, tally, tmp)
        except BaseException as exc:  # a failure that escaped the op's own accounting
            tally.error(op, exc)
        finally:
            done.set()

    threading.Thread(target=target, name=f"fuzz-{op}-{seed}", daemon=True).start()
    if not done.wait(bound_s(op)):
        with tally.lock:
            tally.hangs += 1
        tally.problem(f"{op} (seed {seed}) ran past its bound of {bound_s(op):.1f} s")
        done.wait(30)  # let it finish (bounded) so that the rest of the run is not disturbed
    return time.monotonic() - started, seed


# --------------------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------------------


def warm_up() -> None:
    """Load now, in this thread, what the entry points load lazily (datasets and what its fingerprinting pulls in
    from transformers, the schema renderer): no op's clock should count an import, and the same lazy imports
    racing in several threads can hold each other up for many seconds on a loaded machine."""
    datasets = pytest.importorskip("datasets")
    transformers = pytest.importorskip("transformers")
    _ = transformers.PreTrainedTokenizerBase
    datasets.Dataset.from_dict({"x": [1]})

    def probe(step: int) -> str:
        """Probe.

        Args:
            step: a number.
        """
        return str(step)

    transformers.utils.get_json_schema(probe)


def report_step(tmp: str, tally: Tally) -> dict[str, Any]:
    """`ors_trl.write_report` on every episode log and eval output the run wrote, the first ending in half a record
    (what an interrupted write leaves): the page is written, counts the lines that are no record, embeds every
    record (the tool metadata with a NaN 60 levels deep included) and holds no credential and no lone surrogate."""
    inputs = sorted(p for p in glob.glob(os.path.join(tmp, "*.jsonl")) if os.path.getsize(p) > 0)
    if not inputs:
        tally.problem("report: the run wrote no episode log or eval output")
        return {}
    with open(inputs[0], "rb") as fh:
        first = fh.readline()
    with open(inputs[0], "ab") as fh:
        fh.write(first[: len(first) // 2])
    lines = records = deep = 0
    for path in inputs:
        with open(path, "rb") as fh:
            for raw in fh:
                if raw.strip():
                    lines += 1
                    with contextlib.suppress(ValueError):
                        records += isinstance(json.loads(raw), dict)
                        deep += DEEP_NAN_KEY.encode() in raw
    out = os.path.join(tmp, "report.html")
    try:  # every input its own run: they are all episodes of this process, of the same few tasks
        summary = write_report(inputs, out, labels=[(os.path.basename(p), p) for p in inputs])
    except BaseException as exc:  # the page is always written, whatever the inputs hold
        tally.problem(f"report: {type(exc).__name__}: {exc}")
        return {}
    with open(out, encoding="utf-8") as fh:  # strict: a lone surrogate is no UTF-8
        page = fh.read()
    tally.scan("report page", page)
    if (found := LONE_SURROGATE_ESCAPE.search(page)) is not None:
        tally.problem(f"report: the page holds a lone surrogate escape {found[0]!r}")
    if (summary.episodes, summary.skipped) != (records, lines - records):
        tally.problem(f"report: {summary.episodes} episodes and {summary.skipped} skipped lines counted; the inputs "
                      f"hold {records} records in {lines} lines")
    if f"{lines - records} record(s) skipped" not in page:
        tally.problem(f"report: the page does not say that {lines - records} record(s) were skipped")
    if summary.embedded != records or (deep and DEEP_NAN_KEY not in page):
        tally.problem(f"report: {summary.embedded} of {records} records embedded ({deep} with a deep NaN)")
    return {"inputs": len(inputs), "episodes": summary.episodes, "skipped": summary.skipped, "deep_nan_records": deep,
            "bytes": summary.bytes}


def test_fuzz_every_entry_point(tmp_path) -> None:
    warm_up()
    seed = int(os.environ.get("ORS_FUZZ_SEED", "0"))
    tally = Tally()
    started = time.monotonic()
    rng = random.Random(seed)
    seconds: dict[str, tuple[float, int]] = {}
    with captured_logs() as logs, HostileServer(seed=seed, max_seconds=10.0) as hostile:
        order = [op for op in OPS for _ in range(2)]  # every entry point at least twice
        with concurrent.futures.ThreadPoolExecutor(WORKERS) as pool:
            futures = []
            for i in range(MAX_OPS):
                if len(hostile.requests) >= TARGET_REQUESTS and i >= len(order):
                    break
                op = order[i] if i < len(order) else rng.choice(list(OPS))
                futures.append((op, pool.submit(run_op, op, hostile.url, rng.getrandbits(32), tally, str(tmp_path))))
                while sum(not f.done() for _, f in futures) >= WORKERS:
                    concurrent.futures.wait([f for _, f in futures], return_when=concurrent.futures.FIRST_COMPLETED)
            for op, fut in futures:
                took, op_seed = fut.result()
                if took > seconds.get(op, (0.0, 0))[0]:
                    seconds[op] = (took, op_seed)
        answers, requests = Counter(hostile.answers), len(hostile.requests)
        elsewhere = hostile.elsewhere_requests
        # Surely met: `inspect` of terminal control sequences in split and tool names, descriptions and task fields,
        # the spec and eval of the NaN deep in tool metadata (against answers valid but for these)
        with HostileServer(seed=seed, only=frozenset({"valid"})) as calm:
            for route in ("/splits", "/task_range", "/tools", "/task_tools"):
                calm.force("terminal_escapes", path=route)
            run_op("inspect", calm.url, seed, tally, str(tmp_path))
            calm.force("deep_nan", path="/call", times=8)
            for op in ("spec", "eval"):
                run_op(op, calm.url, seed, tally, str(tmp_path))
            deep_nan_sent = calm.answers["deep_nan"]
        report = report_step(str(tmp_path), tally)
    for name, level, line in logs.lines:
        tally.scan(f"log {name}", line)
        if name == "asyncio" and level >= logging.ERROR:
            tally.problem(f"a background task failed: {line[:300]}")
    for seen in elsewhere:  # a redirect to another host must not carry the credentials there
        for header in ("x-api-key", "x-secrets"):
            if header in seen.headers:
                tally.problem(f"{header} was sent to the redirect target {seen.method} {seen.path}")
    FIGURES.update({
        "seed": seed, "requests": requests, "ops": len(futures), "answers": dict(answers.most_common()),
        "outcomes": dict(sorted(tally.outcomes.items())), "hangs": tally.hangs, "crashes": tally.crashes,
        "problems": len(tally.problems), "slowest_op_s": {k: [round(v, 2), s] for k, (v, s) in seconds.items()},
        "redirects_followed_elsewhere": len(elsewhere), "deep_nan_sent": deep_nan_sent, "report": report,
        "seconds": round(time.monotonic() - started, 1)})
    print("\nfuzz figures:", json.dumps(FIGURES, indent=1))
    assert requests >= TARGET_REQUESTS * 0.9
    assert not tally.problems, "\n".join(tally.problems[:40])
    assert tally.hangs == 0 and tally.crashes == 0
    # what the checks above looked at was there: renamed task fields, the deep NaN in a record the page embeds
    assert tally.outcomes["spec.renamed task field: ok"] > 0 and tally.outcomes["inspect.escaped: ok"] > 0
    assert deep_nan_sent > 0 and report.get("deep_nan_records", 0) > 0, report


def rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Peak:
    """The highest RSS of this process while the block runs (sampled every 5 ms), and the traced Python peak."""

    def __enter__(self) -> Peak:
        self.base = self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        tracemalloc.start()
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(2)
        self.traced = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        self.growth = max(self.peak - self.base, 0)


CAP = 64 * 1024 * 1024
#: Above the cap: read buffers, the request in flight, the allocator's rounding, and other threads' allocations
#: meanwhile (tracemalloc counts the whole process: +5.6 MiB alone, +8.8 MiB inside a full suite run). Reading
#: the body twice over is +128 MiB and fails.
SLACK_BYTES = 32 * 1024 * 1024
#: The traced peak is the exact measure of what the client buffers (every Python and C-extension buffer aiohttp,
#: zlib and our reader allocate goes through Python's allocator). The process's RSS is not: it moves with the
#: in-process server's writes, tracemalloc's own bookkeeping and whatever else a long test session's threads hold
#: meanwhile (+64 MiB alone, +89 and +106 MiB measured inside full suite runs on a busy machine), so it only bounds
#: native memory grossly: a body held several times over outside Python's allocator.
RSS_GROSS_BYTES = 3 * CAP


@pytest.mark.parametrize("variant,route", [
    ("huge_declared", "num_tasks"), ("huge_chunked", "num_tasks"), ("huge_gzip", "num_tasks"),
    ("huge_error", "num_tasks"), ("sse_huge_declared", "call"), ("sse_huge_line", "call"),
    ("sse_huge_chunks", "call"), ("huge_chunked", "create_session"), ("huge_error", "call"),
])
def test_answers_past_the_response_cap_are_refused_not_buffered(variant, route) -> None:
    """64 MiB+ bodies: a typed error, quickly, and memory growth below the cap (a declared size or an error's
    detail: next to nothing read)."""
    with HostileServer(seed=1, only=frozenset({"valid"})) as hostile:
        async def go() -> None:
            async with AsyncClient(hostile.url, env_name=ENV, api_key=KEY, timeouts=Timeouts(request=30.0,
                                   stream_idle=30.0, tool_call=60.0), retry=RETRY, keepalive_interval=None) as client:
                session = await client.open_session(split="train", index=0) if route == "call" else None
                hostile.force(variant, path=f"/{route}", times=RETRY.max_attempts)
                try:
                    if route == "call":
                        assert session is not None
                        await session.call("work", {"step": 0})
                    elif route == "create_session":
                        await client.open_session(split="train", index=0)
                    else:
                        await client.num_tasks("train")
                finally:
                    if session is not None:
                        await session.close()

        started = time.monotonic()
        expected = ServerError if variant == "huge_error" else ProtocolError
        with Peak() as peak, pytest.raises(expected) as info:
            get_loop().run(go())
        elapsed = time.monotonic() - started
    print(f"\n{variant} on /{route}: {type(info.value).__name__} in {elapsed:.2f} s, RSS +{peak.growth / 2**20:.1f} "
          f"MiB, traced peak {peak.traced / 2**20:.1f} MiB: {str(info.value)[:120]}")
    assert "limit" in str(info.value) or "bytes" in str(info.value) or variant == "huge_error"
    assert len(str(info.value)) < MAX_MESSAGE and KEY not in str(info.value)
    # It reads up to the cap (it must, to know that a body is too large), never past it and never twice over.
    assert peak.traced < CAP + SLACK_BYTES, (peak.traced, peak.growth)
    assert peak.growth < RSS_GROSS_BYTES, (peak.traced, peak.growth)
    if "declared" in variant or variant == "huge_error":  # refused before reading (past) the body
        assert peak.traced < BIG // 16


# --------------------------------------------------------------------------------------------------
# One test per bug the fuzzer found (each failed before its fix)
# --------------------------------------------------------------------------------------------------


def run_client(url: str, body: Callable[[AsyncClient], Any], **kwargs: Any) -> Any:
    """Run `body(client)` on the background loop with the fuzz settings (and `kwargs` over them)."""
    options: dict[str, Any] = {"env_name": ENV, "api_key": KEY, "secrets": SECRETS, "timeouts": TIMEOUTS,
                               "retry": RETRY, "keepalive_interval": None, **kwargs}

    async def go() -> Any:
        async with AsyncClient(url, **options) as client:
            return await body(client)

    return get_loop().run(go())


async def _in_session(client: AsyncClient, what: str) -> Any:
    session = await client.open_session(split="train", index=0)
    try:
        if what == "score_group":
            return await session.score_group([{"messages": []}])
        return await session.call("work", {"step": 0})
    finally:
        await session.close()


@pytest.mark.parametrize("route,answer", [
    ("/num_tasks", {"num_tasks": "x" * 170 + KEY}),  # the repr is cut at 200 characters: through the key
    ("/num_tasks", {"num_tasks": SECRET_A}),
    ("/list_environments", {"environments": [KEY]}),
    ("/task_range", {"tasks": KEY}),
    ("/tools", {"tools": [{"name": 5, "key": KEY}]}),
    ("/tools", {"tools": [], "terminal_tool": {"name": SECRET_B, "arg": 5}}),
])
def test_a_server_echoing_credentials_into_a_malformed_answer_never_gets_them_into_the_message(route, answer) -> None:
    """Bug: errors raised while checking an answer quoted it unmasked (only the transport's own errors were
    masked), and a quote cut at 200 characters could leave part of a secret even where it was masked."""
    from ors_trl.testing.faults import FaultProxy, Reply

    with FaultProxy(None) as proxy:
        proxy.add(Reply(json.dumps([ENV])), path="/list_environments", times=None if route != "/list_environments"
                  else 0)
        proxy.add(Reply(json.dumps(answer)), path=route, times=None)
        call = {"/num_tasks": lambda c: c.num_tasks("train"), "/list_environments": lambda c: c.list_environments(),
                "/task_range": lambda c: c.task_range("train", 0, 2), "/tools": lambda c: c.tools()}[route]
        with pytest.raises(ProtocolError) as info:
            run_client(proxy.url, call)
    message = str(info.value)
    assert "***" in message and leaked(message) is None, message


ESCAPES = "\x1b[2J\x1b[31mALERT\x1b[0m\r\x00\x07 \u202eevil\u202c "


@pytest.mark.parametrize("route,fault", [
    ("/num_tasks", ("status", 400, ESCAPES + KEY)),
    ("/num_tasks", ("status", 500, "detail " * 300_000)),
    ("/call", ("sse", [("task_id", "t"), ("error", ESCAPES + "x" * 500_000)])),
    ("/call", ("sse", [("task_id", "t"), ("end", json.dumps({"ok": False, "reason": ESCAPES,
                                                             "error": ESCAPES + "y" * 100_000}))])),
    ("/create_session", ("sse", [("error", ESCAPES + SECRET_A)])),
], ids=["detail-escapes", "detail-2MiB", "tool-error-event", "refusal", "create-session-error"])
def test_what_a_server_says_reaches_a_message_bounded_and_escaped(route, fault) -> None:
    """Bug: an error's `detail` (a string) was quoted whole (2 MiB of it), and details, tool error events and
    refusals were quoted raw, so a server could put terminal escape sequences into messages and logs."""
    from ors_trl.testing.faults import FaultProxy, Reply, SSEReply, Status

    kind, *rest = fault
    with FaultProxy(None) as proxy:
        proxy.add(Status(rest[0], rest[1]) if kind == "status" else SSEReply(rest[0]), path=route, times=None)
        proxy.add(SSEReply([("task_id", "sid-1")]), path="/create_session", times=None)
        proxy.add(Reply(json.dumps([ENV])), path="/list_environments", times=None)
        proxy.add(Reply("{}"), times=None)
        with pytest.raises(ORSError) as info:
            if route == "/num_tasks":
                run_client(proxy.url, lambda c: c.num_tasks("train"))
            else:
                run_client(proxy.url, lambda c: _in_session(c, "call"))
    message = str(info.value)
    assert 0 < len(message) < MAX_MESSAGE, len(message)
    assert not any(ord(c) < 32 and c not in "\n\t" for c in message), message[:300]
    assert "\u202e" not in message and leaked(message) is None, message[:300]


@pytest.mark.parametrize("location", ["http://127.0.0.1:notaport/x", "http://127.0.0.1:99999/x", "http://[::1",
                                      "ftp://127.0.0.1/x", "javascript:alert(1)", "//"])
def test_a_redirect_to_a_malformed_url_is_a_transport_error(location) -> None:
    """Bug: a `Location` with a bad port or a broken IPv6 literal raised a bare ValueError out of the client."""
    from ors_trl import TransportError
    from ors_trl.testing.faults import FaultProxy, Redirect

    with FaultProxy(None) as proxy:
        proxy.add(Redirect(location), times=None)
        with pytest.raises(TransportError):
            run_client(proxy.url, lambda c: c.list_environments())


def test_a_redirect_chain_is_bounded_by_the_request_deadline() -> None:
    """Bug: redirects are followed by hand, and each hop got a fresh `Timeouts.request`: eleven slow hops took
    eleven deadlines."""
    from ors_trl import ORSTimeoutError

    with HostileServer(seed=4, only=frozenset({"valid"})) as hostile:
        hostile.force("slow_redirect", path="/list_environments", times=12)
        with pytest.raises(ORSTimeoutError):
            run_client(hostile.url, lambda c: c.list_environments(), retry=RetryPolicy(max_attempts=1))
        hops = hostile.answers["slow_redirect"]
    # one deadline for the whole chain: it is cut within the hops that fit it (0.5 s / 0.375 s a hop: the second
    # hop), not after all eleven ("too many redirects"), however slow the machine (a hop is never quicker)
    assert hops <= math.ceil(TIMEOUTS.request / (SLOW_S / 8)), hops


@pytest.mark.parametrize("variant,route", [("bad_json", "/tools"), ("sse_deep_json", "/call"),
                                           ("sse_deep_json", "/score_group")])
def test_json_nested_too_deeply_is_a_protocol_error(variant, route) -> None:
    """Bug: `json.loads` raises RecursionError (not ValueError) on deep nesting; it escaped untyped."""
    with HostileServer(seed=5, only=frozenset({"valid"})) as hostile:
        if variant == "bad_json":
            from ors_trl.testing.faults import Reply

            hostile._proxy.clear()  # answer /tools with exactly the deep body
            hostile._proxy.add(Reply("[" * 200_000), path=route, times=None)
            hostile._proxy.add(Reply(json.dumps([ENV])), times=None)
            call: Callable[[AsyncClient], Any] = lambda c: c.tools()  # noqa: E731
        else:
            hostile.force(variant, path=route, times=RETRY.max_attempts)
            call = lambda c: _in_session(c, route.strip("/"))  # noqa: E731
        with pytest.raises(ProtocolError, match=r"nested too deeply|invalid JSON"):
            run_client(hostile.url, call)


@pytest.mark.parametrize("route", ["/call", "/score_group"])
def test_an_integer_reward_too_large_for_a_float_is_a_protocol_error(route) -> None:
    """Bug: `float(10**400)` raises OverflowError, which escaped `parse_reward` untyped."""
    from ors_trl.testing.faults import FaultProxy, Reply, SSEReply

    big = "1" + "0" * 400
    result = (f'{{"scores": [{{"reward": {big}}}]}}' if route == "/score_group"
              else f'{{"ok": true, "output": {{"blocks": [], "reward": {big}}}}}')
    with FaultProxy(None) as proxy:
        proxy.add(SSEReply([("task_id", "sid-1")]), path="/create_session", times=None)
        proxy.add(SSEReply([("task_id", "t"), ("end", result)]), path=route, times=None)
        proxy.add(Reply(json.dumps([ENV])), path="/list_environments", times=None)
        proxy.add(Reply("{}"), times=None)
        with pytest.raises(ProtocolError, match="non-numeric reward"):
            run_client(proxy.url, lambda c: _in_session(c, route.strip("/")))


def test_inspect_is_bounded_by_the_timeouts_it_is_given() -> None:
    """Bug: `inspect` took no `timeouts`/`retry`, so a server that never answers held it for the defaults
    (60 s a request, six attempts)."""
    from ors_trl import ORSTimeoutError

    with HostileServer(seed=6, only=frozenset({"hang"}), max_seconds=30) as hostile:
        with pytest.raises(ORSTimeoutError, match=r"no answer within 0\.3 s \(attempt 2\)"):
            inspect_target(hostile.url, timeouts=Timeouts(request=0.3), retry=RetryPolicy(max_attempts=2))
        assert sum(hostile.answers.values()) == 2  # the two attempts it was given, each cut at its 0.3 s


# --------------------------------------------------------------------------------------------------
# Issue 22: hostile-but-valid answers, handled where they are decoded (each failed before its fix)
# --------------------------------------------------------------------------------------------------


def proxy_client(answers: dict[str, Any], body: Callable[[AsyncClient], Any], **kwargs: Any) -> Any:
    """`body(client)` against a FaultProxy answering `answers` (path -> JSON value, raw bytes, or SSE events),
    with a valid `/list_environments` and session, and `{}` for anything else."""
    from ors_trl.testing.faults import FaultProxy, Reply, SSEReply

    with FaultProxy(None) as proxy:
        for path, answer in answers.items():
            fault = (SSEReply(answer) if isinstance(answer, list) and answer and isinstance(answer[0], tuple)
                     else Reply(answer if isinstance(answer, bytes) else json.dumps(answer)))
            proxy.add(fault, path=path, times=None)
        proxy.add(Reply(json.dumps([ENV])), path="/list_environments", times=None)
        proxy.add(SSEReply([("task_id", "sid-1")]), path="/create_session", times=None)
        proxy.add(Reply("{}"), times=None)
        return run_client(proxy.url, body, **kwargs)


async def _session_value(client: AsyncClient, what: str) -> Any:
    session = await client.open_session(split="train", index=0)
    try:
        return await {"prompt": session.prompt, "messages": session.messages, "tools": session.tools,
                      "call": lambda: session.call("work", {}),
                      "score_group": lambda: session.score_group([{"messages": []}])}[what]()
    finally:
        await session.close()


CALL_ODD = '{"ok": true, "output": {"blocks": [{"type": "text", "text": "out \\ud800"}], "reward": 1.0, ' \
           '"metadata": {"k\\udfff": ["v\\udc80", {"\\ud83d": "deep \\ude00"}]}}}'


@pytest.mark.parametrize("what,answers", [
    ("prompt", {"/prompt": b'[{"type": "text", "text": "a \\ud800 b"}]'}),
    ("prompt", {"/prompt": b'[{"type": "text", "text": "caf\xff \xed\xa0\x80 \xe2\x82"}]'}),  # not UTF-8 at all
    ("messages", {"/messages": b'[{"role": "user", "blocks": [{"type": "text", "text": "\\udfffhi"}]}]'}),
    ("tools", {"/task_tools": b'{"tools": [{"name": "work\\ud800", "description": "d\\udc00", "input_schema": '
                              b'{"type": "object", "properties": {"p\\ud800": {"type": "string"}}}}]}'}),
    ("call", {"/call": [("task_id", "t\xff"), ("end", CALL_ODD)]}),
    ("score_group", {"/score_group": [("task_id", "t"), ("end", '{"scores": [{"reward": 1, "metadata": '
                                                                 '{"why": "\\ud800"}}]}')]}),
    ("task_range", {"/task_range": b'{"tasks": [{"q\\ud800": "x\\udfff", "bytes": "\xc3"}]}'}),
], ids=["prompt-escape", "prompt-bytes", "messages", "task-tools", "call", "score-group", "task-range"])
def test_text_a_tokenizer_cannot_take_is_repaired_where_it_is_decoded(what, answers) -> None:
    """Bug: a lone surrogate (valid JSON: `"\\ud800"`) reached the model's text, task fields, tool names and records
    unchanged, where a fast tokenizer or a UTF-8 file write dies of it; bytes that are not UTF-8 made a whole answer
    "invalid JSON". Every string of every answer is repaired (U+FFFD), dict keys included."""
    call = (lambda c: c.task_range("train", 0, 1)) if what == "task_range" else lambda c: _session_value(c, what)
    value = proxy_client(answers, call)
    text = texts(value)
    text.encode("utf-8")  # raises on a lone surrogate
    assert "\ufffd" in text, text


@pytest.mark.parametrize("body,shown", [
    (b'{"num_tasks": 1' + b"0" * 400 + b"}", "1000000000"), (b'{"num_tasks": -5}', "-5"),
    (b'{"num_tasks": true}', "True"), (b'{"num_tasks": 1.5}', "1.5"), (b'{"num_tasks": "7"}', "'7'"),
    (b'{"num_tasks": 9007199254740993}', "9007199254740993"),
])
def test_a_count_that_is_no_count_is_a_protocol_error_naming_it(body, shown) -> None:
    """Bug: `10**400` was taken as a count (an OverflowError later), `-5` gave an empty dataset and `true` one
    task."""
    with pytest.raises(ProtocolError, match=r"/num_tasks: expected .*integer from 0 to 2\*\*53") as info:
        proxy_client({"/num_tasks": body}, lambda c: c.num_tasks("train"))
    assert shown in str(info.value)


@pytest.mark.parametrize("claimed", [100_001, 10**9])
def test_a_split_claiming_more_tasks_than_a_whole_split_may_needs_a_selection(claimed) -> None:
    """Bug: the whole split's indices were listed before anything was fetched (`list(range(total))`: ~36 GB for a
    claim of 10**9). Past `MAX_WHOLE_SPLIT` a whole split is a ConfigurationError that says how to page; a
    selection of three tasks out of 10**9 costs what three tasks cost."""
    from ors_trl import ConfigurationError
    from ors_trl.tasks.selection import MAX_WHOLE_SPLIT
    from ors_trl.testing.faults import FaultProxy, Reply

    tasks = {"tasks": [{"id": f"t{i}"} for i in range(3)]}
    with FaultProxy(None) as proxy:
        proxy.add(Reply(json.dumps({"num_tasks": claimed})), path="/num_tasks", times=None)
        proxy.add(Reply(json.dumps(tasks)), path="/task_range", times=None)
        proxy.add(Reply(json.dumps([ENV])), times=None)
        tracemalloc.start()
        try:
            whole = OpenRewardSpec(proxy.url, retry=RETRY, timeouts=TIMEOUTS)
            with pytest.raises(ConfigurationError, match=rf"{claimed} tasks, more than the {MAX_WHOLE_SPLIT}.*"
                                                         r"num_tasks=N .*indices="):
                whole.train_dataset  # noqa: B018
            whole.close()
            some = OpenRewardSpec(proxy.url, num_tasks=3, retry=RETRY, timeouts=TIMEOUTS)
            assert some.train_dataset["id"] == ["t0", "t1", "t2"]
            some.close()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < 64 * 2**20, peak  # the selection's size, not the claim's (10**9 indices: ~36 GB)


@pytest.mark.parametrize("answer,match", [
    ({"tools": [{"name": f"t{i}"} for i in range(200_000)]}, r"would take about \d+ MiB of memory"),  # refused decoding
    ({"tools": [{"name": f"t{i}"} for i in range(4097)]}, "4097 tools, more than the 4096"),
    ({"tools": [{"name": "big", "description": "d" * (2 << 20)}]}, "tool 'big' is larger than 1 MiB"),
    ({"tools": [{"name": f"t{i}", "input_schema": {"type": "object", "description": "d" * 900_000}}
                for i in range(20)]}, "larger than 16 MiB of JSON together"),
], ids=["200k", "4097", "one-of-2MiB", "all-past-16MiB"])
def test_tool_lists_past_the_bounds_are_protocol_errors(answer, match) -> None:
    """Bug: 200,000 tools (3.5 MB) took 10 s and +320 MB to bind, and would have been rendered into every prompt."""
    with pytest.raises(ProtocolError, match=match):
        proxy_client({"/tools": answer}, lambda c: c.tools())


def test_a_tool_list_at_the_bound_binds() -> None:
    from ors_trl.protocol.types import MAX_TOOLS

    listed = proxy_client({"/tools": {"tools": [{"name": f"t{i}"} for i in range(MAX_TOOLS)]}}, lambda c: c.tools())
    assert len(listed.tools) == MAX_TOOLS


@pytest.mark.parametrize("route,answer,match", [
    ("/splits", [{"name": f"s{i}", "type": "train"} for i in range(100_000)], "100000 splits, more than the 256"),
    ("/list_environments", [ENV] + [f"e{i}" for i in range(100_000)], "100001 environments, more than the 1024"),
    ("/task_range", {"tasks": [{"id": i} for i in range(50)]}, r"tasks 0\.\.2 \(2\), the server answered 50"),
])
def test_lists_longer_than_anything_real_are_protocol_errors(route, answer, match) -> None:
    """Bug: 100,000 splits made `inspect` ask 100,000 counts at once; a task page longer than asked was kept."""
    call = {"/splits": lambda c: c.splits(), "/list_environments": lambda c: c.list_environments(),
            "/task_range": lambda c: c.task_range("train", 0, 2)}[route]
    with pytest.raises(ProtocolError, match=match):
        proxy_client({route: answer}, call)


#: A bare CR is no character of a session id on the wire: it ends an SSE line (`data: a\rb` carries `a`); VT is the
#: control character that stays.
BAD_SIDS = ["a\x0bb", "sid\x00", "\x1b[2Jsid", "s\u00e9ance", "x" * 300, "two words", "\x7f"]


@pytest.mark.parametrize("sid", BAD_SIDS, ids=["VT", "NUL", "ESC", "non-ascii", "300-chars", "space", "DEL"])
def test_a_session_id_that_cannot_be_a_header_fails_the_open_typed(sid) -> None:
    """Bug: a session id with a control character made aiohttp raise an untyped ValueError out of `reset()`, which
    promises never to raise for environment failures; other ids went back into headers unchecked."""
    with pytest.raises(ProtocolError, match=r"/create_session: the server's session id .* cannot be sent back as "
                                            "a header") as info:
        proxy_client({"/create_session": [("task_id", sid)]}, lambda c: c.open_session(split="train", index=0))
    assert not any(ord(c) < 32 for c in str(info.value))


def test_a_session_id_that_cannot_be_a_header_is_a_failed_episode_scored_none(tmp_path) -> None:
    from ors_trl.testing.faults import FaultProxy, Reply, SSEReply

    log = tmp_path / "episodes.jsonl"
    with FaultProxy(None) as proxy:
        proxy.add(SSEReply([("task_id", "a\r\nX-Injected: 1")]), path="/create_session", times=None)
        proxy.add(Reply(json.dumps({"tools": [{"name": "work"}]})), path="/tools", times=None)
        proxy.add(Reply(json.dumps({"num_tasks": 1})), path="/num_tasks", times=None)
        proxy.add(Reply(json.dumps({"tasks": [{"id": "t0"}]})), path="/task_range", times=None)
        proxy.add(Reply(json.dumps([ENV])), times=None)
        spec = OpenRewardSpec(proxy.url, retry=RETRY, timeouts=TIMEOUTS, discover_task_tools=False,
                              episode_log=str(log))
        env = spec.environment_factory()
        text = env.reset(**spec.train_dataset[0])
        assert text.startswith("[The environment failed to start this task:") and "session id" in text
        assert spec.reward_funcs(environments=[env], completions=[[{"role": "assistant", "content": "x"}]]) == [None]
        spec.close()
    record = json.loads(log.read_text().splitlines()[0])
    assert record["reward"] is None and record["error"]["kind"] == "protocol", record


@pytest.mark.parametrize("name", ["../admin", "a/b", "..", "x?y=1", "e#f", "%2e%2e", "\x1b[2J", "sp ace", "n" * 300])
def test_an_environment_name_that_is_no_path_segment_is_a_protocol_error(name) -> None:
    """Bug: the first listed environment's name went into every request's path as it was (`../admin` made the
    client ask `/num_tasks` of the server's root)."""
    from ors_trl.testing.faults import FaultProxy, Reply

    with FaultProxy(None) as proxy:
        proxy.add(Reply(json.dumps([name, ENV])), path="/list_environments", times=None)
        proxy.add(Reply(json.dumps({"num_tasks": 4})), times=None)
        with pytest.raises(ProtocolError, match="cannot be part of a URL path"):
            run_client(proxy.url, lambda c: c.num_tasks("train"), env_name=None)
        assert [r.path for r in proxy.requests] == ["/list_environments"]


def test_blocks_nested_hundreds_deep_are_a_protocol_error() -> None:
    """Bug: blocks are parsed (and rendered) recursively; `tool_result` blocks 400 deep, which JSON decodes fine,
    ended in an untyped RecursionError."""
    block: dict[str, Any] = {"type": "text", "text": "bottom"}
    for _ in range(400):
        block = {"type": "tool_result", "tool_call_id": "c", "blocks": [block]}
    with pytest.raises(ProtocolError, match="tool_result blocks nested more than 16 deep"):
        proxy_client({"/prompt": [block]}, lambda c: _session_value(c, "prompt"))


ESCAPED_KEY = "".join(f"\\u{ord(c):04x}" for c in KEY)


@pytest.mark.parametrize("body", [
    b'[{"type": "text", "text": "key: \\u0073' + KEY[1:].encode() + b'"}]',  # first character escaped
    b'[{"type": "text", "text": "key: ' + ESCAPED_KEY.encode() + b'"}]',  # every character
    b'[{"type": "text", "text": "key: ' + KEY.encode() + b'"}]',
    b'[{"type": "text", "text": "x", "detail": {"' + ESCAPED_KEY.encode() + b'": 1}}]',  # in a key
])
def test_a_secret_in_an_answer_is_masked_however_the_json_spells_it(body) -> None:
    """Bug: only error messages were masked, and only where the secret appeared literally; a prompt, a tool output
    or a task field echoing the key (`printenv`) reached the model and the records as it was."""
    blocks = proxy_client({"/prompt": body}, lambda c: _session_value(c, "prompt"))
    shown = texts(blocks) + json.dumps([b.detail for b in blocks])
    assert KEY not in shown and "***" in shown, shown


@pytest.mark.parametrize("body", [
    b'{"detail": "\\u0073' + KEY[1:].encode() + b'", "cut',  # invalid JSON, the key escaped
    b'["' + ESCAPED_KEY.encode() + b' oops]',
    b"not json " + KEY.encode(),
])
def test_a_secret_in_an_answer_that_is_not_json_is_masked_in_the_message_and_chain(body) -> None:
    """Bug: the message quoted the raw body (escaped secrets unmasked), and the error's `__context__` kept the
    `JSONDecodeError`, whose `.doc` is the raw body, credentials included."""
    with pytest.raises(ProtocolError, match="invalid JSON") as info:
        proxy_client({"/num_tasks": body}, lambda c: c.num_tasks("train"))
    chain = "".join(traceback.format_exception(info.value))
    assert info.value.__context__ is None and info.value.__cause__ is None
    assert leaked(chain) is None and leaked(str(info.value)) is None and "***" in str(info.value), str(info.value)


def test_errors_carry_no_exception_chain_with_credentials() -> None:
    """Bug: an ORSError kept a suppressed `__context__`: aiohttp's error for a redirect to a bad URL (the URL with
    the key in it), the `JSONDecodeError` of a tool result (the raw result). `traceback.format_exception` with the
    chain shows neither, nor does any error's context."""
    from ors_trl.testing.faults import FaultProxy, Redirect, Reply, SSEReply

    errors: list[BaseException] = []
    with FaultProxy(None) as proxy:
        proxy.add(Reply(json.dumps([ENV])), path="/list_environments", times=None)
        proxy.add(SSEReply([("task_id", "sid-1")]), path="/create_session", times=None)
        proxy.add(Redirect(f"http://127.0.0.1:99999/x?key={KEY}"), path="/num_tasks", times=None)
        proxy.add(Redirect(f"http://127.0.0.1:1/refused?key={KEY}"), path="/splits", times=None)
        proxy.add(SSEReply([("task_id", "t"), ("end", f"not json {KEY}")]), path="/call", times=None)
        proxy.add(Reply("{}"), times=None)
        for call in (lambda c: c.num_tasks("train"), lambda c: c.splits(), lambda c: _in_session(c, "call"),
                     lambda c: c._transport.request("GET", "/x", extra_headers={"X-Bad": f"{KEY}\r\nX: 1"})):
            with pytest.raises(ORSError) as info:
                run_client(proxy.url, call)
            errors.append(info.value)
    assert [type(e).__name__ for e in errors] == ["TransportError", "TransportError", "ProtocolError", "ProtocolError"]
    for error in errors:
        chain = "".join(traceback.format_exception(error))
        assert error.__context__ is None and error.__cause__ is None, repr(error.__context__)
        assert leaked(chain) is None, chain


def test_a_header_value_aiohttp_refuses_is_a_protocol_error() -> None:
    """Bug: aiohttp raises a bare ValueError for a header with a control character; it escaped the client."""
    with pytest.raises(ProtocolError, match="the request cannot be sent"):
        proxy_client({}, lambda c: c._transport.request("GET", "/x", extra_headers={"X-Bad": "a\x1bb"}))


@pytest.mark.parametrize("events,then", [
    ([("task_id", "t"), ("end", json.dumps({"ok": False, "reason": "no", "error": "refused"}))], "end"),
    ([("task_id", "t"), ("end", json.dumps({"ok": True}))], "end"),
    ([], "close"),
], ids=["refused", "no-output", "cut-before-task-id"])
def test_a_tool_name_of_10000_characters_is_cut_in_messages(events, then) -> None:
    """Bug (found by the fuzz run): a tool's name, which the server chooses, went into messages whole, so a call of a
    tool named with 10,000 characters failed with a message of 10,000+ characters."""
    from ors_trl.testing.faults import FaultProxy, Reply, SSEReply

    name = "x" * 10_000
    with FaultProxy(None) as proxy:
        proxy.add(SSEReply(events, then=then), path="/call", times=None)
        proxy.add(Reply(json.dumps([ENV])), path="/list_environments", times=None)
        proxy.add(SSEReply([("task_id", "sid-1")]), path="/create_session", times=None)
        proxy.add(Reply("{}"), times=None)

        async def call(client: AsyncClient) -> Any:
            async with await client.open_session(split="train", index=0) as session:
                return await session.call(name, {})

        with pytest.raises(ORSError) as info:
            run_client(proxy.url, call)
    message = str(info.value)
    assert len(message) < 500 and "x" * 80 + "'…" in message, message[:300]
    assert getattr(info.value, "tool", name) == name  # the error still names the whole tool
