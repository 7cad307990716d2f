"""`OpenRewardSpec`: one object that wires an ORS environment into TRL's `GRPOTrainer`.

    spec = OpenRewardSpec("Eigent/SETA", num_tasks=64)        # or "http://127.0.0.1:8000"
    trainer = GRPOTrainer(model=..., args=GRPOConfig(...), train_dataset=spec.train_dataset,
                          environment_factory=spec.environment_factory, reward_funcs=spec.reward_funcs)

Same signature and meaning as `trl.experimental.openreward.OpenRewardSpec`, plus keyword-only options. A spec, its
factory and reward functions pickle (for TRL's async trainer's spawned rollout worker): the copy opens its own sessions.
"""

from __future__ import annotations

import asyncio
import copyreg
import json
import logging
import math
import os
import random
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .core.binding import Toolset
from .core.episode import EnvironmentRuntime, Task
from .core.metrics import EnvMetrics
from .core.records import RecordWriter
from .core.scoring import reward_rule
from .protocol.client import AsyncClient
from .protocol.errors import (
    BadRequestError,
    ConfigurationError,
    NotFoundError,
    ORSError,
    checked_keywords,
    extra_module,
)
from .protocol.loop import get_loop
from .protocol.target import SecretValue, platform_key_secret, resolve_target
from .protocol.transport import RetryPolicy, Timeouts
from .protocol.types import TerminalTool, ToolSpec
from .tasks.difficulty import (
    Difficulty,
    PlatformDifficulty,
    check_range,
    known_rewards,
    platform_known,
    select_by_difficulty,
)
from .tasks.sampling import Curriculum, TaskSampler, UniformSampler, make_sampler, uniform_draws
from .tasks.selection import check_in_range, check_selection, fetch_tasks, log_notes, select, task_columns
from .trl import backend as _trl
from .trl.adapter import RESERVED as ADAPTER_NAMES
from .trl.adapter import OpenRewardEnvironment, for_this_process
from .trl.credit import install as install_credit
from .trl.engine import TASK_KEY, RolloutEngine
from .trl.rewards import group_reward, outcome_reward, reward_function

if TYPE_CHECKING:
    from datasets import Dataset, IterableDataset

    from .evaluation.runner import EvalOptions, EvalReport

__all__ = ["OpenRewardSpec"]

logger = logging.getLogger("ors_trl")

#: Tool-discovery sessions open at once (each may be a sandbox on a catalog environment).
PROBE_CONCURRENCY = 4
#: Episode logs are bounded: long texts are cut, and the file stops growing at this size.
EPISODE_LOG_MAX_BYTES = 256 * 1024 * 1024
EPISODE_LOG_MAX_TEXT = 8_000
#: The column TRL routes rows by in multi-environment mode.
ENVIRONMENT_COLUMN = "environment"


def _slug(text: str) -> str:
    return re.sub(r"[^0-9A-Za-z]+", "_", text).strip("_")[:48] or "env"


def _check(low: float | None, *, integer: bool = True, optional: bool = False, strict: bool = False,
           **options: Any) -> None:
    """Refuse (`ConfigurationError`) each of `options` (`name=value`) whose value is not an int (with `integer=False`:
    a number) `>= low` (`> low` when `strict`; a finite number when `low` is None), nor None where `optional`."""
    for name, value in options.items():
        if optional and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int if integer else int | float) or not (
                math.isfinite(value) if low is None else value > low if strict else value >= low):  # NaN fails each
            bound = "" if low is None else f" {'>' if strict else '>='} {low:g}"
            what = "an int" if integer else "a finite number" if low is None else "a number"
            raise ConfigurationError(f"{name} must be {what}{bound}{' or None' if optional else ''}, got {value!r}")


def _writer(path: str | None) -> RecordWriter | None:
    """The bounded episode log at `path` (None: none)."""
    return None if path is None else RecordWriter(path, max_bytes=EPISODE_LOG_MAX_BYTES, max_text=EPISODE_LOG_MAX_TEXT)


def mixture_counts(sizes: Sequence[int], weights: Sequence[float]) -> list[int]:
    """Rows per environment so that their shares follow `weights`, keeping the total at `sum(sizes)` (largest-remainder
    rounding; every environment with a positive weight keeps at least one row)."""
    total = sum(sizes)
    wsum = sum(weights)
    raw = [total * w / wsum for w in weights]
    counts = [int(r) for r in raw]
    for i in sorted(range(len(raw)), key=lambda i: raw[i] - counts[i], reverse=True)[: total - sum(counts)]:
        counts[i] += 1
    return [max(c, 1) if w > 0 else 0 for c, w in zip(counts, weights, strict=True)]


def _train_dataset(specs: Mapping[str | None, OpenRewardSpec], label: str, weights: list[float] | None = None,
                   seed: int = 0) -> tuple[Dataset | IterableDataset, list[str]]:
    """A spec's (`{None: spec}`: its tasks in order) or a mix's `train_dataset` (TRL's routing column, rows in the
    weights' proportions, seeded), and what the tasks' fields as columns changed (`task_columns`, logged once); with
    a spec's `task_sampling`, an endless stream drawing each row's environment by weight, then its task."""
    Dataset = extra_module("datasets", f"{'spec' if None in specs else 'mix'}.train_dataset").Dataset

    async def fetch_all() -> list[tuple[list[int], list[Any]]]:
        return list(await asyncio.gather(*(spec.select_tasks() for spec in specs.values())))

    fetched = get_loop().run(fetch_all())
    sampled = any(spec.curriculum is not None for spec in specs.values())
    picks: list[Sequence[int]] = [range(len(indices)) for indices, _ in fetched]
    if not sampled and None not in specs:
        counts = [len(p) for p in picks] if weights is None else mixture_counts([len(p) for p in picks], weights)
        rng = random.Random(seed)
        picks = [uniform_draws(p, count, rng) if p else [] for p, count in zip(picks, counts, strict=True)]
    rows: dict[str, list[Any]] = {"prompt": [], "task_index": [], ENVIRONMENT_COLUMN: []}
    tasks: list[Any] = []
    for (name, spec), (indices, spec_tasks), chosen in zip(specs.items(), fetched, picks, strict=True):
        part = spec.dataset_rows([indices[p] for p in chosen], env=name)
        rows["prompt"] += part["prompt"]
        rows["task_index"] += part["task_index"]
        rows[ENVIRONMENT_COLUMN] += [name] * len(chosen)
        tasks += [spec_tasks[p] for p in chosen]
    envs = rows.pop(ENVIRONMENT_COLUMN) if None in specs else rows[ENVIRONMENT_COLUMN]
    columns, notes = task_columns(tasks)  # the routing column is reserved too
    log_notes(notes, label)
    dataset = Dataset.from_dict(rows | columns)
    if not sampled:
        return dataset, notes
    from .tasks.stream import sampled_stream
    from .trl.callbacks import attach_task_sampling

    for spec in specs.values():
        if spec.curriculum is None:  # a mix's uniform specs: seeded passes
            spec.curriculum = Curriculum(UniformSampler(seed=seed), spec.runtime)
    where = {(name, i): row for row, (name, i) in enumerate(zip(envs, rows["task_index"], strict=True))}
    chosen = {name: indices for name, (indices, _) in zip(specs, fetched, strict=True) if indices or name is None}
    if weights is not None:
        weights = [w for name, w in zip(specs, weights, strict=True) if name in chosen]
    return sampled_stream(dataset, where, {name: specs[name] for name in chosen}, chosen, weights=weights, seed=seed,
                          on_bind=attach_task_sampling), notes


class _AdapterClass(type):
    """Metaclass of the adapter classes specs generate: a generated class pickles as its spec."""


def _adapter_class_of(spec: OpenRewardSpec) -> type:
    """What an unpickled adapter class is: its spec's (in TRL's async rollout worker, with `get_reward`)."""
    return for_this_process(spec.environment_factory)


copyreg.pickle(_AdapterClass, lambda cls: (_adapter_class_of, (cls._spec,)))  # type: ignore[attr-defined]
_restored: dict[tuple[Any, ...], OpenRewardSpec] = {}
_restored_lock = threading.Lock()


def _restore(options: dict[str, Any], tools: tuple[Any, ...] | None,
             joined: tuple[str | None, str | None] | None = None) -> OpenRewardSpec:
    """A spec rebuilt from its pickled state, once per process (every copy of it shares sessions and metrics);
    `joined`: the name and episode log a mix gave it (`OpenRewardMix` renames its specs' runtimes)."""
    key = (repr(sorted(options.items(), key=lambda kv: kv[0])), repr(tools), repr(joined))
    with _restored_lock:
        spec = _restored.get(key)
        if spec is None:
            spec = _restored[key] = OpenRewardSpec(**options)
            if tools is not None:
                spec._set_tools(*tools)
            if joined is not None:
                name, log = joined
                spec._runtime.rename(name, EnvMetrics(spec._runtime.metrics.success_threshold), _writer(log))
        return spec


class _TrainerInputs:
    """What a spec and a mix give `GRPOTrainer` alike, over `_parts` (`{name: spec}`; a lone spec: `{None: spec}`)."""

    _what = "spec"  # names the feature in errors
    _unscored_groups = "group_reward_func needs OpenRewardSpec(..., score_groups=True)"
    _parts: Mapping[str | None, OpenRewardSpec]
    _unscored_reward: float | None
    gather_window: float | None
    train_dataset: Any

    @cached_property
    def rollout_func(self) -> RolloutEngine:
        """The rollout engine for `GRPOTrainer(rollout_func=...)`, instead of `environment_factory`: a batch's episodes
        run on their own, sessions and tool calls overlap, each with its spec's `episode_timeout`. One gather window:
        a mix's, else the specs' (which must agree). A `UsageError` on a TRL version it is not verified on."""
        _trl.require_engine(f"{self._what}.rollout_func")
        for spec in self._parts.values():
            _ = spec.tool_specs
        windows = {spec.gather_window for spec in self._parts.values()}
        if self.gather_window is None and len(windows) > 1:
            raise ConfigurationError(f"the specs of this mix ask for different gather windows "
                                     f"({sorted(windows, key=str)}); pass OpenRewardMix(..., gather_window=...) to "
                                     "choose one")
        window = windows.pop() if self.gather_window is None else self.gather_window
        return RolloutEngine({name: spec.runtime for name, spec in self._parts.items()}, gather_window=window)

    @property
    def reward_funcs(self) -> Callable[..., list[float | None]]:
        """The outcome reward function (picklable): each rollout's own environment's last non-None reward."""
        return reward_function(outcome_reward, self._unscored_reward)

    @property
    def group_reward_func(self) -> Callable[..., list[float | None]]:
        """Each rollout's comparative reward in its GRPO group from its own environment's `/score_group`, for
        `reward_funcs=[...]`; needs `score_groups=True` (on a spec of a mix) and an environment that supports it."""
        scored = [spec for spec in self._parts.values() if spec.score_groups]
        if not scored:
            raise ConfigurationError(self._unscored_groups)
        for spec in scored:
            if not spec._tools[2]:
                raise ConfigurationError(f"{spec.name} does not support group scoring (its /tools does not say "
                                         "supports_score_group: true); use spec.reward_funcs alone.")
        return group_reward

    @cached_property
    def callbacks(self) -> list[Any]:
        """Trainer callbacks for `GRPOTrainer(callbacks=...)`: close sessions after each step and at the end, and
        (with a spec's `task_sampling`) update, log and checkpoint the task samplers.

        Optional with `GRPOTrainer`: it gets them automatically the first time it reads the dataset, resets an
        adapter or runs the engine. `AsyncGRPOTrainer` needs them for task sampling's checkpoints and metrics.
        """
        from .trl.callbacks import SessionCleanupCallback, stream_callbacks

        sampled = any(spec.curriculum is not None for spec in self._parts.values())
        return [SessionCleanupCallback([spec.runtime for spec in self._parts.values()]),
                *(stream_callbacks(self.train_dataset) if sampled else [])]

    def close(self) -> None:
        """Close every session opened (by each spec of a mix) and wait until the server has them deleted."""
        for spec in self._parts.values():
            spec.runtime.close_all()


class OpenRewardSpec(_TrainerInputs):
    """Wire an ORS environment into `GRPOTrainer`: `train_dataset`, `environment_factory`, `reward_funcs`.

    Args:
        target (`str`):
            An openreward.ai catalog name (`"Eigent/SETA"`) or any ORS server's URL, told apart by `://`.
        num_tasks (`int`, *optional*):
            Use the first `num_tasks` tasks of the split (capped at its size). Default: all.
        split (`str`, *optional*, defaults to `"train"`):
            The split tasks are drawn from.
        indices (`list[int]`, *optional*):
            Exactly these task indices (mutually exclusive with `num_tasks`).
        api_key (`str`, *optional*):
            Overrides `OPENREWARD_API_KEY` for catalog names; for a URL, sent only if given.
        secrets (`Mapping[str, str | dict]`, *optional*):
            Per-session secrets (`X-Secrets`). In catalog mode, by default the API key as the `api_key` secret.
        env_name (`str`, *optional*):
            Which environment on a server that hosts several.
        include_metadata (`bool`, *optional*, defaults to `True`):
            Copy each task's fields into dataset columns; one named like a keyword TRL passes (`RESERVED_COLUMNS` of
            `ors_trl.tasks.selection`) becomes `task_<name>`, logged once.
        discover_task_tools (`bool`, *optional*, defaults to `True`):
            Bind task-specific tools (`/task_tools`) too, from probe sessions: one per distinct task of `indices`
            (task 0 otherwise), `PROBE_CONCURRENCY` (4) at once.
        task_tools_discovery_index (`int`, *optional*):
            Probe only this task index.
        cache_prompts (`bool`, *optional*, defaults to `True`):
            Answer repeated resets of a task from its cached prompt while sessions open in the background.
        max_output_chars (`int`, *optional*):
            Cap on the tool output text the model sees (truncation is marked).
        keepalive_interval (`float`, *optional*, defaults to `10.0`):
            Seconds between keepalive pings of idle sessions (`None` disables them).
        timeouts (`Timeouts`, *optional*):
            Limits for connects, requests, tool-call streams and whole tool calls.
        retry (`RetryPolicy`, *optional*):
            Retries of transient failures.
        max_sessions (`int`, *optional*):
            Cap on sessions open at once through this spec; more wait for a free slot. With `environment_factory`,
            TRL's loop holds a batch's sessions open together: a batch of more rollouts per process is refused.
        episode_log (`str`, *optional*):
            Path of a JSON-lines file receiving every finished episode (off by default).
        batch_tool_calls (`bool`, *optional*, defaults to `True`):
            In TRL's tool loop, start all of a turn's tool calls across the batch at its first call (each in order).
        async_tools (`bool`, *optional*, defaults to `False`):
            Bind tools as coroutine methods (TRL gathers a rollout's parallel calls).
        max_concurrent_tool_calls (`int`, *optional*, defaults to `64`):
            Tool calls in flight at once, per environment.
        episode_timeout (`float`, *optional*):
            With `rollout_func` (and `evaluate`'s default): seconds before an episode is closed and scored `None`.
        unscored_reward (`float`, *optional*):
            `reward_funcs`' value for an unscored rollout: `None` (TRL's convention) leaves it out of the baseline. A
            rollout a failure, timeout or dropped group voided stays `None`: it is no score.
        score_groups (`bool`, *optional*, defaults to `False`):
            Provide `group_reward_func` (`/score_group` of each GRPO group), keeping sessions until the step ends.
        gather_window (`float`, *optional*):
            With `rollout_func`, seconds generation waits for more ready rollouts (`None`: automatic, <= 0.05 s).
        max_tool_calls (`int`, *optional*):
            Tool calls one episode may make (`None`: no cap); later ones are refused locally (the model reads why).
        success_threshold (`float`, *optional*, defaults to `1.0`):
            The reward at or above which an episode is a success (metrics, evaluation, reports, task sampling).
        upload_rollouts (`bool` or `str`, *optional*, defaults to `False`):
            Send every episode to the OpenReward rollout viewer (`True`, or the run's name there) in the background
            (`ors_trl.protocol.upload`), with `api_key=` for a catalog name, else `OPENREWARD_API_KEY`.
        images (`str`, *optional*, defaults to `"pass"`):
            `"pass"`: image blocks reach the model as image parts (for a vision-language model's processor);
            `"placeholder"`: as the text `[image: <media type>]`. Bounds: `ors_trl.protocol.images`.
        max_session_rate (`float` or `tuple[float, int]`, *optional*):
            Sessions created per second by this process, or `(rate, burst)`; a 429 or `503 starting` slows it.
            `None`: no pace. `ORS_TRL_MAX_SESSION_RATE="RATE[:BURST]"` sets one shared by the working directory.
        toolset (`str`, *optional*):
            The platform toolset every session gets (e.g. `"codex"`), its tools bound like the environment's; one
            the server refuses is a `ConfigurationError` at the first open.
        toolset_fallback (`bool`, *optional*, defaults to `False`):
            When the server refuses `toolset`, open sessions without it (one log line) instead.
        env_overrides (`Mapping[str, str]`, *optional*):
            Environment variables for every session (masked like secrets); on the platform, non-owners may set only
            the OpenAI/Anthropic URL and key variables.
        task_sampling (`str` or `TaskSampler`, *optional*, defaults to `"uniform"`):
            `"uniform"`: a `Dataset` in TRL's order. `"adaptive"` (`AdaptiveSampler`) or a `TaskSampler`: an endless
            `IterableDataset` drawn from the rewards so far (needs `GRPOConfig(max_steps=...)`), checkpointed.
        difficulty (`tuple[float, float]`, *optional*):
            Keep only tasks whose known mean reward lies in `[low, high]` (tasks without data are kept and counted).
        difficulty_from (`str`, `os.PathLike`, `Mapping[int, float]` or `PlatformDifficulty`, *optional*):
            Where `difficulty` reads mean rewards: an `ors-trl eval --output` file, an episode log, a
            `{task_index: mean reward}` mapping, or `PlatformDifficulty(...)` (`"platform"`, a catalog name's default).
        reward (`str` or `Callable`, *optional*, defaults to `"last"`):
            How per-call rewards make an episode's on every path: `"last"` (TRL's convention), `"sum"`, `"max"`,
            `"discounted:<gamma>"`, or `f(rewards, episode) -> float | None` (rewards the model never saw never count).
        score_failures (`bool`, *optional*, defaults to `False`):
            Keep what an episode scored before an infrastructure failure; by default it is unscored (`"error"`).
        tool_errors (`str`, *optional*, defaults to `"model"`):
            A tool that raised: `"model"` reads the error and goes on (TRL's loop), `"environment"` ends it unscored.
        episode_retries (`int`, *optional*, defaults to `0`):
            With `rollout_func` and `evaluate`: replay an episode infrastructure voided on a fresh session, up to this
            many times (its tools run again). TRL's own loop cannot replay.
        failed_groups (`str`, *optional*, defaults to `"partial"`):
            A group with an episode void after retries: `"partial"` trains the others, `"drop"` none of it.
        credit (`str`, *optional*, defaults to `"episode"`):
            `"turn"`: each turn's tokens train on the mean of the episode's advantage and the group-normalised return
            of the calls from that turn on (`ors_trl.trl.credit`); not with TRL's async trainer.
    """

    @checked_keywords
    def __init__(self, target: str, *, num_tasks: int | None = None, split: str = "train",
                 indices: list[int] | None = None, api_key: str | None = None,
                 secrets: Mapping[str, SecretValue] | None = None, env_name: str | None = None,
                 include_metadata: bool = True, discover_task_tools: bool = True,
                 task_tools_discovery_index: int | None = None, cache_prompts: bool = True,
                 max_output_chars: int | None = None, keepalive_interval: float | None = 10.0,
                 timeouts: Timeouts | None = None, retry: RetryPolicy | None = None, max_sessions: int | None = None,
                 episode_log: str | None = None, batch_tool_calls: bool = True, async_tools: bool = False,
                 max_concurrent_tool_calls: int = 64, episode_timeout: float | None = None,
                 unscored_reward: float | None = None, score_groups: bool = False, gather_window: float | None = None,
                 max_tool_calls: int | None = None, success_threshold: float = 1.0, upload_rollouts: bool | str = False,
                 images: str = "pass", max_session_rate: float | tuple[float, int] | None = None,
                 toolset: str | None = None, toolset_fallback: bool = False,
                 env_overrides: Mapping[str, str] | None = None, task_sampling: str | TaskSampler = "uniform",
                 difficulty: tuple[float, float] | None = None,
                 difficulty_from: str | os.PathLike[str] | Mapping[int, float] | PlatformDifficulty | None = None,
                 reward: str | Callable[..., float | None] = "last", score_failures: bool = False,
                 tool_errors: str = "model", episode_retries: int = 0, failed_groups: str = "partial",
                 credit: str = "episode") -> None:
        self._options = options = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        self._indices = check_selection(num_tasks, indices)
        self._progress = True  # the tool discovery's progress bar; an evaluation sets its own `progress`
        if not isinstance(split, str) or not split:
            raise ConfigurationError("split must be a non-empty string")
        _check(1, optional=True, max_output_chars=max_output_chars)
        _check(1, max_concurrent_tool_calls=max_concurrent_tool_calls)
        _check(0, integer=False, optional=True, strict=True, episode_timeout=episode_timeout)
        _check(0, integer=False, optional=True, gather_window=gather_window)
        _check(0, optional=True, max_tool_calls=max_tool_calls)
        _check(None, integer=False, success_threshold=success_threshold)
        _check(0, episode_retries=episode_retries)
        for name, value, allowed in (("images", images, ("pass", "placeholder")), ("tool_errors", tool_errors,
                                     ("model", "environment")), ("failed_groups", failed_groups, ("partial", "drop")),
                                     ("credit", credit, ("episode", "turn"))):
            if value not in allowed:
                raise ConfigurationError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
        reward_rule(reward)  # checked now
        sampler = make_sampler(task_sampling, success_threshold=float(success_threshold))
        self._difficulty = None if difficulty is None else check_range(difficulty)
        if difficulty_from is not None and difficulty is None:
            raise ConfigurationError("difficulty_from= says where task difficulty comes from; pass difficulty=(low, "
                                     "high) too, the range of mean rewards to keep.")
        self._unscored_reward = None if unscored_reward is None else float(unscored_reward)
        # In catalog mode the key also goes to the environment as its conventional `api_key` secret, unless the
        # caller chose the secrets.
        resolved = resolve_target(target, api_key=api_key)
        effective = dict(secrets) if secrets is not None else platform_key_secret(resolved)
        self._client = AsyncClient(target, env_name=env_name, api_key=api_key, secrets=effective or None,
                                   timeouts=timeouts, retry=retry, keepalive_interval=keepalive_interval,
                                   max_sessions=max_sessions, max_session_rate=max_session_rate, toolset=toolset,
                                   toolset_fallback=toolset_fallback, env_overrides=env_overrides)
        self._runtime = EnvironmentRuntime(self._client, None, options, _writer(episode_log))
        #: Task sampling (`ors_trl.tasks.sampling`): draws the stream's tasks, hears the runtime's training episodes.
        self.curriculum = None if sampler is None else Curriculum(sampler, self._runtime)
        self._known: dict[int, Difficulty] | PlatformDifficulty | None = None
        if self._difficulty is not None:
            if difficulty_from is None or difficulty_from == "platform":
                difficulty_from = PlatformDifficulty()
            if isinstance(difficulty_from, PlatformDifficulty):
                if resolved.kind != "catalog":
                    raise ConfigurationError(
                        f"{self.name} is a self-hosted server, which serves no task difficulty (only openreward.ai "
                        "catalog environments do); pass difficulty_from= an `ors-trl eval --repeats N --output` file, "
                        "an episode log, or a {task_index: mean reward} mapping.")
                self._known = difficulty_from
            else:
                self._known = known_rewards(difficulty_from, split=split, environment=self.name)
        if upload_rollouts:
            from .protocol.upload import RolloutUploader
            from .trl.backend import training_info

            rt = self._runtime
            rt.uploads = RolloutUploader(
                api_key=api_key if resolved.kind == "catalog" else None,
                run_name=upload_rollouts if isinstance(upload_rollouts, str) else None,
                run_info=lambda: training_info(rt.trainer),
                step=lambda: getattr(getattr(rt.trainer, "state", None), "global_step", None))
        self.dataset_notes: list[str] = []
        self._selection: tuple[list[int], list[Any]] | None = None

    def __repr__(self) -> str:
        return f"OpenRewardSpec({self.target!r}, split={self.split!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        tools = self._tools if "_tools" in self.__dict__ else None
        rt = self._runtime
        log = str(rt.recorder.path) if rt.recorder is not None else None
        own_log = self._options["episode_log"]
        joined = (rt.given_name, log) if rt.given_name is not None or log != (own_log and str(Path(own_log))) else None
        return _restore, (self._options, tools, joined)

    target = property(lambda self: self._client.target.name, doc="The catalog name or server URL given.")
    split = property(lambda self: self._options["split"], doc="The split the tasks are drawn from.")
    name = property(lambda self: self._client.env_label,
                    doc="A short name for logs, metrics and records: the environment's (`AsyncClient.env_label`).")
    client = property(lambda self: self._client,
                      doc="The async client (bound to the background loop; drive it with `spec.run(...)`).")
    metrics = property(lambda self: self._runtime.metrics,
                       doc="What the environment did, accumulated since the last flush (`EnvMetrics`).")
    runtime = property(lambda self: self._runtime, doc="What this spec's episodes share (client, bound tools, metrics, "
                       "record writer, live episodes): what a mix combines and the engine drives.")
    score_groups = property(lambda self: bool(self._options["score_groups"]),
                            doc="True when the spec was asked for group scores (`score_groups=True`).")
    gather_window = property(lambda self: self._options["gather_window"],
                             doc="The engine's gather window this spec asks for (None: automatic).")
    _parts = property(lambda self: {None: self})

    def run(self, coro: Any) -> Any:
        """Run a coroutine using this spec's client on the background loop and return its result.

        Args:
            coro (`Coroutine`):
                The coroutine (e.g. `spec.client.tasks("train")`).
        """
        return get_loop().run(coro)

    async def select_tasks(self) -> tuple[list[int], list[Any]]:
        """The selected task indices and their task specs (`{}` for each when `include_metadata=False`), asked of
        the server once (difficulty data included) and kept."""
        if self._selection is None:
            self._selection = await self._select()
        return self._selection

    async def _select(self) -> tuple[list[int], list[Any]]:
        total = await self._client.num_tasks(self.split)
        indices = select(total, self.split, self._options["num_tasks"], self._indices, name=self.name)
        if self._difficulty is not None:
            known, where = self._known, str(self._options["difficulty_from"])
            if isinstance(known, PlatformDifficulty):
                known, where = await platform_known(self._client, self.split, known)
            assert known is not None
            indices = select_by_difficulty(indices, known, *self._difficulty, name=self.name, source=where)
        if not self._options["include_metadata"]:
            return indices, [{} for _ in indices]
        by_index = await fetch_tasks(self._client, self.split, indices, name=self.name)
        return indices, [by_index[i] for i in indices]

    def dataset_rows(self, indices: list[int], env: str | None = None) -> dict[str, list[Any]]:
        """The `prompt` (an empty user message carrying the task's identity) and `task_index` columns of these tasks.

        Args:
            indices (`list[int]`):
                The task indices.
            env (`str`, *optional*):
                The environment's name in a mix.
        """
        return {
            "prompt": [[{"role": "user", "content": "", TASK_KEY: Task(self.split, i, env=env).identity()}]
                       for i in indices],
            "task_index": list(indices),
        }

    @cached_property
    def train_dataset(self) -> Dataset | IterableDataset:
        """The selected tasks as TRL's `train_dataset` (built on first access): a `datasets.Dataset`, one row per task,
        or with `task_sampling` an endless `datasets.IterableDataset`. Columns: `prompt` (an empty user message TRL
        appends the environment's prompt to), `task_index`, and with `include_metadata` every task field."""
        dataset, self.dataset_notes = _train_dataset({None: self}, self.name)
        return dataset

    async def _discover(self) -> tuple[list[ToolSpec], TerminalTool | None, bool, tuple[str, ...] | None]:
        """Shared tools plus the task-specific ones of the probe tasks, and what the server supports."""
        client = self._client
        listed = await client.tools()
        features = (listed.supports_score_group, listed.message_block_types)
        merged: dict[str, ToolSpec] = {t.name: t for t in listed.tools}
        terminal = listed.terminal_tool
        if not self._options["discover_task_tools"] and self._options["toolset"] is None:  # a toolset's tools show
            return list(merged.values()), terminal, *features  # only in a session
        try:
            total = await client.num_tasks(self.split)
        except (BadRequestError, NotFoundError):
            raise  # a wrong split or environment is the user's to fix, now, not a degraded tool set
        except ORSError as exc:
            logger.warning("%s: num_tasks failed (%s); binding shared tools only.", self.name, exc)
            return list(merged.values()), terminal, *features
        if self._indices is not None:
            check_in_range(self._indices, total, self.split)
        only = self._options["task_tools_discovery_index"]
        wanted = [only] if only is not None else sorted(set(self._indices)) if self._indices is not None else [0]
        probes = [i for i in wanted if 0 <= i < total]
        dropped = sorted(set(wanted) - set(probes))
        if dropped:
            logger.warning("%s: tool discovery indices %s are out of range (split %r has %d tasks); ignored.",
                           self.name, dropped, self.split, total)
        probes = await self._distinct_tasks(probes)
        gate = asyncio.Semaphore(PROBE_CONCURRENCY)

        async def probe(index: int) -> Any:
            async with gate:
                session = await client.open_session(split=self.split, index=index)
                try:
                    return await session.tools()
                finally:
                    await session.close()

        results = await asyncio.gather(*(probe(i) for i in probes), return_exceptions=True)
        shared = set(merged)
        for index, result in zip(probes, results, strict=True):
            if isinstance(result, BaseException):
                if not isinstance(result, Exception) or isinstance(result, ConfigurationError):
                    raise result  # a refused toolset or env override: the user's to fix, now
                logger.warning("%s: tool discovery for task %d failed (%s); skipping it.", self.name, index, result)
                continue
            terminal = terminal or result.terminal_tool
            for spec in result.tools:
                known = merged.setdefault(spec.name, spec)
                if known != spec and spec.name not in shared:
                    logger.warning("%s: tool %r has different schemas in different tasks; keeping the first.",
                                   self.name, spec.name)
        if probes and all(isinstance(r, BaseException) for r in results):
            logger.warning("%s: every tool discovery session failed; binding shared tools only.", self.name)
        return list(merged.values()), terminal, *features

    async def _distinct_tasks(self, indices: list[int]) -> list[int]:
        """One index per distinct task among `indices` (tasks with equal specs advertise the same task tools)."""
        if len(indices) < 2:
            return indices
        try:
            specs = await fetch_tasks(self._client, self.split, indices, name=self.name, progress=self._progress)
        except ORSError as exc:
            logger.warning("%s: could not fetch the tasks to probe (%s); probing every index.", self.name, exc)
            return indices
        first: dict[str, int] = {}
        for index in indices:
            first.setdefault(json.dumps(specs.get(index), sort_keys=True, default=str), index)
        return list(first.values())

    @cached_property
    def _tools(self) -> tuple[list[ToolSpec], TerminalTool | None, bool, tuple[str, ...] | None]:
        tools = self.run(self._discover())
        self._set_tools(*tools)
        return tools

    def _set_tools(self, specs: list[ToolSpec], terminal: TerminalTool | None, score_group: bool,
                   block_types: tuple[str, ...] | None) -> None:
        rt = self._runtime
        self.__dict__["_tools"] = (specs, terminal, score_group, block_types)
        rt.supports_score_group, rt.block_types = score_group, block_types
        rt.uses_messages = block_types is not None  # an older server (no message_block_types) has no /messages
        rt.toolset = Toolset(specs, terminal=terminal, asynchronous=self._options["async_tools"], module=__name__,
                             qualname_prefix=f"OpenRewardEnvironment_{_slug(self.name)}", reserved=ADAPTER_NAMES)

    tool_specs = property(lambda self: self._tools[0],
                          doc="The tools the adapter binds (shared plus discovered task-specific ones).")
    terminal_tool = property(lambda self: self._tools[1], doc="The environment's `@terminal` tool (hidden from the "
                             "model, called with its final message), if any.")

    @property
    def binding(self) -> Any:
        """What binding did: the functions, their names, and every warning (`BindingResult`)."""
        _ = self._tools
        assert self._runtime.toolset is not None
        return self._runtime.toolset.binding

    @cached_property
    def environment_factory(self) -> Callable[[], OpenRewardEnvironment]:
        """A zero-argument callable returning a fresh adapter per rollout (TRL's `environment_factory`): the adapter
        class itself, generated for this environment, one method per tool."""
        _ = self._tools
        toolset = self._runtime.toolset
        assert toolset is not None
        name = f"OpenRewardEnvironment_{_slug(self.name)}"
        cls = _AdapterClass(name, (OpenRewardEnvironment,), {"_runtime": self._runtime, "_spec": self,
                                                              "__module__": __name__})
        if self._runtime.options["credit"] == "turn":
            install_credit()
        return toolset.install(cls)

    def eval_callback(self, tasks: int | Sequence[int] | None = None, *, split: str = "test", every: int = 50,
                      repeats: int = 1, at_start: bool = True) -> Any:
        """A trainer callback evaluating held-out tasks during training with the model being trained: every `every`
        steps (and before the first), `repeats` episodes per task through the rollout engine with the trainer's own
        generation and turn rules. `eval/<env>/pass@k`, pass@1's 95% interval and the episode metrics go to
        `log_history`; the episodes to `episode_log` (`source: "eval"`). Needs the engine's verified TRL.

        Args:
            tasks (`int` or `Sequence[int]`, *optional*):
                The first `tasks` tasks of `split`, or exactly these indices; default: the whole split.
            split (`str`, *optional*, defaults to `"test"`):
                The held-out split.
            every (`int`, *optional*, defaults to `50`):
                Evaluate when the global step is a multiple of it.
            repeats (`int`, *optional*, defaults to `1`):
                Episodes per task and evaluation (sampled with the trainer's generation settings).
            at_start (`bool`, *optional*, defaults to `True`):
                Also evaluate before the first step.

        Returns:
            `EvalCallback`: For `GRPOTrainer(callbacks=[...])`.
        """
        from .trl.callbacks import EvalCallback

        _trl.require_engine("spec.eval_callback")
        _check(1, every=every, repeats=repeats)
        count, chosen = (tasks, None) if tasks is None or isinstance(tasks, int) else (None, list(tasks))
        held = OpenRewardSpec(**{**self._options, "split": split, "num_tasks": count, "indices": chosen,
                                 "episode_log": None, "upload_rollouts": False, "include_metadata": False,
                                 "task_sampling": "uniform", "difficulty": None, "difficulty_from": None})
        held._set_tools(*self._tools)  # the tools training binds
        rt = held.runtime
        rt.rename(self._runtime.given_name, rt.metrics, self._runtime.recorder)  # its own metrics, the training's log
        rt.uploads = self._runtime.uploads
        indices, _ = held.run(held.select_tasks())
        return EvalCallback(held, held.dataset_rows(indices)["prompt"], every=every, repeats=repeats, at_start=at_start)

    def evaluate(self, policy: Any, options: EvalOptions | None = None, *, _others: Sequence[str] = (),
                 **kwargs: Any) -> EvalReport:
        """Run `policy` over this spec's tasks through the same client, tool binding and episode core as training;
        the `EvalReport` says what it did (`report.episodes`: every record).

        Args:
            policy (`str`, `os.PathLike`, `tuple[Any, Any]` or `Policy`):
                A local model directory, a `(model, tokenizer)` pair, an `OpenAIPolicy`, a generator, or a `Policy`.
            options (`EvalOptions`, *optional*):
                How to run; `**kwargs` set its fields. By default the spec's task selection, `episode_timeout` and
                `success_threshold`.
        """
        from .evaluation.runner import EvalOptions, evaluate

        opts = EvalOptions.of(options, **kwargs)
        if opts.num_tasks is None and opts.indices is None:
            opts.num_tasks, opts.indices = self._options["num_tasks"], self._indices
        for key in ("episode_timeout", "success_threshold"):
            if getattr(opts, key) is None:
                setattr(opts, key, self._options[key])
        self._progress = opts.progress
        _ = self._tools  # bind as training does
        return evaluate(self._runtime, policy, opts, others=_others)
