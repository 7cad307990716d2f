"""One episode, written once: the core every driver (TRL's loop, the engine, eval, the demo) drives.

An `Episode` owns one rollout of one task from open to close: session, prompt, **the turn rule** (`Episode.reply`:
which calls run, when and why it ends, what it scores), the terminal grade and one record; metrics are counted here
only. TRL's loop makes its calls live (`Episode.call`) and is replayed through the same rule (`Episode.replay`).
`EnvironmentRuntime` is what the episodes of one environment share, on the background loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import json
import logging
import re
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from types import EllipsisType, MappingProxyType
from typing import Any

from ..protocol.client import AsyncClient, AsyncSession
from ..protocol.errors import (
    ConfigurationError,
    NotFoundError,
    ORSError,
    SessionExpiredError,
    ToolError,
    ToolRefusedError,
    TransportError,
)
from ..protocol.loop import get_loop
from ..protocol.text import cut, show_name
from ..protocol.types import Block, ImageBlock, TerminalTool, ToolList, ToolResult, image_blocks
from .binding import Toolset
from .conversation import Content, Prompt, content, transcript
from .metrics import EnvMetrics
from .records import RUN_ID, CallRecord, EpisodeRecord, RecordWriter, TurnRecord, error_record, image_record
from .scoring import reward_rule

__all__ = ["MANUAL", "TRAINING_SOURCES", "EnvironmentRuntime", "Episode", "Outcome", "Reply", "Rules", "Task",
           "ToolCall", "drop_failed_groups", "runtimes", "score_groups"]

logger = logging.getLogger("ors_trl")
#: Seconds a close waits for an open still in flight; a session that lands later is deleted when it lands.
OPEN_WAIT = 30.0

# Live runtimes by key: how a reward function finds the engine's episodes (only keys travel through TRL's columns).
_RUNTIMES: weakref.WeakValueDictionary[str, EnvironmentRuntime] = weakref.WeakValueDictionary()
#: The episode sources that train (TRL's loop, the engine): their outcomes teach task sampling; evaluation's do not.
TRAINING_SOURCES = frozenset({"trl", "engine"})
#: The source of an adapter's episode opened with no trainer driving it: counted apart, out of the training metrics
#: and task sampling, until a reward function reads it (`Episode.adopt`).
MANUAL = "manual"


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

    @property
    def where(self) -> dict[str, Any]:
        """The task as `open_session` takes it."""
        return {"task_spec": self.spec} if self.spec is not None else {"split": self.split, "index": self.index}

    def identity(self) -> str:
        """The JSON a dataset row carries so that `rollout_func` (which sees only prompts) knows its task."""
        return json.dumps({"env": self.env, "split": self.split, "index": self.index})

    @classmethod
    def from_row(cls, split: str, task_index: Any = None, task_spec: Any = None, env: str | None = None) -> Task:
        """The task of a dataset row's `reset(task_index=..., task_spec=...)` arguments, validated."""
        if task_spec is None and task_index is None:
            raise ConfigurationError(
                "reset() needs task_index= (the rows of spec.train_dataset carry it) or task_spec=.")
        if task_spec is None and (isinstance(task_index, bool) or not isinstance(task_index, int)):
            raise ConfigurationError(f"task_index must be an int, got {task_index!r}")
        if task_spec is not None and not isinstance(task_spec, Mapping):
            raise ConfigurationError(f"task_spec must be a mapping, got {type(task_spec).__name__}")
        return cls(split, None if task_spec is not None else task_index,
                   dict(task_spec) if task_spec is not None else None, env)


def _arguments(value: Any) -> Any:
    """A call's arguments as the binding takes them: a JSON object's text decoded, anything else as it is."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value) if value.strip() else {}
        except ValueError:
            return value
        return parsed if isinstance(parsed, dict) else value
    return value


@dataclass(frozen=True)
class ToolCall:
    """One tool call as the model wrote it: the name it saw, its arguments, its id and its type."""

    name: str
    arguments: Any = None
    id: str | None = None
    type: str = "function"

    @classmethod
    def of(cls, call: ToolCall | Mapping[str, Any]) -> ToolCall:
        """A call from a chat message's `tool_calls` entry (`{"id", "type", "function": {"name", "arguments"}}`, as
        TRL's `parse_response` and OpenAI-style APIs write it) or a flat `{"id", "name", "arguments"}`."""
        if isinstance(call, ToolCall):
            return call
        kind = str(call.get("type") or "function")
        function = call.get("function") if isinstance(call.get("function"), Mapping) else call
        name = str(function.get("name") or ("unknown" if kind != "function" or "function" in call else ""))
        return cls(name, _arguments(function.get("arguments")) if kind == "function" else None,
                   call.get("id") or None, kind)

    def record(self, **more: Any) -> CallRecord:
        """The call as its record starts (`more`: further fields)."""
        return {"id": self.id, "name": self.name, "arguments": self.arguments, **more}  # type: ignore[typeddict-item]

    def chat(self, id: str | None = None) -> dict[str, Any]:
        """The call as a chat message's `tool_calls` entry."""
        return {"id": id or self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Reply:
    """One model reply, from any generator to the record (`PolicyReply` is the same type).

    Attributes:
        content (`str`, *optional*, defaults to `""`):
            The visible text (`None`: nothing could be parsed).
        tool_calls (`Sequence[ToolCall | dict]`, *optional*, defaults to `()`):
            The calls, in order: `ToolCall`s, or dicts as chat messages or `{"id", "name", "arguments"}` write them.
        truncated (`bool`, *optional*, defaults to `False`):
            Whether the length limit cut the reply.
        raw (`str`, *optional*):
            The raw completion text, special tokens included, where the generator has it.
        usage (`dict[str, Any]`, *optional*):
            Token counts an endpoint reported.
        seconds (`float`, *optional*):
            What generating it took.
        reasoning (`str`, *optional*):
            An endpoint's `reasoning_content`: it stays in the history the policy sees next, as training keeps it.
        limit (`str`, *optional*, defaults to `"length"`):
            Which limit cut a truncated reply (the end reason): `"length"` (completion budget) or `"context_length"`.
    """

    content: str | None = ""
    tool_calls: Sequence[ToolCall | Mapping[str, Any]] = ()
    truncated: bool = False
    raw: str | None = None
    usage: dict[str, Any] | None = None
    seconds: float | None = None
    reasoning: str | None = None
    limit: str = "length"

    def __post_init__(self) -> None:
        self.tool_calls = tuple(ToolCall.of(c) for c in self.tool_calls or ())


@dataclass(frozen=True)
class Rules:
    """The limits a driver plays its episodes under. `max_replies`: model replies an episode may have (the last one's
    calls are not run: it ends `max_turns`); `max_tool_calls`: tool calls it may make (later ones refused);
    `error_text`: what the model reads for a failed call; `tool_markup`: the text (qwen3: `<tool_call>`) or pattern
    that opens a tool call: a reply without calls that holds it is marked `unparsed`."""

    max_replies: int | None = None
    max_tool_calls: int | None = None
    error_text: Callable[[BaseException], str] = str
    tool_markup: str | re.Pattern[str] | None = None

    def holds_call(self, text: str) -> bool:
        """Whether `text` holds tool-call markup (`tool_markup`)."""
        markup = self.tool_markup
        if isinstance(markup, str):
            return bool(markup) and markup in text
        return markup is not None and markup.search(text) is not None


class Outcome:
    """What one tool call gave the model: `content` is what it reads (the output, or `Rules.error_text` of `error`),
    text or content parts with an image; `text` is its text as recorded (an image as its `[image: ...]` marker)."""

    __slots__ = ("content", "error", "result", "text")

    def __init__(self, content: Content, error: ORSError | None = None, result: ToolResult | None = None,
                 text: str | None = None) -> None:
        self.content, self.error, self.result = content, error, result
        self.text = text if text is not None else content if isinstance(content, str) else ""


def _refusal(tool: str, reason: str, why: str) -> ToolRefusedError:
    return ToolRefusedError(f"tool {show_name(tool)} was refused ({reason}): {why}", tool=tool, reason=reason)


class EnvironmentRuntime:
    """What every episode of one environment shares; one per spec.

    `client` is the environment's, `name` its name in metrics and records (None: the environment's own), `recorder`
    the writer of every finished episode's record (or None), `options` the spec's (`OpenRewardSpec` documents each).
    """

    def __init__(self, client: AsyncClient, name: str | None, options: Mapping[str, Any],
                 recorder: RecordWriter | None = None) -> None:
        self.client, self.recorder = client, recorder
        self.options: Mapping[str, Any] = MappingProxyType(options)  # a read-only view of the spec's own
        self.rename(name, EnvMetrics(float(options["success_threshold"])), recorder)
        self.reward_rule = reward_rule(options["reward"])  # how per-call rewards make the episode's reward
        #: An image met a trainer that cannot take images inside TRL's loop: the reward functions raise it at step end.
        self.image_error: ConfigurationError | None = None
        self.uploads: Any = None  # a RolloutUploader sent every closed episode's record, opt-in
        #: Called once with each episode as it is counted: how task sources (`ors_trl.tasks`) hear outcomes.
        self.listeners: list[Callable[[Episode], None]] = []
        self.toolset: Toolset | None = None  # bound by the spec before the first episode
        self.uses_messages: bool | None = None  # /messages supported (None: not known yet)
        self.block_types: tuple[str, ...] | None = None  # block types the server accepts in messages
        self.supports_score_group = False
        self.key = f"{self.name}-{id(self):x}"
        _RUNTIMES[self.key] = self
        self.prompt_cache: dict[str, Prompt] = {}
        self.prompt_mismatches = 0
        self.cached_resets = 0
        self.calls_ahead = 0  # tool calls started ahead of TRL's loop (batch_tool_calls)
        # The `tool_calls` list of TRL's turn last started ahead (no weak reference holds a list): dropped at step end.
        self.last_turn: object = None
        self._trainer: weakref.ref[Any] | None = None  # the trainer driving this environment, once seen
        self.bg = get_loop()
        self.live: set[Episode] = set()
        self._pending: set[concurrent.futures.Future[None]] = set()
        self.lock = threading.Lock()  # guards the shared state: live episodes, the turn started ahead
        self._gates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = \
            weakref.WeakKeyDictionary()
        self._toolsets: dict[str, Toolset] = {}
        self.bg.add_closer(self.aclose)

    def __repr__(self) -> str:
        return f"<EnvironmentRuntime {self.name!r} live={len(self.live)}>"

    @property
    def trainer(self) -> Any:
        """The trainer driving this environment, while it exists (held weakly: a model is not kept alive)."""
        return self._trainer() if self._trainer is not None else None

    @property
    def name(self) -> str:
        """Its name in metrics and records: the one given, else the environment's (known once a session opened)."""
        return self.given_name or self.client.env_label

    def rename(self, name: str | None, metrics: EnvMetrics, recorder: RecordWriter | None) -> None:
        """Report under `name` (None: its own) into `metrics` and `recorder` (None: keep it); how a mix takes it in."""
        self.given_name, self.metrics = name, metrics
        metrics._set_open_sessions_gauge(id(self), lambda: self.name, lambda: self.client.open_sessions)
        if recorder is not None:
            self.recorder = recorder

    def episode(self, task: Task, *, source: str, rules: Rules, metrics: bool = True,
                writer: RecordWriter | None = None, uploads: Any = None, **info: Any) -> Episode:
        """A new, unopened, tracked episode of `task`; `writer` and `uploads` (False: none) replace the runtime's."""
        if self.options["max_tool_calls"] is not None and rules.max_tool_calls is None:
            rules = dataclasses.replace(rules, max_tool_calls=self.options["max_tool_calls"])
        apart = source == MANUAL or not metrics  # counted in metrics of its own (see MANUAL), or nowhere
        return Episode(self, task, source=source, rules=rules, metrics=None if apart else self.metrics,
                       writer=writer if writer is not None else self.recorder,
                       uploads=uploads if uploads is not None else self.uploads, **info)

    def toolset_of(self, listed: ToolList) -> Toolset:
        """The toolset of one session's own tool list (`/task_tools`), bound once per distinct list."""
        key = json.dumps([t.to_json() for t in listed.tools], sort_keys=True, default=str) + repr(listed.terminal_tool)
        if key not in self._toolsets:
            self._toolsets[key] = Toolset(listed.tools, terminal=listed.terminal_tool)
        return self._toolsets[key]

    def tool_gate(self) -> asyncio.Semaphore:
        """The running loop's bound on this environment's tool calls in flight."""
        loop = asyncio.get_running_loop()
        if loop not in self._gates:
            self._gates[loop] = asyncio.Semaphore(max(1, self.options["max_concurrent_tool_calls"]))
        return self._gates[loop]

    async def read_prompt(self, session: AsyncSession) -> Prompt:
        """The session's prompt: `/messages` where the server has it (probed once), else `/prompt`."""
        if self.uses_messages is not False:
            try:
                prompt = Prompt.from_messages(await session.messages(), images=self.options["images"] == "pass")
            except NotFoundError:
                if self.uses_messages:  # advertised, yet missing: say so once, then stop asking
                    logger.warning("%s: the server advertises /messages but has no such route; using /prompt",
                                   self.name)
                self.uses_messages = False
            else:
                self.uses_messages = True
                return prompt
        return Prompt.from_blocks(await session.prompt(), images=self.options["images"] == "pass")

    def remember_prompt(self, key: str, prompt: Prompt) -> None:
        cached = self.prompt_cache.setdefault(key, prompt)
        if cached.text != prompt.text:
            self.prompt_mismatches += 1
            if self.prompt_mismatches == 1:
                logger.warning("%s: task %s gave a different prompt in a new session than the cached one, so the "
                               "model saw a stale prompt. Pass cache_prompts=False if prompts vary between sessions "
                               "of a task.", self.name, key)

    # -- lifecycle (any thread) ---------------------------------------------------------------

    def submit(self, coro: Any) -> concurrent.futures.Future[Any]:
        """Run `coro` on the background loop, tracked until done (so `close_all` can wait for it)."""
        fut = self.bg.submit(coro)
        with self.lock:
            self._pending.add(fut)
        fut.add_done_callback(self._forget)
        return fut

    def _forget(self, fut: concurrent.futures.Future[Any]) -> None:
        with self.lock:
            self._pending.discard(fut)

    def release_all(self) -> None:
        """Close every live episode in the background (step end): account it, write its record, free its session."""
        with self.lock:
            episodes = list(self.live)
            self.last_turn = None
        for ep in episodes:
            ep.release()

    def close_all(self, timeout: float | None = 60.0) -> None:
        """Close every episode and session of this environment and wait (bounded) until the server has them gone."""
        self.release_all()
        with self.lock:
            pending = list(self._pending)
        concurrent.futures.wait(pending, timeout=timeout)
        try:
            self.bg.run(self.client.close_sessions(), timeout=timeout)
        except ORSError as exc:
            logger.warning("%s: closing sessions failed: %s", self.name, exc)
        if self.uploads is not None:
            self.uploads.close(timeout or 60.0)

    async def aclose(self) -> None:
        """At exit: close every live episode, then the client (which deletes whatever is still open)."""
        await asyncio.gather(*(ep.close() for ep in list(self.live)), return_exceptions=True)
        await self.client.aclose()

    def bind(self, trainer: Any) -> bool:
        """Note the trainer driving this environment (held weakly); False when it was already the one noted."""
        if self.trainer is trainer:
            return False
        self._trainer = weakref.ref(trainer)
        return True


NEW, OPENING, OPEN, ENDED, CLOSED = "new", "opening", "open", "ended", "closed"


class Episode:
    """One rollout of one task (`adapter.episode`, `rollout_func.last_episodes`); its coroutines run on one loop.

    Args:
        env (`EnvironmentRuntime`):
            The environment it runs in.
        task (`Task`):
            The task it runs.
        source (`str`):
            Which driver plays it (`"trl"`, `"engine"`, `"eval"`, ...), for the record.
        rules (`Rules`):
            The limits it is played under, and how a failed call reads to the model.
        metrics (`EnvMetrics` or `None`):
            The metrics it is counted in (`None`: none).
        writer (`RecordWriter` or `None`):
            Where its record is written when it closes (`None`: nowhere).
        task_tools (`bool`, *optional*, defaults to `False`):
            Bind the session's own tool list (`/task_tools`) when it opens, instead of the environment's.
        uploads (`RolloutUploader`, *optional*):
            Where its record is uploaded when it closes.
        **info:
            Extra record fields (`repeat`, `policy`, ...).

    Attributes:
        state (`str`):
            `new`, `opening`, `open`, `ended` (the model stopped, or it failed or timed out) or `closed`.
        reward (`float` or `None`):
            The last non-`None` reward (the outcome convention); `None` if nothing was scored, or it timed out.
        rewards (`list[float | None]`):
            Per tool call, the reward (`None` where absent); `metadata` likewise the environment's metadata.
        finished (`bool`):
            `True` once the environment said the episode is over (the model may still reply).
        tool_calls (`int`):
            The model's tool calls; `tool_failures` how many failed or were refused.
        turns (`list[TurnRecord]`):
            Each model reply's record; `final` the final plain message and its terminal grade.
        error (`dict[str, Any]` or `None`):
            Why the episode failed outside a tool call (`{"kind", "message"}`).
        end_reason (`str` or `None`):
            `finished`, `no_tool_calls`, `max_turns`, `length`, `context_length`, `timeout` or `error` (once ended).
        group_reward (`float` or `None`):
            The comparative reward from `/score_group`, when asked for; `None` where `reward` is voided, as it is.
    """

    def __init__(self, env: EnvironmentRuntime, task: Task, *, source: str, rules: Rules,
                 metrics: EnvMetrics | None, writer: RecordWriter | None, task_tools: bool = False,
                 uploads: Any = None, **info: Any) -> None:
        self.env, self.task, self.source, self.rules, self.info = env, task, source, rules, info
        self._again = functools.partial(Episode, env, task, source=source, rules=rules, metrics=metrics, writer=writer,
                                        task_tools=task_tools, uploads=uploads, **info)
        self.toolset = None if task_tools else env.toolset  # None: bind the session's own tool list when it opens
        self.state = NEW
        self.session: AsyncSession | None = None
        self.prompt: Prompt | None = None
        self.turns: list[TurnRecord] = []
        self.final: dict[str, Any] | None = None
        self.finished = False
        self.tool_calls = 0
        self.tool_failures = 0
        self.error: dict[str, Any] | None = None
        self.end_reason: str | None = None
        self._group_reward: float | None = None
        self.timings: dict[str, float] = {"generation": 0.0, "tools": 0.0}
        self.started = time.monotonic()
        self.started_at = datetime.now(UTC).isoformat(timespec="seconds")
        #: The first infrastructure failure (the open, or a call's: session, network, 5xx, protocol): no score.
        self.failure: ORSError | None = None
        self._dead = False  # the session is known gone (or never opened): it is never called again
        self.dropped = False  # its GRPO group trains on none of its episodes (`failed_groups="drop"`): no score
        #: Token fidelity, where a driver knows it (`ors_trl.core.records.token_fidelity`).
        self.tokens: dict[str, Any] | None = None
        self._given: float | EllipsisType | None = ...  # a reward given outright (`reward = x`), else the rule's
        self._metrics = metrics if metrics is not None else EnvMetrics(env.metrics.success_threshold)  # apart
        self._writer = writer
        self._uploads = uploads
        self._opening: asyncio.Future[bool] | None = None
        self._accounted = False
        self._closing: concurrent.futures.Future[None] | None = None
        self._freeing: asyncio.Future[None] | None = None
        self._ended: float | None = None
        self.images: dict[str, ImageBlock] = {}  # the episode's images by hash (its record lists each once)
        self._billed = 0.0  # session-seconds already counted in the metrics
        self._uncounted = 0  # the model's calls TRL failed itself, seen in its transcript: they count toward the cap
        with env.lock:  # tracked until it is closed
            env.live.add(self)

    def __repr__(self) -> str:
        return f"<Episode {self.env.name} {self.task.key} reward={self.reward} {self.state}>"

    @property
    def terminal(self) -> TerminalTool | None:
        """The environment's `@terminal` tool, which grades the final plain message, if it has one."""
        return self.toolset.terminal if self.toolset is not None else None

    @property
    def seconds(self) -> float:
        """Wall time of the episode so far (until it was closed)."""
        return (self._ended or time.monotonic()) - self.started

    @property
    def over(self) -> bool:
        """True once the episode has ended or closed: nothing the model does changes it any more."""
        return self.state in (ENDED, CLOSED)

    def again(self) -> Episode:
        """A fresh, unopened episode of the same task, played and recorded the same way (a replay after a failure)."""
        return self._again()

    @property
    def reward(self) -> float | None:
        """The environment's reward rule (`OpenRewardSpec(reward=)`) over the per-call rewards the model saw; `None`
        when nothing was scored, past the deadline, or after a failure (unless `score_failures`)."""
        if self.voided:
            return None
        if self._given is not ...:
            return self._given
        return self.env.reward_rule(self._seen_rewards, self)

    @reward.setter
    def reward(self, value: float | None) -> None:
        """Score the episode yourself (a harness's `score` hook): this replaces the rule's reward, not a failure's."""
        self._given = value

    @property
    def voided(self) -> bool:
        """No score counts: past the deadline, its group dropped, or after a failure (unless `score_failures`); nor
        does `unscored_reward`, which scores what the model left unscored."""
        return self.end_reason == "timeout" or self.dropped or (self.broken and not self.env.options["score_failures"])

    @property
    def group_reward(self) -> float | None:
        """The comparative reward from `/score_group`; `None` when not scored, or voided as `reward` is."""
        return None if self.voided else self._group_reward

    @group_reward.setter
    def group_reward(self, value: float | None) -> None:
        self._group_reward = value

    def _ran(self) -> list[dict[str, Any]]:
        """The model's calls that ran (failed ones too), in order, then the terminal tool's grade if it came."""
        ran = [c for t in self.turns for c in t["tool_calls"] if c.get("status") != "not_run"]
        return [*ran, self.final] if self.final is not None and "output" in self.final else ran  # type: ignore[list-item]

    @property
    def rewards(self) -> list[float | None]:
        """Per call that ran (then the terminal grade), its reward, `None` where absent."""
        return [c.get("reward") for c in self._ran()]

    @property
    def metadata(self) -> list[dict[str, Any] | None]:
        """Per call that ran (then the terminal grade), the environment's metadata."""
        return [c.get("metadata") for c in self._ran()]

    @property
    def _seen_rewards(self) -> list[float | None]:
        return [None if c.get("unseen") else c.get("reward") for c in self._ran()]

    def turn_returns(self, rewards: Sequence[float | None] | None = None) -> list[float] | None:
        """Per turn, the reward rule over the per-call rewards from that turn's calls on (a final grade counts for the
        last turn; 0.0 where nothing is left): what `credit="turn"` trains each turn on; None when `reward` is None.

        Args:
            rewards (`Sequence[float | None]`, *optional*):
                Per call, in place of the rewards the model saw (a benchmark's control shuffles them).
        """
        if self.reward is None:
            return None
        seen = self._seen_rewards if rewards is None else list(rewards)
        togo, out, k = [*self.env.reward_rule.returns(seen, self), 0.0], [], 0
        for turn in self.turns:
            out.append(togo[min(k, len(seen))])
            k += sum(1 for c in turn["tool_calls"] if c.get("status") != "not_run")
        return out

    @property
    def retryable(self) -> ORSError | None:
        """The infrastructure failure that voided the episode, or None: a replay on a fresh session may succeed."""
        return self.failure

    @property
    def broken(self) -> bool:
        """True when the episode failed: an infrastructure failure of a call, or outside any call."""
        return self.failure is not None or self.error is not None

    def _stopping(self) -> bool:
        """No call may be sent any more: the session is gone or never opened, or a failure voided the episode."""
        voided = self.failure is not None and not self.env.options["score_failures"]
        return self._dead or voided

    def unsee(self) -> None:
        """The results of the last reply's calls never reached the model: their rewards do not count."""
        for entry in self.turns[-1]["tool_calls"] if self.turns else ():
            if entry.get("status") != "not_run":
                entry["unseen"] = True

    @property
    def final_message(self) -> str | None:
        """The model's final plain message, when it wrote one."""
        return self.final.get("message") if self.final else None

    # -- open --------------------------------------------------------------------------------------

    async def open(self, env_overrides: Mapping[str, str] | None = None) -> bool:
        """Open the session and read the prompt (once, shared); whether it opened (else it ends with `error`).

        Args:
            env_overrides (`Mapping[str, str]`, *optional*):
                The session's own environment variables (a harness's endpoint for an agent the environment runs).
        """
        if self._opening is None:
            self.state = OPENING
            self._opening = asyncio.ensure_future(self._open(env_overrides))
        return await asyncio.shield(self._opening)

    async def _open(self, overrides: Mapping[str, str] | None) -> bool:
        env, task = self.env, self.task
        started = time.monotonic()
        try:
            self.session = await env.client.open_session(**task.where, env_overrides=overrides)
            self.timings["open"] = time.monotonic() - started
            self.prompt = await env.read_prompt(self.session)
            for block in (b for m in self.prompt.messages for b in image_blocks(m.blocks)):
                self._keep(block)
            if self.toolset is None:
                self.toolset = env.toolset_of(await self.session.tools())
        except ORSError as exc:
            self._metrics._count(env.name, failure=exc.kind, open_failures=1)
            logger.warning("%s: could not open a session for task %s: %s", env.name, task.key, exc)
            self.failure, self._dead = exc, True
            self.fail(exc)
            if self.session is not None:
                await self.session.close()
            return False
        self.timings["prompt"] = time.monotonic() - started - self.timings["open"]
        self._metrics._count(env.name, "open_latency", time.monotonic() - started, opens=1)
        env.remember_prompt(task.key, self.prompt)
        if self.state == CLOSED:  # closed while it opened, past `close_session`'s bounded wait: free what landed now
            await self.session.close()
        elif self.state == OPENING:
            self.state = OPEN
        return True

    # -- the turn rule ---------------------------------------------------------------------------------

    def _rule(self, reply: Reply) -> tuple[str | None, str | None]:
        """(None, None) when the calls of a reply (its turn recorded) run, else why the episode ends and the final
        plain message; the calls of the last reply the rules allow are marked `not_run`."""
        if reply.tool_calls:
            limit = self.rules.max_replies
            if limit is None or len(self.turns) < limit:
                return None, None
            self.turns[-1]["tool_calls"] = [c.record(status="not_run") for c in reply.tool_calls]  # type: ignore
            return "max_turns", None
        if reply.truncated:
            return reply.limit, None
        return "no_tool_calls", reply.content

    async def reply(self, reply: Reply) -> list[Outcome] | None:
        """What a model reply does, for every driver: its calls run in order (`call`), unless it is the last reply the
        rules allow (the episode ends `max_turns`); a reply without calls ends it (`no_tool_calls`, or `length` when
        cut) and its text goes to a terminal tool.

        Args:
            reply (`Reply`):
                The model's reply.

        Returns:
            `list[Outcome]` or `None`: The calls' outcomes (generate again, with them), or `None` once it ended.
        """
        if self.over:
            return None
        self._turn(reply)
        reason, message = self._rule(reply)
        if reason is None:
            outcomes = [await self.call(c) for c in reply.tool_calls]  # type: ignore[arg-type]
            if not self._stopping():
                return outcomes
            reason = "error"  # a dead session is not called again; a failure voids the episode: it ends now
        await self.end(reason, message)
        return None

    async def observe(self, reply: Reply) -> None:
        """A model reply in a harness's loop (its calls come through `call`), recorded under the same rule: calls past
        the reply limit end the episode (`max_turns`) and are refused.

        Args:
            reply (`Reply`):
                The model's reply, as the harness received it.
        """
        if not self.over:
            self._turn(reply)
            if self._rule(reply)[0] == "max_turns":
                await self.end("max_turns")

    async def conclude(self, message: str | None) -> None:
        """The harness stopped: the episode ends `no_tool_calls`.

        Args:
            message (`str` or `None`):
                The harness's final answer, which a terminal tool grades (`None`: it gave none).
        """
        await self.end("no_tool_calls", message)

    def _turn(self, reply: Reply) -> TurnRecord:
        turn: TurnRecord = {"index": len(self.turns), "assistant": reply.content, "tool_calls": []}
        for key, value in (("raw", reply.raw), ("reasoning", reply.reasoning), ("usage", reply.usage),
                           ("generation_seconds", reply.seconds)):
            if value:
                turn[key] = value  # type: ignore[literal-required]
        if not reply.tool_calls and self.rules.holds_call(f"{reply.content or ''}{reply.raw or ''}"):
            turn["unparsed"] = True  # the model wrote a tool call the parser did not turn into one
        self.timings["generation"] += float(reply.seconds or 0.0)
        self.turns.append(turn)
        return turn

    async def call(self, call: ToolCall) -> Outcome:
        """One tool call of the model: checked, routed, run, recorded and counted once; never raises for environment
        failures. Refused locally (counted, the model reads why): an unsupported type, a call after `finished` or the
        end, past `Rules.max_tool_calls`, or an unknown tool or arguments. Not run (not counted): a call after the
        session failed or a failure voided the episode.

        Args:
            call (`ToolCall`):
                The call as the model wrote it.
        """
        entry = call.record()
        (self.turns[-1] if self.turns else self._turn(Reply(None)))["tool_calls"].append(entry)
        if self._stopping():  # not the model's doing: neither sent nor counted (TRL's loop calls on regardless)
            entry["status"] = "not_run"
            kind = self.failure.kind if self.failure else "session lost"
            return Outcome(f"[not run: the environment failed ({kind}); this episode is over]")
        self.tool_calls += 1
        started = time.monotonic()
        try:
            remote, wire = self._admit(call)
            entry["remote_name"] = remote
            if wire != call.arguments:
                entry["remote_arguments"] = wire
            result = await self._remote(remote, wire)
        except ORSError as exc:
            return self._failed(entry, exc, time.monotonic() - started if "remote_name" in entry else None)
        except asyncio.CancelledError:  # the episode stopped (a deadline) while the call ran: no one reads its result
            entry.update(status="failed", error={"kind": "cancelled", "message": "the episode stopped during the call"})
            raise
        elapsed = time.monotonic() - started
        shown, text = self._shown(result.blocks)
        entry.update(status="ok", output=text, reward=result.reward, finished=result.finished,
                     metadata=result.metadata, seconds=round(elapsed, 4))
        if images := [self._keep(b) for b in image_blocks(result.blocks)]:
            entry["images"] = images
        self._scored(result)
        self._metrics._count(self.env.name, "call_latency", elapsed, calls=1)
        return Outcome(shown, None, result, text)

    def _shown(self, blocks: list[Block]) -> tuple[Content, str]:
        """What the model reads of a tool's output, each text cut to `max_output_chars`, and the text of it."""
        limit, images = self.env.options["max_output_chars"], self.env.options["images"] == "pass"
        text = cut(content(blocks, images=images, view=True), limit, "output")  # type: ignore[arg-type]
        text = text or "(no output)"
        shown = content(blocks, images=images)
        if isinstance(shown, str):
            return text, text
        return [dict(p, text=cut(p["text"], limit, "output")) if p["type"] == "text" else p for p in shown], text

    def _keep(self, block: ImageBlock) -> str:
        """Remember an image of the episode for its record (each once, by hash); its hash."""
        sha = block.info().sha256
        self.images.setdefault(sha, block)
        return sha

    def made_before(self, calls: int | None) -> None:
        """TRL's loop: how many tool calls the model made before the one coming in; those TRL failed itself count
        toward `Rules.max_tool_calls` (`replay` counts them for good).

        Args:
            calls (`int` or `None`):
                The model's tool calls so far (`None`: unknown).
        """
        if calls is not None:
            self._uncounted = max(self._uncounted, calls - self.tool_calls)

    def _admit(self, call: ToolCall) -> tuple[str, dict[str, Any]]:
        """The remote tool and wire arguments of a call the episode accepts; raises the local refusal otherwise."""
        if call.type == "function":
            if self.finished:
                raise _refusal(call.name, "episode_finished",
                               "the episode has finished, so no further tool calls are accepted.")
            if self.over:
                raise _refusal(call.name, "episode_finished",
                               f"the episode has ended ({self.end_reason or 'closed'}).")
            cap = self.rules.max_tool_calls
            if cap is not None and self.tool_calls + self._uncounted > cap:
                raise _refusal(call.name, "max_tool_calls", f"this episode allows at most {cap} tool calls.")
        return self._route(call)

    def _route(self, call: ToolCall) -> tuple[str, dict[str, Any]]:
        if call.type != "function":
            raise ToolRefusedError(f"Unsupported tool call type: {call.type}", tool=call.name)
        if self.toolset is None:
            raise ToolRefusedError(f"Tool {call.name} not found.", tool=call.name, reason="not_found")
        return self.toolset.route(call.name, call.arguments)

    def _failed(self, entry: CallRecord, exc: ORSError, seconds: float | None) -> Outcome:
        self.tool_failures += 1
        refused = isinstance(exc, ToolRefusedError)
        entry.update(status="refused" if refused else "failed", error=error_record(exc),
                     output=self.rules.error_text(exc))
        if seconds is not None:
            entry["seconds"] = round(seconds, 4)
        self._broke(exc)
        self._metrics._count(self.env.name, "call_latency", seconds, exc.kind, calls=1)  # seconds None: never sent
        return Outcome(entry["output"], exc)

    def _broke(self, exc: ORSError) -> None:
        """A call (the terminal grade too) failed: the environment's failure (not a refusal, nor a tool error the model
        reads, `tool_errors`) voids the episode, unless it had finished (a parallel call meets the session it freed),
        and a session known gone is never called again."""
        if not self.finished and not isinstance(exc, ToolRefusedError) and (
                self.env.options["tool_errors"] == "environment" or not isinstance(exc, ToolError)):
            self.failure = self.failure or exc
            self._dead = self._dead or isinstance(exc, SessionExpiredError | TransportError) or (
                self.session is not None and (self.session.expired or self.session.closed))

    async def _remote(self, remote: str, wire: dict[str, Any]) -> ToolResult:
        """Call remote tool `remote` in this episode's session (opening it first if still opening)."""
        if not await self.open():
            assert self.failure is not None
            raise self.failure
        assert self.session is not None
        started = time.monotonic()
        try:
            async with self.env.tool_gate():
                return await self.session.call(remote, wire)
        finally:
            self.timings["tools"] += time.monotonic() - started

    def _scored(self, result: ToolResult) -> None:
        if self.end_reason == "timeout":  # a call that came back after the deadline scores nothing
            return
        if result.finished and not self.finished:
            self.finished = True
            if not self.env.options["score_groups"]:  # every later call is refused anyway: free the session now
                session = self.session
                if session is not None and not session.closed:
                    self._freeing = asyncio.ensure_future(session.close())  # close() awaits the same close

    def replay(self, replies: Sequence[tuple[Reply, Sequence[str]]], *, cut: bool) -> tuple[str, str | None]:
        """TRL's loop played this episode (its calls came through `call`): rebuild the turns from its transcript by the
        same turn rule, so records and counts match the engine's; a call the loop failed itself counts as refused.

        Args:
            replies (`Sequence[tuple[Reply, Sequence[str]]]`):
                Each reply with the texts the loop showed per call; none when it rolled them back (`length`) or ran
                none (its turn limit).
            cut (`bool`):
                The transcript ends after results (the next reply was cut to nothing).

        Returns:
            `tuple[str, str | None]`: What to `end` with: the reason and the final plain message.
        """
        made = deque(c for t in self.turns for c in t["tool_calls"])
        self.turns, self._uncounted = [], 0
        reason: str | None = "no_tool_calls"
        message: str | None = None
        for reply, shown in replies:
            turn = self._turn(reply)
            reason, message = self._rule(reply)
            calls: tuple[ToolCall, ...] = reply.tool_calls  # type: ignore[assignment]
            rolled_back = reason is None and not shown and bool(made) and made[0].get("name") == calls[0].name
            if reason is None and not shown:  # no results appended: rolled back (the calls ran) or none run
                reason = "length" if rolled_back else "max_turns"
            if reason == "max_turns":
                turn["tool_calls"] = [c.record(status="not_run") for c in calls]
                continue
            for j, call in enumerate(calls):
                if made and made[0].get("name") == call.name:
                    turn["tool_calls"].append(made.popleft())
                    if rolled_back:  # the model never saw what it gave
                        turn["tool_calls"][-1]["unseen"] = True
                elif self._stopping():  # after the environment failed: not the model's doing, not counted
                    turn["tool_calls"].append(call.record(status="not_run"))
                else:  # the loop failed it before it reached us
                    self.tool_calls += 1
                    turn["tool_calls"].append(entry := call.record())
                    self._failed(entry, self._refusal_of(call, shown[j] if j < len(shown) else None), None)
        if cut and reason is None:  # the next reply was cut to nothing
            self._turn(Reply(None, truncated=True))
            reason = "length"
        if made:  # calls the transcript does not show (it was cut): keep them in the last turn
            (self.turns[-1] if self.turns else self._turn(Reply(None)))["tool_calls"].extend(made)
        return reason or "length", message

    def _refusal_of(self, call: ToolCall, shown: str | None) -> ToolRefusedError:
        """The binding's refusal of a call the loop failed itself, else what the loop showed the model."""
        try:
            self._route(call)
        except ToolRefusedError as exc:
            return exc
        return ToolRefusedError(shown if shown is not None else "the call was not made", tool=call.name)

    # -- the end -----------------------------------------------------------------------------------

    async def end(self, reason: str, message: str | None = None, *, detail: str | None = None) -> None:
        """The model stopped: a terminal tool grades the final message (the reason is `finished` if it said so).

        Args:
            reason (`str`):
                Why: `no_tool_calls`, `max_turns`, `length`, `context_length`, ...
            message (`str`, *optional*):
                The model's final plain message; `None` when it was cut off.
            detail (`str`, *optional*):
                Why, in words, for the record.
        """
        if self.over:
            return
        terminal = self.terminal
        if terminal is not None and message is not None and not self.finished and not self.broken:
            self.final = {"message": message, "tool": terminal.name}
            started, kind = time.monotonic(), None
            try:
                result = await self._remote(terminal.name, terminal.arguments(message))
            except ORSError as exc:
                self.final["error"], kind = error_record(exc), exc.kind
                self._broke(exc)
            else:
                limit = self.env.options["max_output_chars"]
                self.final.update(output=cut(result.text, limit, "output"), reward=result.reward,
                                  finished=result.finished, metadata=result.metadata)
                self._scored(result)
            self.final["seconds"] = round(time.monotonic() - started, 4)
            # the harness's call of the hidden terminal tool, counted apart from the model's calls
            self._metrics._count(self.env.name, "terminal_latency", time.monotonic() - started, kind, terminal_calls=1)
        elif message is not None:
            self.final = {"message": message}
        if detail:
            self.info["stop_detail"] = detail
        if not self.over:
            reason = "error" if self._stopping() else reason  # the rest of its replay does not change what broke it
            self.end_reason, self.state = ("finished" if self.finished else reason), ENDED

    def time_out(self, limit: float) -> None:
        """The episode ran past its deadline: it ends now, scored `None`.

        Args:
            limit (`float`):
                The deadline it ran past, in seconds (for the record).
        """
        if self.over:
            return
        self.error = self.error or {"kind": "timeout", "message": f"the episode exceeded episode_timeout={limit:g}s"}
        self.end_reason, self.state = "timeout", ENDED
        logger.warning("%s: episode for task %s exceeded its %gs deadline; closing it, scored None", self.env.name,
                       self.task.key, limit)

    def fail(self, exc: BaseException) -> None:
        """The episode failed outside any tool call: it ends.

        Args:
            exc (`BaseException`):
                The failure, recorded as the episode's `error` (unless it already has one).
        """
        if self.error is None:
            self.error = error_record(exc)
        if not self.over:
            self.end_reason, self.state = "error", ENDED

    # -- accounting, record, close ---------------------------------------------------------------

    @property
    def unscored(self) -> str | None:
        """Why the episode has no reward (timeout, dropped, error, cut_off, no_reward); None when it was scored."""
        if self.end_reason == "timeout":
            return "timeout"
        if self.dropped:
            return "dropped"
        if self.reward is not None:
            return None
        if self.broken:
            return "error"
        if self.terminal is not None and self.final is None and not self.finished:
            return "cut_off"
        return "no_reward"

    def account(self, record: EpisodeRecord | None = None) -> None:
        """Count the episode in the metrics (once).

        Args:
            record (`EpisodeRecord`, *optional*):
                The episode's record, where the caller has just built it (default: built here).
        """
        if self._accounted:
            return
        self._accounted = True
        self._metrics._record_episode(self.env.name, record if record is not None else self.record())
        for listener in self.env.listeners:
            listener(self)
        self._bill()

    def adopt(self) -> None:
        """A manual episode (`MANUAL`) a reward function read becomes a training one, counted and heard as such."""
        if self.source != MANUAL:
            return
        self.env.metrics._absorb(self._metrics)
        self.source, self._metrics = "trl", self.env.metrics
        if self._accounted:
            for listener in self.env.listeners:
                listener(self)

    def _bill(self) -> None:
        """Count the session-seconds spent since the last count (at the reward, the rest when the session is gone)."""
        if self.session is None:
            return
        spent = self.timings["session"] = self.session.seconds
        self._metrics._record_session(self.env.name, spent - self._billed, unscored=self.reward is None)
        self._billed = spent

    def record(self) -> EpisodeRecord:
        """The episode as one record (schema `ors_trl.core.records.RECORD_VERSION`), the same for every driver."""
        prompt = self.prompt
        timings = {k: round(v, 4) for k, v in {**self.timings, "total": self.seconds}.items()}
        seen = [b.info().sha256 for m in (prompt.messages if prompt else ()) for b in image_blocks(m.blocks)]
        images: dict[str, Any] = {}
        if self.images:  # only then: a text-only episode's record is what it always was
            images["images"] = {sha: image_record(b.info()) for sha, b in dict(self.images).items()}  # any thread
            if seen:
                images["prompt_images"] = seen
        return EpisodeRecord(
            version=3, run=RUN_ID, source=self.source, environment=self.env.name,
            target=self.env.client.target.name, split=self.task.split, task_index=self.task.index,
            task_spec=self.task.spec, **self.info, started_at=self.started_at,  # type: ignore[typeddict-item]
            system=prompt.system if prompt else None, prompt=prompt.text if prompt else None, turns=self.turns,
            final=self.final, rewards=self.rewards, reward=self.reward, reward_rule=self.env.reward_rule.name,
            group_reward=self.group_reward, finished=self.finished, end_reason=self.end_reason, unscored=self.unscored,
            tool_calls=self.tool_calls, tool_failures=self.tool_failures, error=self.error, timings=timings, **images,
            **({"tokens": self.tokens} if self.tokens is not None else {}),
        )

    async def close_session(self) -> None:
        """Free the server session (idempotent; waits, bounded, for an open still in flight)."""
        if self._opening is not None and not self._opening.done():
            await asyncio.wait([self._opening], timeout=OPEN_WAIT)
        if self.session is not None:
            await self.session.close()

    async def close(self, *, keep: bool = True, replaced: bool = False) -> None:
        """Free the session, then (once) count the episode and write its record: the one way an episode closes.

        Args:
            keep (`bool`, *optional*, defaults to `True`):
                Count and record it; `False` (an interrupted episode, which is no result) does neither.
            replaced (`bool`, *optional*, defaults to `False`):
                A failure voided it and it is played again: recorded, counted as a retry only.
        """
        if self.state == CLOSED:
            return
        self.end_reason = self.end_reason or "released"
        self.state, self._ended = CLOSED, time.monotonic()
        try:
            await self.close_session()
        finally:
            self._bill()
            with self.env.lock:
                self.env.live.discard(self)
            if replaced:
                self._accounted = True  # the replay is the episode: this attempt is a retry in the metrics
                self._metrics._count(self.env.name, retries=1)
            if keep:
                record = self.record()  # after the last `_bill`: the same record `account` would build
                self.account(record)
                if self._writer is not None:
                    self._writer.write(record, images=self.images)
                if self._uploads:
                    self._uploads.submit(record)

    def release(self) -> concurrent.futures.Future[None] | None:
        """Count the episode now and `close()` it in the background, from any thread (tracked by the runtime)."""
        self.account()
        if self.state == CLOSED:
            return None
        if self._closing is None:
            self._closing = self.env.submit(self.close())
        return self._closing


def drop_failed_groups(episodes: Sequence[Episode]) -> None:
    """`failed_groups="drop"`: a GRPO group with an episode a failure voided trains none of its episodes (each is
    `dropped`), so a partial group does not bias the advantages; counted once."""
    for group in _groups(ep for ep in episodes if ep.env.options["failed_groups"] == "drop"):
        if any(ep.broken for ep in group) and not group[0].dropped:
            for ep in group:
                ep.dropped = True
            group[0]._metrics._count(group[0].env.name, dropped_groups=1)


def _groups(episodes: Iterable[Episode]) -> list[list[Episode]]:
    """The GRPO groups (the episodes of one task of one environment) among `episodes`."""
    groups: dict[tuple[int, str], list[Episode]] = {}
    for ep in episodes:
        groups.setdefault((id(ep.env), ep.task.key), []).append(ep)
    return list(groups.values())


async def score_groups(episodes: Sequence[Episode]) -> None:
    """Score each GRPO group once via `/score_group`, concurrently, of its episodes no failure voided (theirs stay
    None); a failed group keeps None, counted and logged."""

    async def score(group: list[Episode]) -> None:
        env = group[0].env
        session = next((ep.session for ep in group if ep.session is not None and not ep.session.closed
                        and not ep.session.expired), None)
        opened = None
        try:
            if session is None:  # every session of the group is gone: score through a fresh one
                session = opened = await env.client.open_session(**group[0].task.where)
            candidates = [{"messages": [m.to_json() for m in transcript(ep.prompt, ep.turns, ep.final_message,
                                                                         env.block_types)],
                           "metadata": {"rollout": i}} for i, ep in enumerate(group)]
            scores = await session.score_group(candidates)
        except ORSError as exc:
            logger.warning("%s: group scoring of task %s failed (%d rollouts get None): %s", env.name,
                           group[0].task.key, len(group), exc)
            group[0]._metrics._count(env.name, groups=1, group_failures=1)
            return
        finally:
            if opened is not None:
                await opened.close()
        for ep, result in zip(group, scores, strict=True):
            ep.group_reward = result.reward
        group[0]._metrics._count(env.name, groups=1)

    await asyncio.gather(*(score(g) for g in _groups(ep for ep in episodes if not ep.voided)))  # only what counts
