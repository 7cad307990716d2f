"""`OpenRewardSpec`: one object that wires an ORS environment into TRL's `GRPOTrainer`.

    spec = OpenRewardSpec("Eigent/SETA", num_tasks=64)        # or "http://127.0.0.1:8000"
    trainer = GRPOTrainer(
        model=...,
        args=GRPOConfig(...),
        train_dataset=spec.train_dataset,
        environment_factory=spec.environment_factory,
        reward_funcs=spec.reward_funcs,
        callbacks=spec.callbacks,          # optional: closes sessions at each step's end and at the end
    )

Same signature and meaning as `trl.experimental.openreward.OpenRewardSpec`; everything new is
keyword-only with a default that keeps the documented behaviour.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

from ._adapter import EnvironmentRuntime, OpenRewardEnvironment
from ._binding import DEFAULT_RESERVED, BindingResult, bind_tools
from ._client import AsyncClient
from ._engine import TASK_KEY, EngineEnvironment, RolloutEngine
from ._exceptions import BadRequestError, ConfigurationError, NotFoundError, ORSError
from ._loop import get_loop
from ._metrics import EnvMetrics
from ._target import SecretValue, platform_key_secret, resolve_target
from ._transport import RetryPolicy, Timeouts
from ._types import ToolSpec

if TYPE_CHECKING:
    from datasets import Dataset

__all__ = ["OpenRewardSpec", "outcome_reward"]

logger = logging.getLogger("ors_trl")

#: Dataset columns ors-trl owns; task fields with these names are not copied into the dataset.
RESERVED_COLUMNS = frozenset({"prompt", "task_index", "task_spec"})
_PAGE = 500
_FETCH_CONCURRENCY = 8
_PROBE_CONCURRENCY = 16


def outcome_reward(environments: Sequence[Any] | None = None, *, unscored_reward: float | None = None,
                   **kwargs: Any) -> list[float | None]:
    """The outcome reward: each rollout's last non-None reward, None when nothing was scored.

    0.0 and negative rewards are real scores; a later unscored or failed call does not erase an
    earlier score. With the rollout engine (no `environments`), the rewards arrive in the
    `ors_reward` column the engine returns. Also hands the environment metrics of the batch to the
    trainer's `log_metric`, so they appear in the training logs.

    `unscored_reward` (opt-in, via `OpenRewardSpec(unscored_reward=...)`) replaces None for rollouts
    the environment never scored, e.g. 0.0 so that not calling a tool at all is not an escape from
    negative advantages; the environment metrics still count those rollouts as ungraded.
    """
    log_metric = kwargs.get("log_metric")
    if environments is None:
        rewards = kwargs.get("ors_reward")
        if rewards is None:
            raise ConfigurationError(
                "outcome_reward needs `environments` (environment_factory) or the `ors_reward` column "
                "(spec.rollout_func); pass one of them to GRPOTrainer."
            )
        scored = [None if r is None or (isinstance(r, float) and r != r) else float(r) for r in rewards]
        return [unscored_reward if r is None else r for r in scored]
    out: list[float | None] = []
    metrics: dict[int, EnvMetrics] = {}
    for env in environments:
        if isinstance(env, OpenRewardEnvironment):
            env._report_episode()
            metrics.setdefault(id(env._runtime.metrics), env._runtime.metrics)
        out.append(getattr(env, "reward", None))
    if callable(log_metric):
        for m in metrics.values():
            for name, value in m.flush().items():
                log_metric(name, value)
    return [unscored_reward if r is None else r for r in out]


def check_selection(num_tasks: int | None, indices: Sequence[int] | None) -> list[int] | None:
    """Validate a `num_tasks` / `indices` choice (mutually exclusive); return `indices` as a list."""
    if num_tasks is not None and indices is not None:
        raise ConfigurationError("Provide num_tasks or indices, not both.")
    if num_tasks is not None and (isinstance(num_tasks, bool) or not isinstance(num_tasks, int) or num_tasks < 1):
        raise ConfigurationError(f"num_tasks must be a positive int, got {num_tasks!r}")
    if indices is None:
        return None
    indices = list(indices)
    if not indices:
        raise ConfigurationError("indices is empty; pass at least one task index or leave it None.")
    bad = [i for i in indices if isinstance(i, bool) or not isinstance(i, int) or i < 0]
    if bad:
        raise ConfigurationError(f"indices must be non-negative ints; got {bad[:5]}")
    return indices


def check_in_range(indices: Sequence[int], total: int, split: str) -> None:
    """Raise a `ConfigurationError` naming the valid range if any index is past the split's end."""
    out_of_range = sorted({i for i in indices if i >= total})
    if out_of_range:
        raise ConfigurationError(
            f"indices {out_of_range[:10]} are out of range for split {split!r}, which has {total} tasks "
            f"(0..{total - 1})."
        )


def reward_function(unscored_reward: float | None) -> Callable[..., list[float | None]]:
    """`outcome_reward` itself, or bound to an `unscored_reward` (a picklable partial TRL names the same)."""
    if unscored_reward is None:
        return outcome_reward
    return functools.partial(outcome_reward, unscored_reward=unscored_reward)


def _slug(text: str) -> str:
    return re.sub(r"[^0-9A-Za-z]+", "_", text).strip("_")[:48] or "env"


def _arrow_safe(values: list[Any]) -> bool:
    import pyarrow as pa

    try:
        pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError, TypeError, ValueError):
        return False
    return True


def task_columns(task_specs: Sequence[Any], reserved: frozenset[str] = RESERVED_COLUMNS
                 ) -> tuple[dict[str, list[Any]], list[str]]:
    """Task fields as dataset columns, plus notes on what had to change.

    Fields named like a reserved column are left out; a field whose values Arrow cannot store in
    one column (mixed types, ragged nesting) is stored as JSON text, so dataset creation never fails.
    """
    notes: list[str] = []
    keys: list[str] = []
    seen: set[str] = set()
    for spec in task_specs:
        if isinstance(spec, Mapping):
            for k in spec:
                if k not in seen:
                    seen.add(k)
                    keys.append(k)
    columns: dict[str, list[Any]] = {}
    for key in sorted(keys, key=str):
        if not isinstance(key, str) or key in reserved:
            notes.append(f"task field {key!r} is reserved by ors-trl and was not copied into the dataset")
            continue
        values = [spec.get(key) if isinstance(spec, Mapping) else None for spec in task_specs]
        if not _arrow_safe(values):
            values = [None if v is None else json.dumps(v, sort_keys=True, default=str) for v in values]
            notes.append(f"task field {key!r} has values of mixed shapes; stored as JSON text")
        columns[key] = values
    return columns, notes


class OpenRewardSpec:
    """Wire an ORS environment into `GRPOTrainer`: `train_dataset`, `environment_factory`, `reward_funcs`.

    Args:
        target: an openreward.ai catalog name (`"Eigent/SETA"`) or the URL of any ORS server
            (`"http://127.0.0.1:8000"`), told apart by `://`.
        num_tasks: use the first `num_tasks` tasks of the split (capped at its size). Default: all.
        split: the split tasks are drawn from.
        indices: exactly these task indices (mutually exclusive with `num_tasks`).
        api_key: overrides `OPENREWARD_API_KEY` for catalog names; for a URL, sent only if given.
        secrets: per-session secrets (`X-Secrets`), for every session. In catalog mode, when not
            given, the API key is forwarded as the conventional `api_key` secret.
        env_name: which environment on a server that hosts several.
        include_metadata: copy each task's fields into dataset columns (reward functions see them).
        discover_task_tools: open probe sessions to bind task-specific tools (`/task_tools`), not
            only the shared ones.
        task_tools_discovery_index: probe only this task index.
        cache_prompts: return cached prompts from repeated resets of one task while sessions open
            in the background (one session-open wait per distinct task, not per rollout).
        max_output_chars: cap on the tool output text the model sees (truncation is marked).
        keepalive_interval: seconds between keepalive pings of idle sessions (None disables).
        timeouts: `Timeouts` for connects, requests, tool-call streams and whole tool calls.
        retry: `RetryPolicy` for transient failures.
        max_sessions: cap on sessions open at once in this process; more wait for a free slot.
        episode_log: path of a JSON-lines file receiving every finished episode (off by default).
        batch_tool_calls: in TRL's own tool loop (`environment_factory`), start all of a turn's tool
            calls across the batch at once at its first call (each rollout's calls still in order),
            instead of one rollout after another.
        async_tools: bind tools as coroutine methods (TRL gathers a rollout's parallel calls).
        max_concurrent_tool_calls: tool calls in flight at once across a batch (engine and
            `batch_tool_calls`), per environment.
        unscored_reward: what `reward_funcs` gives a rollout the environment never scored. None (the
            default, TRL's convention) leaves it out of the advantage baseline; a number (e.g. 0.0)
            counts it as that score.
        episode_timeout: with `rollout_func`, wall-clock seconds an episode may take before it is
            closed and scored None.
    """

    def __init__(
        self,
        target: str,
        *,
        num_tasks: int | None = None,
        split: str = "train",
        indices: list[int] | None = None,
        api_key: str | None = None,
        secrets: Mapping[str, SecretValue] | None = None,
        env_name: str | None = None,
        include_metadata: bool = True,
        discover_task_tools: bool = True,
        task_tools_discovery_index: int | None = None,
        cache_prompts: bool = True,
        max_output_chars: int | None = None,
        keepalive_interval: float | None = 10.0,
        timeouts: Timeouts | None = None,
        retry: RetryPolicy | None = None,
        max_sessions: int | None = None,
        episode_log: str | None = None,
        batch_tool_calls: bool = True,
        async_tools: bool = False,
        max_concurrent_tool_calls: int = 64,
        episode_timeout: float | None = None,
        unscored_reward: float | None = None,
    ) -> None:
        indices = check_selection(num_tasks, indices)
        if not isinstance(split, str) or not split:
            raise ConfigurationError("split must be a non-empty string")
        if max_output_chars is not None and max_output_chars < 1:
            raise ConfigurationError("max_output_chars must be positive or None")
        if isinstance(max_concurrent_tool_calls, bool) or not isinstance(max_concurrent_tool_calls, int) \
                or max_concurrent_tool_calls < 1:
            raise ConfigurationError(f"max_concurrent_tool_calls must be an int >= 1, got {max_concurrent_tool_calls!r}")
        self._split = split
        self._num_tasks = num_tasks
        self._indices = indices
        self._include_metadata = include_metadata
        self._discover_task_tools = discover_task_tools
        self._task_tools_discovery_index = task_tools_discovery_index
        self._async_tools = async_tools
        self._max_concurrent_tool_calls = max_concurrent_tool_calls
        self._unscored_reward = None if unscored_reward is None else float(unscored_reward)
        self._episode_timeout = episode_timeout
        # In catalog mode the key also goes to the environment as its conventional `api_key` secret,
        # unless the caller chose the secrets.
        resolved = resolve_target(target, api_key=api_key)
        effective = dict(secrets) if secrets is not None else platform_key_secret(resolved)
        self._client = AsyncClient(
            target,
            env_name=env_name,
            api_key=api_key,
            secrets=effective or None,
            timeouts=timeouts,
            retry=retry,
            keepalive_interval=keepalive_interval,
            max_sessions=max_sessions,
        )
        self.metrics = EnvMetrics()
        recorder = None
        if episode_log is not None:
            from ._records import EpisodeRecorder

            recorder = EpisodeRecorder(episode_log)
        self._runtime = EnvironmentRuntime(
            self._client,
            name=self.name,
            split=split,
            cache_prompts=cache_prompts,
            max_output_chars=max_output_chars,
            metrics=self.metrics,
            recorder=recorder,
            batch_tool_calls=batch_tool_calls,
            max_concurrent_tool_calls=max_concurrent_tool_calls,
        )
        self.dataset_notes: list[str] = []
        self.binding: BindingResult | None = None

    def __repr__(self) -> str:
        return f"OpenRewardSpec({self.target!r}, split={self._split!r})"

    # -- identity ----------------------------------------------------------------------------------

    @property
    def target(self) -> str:
        return self._client.target.name

    @property
    def split(self) -> str:
        return self._split

    @property
    def name(self) -> str:
        """A short name for logs and metrics: the environment name, else the catalog name or host."""
        t = self._client.target
        if self._client.requested_env:
            return self._client.requested_env.lower()
        if t.kind == "catalog":
            return t.name
        return t.name.split("://", 1)[1].rstrip("/")

    @property
    def client(self) -> AsyncClient:
        """The underlying async client (bound to the background loop; use `spec.run(...)` to drive it)."""
        return self._client

    def run(self, coro: Any) -> Any:
        """Run a coroutine using this spec's client on the background loop and return its result."""
        return get_loop().run(coro)

    # -- dataset -----------------------------------------------------------------------------------

    @cached_property
    def train_dataset(self) -> Dataset:
        """A `datasets.Dataset` of the selected tasks, built on first access.

        Columns: `prompt` (a conversational prompt with an empty user message, to which TRL appends
        the environment's prompt), `task_index`, and with `include_metadata` every task field.
        """
        from datasets import Dataset

        indices, tasks = self.run(self._fetch_tasks())
        rows: dict[str, list[Any]] = {
            "prompt": [[{"role": "user", "content": "", TASK_KEY: self._task_identity(i)}] for i in indices],
            "task_index": list(indices),
        }
        if self._include_metadata and tasks:
            columns, notes = task_columns(tasks)
            self.dataset_notes = notes
            for note in notes:
                # Reserved names are routine (tasks often carry their own "prompt"); changed values are worth a warning.
                log = logger.info if "is reserved" in note else logger.warning
                log("%s: %s", self.name, note)
            rows.update(columns)
        try:
            return Dataset.from_dict(rows)
        except Exception as exc:  # last resort: every task field as JSON text
            logger.warning("%s: task fields could not be stored as typed columns (%s); storing them as JSON text",
                           self.name, exc)
            for key in list(rows):
                if key not in ("prompt", "task_index"):
                    rows[key] = [None if v is None else json.dumps(v, default=str) for v in rows[key]]
            return Dataset.from_dict(rows)

    def _task_identity(self, index: int) -> str:
        return json.dumps({"env": None, "split": self._split, "index": index})

    async def _fetch_tasks(self) -> tuple[list[int], list[Any]]:
        client, split = self._client, self._split
        total = await client.num_tasks(split)
        if self._indices is not None:
            check_in_range(self._indices, total, split)
            wanted = sorted(set(self._indices))
            by_index = await self._fetch_indices(wanted)
            return list(self._indices), [by_index[i] for i in self._indices]
        n = total if self._num_tasks is None else min(self._num_tasks, total)
        if self._num_tasks is not None and self._num_tasks > total:
            logger.warning("%s: num_tasks=%d but split %r has %d tasks; using all %d.",
                           self.name, self._num_tasks, split, total, total)
        by_index = await self._fetch_indices(list(range(n)))
        return list(range(n)), [by_index[i] for i in range(n)]

    async def _fetch_indices(self, wanted: list[int]) -> dict[int, Any]:
        """Fetch sorted distinct indices in as few `task_range` requests as sensible (pages of contiguous runs)."""
        runs: list[tuple[int, int]] = []
        for i in wanted:
            if runs and i - runs[-1][1] <= 8 and i - runs[-1][0] < _PAGE:
                runs[-1] = (runs[-1][0], i + 1)
            else:
                runs.append((i, i + 1))
        gate = asyncio.Semaphore(_FETCH_CONCURRENCY)
        bar = None
        if len(runs) > 4 or len(wanted) > 2 * _PAGE:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(wanted), desc=f"tasks from {self.name}", unit="task", leave=False)
        wanted_set = set(wanted)
        out: dict[int, Any] = {}

        async def fetch(start: int, stop: int) -> None:
            async with gate:
                tasks = await self._client.task_range(self._split, start, stop)
            if len(tasks) != stop - start:
                raise ORSError(f"task_range({start}, {stop}) returned {len(tasks)} tasks")
            for offset, task in enumerate(tasks):
                if start + offset in wanted_set:
                    out[start + offset] = task
            if bar is not None:
                bar.update(sum(1 for i in range(start, stop) if i in wanted_set))

        try:
            await asyncio.gather(*(fetch(a, b) for a, b in runs))
        finally:
            if bar is not None:
                bar.close()
        return out

    # -- tools -----------------------------------------------------------------------------------

    def _probe_indices(self) -> list[int]:
        if self._task_tools_discovery_index is not None:
            return [self._task_tools_discovery_index]
        if self._indices is not None:
            return sorted(set(self._indices))
        return [0]

    async def _discover_tools(self) -> list[ToolSpec]:
        client = self._client
        shared = (await client.tools()).tools
        if not self._discover_task_tools:
            return shared
        try:
            total = await client.num_tasks(self._split)
        except (BadRequestError, NotFoundError):
            raise  # a wrong split or environment is the user's to fix, now, not a degraded tool set
        except ORSError as exc:
            logger.warning("%s: num_tasks failed (%s); binding shared tools only.", self.name, exc)
            return shared
        if self._indices is not None:
            check_in_range(self._indices, total, self._split)
        probes = [i for i in self._probe_indices() if 0 <= i < total]
        dropped = sorted(set(self._probe_indices()) - set(probes))
        if dropped:
            logger.warning("%s: tool discovery indices %s are out of range (split %r has %d tasks); ignored.",
                           self.name, dropped, self._split, total)
        if not probes:
            return shared
        gate = asyncio.Semaphore(_PROBE_CONCURRENCY)

        async def probe(index: int) -> list[ToolSpec]:
            async with gate:
                session = await client.open_session(split=self._split, index=index)
                try:
                    return (await session.tools()).tools
                finally:
                    await session.close()

        results = await asyncio.gather(*(probe(i) for i in probes), return_exceptions=True)
        merged: dict[str, ToolSpec] = {t.name: t for t in shared}
        ok = 0
        for index, result in zip(probes, results, strict=True):
            if isinstance(result, BaseException):
                if not isinstance(result, Exception):
                    raise result
                logger.warning("%s: tool discovery for task %d failed (%s); skipping it.", self.name, index, result)
                continue
            ok += 1
            for spec in result:
                known = merged.get(spec.name)
                if known is None:
                    merged[spec.name] = spec
                elif known != spec and spec.name not in {t.name for t in shared}:
                    logger.warning("%s: tool %r has different schemas in different tasks; keeping the first.",
                                   self.name, spec.name)
        if not ok:
            logger.warning("%s: every tool discovery session failed; binding shared tools only.", self.name)
        return list(merged.values())

    @cached_property
    def tool_specs(self) -> list[ToolSpec]:
        """The tools the adapter binds (shared plus discovered task-specific ones)."""
        return self.run(self._discover_tools())

    @cached_property
    def environment_factory(self) -> Callable[[], OpenRewardEnvironment]:
        """A zero-argument callable returning a fresh adapter per rollout (TRL's `environment_factory`).

        It is the adapter class itself, generated for this environment: one method per tool.
        """
        specs = self.tool_specs
        cls_name = f"OpenRewardEnvironment_{_slug(self.name)}"
        binding = bind_tools(
            [s.to_json() for s in specs],
            reserved=DEFAULT_RESERVED | {"reset"},
            asynchronous=self._async_tools,
            module=__name__,
            qualname_prefix=cls_name,
        )
        self.binding = binding
        cls = type(cls_name, (OpenRewardEnvironment,), {"_runtime": self._runtime, "__module__": __name__})
        binding.install(cls)
        return cls

    def engine_environment(self) -> EngineEnvironment:
        """This environment as the rollout engine sees it (binds the tools if not done yet)."""
        cls = self.environment_factory
        assert self.binding is not None
        return EngineEnvironment(self._runtime, cls, dict(self.binding.remote_names), dict(self.binding.display_names))

    @cached_property
    def rollout_func(self) -> RolloutEngine:
        """The concurrent rollout engine for `GRPOTrainer(rollout_func=...)`.

        Use it instead of `environment_factory` (not with it), with `train_dataset` and `reward_funcs`:
        every episode of a batch runs at once, sessions open concurrently and tool calls overlap.
        """
        return RolloutEngine(
            {None: self.engine_environment()},
            max_concurrent_tool_calls=self._max_concurrent_tool_calls,
            episode_timeout=self._episode_timeout,
        )

    # -- rewards and callbacks -------------------------------------------------------------------

    @property
    def reward_funcs(self) -> Callable[..., list[float | None]]:
        """The outcome reward function (picklable): last non-None reward per rollout."""
        return reward_function(self._unscored_reward)

    @cached_property
    def callbacks(self) -> list[Any]:
        """Trainer callbacks for `GRPOTrainer(callbacks=...)`: close sessions after each step and at the end."""
        from ._callback import SessionCleanupCallback

        return [SessionCleanupCallback([self._runtime])]

    def close(self) -> None:
        """Close every session this spec opened and wait until the server has them deleted."""
        self._runtime.close_all()

    def evaluate(
        self,
        policy: Any,
        *,
        num_tasks: int | None = None,
        indices: Sequence[int] | None = None,
        concurrency: int = 8,
        max_turns: int = 10,
        output: str | None = None,
        resume: bool = False,
        **kwargs: Any,
    ) -> Any:
        """Run `policy` over this spec's tasks through the same client and tool binding as training.

        `policy` is a local model directory, a `(model, tokenizer)` pair or an `OpenAIPolicy`. Returns an
        `EvalReport` (mean reward, grading coverage, finished rate, tool calls/failures per episode, `.episodes`).
        See `ors_trl._eval.evaluate` for the other keyword arguments (repeats, overwrite, temperature, ...).
        """
        from ._eval import evaluate

        return evaluate(self, policy, num_tasks=num_tasks, indices=indices, concurrency=concurrency,
                        max_turns=max_turns, output=output, resume=resume, **kwargs)
