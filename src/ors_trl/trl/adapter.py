"""The per-rollout adapter TRL's `environment_factory` hands out: a thin driver of `ors_trl.core.episode.Episode`.

A tool method is one `Episode.call` and raises on failure (how TRL counts `tools/failure_frequency`). Where TRL's loop
allows (`ors_trl.trl.backend`), the batch's first reset opens every session of the batch, and a turn's first tool call
starts the turn's calls across the batch. An episode no trainer drives has source `manual` (`settle_all`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import threading
import types
from collections import OrderedDict, deque
from collections.abc import Mapping
from typing import Any, ClassVar

from ..core.episode import MANUAL, EnvironmentRuntime, Episode, Outcome, Task, ToolCall
from ..core.records import token_fidelity
from ..protocol.budget import get_max_sessions
from ..protocol.errors import ConfigurationError, ORSError, ToolRefusedError, UsageError
from ..protocol.loop import get_loop
from ..protocol.text import show_json
from . import backend as _trl

__all__ = ["READS_EPISODES", "RESERVED", "OpenRewardEnvironment", "for_this_process", "settle_all"]

logger = logging.getLogger("ors_trl")

#: Bounds the wait for calls started ahead that TRL then did not ask for (an aborted turn).
_SETTLE_TIMEOUT_S = 300.0
#: The marker of a reward function that reads the episodes (`ors_trl.trl.rewards`): in TRL's async worker,
#: `get_reward` leaves the reward to such functions when one of them will run.
READS_EPISODES = "_ors_reads_episodes"


class _Ahead(concurrent.futures.Future[Outcome]):
    """A call started ahead of TRL's loop: the future of its outcome."""

    def __init__(self, call: ToolCall) -> None:
        super().__init__()
        self.call = call


class _NotATool(functools.partial):  # type: ignore[type-arg]
    """A public adapter method that TRL does not take for a tool: TRL offers the model every function of the adapter
    class (`inspect.getmembers(cls, inspect.isfunction)` but `reset` and `get_reward`), and this is not one (callable
    on the class, `OpenRewardEnvironment.close(env)`, and bound on an instance)."""

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else types.MethodType(self.func, obj)


class OpenRewardEnvironment:
    """One rollout's view of an ORS environment (what TRL's `environment_factory` returns): `reset(**row)` and one
    method per environment tool under its exact name; `close()` (`_close()` in TRL's adapter) ends the episode and
    frees its session now; the properties read the episode's state, `last_output` the latest tool result (or error)."""

    _runtime: ClassVar[EnvironmentRuntime]

    def __init__(self) -> None:
        self._episode: Episode | None = None
        self._preopened: tuple[Task, Episode, concurrent.futures.Future[bool]] | None = None
        self._ahead: deque[_Ahead] = deque()
        self._context_cut: tuple[str, str] | None = None  # TRL's async worker: how the context ended the rollout
        self.last_output = ""

    def __repr__(self) -> str:
        ep = self._episode
        return f"<{type(self).__name__} task={ep.task.index if ep else None} reward={self.reward}>"

    def _get(self, name: str, default: Any) -> Any:
        return getattr(self._episode, name) if self._episode is not None else default

    reward = property(lambda self: self._get("reward", None), doc="Last non-None reward, else None.")
    rewards = property(lambda self: self._get("rewards", []), doc="Per tool call: its reward or None.")
    metadata = property(lambda self: self._get("metadata", []), doc="Per tool call: its metadata or None.")
    finished = property(lambda self: self._get("finished", False), doc="True once the episode is over.")
    tool_calls = property(lambda self: self._get("tool_calls", 0), doc="Tool calls this episode.")
    tool_failures = property(lambda self: self._get("tool_failures", 0), doc="Failed tool calls this episode.")
    task_index = property(lambda self: self._episode.task.index if self._episode else None)
    task_spec = property(lambda self: self._episode.task.spec if self._episode else None)

    @property
    def error(self) -> str | None:
        """Why the episode failed outside any tool call (its session could not open), else None."""
        err = self._get("error", None)
        return err["message"] if err else None

    episode = property(lambda self: self._episode, doc="The current episode (its full record: `episode.record()`).")

    def reset(self, task_index: int | None = None, task_spec: Mapping[str, Any] | None = None,
              **row: Any) -> str | list[dict[str, Any]]:
        """Start a new episode for the row's task (closing the previous one in the background); its prompt as text or
        content parts (with images, as TRL's loop takes them). An environment failure is recorded and told in the text;
        an image the processing class cannot take is a `ConfigurationError` (see the spec's `images=`)."""
        rt = self._runtime
        trainer, batch = _trl.resetting_batch(self)
        if trainer is not None:
            from .callbacks import attach_session_cleanup

            attach_session_cleanup(trainer, rt)
        _check_session_caps(batch or [])
        for env, batch_row in batch or ():
            if isinstance(env, OpenRewardEnvironment) and env._preopened is None:
                with contextlib.suppress(ValueError):  # reset() says what is wrong with the row
                    env._preopened = env._preopen(batch_row.get("task_index"), batch_row.get("task_spec"), trainer)
        self._end()
        self._context_cut = None
        task = Task.from_row(rt.options["split"], task_index, task_spec)
        pre, self._preopened = self._preopened, None
        if pre is not None and pre[0] != task:
            pre[1].release()
        _, ep, opened = pre if pre is not None and pre[0] == task else self._preopen(task_index, task_spec, trainer)
        self._episode = ep
        cached = rt.prompt_cache.get(task.key) if rt.options["cache_prompts"] else None
        if cached is not None:
            rt.cached_resets += 1
        elif not opened.result():
            return f"[The environment failed to start this task: {self.error}]"
        prompt = cached or ep.prompt
        assert prompt is not None
        shown = prompt.content()
        if isinstance(shown, list):
            _refuse_images(trainer or rt.trainer, f"The prompt of task {task.key}")
        return shown

    def _preopen(self, task_index: Any, task_spec: Any, trainer: Any
                 ) -> tuple[Task, Episode, concurrent.futures.Future[bool]]:
        """Start opening the session of a row's task (the batch's first reset does this for every adapter)."""
        rt = self._runtime
        task = Task.from_row(rt.options["split"], task_index, task_spec)
        ep = rt.episode(task, source=_source(trainer), rules=_trl.rules(trainer))
        return task, ep, rt.submit(ep.open())

    def _end(self) -> None:
        """Settle calls started ahead and close the current episode in the background (`close()` also waits)."""
        self._settle_ahead()
        if self._episode is not None:
            self._episode.release()

    def _close_now(self) -> None:
        """End this rollout's episode now: account it, write its record and wait (bounded) until the server has
        deleted its session. Idempotent; the episode's state stays readable; a slow delete is logged, not raised.
        (`_close()`: the name TRL's own adapter, and scripts written against it, use.)"""
        self._settle_ahead()
        pre, self._preopened = self._preopened, None
        episodes = [ep for ep in (self._episode, pre[1] if pre is not None else None) if ep is not None]
        if not episodes:
            return
        try:
            self._runtime.bg.run(_close_episodes(episodes), timeout=_SETTLE_TIMEOUT_S)
        except ORSError as exc:
            logger.warning("%s: closing the episode's session did not finish: %s", self._runtime.name, exc)

    close = functools.update_wrapper(_NotATool(_close_now), _close_now)
    _close = _close_now

    def _current(self) -> Episode:
        if self._episode is None:
            raise UsageError("call reset() before calling a tool")
        return self._episode

    def _answer(self, outcome: Outcome) -> str | list[dict[str, Any]]:
        self.last_output = outcome.text
        if outcome.error is not None:
            raise outcome.error
        if isinstance(outcome.content, list):
            rt = self._runtime
            try:
                _refuse_images(rt.trainer, f"The output of a {rt.name} tool")
            except ConfigurationError as exc:  # TRL's loop would swallow it here: the step's reward functions raise it
                rt.image_error = rt.image_error or exc
                return outcome.text
        return outcome.content

    def _call_tool(self, name: str, arguments: dict[str, Any]) -> str | list[dict[str, Any]]:
        """A tool call of TRL's loop: one `Episode.call`; raises on failure (TRL counts it, shows `{'error': ...}`).
        A turn's first call starts the turn's calls across the batch (`_start_turn`)."""
        ep = self._current()
        call = ToolCall(name, arguments)
        batch = not self._ahead and self._runtime.options["batch_tool_calls"]
        seen = _trl.tool_turn(self, rest=batch)
        ep.made_before(seen[1][0][2] if seen else None)
        if seen and batch:
            self._start_turn(call, *seen)
        if self._ahead:
            head = self._ahead[0]
            if head.call == call:
                self._ahead.popleft()
                return self._answer(head.result())
            logger.warning("%s: TRL asked for %s(%s), not the call started ahead of it (%s(%s))", self._runtime.name,
                           name, show_json(arguments), head.call.name, show_json(head.call.arguments))
            self._settle_ahead()
        return self._answer(self._runtime.bg.run(ep.call(call)))

    async def _acall_tool(self, name: str, arguments: dict[str, Any]) -> str | list[dict[str, Any]]:
        """Coroutine twin of `_call_tool`, for async tool methods (the call runs on the background loop)."""
        call = self._current().call(ToolCall(name, arguments))
        return self._answer(await asyncio.wrap_future(self._runtime.bg.submit(call)))

    def _start_turn(self, first: ToolCall, turn: object, rollouts: list[tuple[Any, list[tuple[str, Any]], int]]
                    ) -> None:
        """Start the turn's calls across the batch (`backend.tool_turn`): per rollout, the longest prefix of its calls
        TRL will make as given (its tools, arguments that bind), in order on its session."""
        rt = self._runtime
        with rt.lock:
            if rt.last_turn is turn:
                return
            rt.last_turn = turn
        planned: list[tuple[OpenRewardEnvironment, list[_Ahead], int]] = []
        for env, calls, made in rollouts:
            if (not isinstance(env, OpenRewardEnvironment) or env._episode is None or env._episode.finished
                    or env._ahead or env._runtime.toolset is None):
                continue
            chain = []
            for name, arguments in calls:
                try:
                    env._runtime.toolset.route(name, arguments)
                except ToolRefusedError:  # TRL fails this call itself (an unknown tool, arguments that do not bind)
                    break
                chain.append(_Ahead(ToolCall(name, arguments)))
            if chain:
                planned.append((env, chain, made))
        if not planned or planned[0][0] is not self or planned[0][1][0].call != first:
            return  # what we read is not the call being made: run nothing ahead
        for env, chain, made in planned:
            env._current().made_before(made)
            env._ahead.extend(chain)
            env._runtime.calls_ahead += len(chain)
            env._runtime.submit(_run_chain(env._current(), chain))

    def _settle_ahead(self) -> None:
        """Wait (bounded) for calls started ahead that TRL did not ask for: they are recorded, nothing is lost."""
        if not self._ahead:
            return
        entries, self._ahead = list(self._ahead), deque()
        _, running = concurrent.futures.wait(entries, timeout=_SETTLE_TIMEOUT_S)
        if running:
            logger.warning("%s: %d tool call(s) started ahead are still running", self._runtime.name, len(running))


def _check_session_caps(batch: list[tuple[Any, Mapping[str, Any]]]) -> None:
    """TRL's loop holds every session of a batch open until its step ends: a cap below that could only time out."""
    rts = [env._runtime for env, _ in batch if isinstance(env, OpenRewardEnvironment)]
    needs = [(sum(r is rt for r in rts), rt.client.max_sessions, f"{rt.name}'s max_sessions=") for rt in set(rts)]
    for n, cap, what in [*needs, (len(rts), get_max_sessions(), "the process's session cap ")]:
        if cap is not None and n > cap:
            raise ConfigurationError(f"TRL's environment_factory loop holds all {n} sessions of a batch open at once, "
                                     f"past {what}{cap}: raise the cap "
                                     "to the rollouts per process, or train with rollout_func=spec.rollout_func, "
                                     "which runs a batch in waves under it.")


def _source(trainer: Any) -> str:
    """`trl` when a trainer drives the episode (found calling `reset`, or TRL's async worker), else `MANUAL`."""
    return "trl" if trainer is not None or _trl.in_async_worker() else MANUAL


def _refuse_images(trainer: Any, what: str) -> None:
    """An image a trainer cannot take is a `ConfigurationError` (an adapter driven by hand has nothing to check)."""
    if trainer is not None:
        _trl.Backend.of(trainer).refuse_images(what)


async def _close_episodes(episodes: list[Episode]) -> None:
    """Close each episode (its record, once), then wait for its session's delete, also one started elsewhere."""
    await asyncio.gather(*(ep.close() for ep in episodes), return_exceptions=True)
    await asyncio.gather(*(ep.close_session() for ep in episodes), return_exceptions=True)


async def _run_chain(ep: Episode, chain: list[_Ahead]) -> None:
    """One rollout's calls of a turn, in order on its session; resolves each entry's future."""
    for i, entry in enumerate(chain):
        try:
            outcome = await ep.call(entry.call)
        except BaseException as exc:  # cancelled (loop shutting down) or a bug: nobody may wait forever
            for rest in chain[i:]:
                if not rest.done():
                    rest.set_exception(exc if isinstance(exc, Exception) else UsageError(f"aborted: {exc!r}"))
            raise
        entry.set_result(outcome)


#: Names a tool may not take as an attribute of the adapter class (bound under another attribute, shown to the model
#: under its own name): the adapter's own API and TRL's hooks.
RESERVED = frozenset({"reset", "get_reward", "last_output",
                      *(n for n in vars(OpenRewardEnvironment) if not n.startswith("_"))})


def settle_all(environments: list[Any], completions: list[Any] | None, completion_ids: list[Any] | None,
               eos_token_ids: set[int] | None = None, tokens: dict[str, Any] | None = None) -> None:
    """After TRL's loop: replay each transcript through the turn rule (`Episode.replay`) and run the batch's ends
    (terminal tools) at once, so the rewards read next are final (their episodes train: `Episode.adopt`). With no
    trainer to ask (TRL's async worker) `eos_token_ids` and `tokens` (fidelity) are given; else read off TRL's masks."""
    masks = _trl.tool_masks() if tokens is None else None
    for env in environments:  # an image a text-only trainer could not take: the step stops here, saying why
        error = getattr(getattr(env, "_runtime", None), "image_error", None)
        if error is not None:
            raise error
    ends: list[Any] = []
    for i, env in enumerate(environments):
        ep = env._episode if isinstance(env, OpenRewardEnvironment) else None
        if ep is not None:
            ep.adopt()  # read for its reward: a training episode, whoever opened it
        if ep is None or ep.over:
            continue
        env._settle_ahead()
        messages = completions[i] if completions is not None and isinstance(completions[i], list) else []
        eos = eos_token_ids if eos_token_ids is not None else _trl.eos_token_ids(env._runtime.trainer)
        ids = completion_ids[i] if completion_ids is not None else None
        context = getattr(env, "_context_cut", None)  # the async worker's context bound ended it
        if context is not None and context[0] == "prompt" and messages and messages[-1].get("role") == "assistant":
            messages = messages[:-1]  # the empty reply that stands for "no room": nothing was generated
        replies, cut = _trl.replies_of(messages, bool(eos) and bool(ids) and int(ids[-1]) not in eos)
        reason, message = ep.replay(replies, cut=cut and context is None)
        if context is not None:
            reason, message = "context_length", None
            if context[0] == "prompt":  # its last results fill the context: no reply saw them
                ep.unsee()
        if tokens is not None or (masks is not None and i < len(masks)):
            ep.tokens = tokens or token_fidelity(int(sum(masks[i])))
        ends.append(ep.end(reason, message, detail=context[1] if context else None))
    if ends:
        async def run() -> None:
            await asyncio.gather(*ends)

        get_loop().run(run())


#: Each ended rollout's episode by the id of its transcript (TRL's `completions` entry, kept alive so no other list
#: takes its id), with how many reading reward functions are to come; bounded, for those that never come.
_HANDOVER: OrderedDict[int, tuple[list[Any], Episode, int]] = OrderedDict()
_HANDOVER_MAX = 16_384
_HANDOVER_LOCK = threading.Lock()


async def _get_reward(self: OpenRewardEnvironment) -> float | None:
    """TRL's async worker awaits this per finished rollout: settle the episode on its transcript, free its session and
    return its reward, or None when a reading reward function of the spec will give it."""
    seen = _trl.finished_rollout(self)  # before the first await: it reads the worker loop's frame
    return await asyncio.to_thread(_rollout_ended, self, seen)


def _rollout_ended(env: OpenRewardEnvironment, seen: _trl.FinishedRollout | None) -> float | None:
    ep = env._episode
    if ep is None:
        return None
    if seen is None:
        settle_all([env], None, None)
        env._end()  # the rollout is over: close its session now, not when TRL reuses this adapter
        return ep.reward
    settle_all([env], [seen.messages], [seen.completion_ids], eos_token_ids=seen.eos_token_ids, tokens=seen.tokens)
    env._end()
    readers = sum(bool(getattr(getattr(f, "func", f), READS_EPISODES, False)) for f in seen.reward_funcs)
    if readers:
        with _HANDOVER_LOCK:
            _HANDOVER[id(seen.messages)] = (seen.messages, ep, readers)
            while len(_HANDOVER) > _HANDOVER_MAX:
                _HANDOVER.popitem(last=False)
        return None
    return ep.reward


def take_ended(messages: Any) -> Episode | None:
    """In TRL's async worker: the episode handed over with transcript `messages`, if any (forgotten once every
    reading reward function has had it)."""
    with _HANDOVER_LOCK:
        hit = _HANDOVER.get(id(messages))
        if hit is None or hit[0] is not messages:
            return None
        if hit[2] <= 1:
            del _HANDOVER[id(messages)]
        else:
            _HANDOVER[id(messages)] = (messages, hit[1], hit[2] - 1)
        return hit[1]


def _context_cut(environment: Any, kind: str, detail: str) -> None:
    """TRL's async worker stopped `environment`'s rollout at the model's context (`backend.bound_async_context`)."""
    if isinstance(environment, OpenRewardEnvironment):
        environment._context_cut = (kind, detail)


def for_this_process(cls: type[OpenRewardEnvironment]) -> type[OpenRewardEnvironment]:
    """The adapter class as this process uses it: in TRL's async rollout worker, a subclass with TRL's
    `get_reward` hook (same name, same tools); anywhere else `cls` itself (`GRPOTrainer` would add a
    `get_reward` class as a second reward source)."""
    if not _trl.in_async_worker():
        return cls
    _trl.bound_async_context(_context_cut)
    sub = cls.__dict__.get("_worker_class")
    if sub is None:
        sub = type(cls)(cls.__name__, (cls,), {"get_reward": _get_reward, "__module__": cls.__module__,
                                                "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})
        type.__setattr__(cls, "_worker_class", sub)
    return sub
