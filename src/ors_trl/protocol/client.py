"""The ORS client: the environment's endpoints and its sessions. `AsyncClient` / `AsyncSession` run on the event loop
that awaits them; `Client` / `Session` drive the same objects from any thread through the process's background loop
(`protocol.loop`). This module speaks the requests; the client's `SessionPool` decides when a session opens, keeps it
alive and closes what is left."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import ipaddress
import itertools
import logging
import math
import re
import socket
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .budget import parse_rate
from .errors import (
    BadRequestError,
    ConfigurationError,
    EnvironmentNotFoundError,
    NotFoundError,
    ORSError,
    ORSTimeoutError,
    ProtocolError,
    SessionExpiredError,
    ToolRefusedError,
    UsageError,
)
from .loop import BackgroundLoop, get_loop
from .pool import CLOSE_WAIT_S, OPENING_WAIT_S, Lease, SessionPool
from .target import SecretValue, Target, encode_secrets, resolve_target
from .text import readable, show_name
from .transport import RetryPolicy, Timeouts, Transport, masked
from .types import (
    MAX_ENVIRONMENTS,
    MAX_SPLITS,
    MAX_TASK_COUNT,
    Block,
    GroupScore,
    Message,
    Split,
    ToolList,
    ToolResult,
    parse_blocks,
    parse_messages,
    quoted,
)

__all__ = ["AsyncClient", "AsyncSession", "Client", "ClientOptions", "Session"]

logger = logging.getLogger("ors_trl.client")

# Deleting sessions while shutting down: a dead server must not hold up interpreter exit.
_QUICK_RETRY = RetryPolicy(max_attempts=2, backoff_initial=0.1, backoff_max=0.5)
_ORPHAN_CONCURRENCY = 16
_PROBE_S = 2.0  # bound on the connection that tells whether a loopback server is gone (a refusal is immediate)
#: A session id the server hands out travels in the `X-Session-ID` header of every later request: visible ASCII only.
_SESSION_ID = re.compile(r"[\x21-\x7e]{1,256}")
#: An environment name from `/list_environments` becomes a URL path segment: no `/`, `?`, `#`, `%`, nothing to escape.
_ENV_NAME = re.compile(r"[A-Za-z0-9._~!$&'()*+,;=:@-]{1,200}")
_SEGMENT_RULE = "1 to 200 of A-Z a-z 0-9 . _ ~ - and the other characters a path segment takes unescaped"
#: Rows of the platform's task difficulty accepted in one answer (one per task, like a whole split's tasks).
MAX_DIFFICULTY_ROWS = 100_000


@dataclass(frozen=True)
class ClientOptions:
    """How a client reaches an environment and keeps its sessions: the options `AsyncClient`, `Client`,
    `OpenRewardSpec`, `OpenRewardMix` and the CLI take, documented here once; each is also a keyword of a client
    (`AsyncClient(url, api_key=...)`). An option that cannot work is a `ConfigurationError`.

    Args:
        env_name (`str`, *optional*):
            Which environment on a server hosting several (case-insensitive).
        api_key (`str`, *optional*):
            The OpenReward key (`OPENREWARD_API_KEY` for catalog names); sent only to the platform's hosts, or to a
            self-hosted URL when passed explicitly.
        secrets (`Mapping[str, str | tuple[str, Sequence[str]]]`, *optional*):
            Sent with every session in `X-Secrets`; a value is a string or `(value, allowed_domains)`.
        timeouts (`Timeouts`, *optional*):
            Connect, request and tool-call deadlines.
        retry (`RetryPolicy`, *optional*):
            Retries of transient failures.
        keepalive_interval (`float`, *optional*, defaults to `10.0`):
            Seconds between pings of an idle open session; None disables keepalive.
        max_sessions (`int`, *optional*):
            Cap on sessions open at once through this client; past it `open_session` waits (`session_wait`).
        session_wait (`float`, *optional*, defaults to `1800.0`):
            How long `open_session` may wait for a slot under `max_sessions` (None: no limit).
        max_connections (`int`, *optional*, defaults to `0`):
            Connection pool size (0: unlimited).
        max_session_rate (`float` or `tuple[float, int]`, *optional*):
            Sessions created per second, or `(rate, burst)`; a 429 or `503 starting` slows it (None: no pace).
        toolset (`str`, *optional*):
            The platform toolset every session gets (e.g. `"codex"`).
        toolset_fallback (`bool`, *optional*, defaults to `False`):
            When the server refuses `toolset`, open sessions without it (said once) instead of failing.
        env_overrides (`Mapping[str, str]`, *optional*):
            Environment variables for every session (on the platform, non-owners may set only the OpenAI/Anthropic
            URL and key variables); masked like secrets.
    """

    env_name: str | None = None
    api_key: str | None = dataclasses.field(default=None, repr=False)
    secrets: Mapping[str, SecretValue] | None = dataclasses.field(default=None, repr=False)
    timeouts: Timeouts | None = None
    retry: RetryPolicy | None = None
    keepalive_interval: float | None = 10.0
    max_sessions: int | None = None
    session_wait: float | None = 1800.0
    max_connections: int = 0
    max_session_rate: float | tuple[float, int] | None = None
    toolset: str | None = None
    toolset_fallback: bool = False
    env_overrides: Mapping[str, str] | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.env_name is not None and not _is_segment(self.env_name):  # it goes into every request's path as it is
            raise ConfigurationError(f"env_name {quoted(self.env_name, 100)} cannot be part of a URL path; pass an "
                                     f"environment's key as the server lists it ({_SEGMENT_RULE})")
        if self.toolset is not None and (not isinstance(self.toolset, str) or not self.toolset.strip()):
            raise ConfigurationError(f"toolset must be a toolset's name (e.g. 'codex') or None, got {self.toolset!r}")
        if self.env_overrides is not None and not (isinstance(self.env_overrides, Mapping) and all(
                isinstance(k, str) and k and isinstance(v, str) for k, v in self.env_overrides.items())):
            raise ConfigurationError("env_overrides must map environment variable names to string values")
        if self.keepalive_interval is not None and self.keepalive_interval <= 0:
            raise ConfigurationError("keepalive_interval must be positive, or None to disable keepalive")
        if self.max_sessions is not None and self.max_sessions < 1:
            raise ConfigurationError("max_sessions must be at least 1, or None for no cap")
        if self.max_session_rate is not None:
            parse_rate(self.max_session_rate, "max_session_rate")

    @classmethod
    def _of(cls, options: ClientOptions | None, overrides: Mapping[str, Any]) -> ClientOptions:
        """`options` with the fields in `overrides` replaced; an unknown key is a `ConfigurationError`."""
        names = [f.name for f in dataclasses.fields(cls)]
        if unknown := sorted(set(overrides) - set(names)):
            raise ConfigurationError(f"unknown client option(s) {', '.join(map(repr, unknown))}; the options are "
                                     f"{', '.join(names)} (see ClientOptions)")
        return dataclasses.replace(options or cls(), **overrides)


class AsyncSession(contextlib.AbstractAsyncContextManager["AsyncSession"]):
    """One ORS session (one episode of one task), from `AsyncClient.open_session`. Each argument is kept as the
    attribute of the same name, beside `opened_at`, `closed_at` (`time.monotonic()`; None until the server deleted
    it), `expired` (the server said it is gone) and `closed`.

    Args:
        client (`AsyncClient`):
            The client the session belongs to.
        sid (`str`):
            The server's session id.
        split (`str` or `None`):
            The task's split (`None` for an explicit `task_spec`).
        index (`int` or `None`):
            The task's index in `split` (`None` for an explicit `task_spec`).
        task_spec (`Mapping[str, Any]` or `None`):
            The explicit task, if the session was opened with one.
        open_seconds (`float`):
            How long opening took (waits included).
        created_at (`float`):
            `time.monotonic()` when its creation was asked for.
    """

    def __init__(self, client: AsyncClient, sid: str, *, split: str | None, index: int | None,
                 task_spec: Mapping[str, Any] | None, open_seconds: float, created_at: float) -> None:
        self.client, self.sid, self.split, self.index = client, sid, split, index
        self._transport: Transport = client._transport
        self.task_spec = dict(task_spec) if task_spec is not None else None
        self.created_at, self.open_seconds = created_at, open_seconds
        self.opened_at = self.last_activity = time.monotonic()
        self.closed_at: float | None = None
        self.expired = self.closed = False
        self._close_task: asyncio.Task[None] | None = None
        self._lease: Lease = ()  # session-cap slots, given back on close
        self._masked: list[str] = []  # its own env_overrides' values, masked until it closes

    def __repr__(self) -> str:
        task = f"index={self.index}" if self.index is not None else "task_spec=..."
        state = "closed" if self.closed else "expired" if self.expired else "open"
        return f"<AsyncSession {self.sid[:8]} {task} {state}>"

    @property
    def seconds(self) -> float:
        """How long the session has existed on the server, until deleted (what a sandbox platform bills)."""
        return (self.closed_at or time.monotonic()) - self.created_at

    @contextlib.asynccontextmanager
    async def _active(self) -> AsyncIterator[None]:
        """A request in this session: refused once closed, counted as activity, marking it expired if gone."""
        if self.closed:
            raise UsageError(f"session {self.sid} is closed; open a new one")
        self.last_activity = time.monotonic()
        try:
            yield
        except SessionExpiredError:
            self.expired = True
            raise
        finally:
            self.last_activity = time.monotonic()

    async def _get(self, suffix: str, *, scoped: bool = True) -> Any:
        """A GET in this session; a 404 (`scoped`) or a 410 marks it expired."""
        async with self._active():
            return await self._transport.request("GET", self.client._path(suffix), sid=self.sid, session_scoped=scoped)

    @masked
    async def prompt(self) -> list[Block]:
        """The task's prompt blocks (waits for the environment's setup, riding out `starting`)."""
        return parse_blocks(await self._get("/prompt"), where="prompt")

    @masked
    async def messages(self) -> list[Message]:
        """The task's prompt as a role-tagged conversation (`/messages`, servers from SDK 0.1.157 on); a
        `NotFoundError` on an older server (use `prompt()` there)."""
        try:
            raw = await self._get("/messages", scoped=False)  # a 404 may be an older server's: no route
        except NotFoundError as exc:
            if "active environment not found" in exc.detail.lower():  # the session is gone, not the route
                self.expired = True
                raise SessionExpiredError(str(exc), status_code=404, detail=exc.detail, path=exc.path) from None
            raise
        return parse_messages(raw)

    @masked
    async def tools(self) -> ToolList:
        """The session's full tool list: shared, task-specific and toolset tools."""
        return ToolList.from_json(await self._get("/task_tools"), where="task_tools")

    @masked
    async def call(self, name: str, arguments: Mapping[str, Any] | None = None) -> ToolResult:
        """Call a tool in this session: a `ToolRefusedError` (`.reason` says why), `ToolFailedError` (it raised),
        `StreamInterruptedError` (the stream broke before the call was acknowledged: not re-run) or `ORSTimeoutError`
        (past `Timeouts.tool_call`) when it gives no output.

        Args:
            name (`str`):
                The tool's name.
            arguments (`Mapping[str, Any]`, *optional*):
                Its arguments.
        """
        what = f"tool {show_name(name)}"
        body, task_id = await self._stream("/call", {"name": name, "input": dict(arguments or {})}, what=what,
                                           tool=name)
        if not isinstance(body, dict) or "ok" not in body:
            raise ProtocolError(f"{what}: the result has no 'ok' field: {quoted(body)}")
        if body["ok"] is True:
            if "output" not in body:
                raise ProtocolError(f"{what}: a successful result has no 'output'")
            return ToolResult.from_output(body["output"], tool=name, task_id=task_id)
        quote = self._transport.decoder.quote  # what the server said: secrets it echoed masked, escaped, bounded
        reason, error = body.get("reason"), body.get("error") or "the server refused the call"
        raise ToolRefusedError(f"{what} was refused ({quote(str(reason)) if reason else 'no reason given'}): "
                               f"{quote(error if isinstance(error, str) else quoted(error, 2000))}",
                               tool=name, reason=reason if isinstance(reason, str) else None)

    @masked
    async def score_group(self, candidates: list[dict[str, Any]]) -> list[GroupScore]:
        """Score a GRPO group of this session's task (`/score_group`, streamed like a tool call): one score per
        candidate, in order; a `NotFoundError` where the environment does not score groups.

        Args:
            candidates (`list[dict[str, Any]]`):
                The group's completions, each `{"messages": [Message.to_json(), ...], "metadata"?: {...}}`.
        """
        body, _ = await self._stream("/score_group", {"candidates": list(candidates)}, what="score_group",
                                     tool="score_group")
        return GroupScore.parse_all(body, expected=len(candidates))

    async def _stream(self, suffix: str, body: dict[str, Any], *, what: str, tool: str) -> tuple[Any, str | None]:
        """One streamed call, bounded by `Timeouts.tool_call`, resumed by task id if its stream drops."""
        limit = self._transport.timeouts.tool_call
        try:
            async with self._active(), asyncio.timeout(limit):
                return await self._transport.stream(self.client._path(suffix), body=body, sid=self.sid, what=what,
                                                    tool=tool)
        except TimeoutError:
            raise ORSTimeoutError(f"{what} did not finish within {limit} s (Timeouts.tool_call); it may still be "
                                  "running on the server.") from None

    @masked
    async def ping(self) -> bool:
        """Refresh the server's idle timer; False (the session marked expired) if it is gone."""
        if self.closed:
            return False
        try:
            async with self._active():  # a 404 or 410 marks it expired
                await self._transport.request("POST", "/ping", sid=self.sid, session_scoped=True)
        except NotFoundError:
            return False
        return True

    async def close(self) -> None:
        """Delete the session on the server; idempotent, never raises for one already gone. Its slot is free at once;
        the server is waited for at most `CLOSE_WAIT_S` (1 s), a slower delete going on in the background."""
        if self._close_task is None:
            self.closed = True
            self._close_task = self.client._pool.delete_soon(self.sid, session=self)
            for value in self._masked:
                self._transport.decoder.discard(value)
        await asyncio.wait([self._close_task], timeout=CLOSE_WAIT_S)

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def _landed(request: Any, into: list[Any]) -> Any:
    """Await a request that may create something on the server, appending its result to `into`; if cancelled, let it
    land first (bounded), so that the caller's delete cannot overtake the create."""
    task = asyncio.ensure_future(request)
    try:
        into.append(await asyncio.shield(task))
    except asyncio.CancelledError:
        with contextlib.suppress(BaseException):
            into.append(await asyncio.wait_for(task, OPENING_WAIT_S))
        raise
    return into[-1]


class AsyncClient(contextlib.AbstractAsyncContextManager["AsyncClient"]):
    """Async client for one ORS environment; a `ConfigurationError` for a malformed target or option, a
    `MissingAPIKeyError` for a catalog name with no API key.

    Args:
        target (`str`):
            A catalog name (`"Eigent/SETA"`) or the URL of a self-hosted server (`"http://127.0.0.1:8000"`).
        options (`ClientOptions`, *optional*):
            How to reach it and keep its sessions.
        **kwargs:
            `ClientOptions` fields, each replacing the one of `options`.
    """

    def __init__(self, target: str, options: ClientOptions | None = None, **kwargs: Any) -> None:
        self.options = options = ClientOptions._of(options, kwargs)
        self.target: Target = resolve_target(target, api_key=options.api_key)
        self.toolset = options.toolset  # None once the server refused it under toolset_fallback
        self._overrides = dict(options.env_overrides or {})
        self._pool = SessionPool(self._delete, delete_orphans, options, self.target.name)
        secrets = options.secrets or {}
        self._secret_headers = {"X-Secrets": encode_secrets(secrets)} if secrets else {}
        self._transport = Transport(self.target, timeouts=options.timeouts, retry=options.retry,
                                    max_connections=options.max_connections)
        self._transport.on_throttle = self._pool.throttled
        # Masked from the start: each override may be a key.
        for value in [*self._secret_headers.values(), *self._overrides.values(),
                      *(v if isinstance(v, str) else v[0] for v in secrets.values())]:
            self._transport.decoder.add(value)
        self._env: str | None = None
        self._env_resolved = False
        self._env_lock = asyncio.Lock()  # bound to a loop only once it is waited on
        self._control_sid: str | None = None

    def __repr__(self) -> str:
        env = self._env if self._env_resolved else (self.options.env_name or "?")
        return f"<AsyncClient {self.target.name!r} env={env!r} open_sessions={self.open_sessions}>"

    @property
    def timeouts(self) -> Timeouts:
        """The deadlines this client's requests run under."""
        return self._transport.timeouts

    @property
    def env_label(self) -> str:
        """The environment's name in logs, metrics and records: the one asked for (`env_name`), else the server's once
        resolved (so one environment served on two ports has one name), else the catalog name or the server's host;
        lower case."""
        env = self.options.env_name or (self._env if self._env_resolved else None)
        if env:
            return env.lower()
        return self.target.name if not self.target.is_url else self.target.name.split("://", 1)[1].rstrip("/")

    @property
    def open_sessions(self) -> int:
        """Sessions opened through this client and not yet closed."""
        return len(self._pool.sessions)

    @property
    def max_sessions(self) -> int | None:
        """This client's cap on sessions open at once (None: no cap)."""
        return self.options.max_sessions

    @property
    def duplicate_sessions(self) -> int:
        """Session ids the server handed out that another session already had (each refused, another asked for)."""
        return self._pool.duplicates

    def _path(self, suffix: str) -> str:
        return f"/{self._env}{suffix}" if self._env else suffix

    @masked
    async def environment(self) -> str | None:
        """The environment key used in request paths, resolved once: for a URL, `env_name` matched against
        `/list_environments` (exact name first, then case-insensitively; none: the server's first); for a catalog
        name, `env_name` as it is."""
        if not self._env_resolved:
            async with self._env_lock:
                if not self._env_resolved:
                    self._env = await self._resolve_env()
                    self._env_resolved = True
        return self._env

    async def _resolve_env(self) -> str | None:
        wanted = self.options.env_name
        if not self.target.is_url:
            return wanted
        try:
            available = await self.list_environments()
        except NotFoundError:  # a server without /list_environments: trust the name, or let the server route
            return wanted
        if not available:
            raise EnvironmentNotFoundError(f"{self.target.name} hosts no environments", available=[])
        listed = readable(", ".join(available), 1000)
        if wanted is None:
            if len(available) > 1:
                logger.warning("%s hosts %d environments (%s); using the server's default %r. Pass env_name= to "
                               "choose.", self.target.name, len(available), listed, available[0])
            return _env_segment(available[0])
        matches = [wanted] if wanted in available else [n for n in available if n.lower() == wanted.lower()]
        if len(matches) == 1:
            return _env_segment(matches[0])
        if matches:
            raise EnvironmentNotFoundError(
                f"environment {wanted!r} matches {len(matches)} environments of {self.target.name} that differ only in "
                f"case ({readable(', '.join(matches), 1000)}); pass one of them exactly as env_name=.",
                available=available)
        raise EnvironmentNotFoundError(f"environment {wanted!r} is not on {self.target.name}; available: {listed}. "
                                       "Pass one of these as env_name=.", available=available)

    async def _env_request(self, method: str, suffix: str, body: Any = None) -> Any:
        await self.environment()
        if not self.target.is_url and self._control_sid is None:
            # The platform routes even metadata calls by session: one is kept for the client's lifetime.
            self._control_sid = await self._create_sid()
        return await self._transport.request(method, self._path(suffix), body=body, sid=self._control_sid)

    @masked
    async def list_environments(self) -> list[str]:
        """The environment keys a self-hosted server serves."""
        raw = await self._transport.request("GET", "/list_environments")
        if not isinstance(raw, list) or not all(isinstance(x, str) for x in raw):
            raise ProtocolError(f"/list_environments: expected a list of names, got {quoted(raw)}")
        if len(raw) > MAX_ENVIRONMENTS:
            raise ProtocolError(f"/list_environments: the server lists {len(raw)} environments, more than the "
                                f"{MAX_ENVIRONMENTS} a server may host")
        return raw

    @masked
    async def health(self) -> bool:
        """True when the server answers `/health`."""
        raw = await self._transport.request("GET", "/health")
        return isinstance(raw, dict) and raw.get("status") == "ok"

    @masked
    async def splits(self) -> list[Split]:
        """The environment's task splits (`/splits`)."""
        raw = await self._env_request("GET", "/splits")
        if not isinstance(raw, list):
            raise ProtocolError(f"/splits: expected a list, got {quoted(raw)}")
        if len(raw) > MAX_SPLITS:
            raise ProtocolError(f"/splits: the server lists {len(raw)} splits, more than the {MAX_SPLITS} an "
                                "environment may have")
        out = []
        for item in raw:
            item = {"name": item} if isinstance(item, str) else item
            if not (isinstance(item, dict) and isinstance(item.get("name"), str)):
                raise ProtocolError(f"/splits: bad entry {quoted(item)}")
            out.append(Split(item["name"], str(item.get("type", item["name"]))))
        return out

    async def _task_error(self, split: str, index: int | None, exc: BadRequestError) -> BadRequestError:
        """The server's bare "Invalid index" as a message with the valid range, "Invalid split" with the splits."""
        if index is not None and "index" in exc.detail.lower():
            n = await self.num_tasks(split)
            message = f"task index {index} is out of range for split {split!r}, which has {n} tasks (0..{n - 1})."
        elif "split" in exc.detail.lower():
            names = [s.name for s in await self.splits()]
            message = f"split {split!r} does not exist on {self.target.name}; available splits: {', '.join(names)}."
        else:
            return exc
        return BadRequestError(message, status_code=exc.status_code, detail=exc.detail, path=exc.path)

    async def _split_request(self, suffix: str, body: dict[str, Any], key: str | None = None) -> Any:
        """POST a request about `body["split"]`; the answer's `key` when given, checked to be a list."""
        try:
            raw = await self._env_request("POST", suffix, body)
        except BadRequestError as exc:
            raise await self._task_error(body["split"], body.get("index"), exc) from None
        if key is not None and not (isinstance(raw, dict) and isinstance(raw.get(key), list)):
            raise ProtocolError(f"{suffix}: expected {{'{key}': [...]}}, got {quoted(raw)}")
        return raw if key is None else raw[key]

    @masked
    async def num_tasks(self, split: str = "train") -> int:
        """The number of tasks in a split (`/num_tasks`); a `BadRequestError` listing the splits for an unknown one.

        Args:
            split (`str`, *optional*, defaults to `"train"`):
                The split to count.
        """
        raw = await self._split_request("/num_tasks", {"split": split})
        count = raw.get("num_tasks") if isinstance(raw, dict) else None
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_TASK_COUNT:
            raise ProtocolError(f"/num_tasks: expected {{'num_tasks': n}} with n an integer from 0 to 2**53, got "
                                f"{quoted(raw)}")
        return count

    @masked
    async def task(self, split: str, index: int) -> dict[str, Any]:
        """One task spec (`/task`); a `BadRequestError` for an unknown split or an index out of its range.

        Args:
            split (`str`):
                The split the task is in.
            index (`int`):
                Its index in `split`.
        """
        raw = await self._split_request("/task", {"split": split, "index": index})
        if not isinstance(raw, dict) or "task" not in raw:
            raise ProtocolError(f"/task: expected {{'task': ...}}, got {quoted(raw)}")
        return raw["task"]

    @masked
    async def task_range(self, split: str, start: int | None = None, stop: int | None = None) -> list[dict[str, Any]]:
        """Task specs `start:stop` of a split, in one request (`/task_range`, Python slice rules).

        Args:
            split (`str`):
                The split the tasks are in.
            start (`int`, *optional*):
                The first task's index.
            stop (`int`, *optional*):
                The index past the last task.
        """
        bounds = {k: v for k, v in (("start", start), ("stop", stop)) if v is not None}
        tasks = await self._split_request("/task_range", {"split": split, **bounds}, "tasks")
        asked = len(range(start or 0, stop)) if stop is not None and (start or 0) >= 0 and stop >= 0 else None
        if asked is not None and len(tasks) > asked:
            raise ProtocolError(f"/task_range: asked for tasks {start or 0}..{stop} ({asked}), the server answered "
                                f"{len(tasks)}")
        return tasks

    @masked
    async def tasks(self, split: str = "train") -> list[dict[str, Any]]:
        """Every task spec of a split (`/tasks`; slow on large catalogs: prefer `task_range`).

        Args:
            split (`str`, *optional*, defaults to `"train"`):
                The split whose tasks are listed.
        """
        return await self._split_request("/tasks", {"split": split}, "tasks")

    @masked
    async def task_difficulty(self, split: str, filters: Mapping[str, str] | None = None) -> dict[int, Any]:
        """The platform's per-task difficulty of a catalog environment's `split`: `{task index: (mean reward, logged
        rollouts)}`; a `ConfigurationError` for a self-hosted URL, which serves none.

        Args:
            split (`str`):
                The split.
            filters (`Mapping[str, str]`, *optional*):
                The platform's query filters: `PlatformDifficulty.params()`.
        """
        if self.target.is_url:
            raise ConfigurationError(
                f"{self.target.name} is a self-hosted server: the platform's task difficulty exists only for "
                "openreward.ai catalog environments; pass difficulty_from= an `ors-trl eval --output` file or an "
                "episode log instead.")
        owner, _, name = self.target.name.partition("/")
        query = urllib.parse.urlencode({"split": split, **(filters or {})})
        path = f"/v1/environments/{urllib.parse.quote(owner)}/{urllib.parse.quote(name)}/task-difficulty?{query}"
        raw = await self._transport.request("GET", path, api=True)
        rows = raw.get("tasks") if isinstance(raw, dict) else None
        if not isinstance(rows, list) or len(rows) > MAX_DIFFICULTY_ROWS:
            raise ProtocolError(f"task-difficulty: expected {{'tasks': [...]}} (at most {MAX_DIFFICULTY_ROWS}), got "
                                f"{quoted(raw)}")
        out: dict[int, Any] = {}
        for row in rows:
            index, mean, count = (row.get(k) if isinstance(row, dict) else None
                                  for k in ("task_index", "avg_reward", "num_rollouts"))
            if not (isinstance(index, int) and isinstance(mean, int | float) and isinstance(count, int)) \
                    or isinstance(index, bool) or not math.isfinite(mean):
                raise ProtocolError(f"task-difficulty: a malformed row {quoted(row)}")
            if row.get("split") in (None, split):
                out[index] = (float(mean), count)
        return out

    @masked
    async def tools(self) -> ToolList:
        """The environment's shared tools (task-specific ones need a session: `AsyncSession.tools`)."""
        return ToolList.from_json(await self._env_request("GET", "/tools"), where="tools")

    async def _create_sid(self, overrides: Mapping[str, str] | None = None) -> str:
        """A new session id (its environment `overrides`, default the client's), claimed for this process and in the
        orphan registry before this returns. Every other id the answers named (an attempt that then stalled or broke)
        is deleted in the background."""
        for tries in itertools.count(1):
            named: list[str] = []
            sid = None
            try:
                sid = await self._new_sid(named, self._overrides if overrides is None else overrides)
                if await self._pool.claim(sid):
                    return sid
                self._pool.duplicate(sid, tries)  # raises at the last try
            finally:
                for other in dict.fromkeys(named):
                    if other != sid and self._sendable(other) and await self._pool.claim(other):
                        self._pool.delete_soon(other, quiet=True)
        raise AssertionError("unreachable")

    async def _new_sid(self, named: list[str], overrides: Mapping[str, str]) -> str:
        """`/create_session`, never re-posted on the platform once it may have landed (an allocation per request);
        each id any attempt names is appended to `named` as it arrives."""
        def seen(event: str, data: str) -> None:
            if event == "task_id" and data.strip():
                named.append(data.strip())

        try:
            events = await self._transport.request(
                "POST", "/create_session", body={"env": dict(overrides)} if overrides else {},
                extra_headers=self._secret_headers, idempotent=self.target.is_url, on_event=seen)
        except BadRequestError as exc:
            if not overrides:
                raise
            raise ConfigurationError(
                f"{self.target.name} refused the session's env_overrides ({', '.join(sorted(overrides))}): "
                f"{exc.detail.rstrip('.')}. On the platform, callers other than the environment's owner may set only "
                "OPENAI_BASE_URL, OPENAI_API_KEY, ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY.") from None
        for event, data in events:
            if event == "task_id" and data.strip():
                sid = data.strip()
                if not self._sendable(sid):  # checked where it is received: it goes into a header of every request
                    raise ProtocolError(
                        f"/create_session: the server's session id {self._transport.decoder.quote(sid, 100)!r} "
                        f"({len(sid)} characters) cannot be sent back as a header (1 to 256 visible ASCII characters, "
                        "no credential); the session was not used. The server is broken: report it to its authors.")
                return sid
            if event == "error":
                raise ProtocolError(f"/create_session failed: {self._transport.decoder.quote(data)}")
        raise ProtocolError("/create_session: the stream carried no session id")

    def _sendable(self, sid: str) -> bool:
        return _SESSION_ID.fullmatch(sid) is not None and self._transport.mask(sid) == sid

    @masked
    async def open_session(self, *, split: str | None = None, index: int | None = None,
                           task_spec: Mapping[str, Any] | None = None, toolset_name: str | None = None,
                           env_overrides: Mapping[str, str] | None = None) -> AsyncSession:
        """Open a session for task `split`/`index` or an explicit `task_spec` (exactly one of the two). Under
        `max_sessions`, waits (up to `session_wait`) for a slot; whatever this creates on the server is deleted again
        if the open fails or is cancelled halfway. A `ConfigurationError` for both or neither, or a refused toolset or
        `env_overrides`; a `BadRequestError` for an unknown split or an index out of its range.

        Args:
            split (`str`, *optional*):
                The split of the task at `index`; `"train"` when omitted.
            index (`int`, *optional*):
                The task's index in `split`.
            task_spec (`Mapping[str, Any]`, *optional*):
                An explicit task to run instead of one by index.
            toolset_name (`str`, *optional*):
                The platform toolset for this session; overrides the client's `toolset`.
            env_overrides (`Mapping[str, str]`, *optional*):
                Environment variables for this session, over the client's `env_overrides`; masked until it closes.
        """
        if (task_spec is None) == (index is None):
            raise ConfigurationError("open_session needs exactly one of index= (with split=) or task_spec=")
        if index is not None:
            split = split or "train"
            if isinstance(index, bool) or not isinstance(index, int):
                raise ConfigurationError(f"task index must be an int, got {index!r}")
        self._check_usable()
        ClientOptions(env_overrides=env_overrides)  # validated as the client's are
        own = [v for v in (env_overrides or {}).values() if v not in self._overrides.values()]
        overrides = {**self._overrides, **env_overrides} if env_overrides else None
        for value in own:
            self._transport.decoder.add(value)
        try:
            async with self._pool.opening():
                session = await self._open(split, index, task_spec, toolset_name, overrides)
        except BaseException:
            for value in own:
                self._transport.decoder.discard(value)
            raise
        session._masked = own
        return session

    async def _open(self, split: str | None, index: int | None, task_spec: Mapping[str, Any] | None,
                    toolset_name: str | None, overrides: Mapping[str, str] | None = None) -> AsyncSession:
        env = await self.environment()
        started = time.monotonic()
        lease = await self._pool.acquire()
        created = time.monotonic()
        sids: list[str] = []
        try:
            self._check_usable()
            body: dict[str, Any] = {"task_spec": dict(task_spec)} if task_spec is not None else {
                "split": split, "index": index}
            if env:
                body["env_name"] = env
            for tries in itertools.count(1):
                sid = await _landed(self._create_sid(overrides), sids)
                toolset = toolset_name or self.toolset
                try:
                    ours = await self._create(sid, {**body, "toolset_name": toolset} if toolset else body, first=True)
                except BadRequestError as exc:
                    if toolset and "toolset" in exc.detail.lower():
                        self._refused_toolset(toolset, exc)  # raises, unless toolset_fallback: then without it
                        ours = await self._create(sid, body)
                    elif index is None:
                        raise
                    else:
                        raise await self._task_error(split or "train", index, exc) from None
                if ours:
                    break
                sids.clear()  # another process's session: given up, not deleted
                self._pool.duplicate(sid, tries, mine=True)
            session = AsyncSession(self, sid, split=split if index is not None else None, index=index,
                                   task_spec=task_spec, open_seconds=time.monotonic() - started, created_at=created)
            session._lease = lease
        except BaseException:
            if sids:
                with contextlib.suppress(BaseException):
                    await asyncio.wait([self._pool.delete_soon(sids[0], lease)], timeout=CLOSE_WAIT_S)
            else:
                self._pool.release(lease)
            raise
        self._pool.add(session)
        return session

    async def _create(self, sid: str, body: dict[str, Any], *, first: bool = False) -> bool:
        """`/create`; False when the session is not ours: "Session already exists" means that our own retried request
        had landed, except on the `first` try of a new id, where the server gave the id to another process too."""
        tries: list[None] = []
        try:
            await _landed(self._transport.request("POST", "/create", body=body, sid=sid,
                                                  extra_headers=self._secret_headers,
                                                  on_attempt=lambda: tries.append(None)), [])
        except BadRequestError as exc:
            if exc.detail != "Session already exists":
                raise
            return not (first and len(tries) == 1)
        return True

    def _refused_toolset(self, toolset: str, exc: BadRequestError) -> None:
        """The server refused `toolset`: a `ConfigurationError`, or (`toolset_fallback`) open without it, said once."""
        if not self.options.toolset_fallback:
            raise ConfigurationError(
                f"{self.target.name} refused toolset {toolset!r} at session open: {exc.detail.rstrip('.')}. Pass a "
                "toolset it offers, none, or toolset_fallback=True to open sessions without it.") from None
        if self.toolset is not None:
            logger.warning("%s refused toolset %r (%s); opening sessions without it (toolset_fallback=True)",
                           self.target.name, toolset, exc.detail)
            self.toolset = None

    def _check_usable(self) -> None:
        if self._pool.closed:
            raise UsageError("this client is closed; create a new one")

    async def _delete(self, sid: str, *, quiet: bool = False) -> bool:
        """`/delete` (environment teardown) and `/delete_session` (platform allocation) of `sid`, each tried even if
        the other fails: True when both went through (or found it gone); logs, never raises."""
        retry = _QUICK_RETRY if self._pool.closed else None
        failed: list[str] = []
        for path in ("/delete", "/delete_session"):
            try:
                await self._transport.request("POST", path, sid=sid, ok_statuses=(404, 410), retry=retry)
            except ORSError as exc:
                failed.append(f"could not {path.lstrip('/')} session {sid[:8]}: {exc}")
        if failed and self.target.is_url and await server_gone(self.target.session_url):
            logger.debug("session %s: %s refuses connections on loopback; the session died with it", sid[:8],
                         self.target.name)
            return True
        for message in failed:
            (logger.debug if quiet else logger.warning)("%s", message)
        return not failed

    async def close_sessions(self) -> None:
        """Close every session open through this client, and those still opening; the client stays usable."""
        await self._pool.close_sessions()

    async def aclose(self) -> None:
        """Close every open session (and those still opening), then the connection pool. Idempotent."""
        if self._pool.closed:
            return
        if self._control_sid is not None:  # nothing runs in it: failing to delete it is worth no warning
            self._pool.delete_soon(self._control_sid, quiet=True)
            self._control_sid = None
        await self._pool.aclose()
        await self._transport.aclose()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


# -- the synchronous facade: the async objects, driven through the process's background loop --------------------


def _blocking(method: Callable[..., Any], wrap: Callable[[Any, Any], Any] = lambda facade, result: result
              ) -> Callable[..., Any]:
    """The blocking form of an async method of the facade's `_inner`; `wrap` turns its result into the facade's."""
    name = method.__name__

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        return wrap(self, self._bg.run(getattr(self._inner, name)(*args, **kwargs)))

    return run


def _facade(of: type, methods: tuple[str, ...], attributes: tuple[str, ...]) -> Callable[[type], type]:
    """Class decorator: the blocking form of `of`'s `methods`, and read-only views of its `attributes`."""
    def install(cls: type) -> type:
        for name in methods:
            if name not in cls.__dict__:
                setattr(cls, name, _blocking(getattr(of, name)))
        for name in attributes:
            doc = getattr(vars(of).get(name), "__doc__", None) or f"The `{of.__name__}`'s `{name}` (read-only)."
            setattr(cls, name, property(lambda self, name=name: getattr(self._inner, name), doc=doc))
        return cls

    return install


class _Facade(contextlib.AbstractContextManager[Any]):
    def __init__(self, inner: Any, bg: BackgroundLoop) -> None:
        self._inner, self._bg = inner, bg

    def __repr__(self) -> str:
        return repr(self._inner).replace("<Async", "<", 1)

    def __exit__(self, *exc: object) -> None:
        self.close()  # type: ignore[attr-defined]


@_facade(AsyncSession, ("prompt", "messages", "tools", "call", "score_group", "ping", "close"),
         ("sid", "index", "expired", "closed", "seconds"))
class Session(_Facade):
    """Synchronous view of an `AsyncSession` (from `Client.open_session`), for any thread: `AsyncSession`'s methods,
    blocking, and its `sid`, `index`, `expired`, `closed` and `seconds`."""

    async_session = property(lambda self: self._inner, doc="The `AsyncSession` this view drives.")


@_facade(AsyncClient, ("environment", "list_environments", "health", "splits", "num_tasks", "task", "task_range",
                       "tasks", "task_difficulty", "tools"), ("target", "options", "open_sessions"))
class Client(_Facade):
    """Synchronous ORS client: the `AsyncClient` API, blocking, from any thread. Closed by `close()`, `with`, or at
    the latest at interpreter exit, deleting every session it still has open.

    Args:
        target (`str`):
            See `AsyncClient`.
        options (`ClientOptions`, *optional*):
            See `AsyncClient`.
        **kwargs:
            See `AsyncClient`.
    """

    def __init__(self, target: str, options: ClientOptions | None = None, **kwargs: Any) -> None:
        super().__init__(AsyncClient(target, options, **kwargs), get_loop())
        self._bg.add_closer(self._inner.aclose)

    async_client = property(lambda self: self._inner, doc="The `AsyncClient` this client drives.")
    open_session = _blocking(AsyncClient.open_session, lambda self, session: Session(session, self._bg))

    def close(self) -> None:
        """Close every open session, then the connection pool."""
        self._bg.remove_closer(self._inner.aclose)
        self._bg.run(self._inner.aclose())


async def delete_orphans(target: str, sids: list[str]) -> list[bool | None]:
    """Delete session ids of `target` a dead process left open (the orphan registry's `Deleter`): per id, whether the
    server has it gone; None for each when `target` is a loopback server refusing connections (nothing is sent)."""
    if "://" in target and await server_gone(target):
        logger.debug("%s refuses connections on loopback: its %d session(s) died with it", target, len(sids))
        return [None] * len(sids)
    gate = asyncio.Semaphore(_ORPHAN_CONCURRENCY)
    async with AsyncClient(target, retry=_QUICK_RETRY, keepalive_interval=None) as client:
        async def delete(sid: str) -> bool:
            async with gate:
                return await client._delete(sid, quiet=True)

        return list(await asyncio.gather(*(delete(sid) for sid in sids)))


def _is_segment(name: object) -> bool:
    """Whether `name` can be a URL path segment as it is: nothing to escape, not `.` or `..` (which URLs resolve)."""
    return isinstance(name, str) and _ENV_NAME.fullmatch(name) is not None and name not in (".", "..")


def _env_segment(name: str) -> str:
    if _is_segment(name):
        return name
    raise ProtocolError(f"/list_environments: the environment name {quoted(name, 100)} cannot be part of a URL path "
                        f"({_SEGMENT_RULE})")


async def server_gone(url: str) -> bool:
    """Whether `url` is a loopback server that refuses connections (its sessions died with it); False for any other
    host, or when unsure."""
    parts = urllib.parse.urlsplit(url)
    try:
        host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
        if host != "localhost" and not ipaddress.ip_address(host).is_loopback:
            return False
        addresses = {info[4][:2] for info in await asyncio.get_running_loop().getaddrinfo(
            host, port, type=socket.SOCK_STREAM)}
    except (ValueError, OSError):
        return False
    for address, at in addresses:
        if not ipaddress.ip_address(address.split("%")[0]).is_loopback:
            return False  # a `localhost` that is not loopback: not ours to judge
        try:
            async with asyncio.timeout(_PROBE_S):
                _, writer = await asyncio.open_connection(address, at)
        except ConnectionRefusedError:
            continue
        except (OSError, TimeoutError):
            return False
        writer.close()
        return False  # something listens there
    return bool(addresses)
