"""The per-rollout environment adapter TRL's `environment_factory` hands out.

TRL constructs adapters once, then for every rollout calls `reset(**row)` and the tool methods
the model asks for, from its training thread. Each adapter owns at most one ORS session, opened
by `reset` and closed by the next `reset`, by the spec's callback at the end of a step or of
training, and at interpreter exit.

Resets do not wait for the network more than once per task: the first reset of a task opens its
session and caches the prompt; later resets of the same task return the cached prompt at once
while their sessions open in the background, and the first tool call waits for its session.
A prompt that turns out to differ between sessions of one task is reported (and the cache can be
turned off with `cache_prompts=False`).

Tool calls do not wait for each other across rollouts either. TRL's tool loop calls one rollout's
tools after another; at the first call of each turn the adapter reads the whole turn's calls from
that loop and starts all of them at once (each rollout's own calls still in order, nothing TRL
will not ask for), then answers TRL's calls as they come. `batch_tool_calls=False` turns it off.

An environment failure never raises out of `reset()`: the rollout is recorded as failed, scored
`None`, and the model is told what happened. Tool failures raise from the tool method (that is
how TRL counts them in `tools/failure_frequency`) with a message the model can read.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any, ClassVar

from ._client import AsyncClient, AsyncSession
from ._exceptions import ConfigurationError, ORSError, ToolRefusedError
from ._loop import get_loop
from ._metrics import EnvMetrics
from ._types import ToolResult, blocks_text

__all__ = ["EnvironmentRuntime", "OpenRewardEnvironment"]

logger = logging.getLogger("ors_trl")

#: The row keys `reset()` consumes itself; anything else in a dataset row is ignored.
TASK_KEYS = ("task_index", "task_spec")

#: A tool call started ahead of TRL: (remote name, wire arguments, future of (result, error, seconds)).
_Ahead = tuple[str, dict[str, Any], "concurrent.futures.Future[tuple[ToolResult | None, ORSError | None, float]]"]
#: Bounds the wait for calls TRL started us on but then did not ask for (an aborted turn); see `_settle_ahead`.
_SETTLE_TIMEOUT_S = 300.0
_tool_batch_lock = threading.Lock()
# The `tool_calls` list of the last turn of TRL's tool loop we started calls for. TRL builds a new list every
# turn; holding this one keeps its id from being reused, so `is` tells turns apart exactly (ids of frames or
# counters repeat from one step to the next).
_last_tool_batch: list[Any] | None = None


def episode_finished_error(tool: str) -> ToolRefusedError:
    """The refusal for a call after the episode finished, raised locally once its session is released.

    ORS servers refuse every call after a result with `finished: true`, so the session is closed as
    soon as the episode finishes (freeing server resources and session slots) and later calls get
    this same refusal without a round trip.
    """
    return ToolRefusedError(
        f"tool {tool!r} was refused (episode_finished): the episode has finished, so no further tool calls are "
        "accepted.",
        tool=tool,
        reason="episode_finished",
    )


def truncate_output(text: str, limit: int | None) -> str:
    """Cap `text` at `limit` characters, saying so in the text itself."""
    if limit is None or len(text) <= limit:
        return text
    return text[:limit] + f"\n[... output truncated: {limit} of {len(text)} characters shown ...]"


def _caller_frame(skip: int, hops: int, match: Callable[[FrameType], bool]) -> FrameType | None:
    """Walking up from the frame `skip` levels above the function calling this one, the first of `hops`
    frames for which `match` holds (how the adapter finds TRL's loop that is calling it), else None."""
    frame: FrameType | None = sys._getframe(skip + 1)
    for _ in range(hops):
        if frame is None or match(frame):
            return frame
        frame = frame.f_back
    return None


def _is_trainer(obj: Any) -> bool:
    return obj is not None and hasattr(obj, "add_callback") and hasattr(obj, "callback_handler")


class EnvironmentRuntime:
    """State shared by every adapter of one environment: client, options, prompt cache, metrics.

    Lives on the process's background loop; adapters reach it through their class.
    """

    def __init__(
        self,
        client: AsyncClient,
        *,
        name: str,
        split: str,
        cache_prompts: bool = True,
        max_output_chars: int | None = None,
        metrics: EnvMetrics | None = None,
        recorder: Any = None,
        batch_tool_calls: bool = True,
        max_concurrent_tool_calls: int = 64,
    ) -> None:
        self.client = client
        self.name = name
        self.split = split
        self.cache_prompts = cache_prompts
        self.batch_tool_calls = batch_tool_calls
        self.max_concurrent_tool_calls = max_concurrent_tool_calls
        self.calls_ahead = 0  # tool calls started ahead of TRL's loop (batch_tool_calls)
        self.max_output_chars = max_output_chars
        self.metrics = metrics or EnvMetrics()
        self.metrics.set_open_sessions_gauge(name, lambda: self.client.open_sessions)
        self.recorder = recorder
        self.bg = get_loop()
        self.prompt_cache: dict[str, str] = {}
        self.cached_resets = 0  # resets answered from the prompt cache (their session opened in the background)
        self.prompt_mismatches = 0
        self._mismatch_warned: set[str] = set()
        self._adapters: weakref.WeakSet[OpenRewardEnvironment] = weakref.WeakSet()
        self._pending_closes: set[concurrent.futures.Future[None]] = set()
        self._lock = threading.Lock()
        self._attached: set[int] = set()
        self.bg.add_closer(self.aclose)

    # -- trainer lifecycle -------------------------------------------------------------------------

    def attach_to(self, trainer: Any) -> None:
        """Make sure `trainer` releases this runtime's sessions at each step's end and closes them at the end.

        Adds a `SessionCleanupCallback` unless one already covers this runtime (e.g. `spec.callbacks`
        was passed), so sessions are cleaned up by the trainer even when the user passed no callback.
        """
        handler = getattr(trainer, "callback_handler", None)
        if handler is None or id(trainer) in self._attached:
            return
        from ._callback import SessionCleanupCallback

        self._attached.add(id(trainer))
        for cb in getattr(handler, "callbacks", []):
            if isinstance(cb, SessionCleanupCallback) and self in cb.runtimes:
                return
        trainer.add_callback(SessionCleanupCallback([self]))

    def observe_caller(self, adapter: OpenRewardEnvironment) -> list[tuple[Any, Any]] | None:
        """Look at the trainer loop calling `adapter.reset()` (a few frames up).

        Attaches the session cleanup callback to that trainer, and, when `adapter` is the first
        environment of the batch TRL is resetting (`trainer.environments` next to the batch's
        `inputs`), returns the batch's (adapter, row) pairs so that all its sessions can be opened
        together. Anything unexpected just returns None: the per-task prompt cache still applies.
        """
        frame = _caller_frame(2, 6, lambda f: _is_trainer(f.f_locals.get("self")))
        if frame is None:
            return None
        candidate = frame.f_locals["self"]
        if id(candidate) not in self._attached:
            try:
                self.attach_to(candidate)
            except Exception as exc:  # convenience only: exit-time cleanup still applies
                logger.debug("could not attach the session cleanup callback: %s", exc)
        envs = getattr(candidate, "environments", None)
        inputs = frame.f_locals.get("inputs")
        if (isinstance(envs, list) and isinstance(inputs, list) and len(envs) == len(inputs) > 1
                and envs[0] is adapter and all(isinstance(row, Mapping) for row in inputs)):
            return list(zip(envs, inputs, strict=True))
        return None

    # -- task identity -------------------------------------------------------------------------

    def task_key(self, index: int | None, task_spec: Mapping[str, Any] | None) -> str:
        if task_spec is not None:
            return "spec:" + json.dumps(task_spec, sort_keys=True, default=str)
        return f"index:{self.split}:{index}"

    # -- sessions (run on the background loop) -------------------------------------------------

    async def open(self, key: str, index: int | None, task_spec: Mapping[str, Any] | None
                   ) -> tuple[AsyncSession, str]:
        """Open a session and read its prompt text; records latency or failure."""
        started = time.monotonic()
        try:
            if task_spec is not None:
                session = await self.client.open_session(task_spec=task_spec)
            else:
                session = await self.client.open_session(split=self.split, index=index)
            try:
                text = blocks_text(await session.prompt())
            except BaseException:
                await session.close()
                raise
        except ORSError as exc:
            self.metrics.record_open(self.name, None, exc.kind)
            raise
        self.metrics.record_open(self.name, time.monotonic() - started)
        cached = self.prompt_cache.get(key)
        if cached is None:
            self.prompt_cache[key] = text
        elif cached != text:
            self.prompt_mismatches += 1
            if key not in self._mismatch_warned:
                self._mismatch_warned.add(key)
                logger.warning(
                    "%s: task %s gave a different prompt in a new session than the cached one, so the model saw a "
                    "stale prompt. Pass cache_prompts=False if prompts vary between sessions of a task.",
                    self.name, key,
                )
        return session, text

    def close_later(self, fut: concurrent.futures.Future[tuple[AsyncSession, str]]) -> concurrent.futures.Future[None]:
        """Close the session `fut` opens (or opened) in the background; tracked until done."""

        async def _close() -> None:
            try:
                session, _ = await asyncio.wrap_future(fut)
            except BaseException:
                return  # never opened: nothing to close
            await session.close()

        done = self.bg.submit(_close())
        with self._lock:
            self._pending_closes.add(done)
        done.add_done_callback(self._forget_close)
        return done

    def _forget_close(self, fut: concurrent.futures.Future[None]) -> None:
        with self._lock:
            self._pending_closes.discard(fut)

    def register(self, adapter: OpenRewardEnvironment) -> None:
        self._adapters.add(adapter)

    def release_all(self) -> None:
        """Start closing every adapter's session, without waiting."""
        for adapter in list(self._adapters):
            adapter._release()

    def close_all(self, timeout: float | None = 60.0) -> None:
        """Close every session opened through this runtime and wait (bounded) until the server has them deleted.

        Covers sessions whose adapter was already garbage-collected, through the client's own registry.
        """
        self.release_all()
        with self._lock:
            pending = list(self._pending_closes)
        concurrent.futures.wait(pending, timeout=timeout)
        try:
            self.bg.run(self.client.close_sessions(), timeout=timeout)
        except ORSError as exc:
            logger.warning("%s: closing sessions failed: %s", self.name, exc)

    async def aclose(self) -> None:
        """At exit: close every session still open through this runtime's client."""
        await self.client.aclose()


def _preopen(batch: list[tuple[Any, Any]]) -> None:
    """Start opening a session for every (adapter, row) of a batch at once (first reset of the batch).

    TRL then resets the adapters one after another; each finds its session already on the way, so a
    batch pays about one session-open latency instead of one per distinct task.
    """
    for adapter, row in batch:
        if not isinstance(adapter, OpenRewardEnvironment) or adapter._preopened is not None:
            continue
        index, spec = row.get("task_index"), row.get("task_spec")
        if spec is None and (isinstance(index, bool) or not isinstance(index, int)):
            continue
        rt = adapter._runtime
        key = rt.task_key(index, spec)
        adapter._preopened = (key, rt.bg.submit(rt.open(key, index, spec)))


def _after_fork_in_child() -> None:
    global _tool_batch_lock, _last_tool_batch
    _tool_batch_lock, _last_tool_batch = threading.Lock(), None


os.register_at_fork(after_in_child=_after_fork_in_child)


def _tool_loop_batch(adapter: OpenRewardEnvironment, name: str, arguments: dict[str, Any]
                     ) -> list[tuple[OpenRewardEnvironment, list[tuple[str, dict[str, Any]]]]] | None:
    """At the first call of a turn of TRL's tool loop, the calls of that turn we can start ahead.

    Reads the loop's locals (`tool_calls`, `idxs_with_tool`, `idx`, `tool_call`) and
    the trainer's `environments` / `_sync_tool_dicts`, and returns, for the calling rollout (from the
    current call on) and every rollout after it, the longest prefix of its calls that TRL will make
    exactly as given: a bound tool method of one of our adapters, with arguments that bind. Anything
    unexpected returns None and the calls run one by one, as TRL makes them.
    """
    global _last_tool_batch
    frame = _caller_frame(3, 4, lambda f: f.f_code.co_name == "_tool_call_loop")
    if frame is None:
        return None
    loc = frame.f_locals
    trainer, idxs, calls = loc.get("self"), loc.get("idxs_with_tool"), loc.get("tool_calls")
    idx, current = loc.get("idx"), loc.get("tool_call")
    envs = getattr(trainer, "environments", None)
    dicts = getattr(trainer, "_sync_tool_dicts", None)
    if not (isinstance(idxs, list) and isinstance(calls, list) and len(idxs) == len(calls)
            and isinstance(idx, int) and 0 <= idx < len(idxs) and isinstance(envs, list)
            and isinstance(dicts, list) and len(dicts) == len(envs)
            and all(isinstance(i, int) and 0 <= i < len(envs) for i in idxs)
            and envs[idxs[idx]] is adapter and isinstance(calls[idx], list)):
        return None
    position = next((j for j, call in enumerate(calls[idx]) if call is current), None)
    if position is None:
        return None
    with _tool_batch_lock:
        if _last_tool_batch is calls:
            return None
        _last_tool_batch = calls
    batch: list[tuple[OpenRewardEnvironment, list[tuple[str, dict[str, Any]]]]] = []
    for k in range(idx, len(idxs)):
        env, tools, turn = envs[idxs[k]], dicts[idxs[k]], calls[k]
        if (not isinstance(env, OpenRewardEnvironment) or env._pending is None or env._over or env._ahead
                or not isinstance(tools, dict) or not isinstance(turn, list)):
            continue
        chain: list[tuple[str, dict[str, Any]]] = []
        for call in turn[position if k == idx else 0:]:
            function = call.get("function") if isinstance(call, dict) and call.get("type") == "function" else None
            method = tools.get(function.get("name")) if isinstance(function, dict) else None
            plan = getattr(getattr(method, "__func__", None), "_ors_plan", None)
            given = function.get("arguments") if isinstance(function, dict) else None
            if (plan is None or getattr(method, "__self__", None) is not env or not isinstance(given, dict)
                    or not all(isinstance(a, str) for a in given)):
                break
            try:
                chain.append((plan.remote_name, plan.arguments((), dict(given))))
            except TypeError:
                break
        if chain:
            batch.append((env, chain))
    if not batch or batch[0][0] is not adapter or batch[0][1][0] != (name, arguments):
        return None  # what we read is not the call being made: run nothing ahead
    return batch


def _show_call(name: str, arguments: dict[str, Any]) -> str:
    text = f"{name}({json.dumps(arguments, default=str)})"
    return text if len(text) <= 120 else text[:117] + "..."


async def _call_in_session(pending: concurrent.futures.Future[tuple[AsyncSession, str]], name: str,
                           arguments: dict[str, Any]) -> ToolResult:
    """Wait for the session being opened (on the background loop), then call remote tool `name` in it."""
    session, _ = await asyncio.wrap_future(pending)
    return await session.call(name, arguments)


async def _run_ahead(pending: concurrent.futures.Future[tuple[AsyncSession, str]], entries: list[_Ahead],
                     limit: asyncio.Semaphore) -> None:
    """Run one rollout's calls of a turn in order on its session; resolve each entry's future."""
    over = False
    for i, (name, arguments, fut) in enumerate(entries):
        if over:  # the episode ended at an earlier call of this turn: refused locally, as `_call_tool` would
            fut.set_result((None, episode_finished_error(name), 0.0))
            continue
        started = time.monotonic()
        try:
            async with limit:
                result = await _call_in_session(pending, name, arguments)
        except ORSError as exc:
            fut.set_result((None, exc, time.monotonic() - started))
        except BaseException as exc:  # cancelled (loop shutting down) or a bug: nobody may wait forever
            for _, _, rest in entries[i:]:
                if not rest.done():
                    rest.set_exception(exc if isinstance(exc, Exception) else ORSError(f"tool call aborted: {exc!r}"))
            raise
        else:
            fut.set_result((result, None, time.monotonic() - started))
            over = result.finished


def _start_ahead(batch: list[tuple[OpenRewardEnvironment, list[tuple[str, dict[str, Any]]]]]) -> None:
    """Start every rollout's chain of calls at once (bounded per environment by `max_concurrent_tool_calls`)."""
    limits: dict[int, asyncio.Semaphore] = {}
    for env, chain in batch:
        rt = env._runtime
        limit = limits.setdefault(id(rt), asyncio.Semaphore(max(1, rt.max_concurrent_tool_calls)))
        entries: list[_Ahead] = [(name, arguments, concurrent.futures.Future()) for name, arguments in chain]
        assert env._pending is not None
        rt.bg.submit(_run_ahead(env._pending, entries, limit))
        rt.calls_ahead += len(entries)
        env._ahead.extend(entries)


def _close_orphan(runtime: EnvironmentRuntime, holder: list[Any]) -> None:
    """Finalizer of a garbage-collected adapter: close the session it still held."""
    fut = holder[0]
    if fut is not None:
        holder[0] = None
        with contextlib.suppress(RuntimeError):  # the background loop is already shut down (interpreter exit)
            runtime.close_later(fut)


class OpenRewardEnvironment:
    """One rollout's view of an ORS environment; TRL's `environment_factory` returns these.

    Public surface (what TRL collects with `inspect.getmembers(type(env), inspect.isfunction)`):
    `reset(**row)` and one method per environment tool. Tool names that would clash with `reset`,
    `get_reward`, start with `_` or are not identifiers are bound under a safe attribute name but
    keep the environment's exact name as `__name__`, which is what the model sees and what TRL
    routes calls by.

    Attributes:
        reward: last non-None reward of the episode (outcome convention); None if nothing was scored.
        rewards: per tool call, the reward or None.
        metadata: per tool call, the environment's metadata dict or None.
        finished: True once a tool said the episode is over.
        last_output: the text of the most recent tool result (or error).
        tool_calls: number of tool calls this episode; `tool_failures` how many failed.
        error: why the episode failed outside any tool call (session could not open), else None.
    """

    _runtime: ClassVar[EnvironmentRuntime]

    def __init__(self) -> None:
        self._pending: concurrent.futures.Future[tuple[AsyncSession, str]] | None = None
        self._preopened: tuple[str, concurrent.futures.Future[tuple[AsyncSession, str]]] | None = None
        self._task_key: str | None = None
        self._ahead: deque[_Ahead] = deque()  # this turn's calls already started (batch_tool_calls)
        self._episode_reported = True
        self._clear()
        self._runtime.register(self)
        # If the adapter is dropped while it holds a session (a trainer going away), close that session.
        self._holder: list[Any] = [None]
        weakref.finalize(self, _close_orphan, self._runtime, self._holder)

    def _clear(self) -> None:
        self.reward: float | None = None
        self.rewards: list[float | None] = []
        self.metadata: list[dict[str, Any] | None] = []
        self.finished = False
        self.last_output = ""
        self.tool_calls = 0
        self.tool_failures = 0
        self.error: str | None = None
        self.task_index: int | None = None
        self.task_spec: dict[str, Any] | None = None
        self.prompt_text = ""
        self.trace: list[dict[str, Any]] = []
        self._started = time.monotonic()
        self._over = False  # the episode finished and its session was released

    @property
    def episode_seconds(self) -> float:
        """Seconds since this episode's reset."""
        return time.monotonic() - self._started

    def __repr__(self) -> str:
        state = "finished" if self.finished else "open" if self._pending is not None else "idle"
        return f"<{type(self).__name__} task={self.task_index} reward={self.reward} {state}>"

    # -- the TRL contract ------------------------------------------------------------------------

    def reset(self, task_index: int | None = None, task_spec: Mapping[str, Any] | None = None, **row: Any) -> str:
        """Start a new episode for the row's task and return its prompt text.

        Closes the previous session (in the background). Never raises for environment failures:
        the episode is then recorded as failed and the returned text says why.
        """
        rt = self._runtime
        batch = rt.observe_caller(self)
        if batch is not None:
            _preopen(batch)
        self._release()
        self._clear()
        if task_spec is None and task_index is None:
            raise ConfigurationError(
                "reset() needs task_index= (the rows of spec.train_dataset carry it) or task_spec=."
            )
        if task_spec is None and (isinstance(task_index, bool) or not isinstance(task_index, int)):
            raise ConfigurationError(f"task_index must be an int, got {task_index!r}")
        self.task_index = task_index
        self.task_spec = dict(task_spec) if task_spec is not None else None
        key = rt.task_key(task_index, task_spec)
        self._task_key = key
        self._episode_reported = False
        preopened, self._preopened = self._preopened, None
        if preopened is not None and preopened[0] == key:
            self._pending = preopened[1]  # opened with the rest of the batch at its first reset
        else:
            if preopened is not None:
                rt.close_later(preopened[1])
            self._pending = rt.bg.submit(rt.open(key, task_index, task_spec))
        self._holder[0] = self._pending
        cached = rt.prompt_cache.get(key) if rt.cache_prompts else None
        if cached is not None:
            rt.cached_resets += 1
            self.prompt_text = cached
            return cached
        try:
            _, text = self._pending.result()
        except ORSError as exc:
            self.error = str(exc)
            logger.warning("%s: could not open a session for task %s: %s", rt.name, key, exc)
            return f"[The environment failed to start this task: {exc}]"
        self.prompt_text = text
        return text

    # -- tool calls ----------------------------------------------------------------------------

    def _session(self) -> AsyncSession:
        if self._pending is None:
            raise ConfigurationError("call reset() before calling a tool")
        session, _ = self._pending.result()
        return session

    def _before_call(self) -> None:
        self.tool_calls += 1

    def _after_call(self, name: str, arguments: dict[str, Any], elapsed: float, result: ToolResult | None,
                    exc: ORSError | None) -> str:
        rt = self._runtime
        if exc is not None:
            self.tool_failures += 1
            self.rewards.append(None)
            self.metadata.append(None)
            self.last_output = f"Error: {exc}"
            rt.metrics.record_call(rt.name, elapsed, exc.kind)
            self.trace.append({"tool": name, "arguments": arguments, "error": str(exc), "error_kind": exc.kind,
                               "seconds": elapsed})
            return self.last_output
        assert result is not None
        self.rewards.append(result.reward)
        if result.reward is not None:
            self.reward = result.reward
        self.metadata.append(result.metadata)
        self.finished = self.finished or result.finished
        if result.finished and not self._over:
            self._over = True
            done = self._pending
            if done is not None:
                self._holder[0] = None
                self._pending = None
                rt.close_later(done)
        text = truncate_output(result.text, rt.max_output_chars) or "(no output)"
        self.last_output = text
        rt.metrics.record_call(rt.name, elapsed)
        self.trace.append({"tool": name, "arguments": arguments, "output": text, "reward": result.reward,
                           "finished": result.finished, "metadata": result.metadata, "seconds": elapsed})
        return text

    def _call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        """Run remote tool `name`; raise (for TRL's failure count) with a readable message on failure."""
        if not self._ahead and self._runtime.batch_tool_calls and not self._over and self._pending is not None:
            batch = _tool_loop_batch(self, name, arguments)
            if batch is not None:
                _start_ahead(batch)
        if self._ahead:
            head_name, head_arguments, fut = self._ahead[0]
            if head_name == name and head_arguments == arguments:
                self._ahead.popleft()
                return self._take_ahead(name, arguments, fut)
            logger.warning("%s: TRL asked for %s, not the call started ahead of it (%s); recording those first",
                           self._runtime.name, _show_call(name, arguments), _show_call(head_name, head_arguments))
            self._settle_ahead()
        self._before_call()
        started = time.monotonic()
        try:
            if self._over:
                raise episode_finished_error(name)
            session = self._session()
            result = self._runtime.bg.run(session.call(name, arguments))
        except ORSError as exc:
            self._after_call(name, arguments, time.monotonic() - started, None, exc)
            raise
        return self._after_call(name, arguments, time.monotonic() - started, result, None)

    def _take_ahead(self, name: str, arguments: dict[str, Any],
                    fut: concurrent.futures.Future[tuple[ToolResult | None, ORSError | None, float]]) -> str:
        """Answer TRL's call with the outcome of the same call started ahead (recorded now, in TRL's order)."""
        self._before_call()
        result, exc, elapsed = fut.result()
        if exc is not None:
            self._after_call(name, arguments, elapsed, None, exc)
            raise exc
        return self._after_call(name, arguments, elapsed, result, None)

    def _settle_ahead(self) -> None:
        """Record calls started ahead that TRL did not ask for (a turn cut short), so nothing that ran is lost."""
        if not self._ahead:
            return
        entries, self._ahead = list(self._ahead), deque()
        concurrent.futures.wait([fut for _, _, fut in entries], timeout=_SETTLE_TIMEOUT_S)
        for name, arguments, fut in entries:
            if not fut.done():
                logger.warning("%s: a tool call started ahead (%s) is still running; not recorded",
                               self._runtime.name, name)
                continue
            try:
                self._take_ahead(name, arguments, fut)
            except ORSError:
                pass  # recorded as a failed call, like any other
            except Exception as exc:
                logger.warning("%s: a tool call started ahead (%s) failed: %r", self._runtime.name, name, exc)

    async def _acall_tool(self, name: str, arguments: dict[str, Any]) -> str:
        """Coroutine twin of `_call_tool`, for async tool methods (runs the call on the background loop)."""
        self._before_call()
        started = time.monotonic()
        rt = self._runtime

        try:
            if self._over:
                raise episode_finished_error(name)
            if self._pending is None:
                raise ConfigurationError("call reset() before calling a tool")
            result = await asyncio.wrap_future(rt.bg.submit(_call_in_session(self._pending, name, arguments)))
        except ORSError as exc:
            self._after_call(name, arguments, time.monotonic() - started, None, exc)
            raise
        return self._after_call(name, arguments, time.monotonic() - started, result, None)

    # -- episode end -----------------------------------------------------------------------------

    def _report_episode(self, timed_out: bool = False) -> None:
        """Record the finished episode in metrics (once)."""
        self._settle_ahead()
        if self._episode_reported:
            return
        self._episode_reported = True
        rt = self._runtime
        rt.metrics.record_episode(rt.name, reward=self.reward, finished=self.finished, calls=self.tool_calls,
                                  timed_out=timed_out)
        if rt.recorder is not None:
            rt.recorder.episode_end(self)

    def _release(self) -> concurrent.futures.Future[None] | None:
        """Report the episode and close its session in the background."""
        self._report_episode()
        if self._pending is None:
            return None
        done = self._runtime.close_later(self._pending)
        self._pending = None
        self._holder[0] = None
        return done

    def _close(self, timeout: float | None = 30.0) -> None:
        """Close this adapter's session now (waits up to `timeout` seconds)."""
        done = self._release()
        if done is not None:
            concurrent.futures.wait([done], timeout=timeout)
