"""The one rollout loop (design decision 14): `play(episode, generator)` shows the generator the conversation and hands
each reply to the turn rule (`Episode.reply`) until the episode ends; the engine, `evaluate` and the eval callback
drive it. A generator gives "the model's next reply to this conversation". `Batcher` is the one micro-batcher.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from ..protocol.errors import ConfigurationError, ContextLengthExceeded
from .conversation import assistant_message
from .episode import Episode, Outcome, Reply

__all__ = ["AUTO_WINDOW", "Batcher", "Conversation", "Generator", "StopEpisode", "play", "play_task"]

logger = logging.getLogger("ors_trl")

#: The automatic gather window's longest wait, in seconds.
AUTO_WINDOW = 0.05


class Conversation:
    """One episode as a generator sees it: its chat `messages`, the tools' schemas, and the generator's `state`."""

    __slots__ = ("episode", "messages", "state", "tools")

    def __init__(self, episode: Episode, messages: list[dict[str, Any]] | None = None,
                 tools: list[dict[str, Any]] | None = None) -> None:
        self.episode, self.messages, self.tools, self.state = episode, messages or [], tools, None

    def add(self, reply: Reply, outcomes: Sequence[Outcome]) -> None:
        """Append a reply whose calls ran (`assistant_message`), and their results as `tool` messages."""
        turn = len(self.episode.turns) - 1
        ids = [c.id or f"call_{turn}_{k}" for k, c in enumerate(reply.tool_calls)]
        self.messages.append(assistant_message(reply, ids))
        self.messages += [{"role": "tool", "name": c.name, "content": o.content, "tool_call_id": i}
                          for c, o, i in zip(reply.tool_calls, outcomes, ids, strict=True)]


class StopEpisode(Exception):
    """Raised by a generator instead of a reply: the episode ends with `reason` (`length`, `context_length`)."""

    def __init__(self, reason: str, detail: str | None = None) -> None:
        super().__init__(detail or reason)
        self.reason, self.detail = reason, detail


@runtime_checkable
class Generator(Protocol):
    """What `play` asks for the model's next reply; optional hooks `start(conversation)` and `finish(conversation)`."""

    async def reply(self, conversation: Conversation) -> Reply:
        """The model's next reply to `conversation`; raises `StopEpisode` or `ContextLengthExceeded` to end it."""


async def play(episode: Episode, generator: Any, *, base: Sequence[Mapping[str, Any]] = (), flatten: bool = False,
               timeout: float | None = None) -> Conversation:
    """Play `episode` with `generator` until it ends. `base`: the dataset row's prompt messages (`Prompt.chat`);
    `flatten`: the prompt as one user message, as TRL's loop shows it; `timeout`: seconds, past which it ends scored
    None. An episode that does not open is left failed; what the generator raises, other than a stop, propagates."""
    conversation = Conversation(episode)
    start, finish = getattr(generator, "start", None), getattr(generator, "finish", None)
    if start is not None:
        start(conversation)
    deadline = asyncio.timeout(timeout)
    try:
        async with deadline:
            await _play(conversation, generator, base, flatten)
    except TimeoutError:
        if not deadline.expired():  # not our deadline: a failure like any other
            raise
        episode.time_out(timeout or 0.0)
    finally:
        if finish is not None:
            finish(conversation)
    return conversation


async def _play(conversation: Conversation, generator: Any, base: Sequence[Mapping[str, Any]], flatten: bool) -> None:
    episode = conversation.episode
    if not await episode.open():
        return
    prompt, toolset = episode.prompt, episode.toolset
    assert prompt is not None
    conversation.messages = [{"role": "user", "content": prompt.flat}] if flatten else prompt.chat(base)
    conversation.tools = toolset.schemas if toolset is not None and toolset.by_name else None
    while not episode.over:
        try:
            reply = await generator.reply(conversation)
        except (StopEpisode, ContextLengthExceeded) as stop:
            if conversation.messages and conversation.messages[-1].get("role") == "tool":
                episode.unsee()  # the results the stop came before never reached the model: they set no reward
            reason = stop.reason if isinstance(stop, StopEpisode) else "context_length"
            await episode.end(reason, detail=stop.detail if isinstance(stop, StopEpisode) else str(stop))
            return
        outcomes = await episode.reply(reply)
        if outcomes is None:
            return
        conversation.add(reply, outcomes)


async def play_task(episode: Episode, generator: Any, *, attempts: list[Episode] | None = None, player: Any = None,
                    **options: Any) -> tuple[Episode, Conversation]:
    """Play `episode`, replaying its task on a fresh session (`Episode.again`) while a failure voided it, at most
    `episode_retries` times (logged: its tools run again). Returns the last attempt and its conversation; voided ones
    are recorded and counted as retries. `attempts` receives each attempt as it starts; `player` plays each (`play`,
    or a harness's) with `options`."""
    attempts, player = [] if attempts is None else attempts, player or play
    attempts.append(episode)
    for attempt in range(episode.env.options["episode_retries"] + 1):
        if attempt:
            logger.warning("%s: task %s failed (%s); replaying it on a fresh session (attempt %d of %d), its tools "
                           "run again", episode.env.name, episode.task.key, episode.retryable, attempt + 1,
                           episode.env.options["episode_retries"] + 1)
            await episode.close(replaced=True)
            episode = episode.again()
            episode.info["replayed"] = attempt
            attempts.append(episode)
        conversation = await player(episode, generator, **options)
        if not episode.retryable:
            break
    return episode, conversation


class _Request:
    __slots__ = ("future", "item", "loop", "order", "since")

    def __init__(self, item: Any, future: asyncio.Future[Any], order: int) -> None:
        self.item, self.future, self.order = item, future, order
        self.loop, self.since = future.get_loop(), time.monotonic()


def _settle(future: asyncio.Future[Any], result: Any) -> None:
    if not future.done():
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)


class Batcher:
    """The micro-batcher in front of a batched generator: a ready request waits for the members (`enter`/`leave`) that
    may still ask, at most `window` seconds (None: `AUTO_WINDOW`, at most half a batch's time), then goes as one batch;
    `barrier`: wait for every member (TRL's schedule). Coroutines `ask`; one pump thread `take`s batches, rows in the
    order members entered, and answers them (`give`)."""

    def __init__(self, window: float | None = None, *, max_batch: int | None = None, barrier: bool = False) -> None:
        if window is not None and not window >= 0:  # also refuses NaN
            raise ConfigurationError(f"the gather window must be >= 0 seconds or None (automatic), got {window!r}")
        self.window, self.max_batch, self.barrier = window, max_batch, barrier
        self.members = 0
        self.batch_sizes: list[int] = []  # requests per batch taken, for inspection
        self._queue: list[_Request] = []
        self._took: float | None = None  # moving average of a batch's generation time
        self._entered = 0
        self._cond = threading.Condition()

    @property
    def seconds(self) -> float:
        """How long a ready request waits for company at most."""
        if self.window is not None:
            return self.window
        return AUTO_WINDOW if self._took is None else min(AUTO_WINDOW, self._took / 2)

    def enter(self) -> int:
        """A member joins; its place in the order of batches' rows (pass it to `ask`)."""
        with self._cond:
            self.members += 1
            self._entered += 1
            return self._entered

    def leave(self) -> None:
        with self._cond:
            self.members -= 1
            self._cond.notify_all()

    def wake(self) -> None:
        """Make `take` look again (its `stop` condition may hold now)."""
        with self._cond:
            self._cond.notify_all()

    async def ask(self, item: Any, order: int = 0) -> Any:
        """Queue `item` (its member's place `order`) for the next batch and wait for its answer (or exception)."""
        request = _Request(item, asyncio.get_running_loop().create_future(), order)
        with self._cond:
            self._queue.append(request)
            self._queue.sort(key=lambda r: r.order)
            self._cond.notify_all()
        try:
            return await request.future
        finally:
            if not request.future.done():  # cancelled (a deadline): never generated for
                with self._cond:
                    if request in self._queue:
                        self._queue.remove(request)

    def take(self, stop: Callable[[], bool] = lambda: False) -> list[_Request]:
        """Block until a batch is ready; `[]` once `stop()` holds with nothing waiting."""
        with self._cond:
            while True:
                self._queue = [r for r in self._queue if not r.future.done()]
                waiting = len(self._queue)
                if waiting:
                    coming = self.members - waiting
                    if coming <= 0 or (not self.barrier and self._left() <= 0):
                        size = min(waiting, self.max_batch or waiting)
                        batch, self._queue = self._queue[:size], self._queue[size:]
                        self.batch_sizes.append(size)
                        return batch
                    self._cond.wait(1.0 if self.barrier else min(max(self._left(), 0.001), 1.0))
                elif stop():
                    return []
                else:
                    self._cond.wait(1.0)  # woken by ask, leave and wake; bounded all the same

    def _left(self) -> float:
        return self.seconds - (time.monotonic() - min(r.since for r in self._queue)) if self._queue else math.inf

    def give(self, batch: Sequence[_Request], results: Sequence[Any], seconds: float | None = None) -> None:
        """Answer a batch (in order; an exception is raised in its asker); `seconds`: what generating it took."""
        if seconds is not None:
            self._took = seconds if self._took is None else 0.7 * self._took + 0.3 * seconds
        for request, result in zip(batch, results, strict=True):
            request.loop.call_soon_threadsafe(_settle, request.future, result)
