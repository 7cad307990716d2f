"""One episode, written once: the core every driver (TRL's loop, the engine, eval, the demo) drives.

An `Episode` owns one rollout of one task from open to close: its session, its prompt (a
conversation from `/messages` where the server has it, else `/prompt`), the model's tool calls
(routed by the name the model saw to the remote tool and wire arguments, called, recorded), the
end (a `@terminal` tool gets the model's final plain message), its reward, finished flag and
metadata, and one record of all of it in one versioned schema. Metrics are counted here and
nowhere else. A driver only decides when to generate and what the model said.

`EnvironmentRuntime` is what the episodes of one environment share: the client, the bound
tools, the prompt cache, metrics, the record writer, and the set of live episodes that are
closed at step end, at `close()` and at interpreter exit. It lives on the process's background
loop (`ors_trl._loop`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ._binding import Toolset
from ._client import AsyncClient, AsyncSession
from ._conversation import Prompt, transcript
from ._exceptions import ConfigurationError, NotFoundError, ORSError, ToolError, ToolRefusedError
from ._loop import get_loop
from ._metrics import EnvMetrics
from ._records import RecordWriter
from ._text import clip
from ._types import TerminalTool, ToolList, ToolResult

__all__ = ["RECORD_VERSION", "EnvironmentRuntime", "Episode", "Outcome", "Task"]

logger = logging.getLogger("ors_trl")

#: Version of the episode record schema (see `Episode.record`).
RECORD_VERSION = 2
#: Tells the records of one process run apart from another's in merged logs.
RUN_ID = f"{socket.gethostname()}-{os.getpid()}-{int(time.time())}"
# Live runtimes by key: how a reward function finds the metrics of the engine's episodes (only their keys
# travel through TRL's extra columns).
_RUNTIMES: weakref.WeakValueDictionary[str, EnvironmentRuntime] = weakref.WeakValueDictionary()


def runtimes(keys: Sequence[Any]) -> list[EnvironmentRuntime]:
    """The live runtimes named by `keys` (an engine's `ors_env` column), each once."""
    return [rt for key in dict.fromkeys(keys) if (rt := _RUNTIMES.get(key)) is not None]


@dataclass(frozen=True)
class Task:
    """Which task an episode runs: `index` of `split`, or an explicit `spec`; `env` names it in a mix."""

    split: str
    index: int | None = None
    spec: Mapping[str, Any] | None = None
    env: str | None = None

    @property
    def key(self) -> str:
        """Identity for the prompt cache and for grouping a GRPO group's rollouts."""
        if self.spec is not None:
            return f"{self.env}:spec:" + json.dumps(self.spec, sort_keys=True, default=str)
        return f"{self.env}:index:{self.split}:{self.index}"

    def identity(self) -> str:
        """The JSON a dataset row carries so that `rollout_func` (which sees only prompts) knows its task."""
        return json.dumps({"env": self.env, "split": self.split, "index": self.index})

    @classmethod
    def from_row(cls, split: str, task_index: Any = None, task_spec: Any = None, env: str | None = None) -> Task:
        """The task of a dataset row's `reset(task_index=..., task_spec=...)` arguments, validated."""
        if task_spec is None and task_index is None:
            raise ConfigurationError("reset() needs task_index= (the rows of spec.train_dataset carry it) or task_spec=.")
        if task_spec is None and (isinstance(task_index, bool) or not isinstance(task_index, int)):
            raise ConfigurationError(f"task_index must be an int, got {task_index!r}")
        if task_spec is not None and not isinstance(task_spec, Mapping):
            raise ConfigurationError(f"task_spec must be a mapping, got {type(task_spec).__name__}")
        return cls(split, None if task_spec is not None else task_index,
                   dict(task_spec) if task_spec is not None else None, env)


class Outcome:
    """What one tool call gave the model: `text` on success, else `error` (and TRL's error text)."""

    __slots__ = ("error", "result", "text")

    def __init__(self, text: str, error: ORSError | None = None, result: ToolResult | None = None) -> None:
        self.text, self.error, self.result = text, error, result

    @property
    def content(self) -> str:
        """The tool message content exactly as TRL's loop writes it (`{'error': ...}` for a failure)."""
        return self.text if self.error is None else str({"error": str(self.error)})


def episode_finished_error(tool: str) -> ToolRefusedError:
    """The refusal of a call after the episode finished, given locally: servers refuse every later call."""
    return ToolRefusedError(
        f"tool {tool!r} was refused (episode_finished): the episode has finished, so no further tool calls are "
        "accepted.",
        tool=tool,
        reason="episode_finished",
    )


def _error(exc: BaseException) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": getattr(exc, "kind", "internal"), "message": str(exc)}
    if getattr(exc, "reason", None):
        out["reason"] = exc.reason  # type: ignore[attr-defined]
    return out


class EnvironmentRuntime:
    """What every episode of one environment shares; one per spec.

    Args:
        client: the environment's client (its sessions live on the background loop).
        name: the environment's name in metrics and records.
        split: the split tasks are drawn from.
        max_output_chars: cap on tool output the model sees (the cut is marked).
        cache_prompts: answer repeated resets of a task from the cached prompt while the session opens.
        max_concurrent_tool_calls: tool calls in flight at once, across the environment's episodes.
        batch_tool_calls: in TRL's own loop, start a turn's calls across the batch at once.
        episode_log: a record writer receiving every finished episode, or None.
        score_groups: keep finished sessions until the step ends, so group scoring can use them.
    """

    def __init__(self, client: AsyncClient, *, name: str, split: str, max_output_chars: int | None = None,
                 cache_prompts: bool = True, max_concurrent_tool_calls: int = 64, batch_tool_calls: bool = True,
                 episode_log: RecordWriter | None = None, score_groups: bool = False) -> None:
        self.client = client
        self.name = name
        self.split = split
        self.max_output_chars = max_output_chars
        self.cache_prompts = cache_prompts
        self.max_concurrent_tool_calls = max_concurrent_tool_calls
        self.batch_tool_calls = batch_tool_calls
        self.recorder = episode_log
        self.score_groups = score_groups
        self.metrics = EnvMetrics()
        self.metrics.set_open_sessions_gauge(name, lambda: self.client.open_sessions)
        self.toolset: Toolset | None = None  # bound by the spec before the first episode
        self.uses_messages: bool | None = None  # /messages supported (None: not known yet)
        self.block_types: tuple[str, ...] | None = None  # block types the server accepts in messages
        self.supports_score_group = False
        self.key = f"{name}-{id(self):x}"
        _RUNTIMES[self.key] = self
        self.prompt_cache: dict[str, Prompt] = {}
        self.prompt_mismatches = 0
        self.cached_resets = 0
        self.calls_ahead = 0  # tool calls started ahead of TRL's loop (batch_tool_calls)
        self._trainer: weakref.ref[Any] | None = None  # the trainer driving this environment, once seen
        self.bg = get_loop()
        self.live: set[Episode] = set()
        self._pending: set[concurrent.futures.Future[None]] = set()
        self._lock = threading.Lock()
        self._gates: dict[int, asyncio.Semaphore] = {}
        self._toolsets: dict[str, Toolset] = {}
        self.bg.add_closer(self.aclose)

    def __repr__(self) -> str:
        return f"<EnvironmentRuntime {self.name!r} live={len(self.live)}>"

    @property
    def terminal(self) -> TerminalTool | None:
        return self.toolset.terminal if self.toolset is not None else None

    @property
    def trainer(self) -> Any:
        """The trainer driving this environment, while it exists (held weakly: a model is not kept alive)."""
        return self._trainer() if self._trainer is not None else None

    def rename(self, name: str, metrics: EnvMetrics, recorder: RecordWriter | None) -> None:
        """Join a mix: report under `name`, into the mix's metrics and record writer."""
        self.name, self.metrics = name, metrics
        metrics.set_open_sessions_gauge(name, lambda: self.client.open_sessions)
        if recorder is not None:
            self.recorder = recorder

    def episode(self, task: Task, *, source: str, metrics: bool = True, writer: RecordWriter | None = None,
                **info: Any) -> Episode:
        """A new, not yet opened episode of `task`, tracked until it is closed."""
        ep = Episode(self, task, source=source, metrics=self.metrics if metrics else None,
                     writer=writer if writer is not None else self.recorder, **info)
        with self._lock:
            self.live.add(ep)
        return ep

    def toolset_of(self, listed: ToolList) -> Toolset:
        """The toolset of one session's own tool list (`/task_tools`), bound once per distinct list."""
        key = json.dumps([t.to_json() for t in listed.tools], sort_keys=True, default=str) + repr(listed.terminal_tool)
        toolset = self._toolsets.get(key)
        if toolset is None:
            toolset = self._toolsets[key] = Toolset(listed.tools, terminal=listed.terminal_tool)
        return toolset

    def tool_gate(self) -> asyncio.Semaphore:
        """The running loop's bound on this environment's tool calls in flight."""
        loop = asyncio.get_running_loop()
        gate = self._gates.get(id(loop))
        if gate is None:
            gate = self._gates[id(loop)] = asyncio.Semaphore(max(1, self.max_concurrent_tool_calls))
        return gate

    async def read_prompt(self, session: AsyncSession) -> Prompt:
        """The session's prompt: `/messages` where the server has it (probed once), else `/prompt`."""
        if self.uses_messages is not False:
            try:
                prompt = Prompt.from_messages(await session.messages())
            except NotFoundError:
                if self.uses_messages:  # advertised, yet missing: say so once, then stop asking
                    logger.warning("%s: the server advertises /messages but has no such route; using /prompt",
                                   self.name)
                self.uses_messages = False
            else:
                self.uses_messages = True
                return prompt
        return Prompt.from_blocks(await session.prompt())

    def remember_prompt(self, key: str, prompt: Prompt) -> None:
        cached = self.prompt_cache.setdefault(key, prompt)
        if cached.text != prompt.text:
            self.prompt_mismatches += 1
            if self.prompt_mismatches == 1:
                logger.warning(
                    "%s: task %s gave a different prompt in a new session than the cached one, so the model saw a "
                    "stale prompt. Pass cache_prompts=False if prompts vary between sessions of a task.",
                    self.name, key,
                )

    # -- lifecycle (any thread) ---------------------------------------------------------------

    def submit(self, coro: Any) -> concurrent.futures.Future[Any]:
        """Run `coro` on the background loop, tracked until done (so `close_all` can wait for it)."""
        fut = self.bg.submit(coro)
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(self._forget)
        return fut

    def _forget(self, fut: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._pending.discard(fut)

    def release_all(self) -> None:
        """Close every live episode in the background (step end): account it, write its record, free its session."""
        with self._lock:
            episodes = list(self.live)
        for ep in episodes:
            ep.release()

    def close_all(self, timeout: float | None = 60.0) -> None:
        """Close every episode and session of this environment and wait (bounded) until the server has them gone."""
        self.release_all()
        with self._lock:
            pending = list(self._pending)
        concurrent.futures.wait(pending, timeout=timeout)
        try:
            self.bg.run(self.client.close_sessions(), timeout=timeout)
        except ORSError as exc:
            logger.warning("%s: closing sessions failed: %s", self.name, exc)

    async def aclose(self) -> None:
        """At exit: close every live episode, then the client (which deletes whatever is still open)."""
        await asyncio.gather(*(ep.close() for ep in list(self.live)), return_exceptions=True)
        await self.client.aclose()

    def attach_to(self, trainer: Any) -> None:
        """Make `trainer` release this environment's sessions at each step's end and close them at the end.

        Adds a `SessionCleanupCallback` (public Trainer API) unless one already covers this runtime.
        """
        if self.trainer is trainer or not hasattr(trainer, "add_callback"):
            return
        from ._callback import SessionCleanupCallback

        self._trainer = weakref.ref(trainer)
        for cb in getattr(getattr(trainer, "callback_handler", None), "callbacks", []):
            if isinstance(cb, SessionCleanupCallback) and self in cb.runtimes:
                return
        trainer.add_callback(SessionCleanupCallback([self]))


class Episode:
    """One rollout of one task. Create it with `EnvironmentRuntime.episode`; run its coroutines on one loop.

    Attributes:
        reward: last non-None reward (the outcome convention); None if nothing was scored.
        rewards, metadata: per tool call, the reward / the environment's metadata (None where absent).
        finished: True once the environment said the episode is over.
        tool_calls, tool_failures: the model's tool calls this episode, and how many failed.
        turns: the record of each model turn (`{"index", "assistant", "tool_calls": [...]}`).
        final: the terminal tool's call with the model's final message, if the environment has one.
        error: why the episode failed outside a tool call (`{"kind", "message"}`), else None.
        end_reason: finished, no_tool_calls, max_turns, length, context_length, timeout or error.
        group_reward: the comparative reward from `/score_group`, when asked for.
    """

    def __init__(self, env: EnvironmentRuntime, task: Task, *, source: str, metrics: EnvMetrics | None,
                 writer: RecordWriter | None, task_tools: bool = False, **info: Any) -> None:
        self.env = env
        self.task = task
        self.source = source
        self.info = info  # extra record fields: repeat, policy, ...
        self.toolset = None if task_tools else env.toolset  # None: bind the session's own tool list when it opens
        self.session: AsyncSession | None = None
        self.prompt: Prompt | None = None
        self.turns: list[dict[str, Any]] = []
        self.final: dict[str, Any] | None = None
        self.reward: float | None = None
        self.rewards: list[float | None] = []
        self.metadata: list[dict[str, Any] | None] = []
        self.finished = False
        self.tool_calls = 0
        self.tool_failures = 0
        self.error: dict[str, Any] | None = None
        self.end_reason: str | None = None
        self.timed_out = False
        self.group_reward: float | None = None
        self.timings: dict[str, float] = {"generation": 0.0, "tools": 0.0}
        self.started = time.monotonic()
        self.started_at = datetime.now(UTC).isoformat(timespec="seconds")
        self._metrics = metrics
        self._writer = writer
        self._opening: asyncio.Future[bool] | None = None
        self._open_error: ORSError | None = None
        self._accounted = False
        self._closed = False
        self._closing: concurrent.futures.Future[None] | None = None
        self._session_closing: asyncio.Future[None] | None = None
        self._ended: float | None = None

    def __repr__(self) -> str:
        state = "closed" if self._closed else "finished" if self.finished else "open" if self.session else "new"
        return f"<Episode {self.env.name} {self.task.key} reward={self.reward} {state}>"

    @property
    def terminal(self) -> TerminalTool | None:
        return self.toolset.terminal if self.toolset is not None else None

    @property
    def seconds(self) -> float:
        """Wall time of the episode so far (until it was closed)."""
        return (self._ended or time.monotonic()) - self.started

    # -- open --------------------------------------------------------------------------------------

    async def open(self) -> bool:
        """Open the session and read the prompt (once; later callers share the first open). False on failure,
        which is recorded: the episode then scores None."""
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._open())
        return await asyncio.shield(self._opening)

    async def _open(self) -> bool:
        env, task = self.env, self.task
        started = time.monotonic()
        try:
            if task.spec is not None:
                self.session = await env.client.open_session(task_spec=task.spec)
            else:
                self.session = await env.client.open_session(split=task.split, index=task.index)
            self.timings["open"] = time.monotonic() - started
            self.prompt = await env.read_prompt(self.session)
            if self.toolset is None:
                self.toolset = env.toolset_of(await self.session.tools())
        except ORSError as exc:
            if self._metrics is not None:
                self._metrics.record_open(env.name, None, exc.kind)
            logger.warning("%s: could not open a session for task %s: %s", env.name, task.key, exc)
            self._open_error = exc
            self.fail(exc)
            if self.session is not None:
                await self.session.close()
            return False
        self.timings["prompt"] = time.monotonic() - started - self.timings["open"]
        if self._metrics is not None:
            self._metrics.record_open(env.name, time.monotonic() - started)
        env.remember_prompt(task.key, self.prompt)
        return True

    def fail(self, exc: BaseException, *, reason: str = "error") -> None:
        """Record why the episode failed outside any tool call; it scores None."""
        if self.error is None:
            self.error = _error(exc)
        self.end_reason = self.end_reason or reason

    # -- turns and tool calls --------------------------------------------------------------------

    def begin_turn(self, assistant: str | None, **extra: Any) -> dict[str, Any]:
        """Start the record of a model turn (its visible text; driver extras like `raw` or `usage`)."""
        turn = {"index": len(self.turns), "assistant": assistant, "tool_calls": [], **extra}
        self.turns.append(turn)
        return turn

    async def call(self, name: str, arguments: Any, *, call_id: str | None = None,
                   routed: tuple[str, dict[str, Any]] | None = None, rejected: ORSError | None = None) -> Outcome:
        """One tool call of the model, by the name it saw; routed, called, recorded and counted once.

        `routed` (remote name, wire arguments) skips routing when the caller already did it (TRL called
        a bound method); `rejected` records a call the driver refused itself. Never raises for environment
        failures: they are in the outcome and the record.
        """
        entry: dict[str, Any] = {"id": call_id, "name": name, "arguments": arguments}
        (self.turns[-1] if self.turns else self.begin_turn(None))["tool_calls"].append(entry)
        self.tool_calls += 1
        started = time.monotonic()
        try:
            if rejected is not None:
                raise rejected
            remote, wire = routed if routed is not None else self._route(name, arguments)
            entry["remote_name"] = remote
            if wire != arguments:
                entry["remote_arguments"] = wire
            result = await self._remote(remote, wire)
        except ORSError as exc:
            elapsed = time.monotonic() - started
            self.tool_failures += 1
            self.rewards.append(None)
            self.metadata.append(None)
            entry.update(error=_error(exc), seconds=round(elapsed, 4))
            self._count_call(elapsed, exc.kind)
            outcome = Outcome(f"Error: {exc}", exc)
            entry["output"] = outcome.content
            return outcome
        elapsed = time.monotonic() - started
        text = clip(result.text, self.env.max_output_chars) or "(no output)"
        entry.update(output=text, reward=result.reward, finished=result.finished, metadata=result.metadata,
                     seconds=round(elapsed, 4))
        self._scored(result)
        self._count_call(elapsed, None)
        return Outcome(text, None, result)

    def _route(self, name: str, arguments: Any) -> tuple[str, dict[str, Any]]:
        if self.toolset is None:
            raise ToolRefusedError(f"Tool {name} not found.", tool=name, reason="not_found")
        return self.toolset.route(name, arguments)

    async def _remote(self, remote: str, wire: dict[str, Any]) -> ToolResult:
        """Call remote tool `remote` in this episode's session (opening it first if still opening)."""
        if self.finished or self._closed:
            raise episode_finished_error(remote)
        if not await self.open():
            assert self._open_error is not None
            raise self._open_error
        assert self.session is not None
        started = time.monotonic()
        try:
            async with self.env.tool_gate():
                return await self.session.call(remote, wire)
        finally:
            self.timings["tools"] += time.monotonic() - started

    def _scored(self, result: ToolResult) -> None:
        self.rewards.append(result.reward)
        self.metadata.append(result.metadata)
        if result.reward is not None:
            self.reward = result.reward
        if result.finished and not self.finished:
            self.finished = True
            if not self.env.score_groups:  # every later call is refused anyway: free the session now
                self._close_session_soon()

    def _metrics_group(self, *, ok: bool) -> None:
        if self._metrics is not None:
            self._metrics.record_group(self.env.name, ok=ok)

    @property
    def final_message(self) -> str | None:
        """The model's final plain message, when it wrote one."""
        return self.final.get("message") if self.final else None

    def _count_call(self, seconds: float, kind: str | None, *, terminal: bool = False) -> None:
        """Count a call: the model's tool call, or (`terminal`) the harness's call of the hidden terminal tool."""
        if self._metrics is not None:
            self._metrics.record_call(self.env.name, seconds, kind, terminal=terminal)

    def _close_session_soon(self) -> None:
        session = self.session
        if session is not None and not session.closed:
            self._session_closing = asyncio.ensure_future(session.close())  # close() awaits the same close

    # -- the end -----------------------------------------------------------------------------------

    async def end(self, message: str | None, *, reason: str) -> None:
        """The model stopped: `message` is its final plain message, None when it was cut off (`reason`:
        no_tool_calls, max_turns, length, context_length, ...). An environment's terminal tool gets the
        message and grades the episode; a cut-off episode of such an environment scores None."""
        if self.end_reason is not None:
            return
        terminal = self.terminal
        if terminal is not None and not self.finished and self.error is None:
            if message is None:
                self.end_reason = reason
                return
            self.final = {"message": message, "tool": terminal.name}
            started = time.monotonic()
            try:
                result = await self._remote(terminal.name, terminal.arguments(message))
            except ORSError as exc:
                self.final.update(error=_error(exc), seconds=round(time.monotonic() - started, 4))
                self._count_call(time.monotonic() - started, exc.kind, terminal=True)
            else:
                self.final.update(output=clip(result.text, self.env.max_output_chars), reward=result.reward,
                                  finished=result.finished, metadata=result.metadata,
                                  seconds=round(time.monotonic() - started, 4))
                self._scored(result)
                self._count_call(time.monotonic() - started, None, terminal=True)
        elif message is not None:
            self.final = {"message": message}
        self.end_reason = "finished" if self.finished else reason

    def settle(self, messages: Sequence[Mapping[str, Any]], *, truncated: bool = False) -> tuple[str | None, str]:
        """Fill the turns from a finished transcript (the assistant and tool messages TRL collected after the
        prompt, when the calls were made through TRL's loop); returns what to `end` with: the final plain
        message (None when the model was cut off) and the reason it stopped."""
        calls = [c for t in self.turns for c in t["tool_calls"]]
        self.turns = []
        final: str | None = None
        reason = "no_tool_calls"
        for message in messages:
            if message.get("role") != "assistant":
                continue
            wanted = message.get("tool_calls") or []
            content = message.get("content")
            text = content if isinstance(content, str) else json.dumps(content, default=str)
            turn = self.begin_turn(text)
            turn["tool_calls"], calls = calls[: len(wanted)], calls[len(wanted):]
            final, reason = (None, "max_turns") if wanted else (text, "no_tool_calls")
        if calls:  # calls the transcript does not show (it was cut): keep them in the last turn
            (self.turns[-1] if self.turns else self.begin_turn(None))["tool_calls"].extend(calls)
        if truncated:
            final, reason = None, "length"
        return final, reason

    # -- accounting, record, close ---------------------------------------------------------------

    @property
    def unscored(self) -> str | None:
        """Why the episode has no reward: timeout, error, cut_off (a terminal tool never got an answer) or
        no_reward (the environment scored nothing); None when it was scored."""
        if self.timed_out:
            return "timeout"
        if self.reward is not None:
            return None
        if self.error is not None:
            return "error"
        if self.terminal is not None and self.final is None and not self.finished:
            return "cut_off"
        return "no_reward"

    def account(self) -> None:
        """Count the episode in the metrics (once)."""
        if self._accounted:
            return
        self._accounted = True
        if self._metrics is not None:
            self._metrics.record_episode(self.env.name, reward=None if self.timed_out else self.reward,
                                         finished=self.finished, calls=self.tool_calls, unscored=self.unscored)

    def record(self) -> dict[str, Any]:
        """The episode as one JSON-able record (schema `RECORD_VERSION`), the same for every driver."""
        prompt = self.prompt
        timings = {k: round(v, 4) for k, v in self.timings.items()}
        timings["total"] = round(self.seconds, 4)
        return {
            "version": RECORD_VERSION,
            "run": RUN_ID,
            "source": self.source,
            "environment": self.env.name,
            "target": self.env.client.target.name,
            "split": self.task.split,
            "task_index": self.task.index,
            "task_spec": self.task.spec,
            **self.info,
            "started_at": self.started_at,
            "system": prompt.system if prompt else None,
            "prompt": prompt.text if prompt else None,
            "turns": self.turns,
            "final": self.final,
            "rewards": self.rewards,
            "reward": None if self.timed_out else self.reward,
            "group_reward": self.group_reward,
            "finished": self.finished,
            "end_reason": self.end_reason,
            "unscored": self.unscored,
            "tool_calls": self.tool_calls,
            "tool_failures": self.tool_failures,
            "error": self.error,
            "timings": timings,
        }

    async def close_session(self) -> None:
        """Free the server session (idempotent; waits, bounded, for an open still in flight)."""
        if self._opening is not None and not self._opening.done():
            await asyncio.wait([self._opening], timeout=30)
        if self.session is not None:
            await self.session.close()

    async def abandon(self) -> None:
        """Close the session of an episode that was interrupted: no record, no metrics (it is not a result)."""
        await self.close(keep=False)

    async def close(self, *, keep: bool = True) -> None:
        """Close the session, account the episode and write its record (once; `keep=False`: neither)."""
        if self._closed:
            return
        self._closed = True
        self._ended = time.monotonic()
        try:
            await self.close_session()
        finally:
            with self.env._lock:
                self.env.live.discard(self)
            if keep:
                self._finish()

    def _finish(self) -> None:
        self.end_reason = self.end_reason or "released"
        self.account()
        if self._writer is not None:
            try:
                self._writer.write(self.record())
            except OSError as exc:
                logger.warning("%s: could not write the episode record: %s", self.env.name, exc)

    def release(self) -> concurrent.futures.Future[None] | None:
        """Account the episode now and `close()` it in the background, from any thread (tracked by the runtime)."""
        self.account()
        if self._closed:
            return None
        if self._closing is None:
            self._closing = self.env.submit(self.close())
        return self._closing


def fatal(outcome: Outcome) -> bool:
    """True when a tool call's failure ends the episode (the session or the network), not only the call."""
    return outcome.error is not None and not isinstance(outcome.error, ToolError)


async def score_groups(episodes: Sequence[Episode]) -> None:
    """Send each GRPO group (the episodes of one task) to `/score_group` once, all groups concurrently, and set
    each episode's `group_reward`. A group whose scoring fails keeps None, is counted and logged."""
    groups: dict[tuple[int, str], list[Episode]] = {}
    for ep in episodes:
        groups.setdefault((id(ep.env), ep.task.key), []).append(ep)

    async def score(group: list[Episode]) -> None:
        env = group[0].env
        session = next((ep.session for ep in group if ep.session is not None and not ep.session.closed
                        and not ep.session.expired), None)
        opened = None
        try:
            if session is None:  # every session of the group is gone: score through a fresh one
                task = group[0].task
                session = opened = await env.client.open_session(
                    **({"task_spec": task.spec} if task.spec is not None else {"split": task.split, "index": task.index}))
            candidates = [{"messages": [m.to_json() for m in transcript(ep.prompt, ep.turns, ep.final_message,
                                                                         env.block_types)],
                           "metadata": {"rollout": i}} for i, ep in enumerate(group)]
            scores = await session.score_group(candidates)
        except ORSError as exc:
            logger.warning("%s: group scoring of task %s failed (%d rollouts get None): %s", env.name,
                           group[0].task.key, len(group), exc)
            group[0]._metrics_group(ok=False)
            return
        finally:
            if opened is not None:
                await opened.close()
        for ep, result in zip(group, scores, strict=True):
            ep.group_reward = result.reward
        group[0]._metrics_group(ok=True)

    await asyncio.gather(*(score(g) for g in groups.values()))
