"""Evaluate a policy against an ORS environment: the episode core (`play`, training's turn rule) driven by a policy
instead of a trainer (`OpenRewardSpec.evaluate`, `OpenRewardMix.evaluate`, `ors-trl eval`). Each finished episode is
flushed to `output` at once (`resume=True` runs only the missing ones); every session is closed, also on Ctrl-C.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core import episode as _episode
from ..core.episode import EnvironmentRuntime, Episode, Rules, Task
from ..core.metrics import DEFAULT_SUCCESS_THRESHOLD, NO_CALL_WARNING
from ..core.records import RecordWriter, read_records
from ..core.rollout import play_task
from ..core.stats import by_task, pass_at_k, task_label
from ..protocol.errors import ConfigurationError, ORSError, PolicyError, unknown_keywords
from ..protocol.loop import get_loop
from ..protocol.text import escape_controls, one_line
from ..tasks.selection import check_selection, select
from ..trl import backend as _trl
from ..trl.tokens import fidelity
from .policies import as_generator, describe_policy, resolve_policy

__all__ = ["EvalOptions", "EvalReport", "MixEvalReport", "evaluate", "load_episodes"]

logger = logging.getLogger("ors_trl.eval")

#: How long Ctrl-C waits for the running episodes to close their sessions.
_CLEANUP_WAIT_S = 30.0
EpisodeKey = tuple[str, int, int]


def _key(record: dict[str, Any]) -> EpisodeKey | None:
    try:
        return (str(record["split"]), int(record["task_index"]), int(record.get("repeat") or 0))
    except (KeyError, TypeError, ValueError):
        return None


def failed(record: dict[str, Any]) -> bool:
    """An episode that failed (its session, or the policy): counted in `num_errors`, run again by `resume`."""
    return "error" in (record.get("end_reason"), record.get("unscored"))


def load_episodes(path: str | os.PathLike[str], environments: Collection[str] | None = None
                  ) -> dict[EpisodeKey, dict[str, Any]]:
    """An episodes file as `{(split, task_index, repeat): record}`, the last record of each key winning; only the
    records of `environments` (their names) when given."""
    return {key: record for record in read_records(path) if (key := _key(record)) is not None
            and (environments is None or record.get("environment") in environments)}


_COUNT = {"at least": 1}  # the metadata of a count option


@dataclass
class EvalOptions:
    """How an evaluation runs, documented once: `OpenRewardSpec.evaluate`, `OpenRewardMix.evaluate` and `ors-trl eval`
    take these as keywords or one `EvalOptions`.

    Attributes:
        num_tasks (`int`, *optional*):
            The first `num_tasks` tasks of the split (with no `indices` either: the spec's own selection).
        indices (`Sequence[int]`, *optional*):
            Exactly these task indices, instead of `num_tasks`.
        repeats (`int`, *optional*, defaults to `1`):
            Episodes per task, told apart by their repeat index (pass@k for k = 1..`repeats`).
        concurrency (`int`, *optional*, defaults to `8`):
            Episodes (and so sessions) running at once.
        max_turns (`int`, *optional*, defaults to `10`):
            Policy replies per episode; the calls of the last are not run (TRL's `max_tool_calling_iterations + 1`).
        episode_timeout (`float`, *optional*):
            Seconds one episode may take (default: the spec's); past it the episode ends `timeout`, scored `None`.
        output (`str` or `os.PathLike`, *optional*):
            JSON-lines file receiving every finished episode at once.
        resume (`bool`, *optional*, defaults to `False`):
            Run only the episodes `output` lacks (those that ended in an error are rerun).
        overwrite (`bool`, *optional*, defaults to `False`):
            Replace an existing non-empty `output` (without `resume`, an existing file is an error).
        per_task_tools (`bool`, *optional*, defaults to `False`):
            Bind each episode's own tool list (`/task_tools` of its session) instead of the spec's tools.
        score_groups (`bool`, *optional*, defaults to `False`):
            Also score each task's episodes (its repeats) together with `/score_group`.
        flatten_prompt (`bool`, *optional*, defaults to `False`):
            Prompt as TRL's `environment_factory` loop does (one user message): for a model trained through it.
        success_threshold (`float`, *optional*):
            An episode succeeded when its reward is at least this (default: the spec's).
        upload (`bool` or `str`, *optional*, defaults to `False`):
            Send every episode to the OpenReward rollout viewer (`True`, or the run's name there; key as for specs).
        temperature (`float`, *optional*, defaults to `0.0`):
            Sampling temperature of a policy given as a path or pair (0: greedy).
        max_new_tokens (`int`, *optional*):
            Tokens per turn of a policy given as a path or pair (default: `LocalPolicy`'s).
        seed (`int`, *optional*, defaults to `0`):
            Generation seed of a policy given as a path or pair.
        device (`str`, *optional*):
            Where a policy given as a path runs (default: `"cuda"` when available, else `"cpu"`).
        progress (`bool`, *optional*, defaults to `True`):
            Show a progress bar on stderr.
        harness (`ors_trl.harness.Harness`, *optional*):
            Play each episode with this agent harness (its own loop, the policy behind its model endpoint).
    """

    num_tasks: int | None = None
    indices: Sequence[int] | None = None
    repeats: int = field(default=1, metadata=_COUNT)
    concurrency: int = field(default=8, metadata=_COUNT)
    max_turns: int = field(default=10, metadata=_COUNT)
    episode_timeout: float | None = None
    output: str | os.PathLike[str] | None = None
    resume: bool = False
    overwrite: bool = False
    per_task_tools: bool = False
    score_groups: bool = False
    flatten_prompt: bool = False
    success_threshold: float | None = None
    upload: bool | str = False
    temperature: float = 0.0
    max_new_tokens: int | None = None
    seed: int | None = 0
    device: str | None = None
    progress: bool = True
    harness: Any = None

    @classmethod
    def of(cls, options: EvalOptions | None = None, **kwargs: Any) -> EvalOptions:
        """`options` (or the defaults) with `kwargs` set; an unknown name is an `UnknownKeywordError` (a
        `ConfigurationError`)."""
        if error := unknown_keywords("evaluation options", kwargs, [f.name for f in dataclasses.fields(cls)]):
            raise error
        return dataclasses.replace(options or cls(), **kwargs)

    def check(self) -> None:
        """Raise a `ConfigurationError` for options that cannot work together."""
        self.indices = check_selection(self.num_tasks, self.indices)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.metadata is _COUNT and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigurationError(f"{f.name} must be an int >= 1, got {value!r}")
        if self.episode_timeout is not None and not self.episode_timeout > 0:  # also refuses NaN
            raise ConfigurationError(f"episode_timeout must be positive seconds or None, got {self.episode_timeout!r}")
        out = self.path
        if self.resume and out is None:
            raise ConfigurationError("resume=True needs output= (the episodes file to continue)")
        if out is not None and not self.resume and not self.overwrite and out.exists() and out.stat().st_size > 0:
            raise ConfigurationError(f"{out} already exists; pass resume=True to continue it or overwrite=True to "
                                     "replace it")

    path = property(lambda self: Path(self.output) if self.output is not None else None, doc="`output` as a `Path`.")


def check_support(runtime: EnvironmentRuntime, opts: EvalOptions) -> None:
    """Raise a `ConfigurationError` for options `runtime`'s environment cannot run (a mix checks all before any plays)."""
    if opts.score_groups and not runtime.supports_score_group:
        raise ConfigurationError(f"{runtime.name} does not support group scoring (its /tools does not say "
                                 "supports_score_group: true)")


def evaluate(runtime: EnvironmentRuntime, policy: Any, opts: EvalOptions, others: Collection[str] = ()) -> EvalReport:
    """Run `policy` (see `OpenRewardSpec.evaluate`) over tasks of `runtime` and report what it did; `others`:
    environments whose episodes `output` also holds (a mix's), left alone."""
    opts.check()
    check_support(runtime, opts)
    out_path, started = opts.path, time.monotonic()
    bg, client, split = get_loop(), runtime.client, runtime.options["split"]
    environment = bg.run(client.environment())  # resolved: the runtime's name is the environment's from here
    selected = list(dict.fromkeys(select(bg.run(client.num_tasks(split)), split, opts.num_tasks, opts.indices,
                                         warn=False)))
    keys: list[EpisodeKey] = [(split, i, r) for i in selected for r in range(opts.repeats)]
    mine = {runtime.name, environment} - (set(others) - {runtime.name})  # another of the mix's names is not mine
    kept: dict[EpisodeKey, dict[str, Any]] = {}
    if opts.resume and out_path is not None:  # (`check` made sure)
        foreign = {r.get("environment") for r in read_records(out_path)} - mine - set(others)
        if foreign:
            logger.warning("%s holds episodes of other environments (%s); they are not reused", out_path,
                           ", ".join(map(str, foreign)))
        wanted = set(keys)
        kept = {k: r for k, r in load_episodes(out_path, mine).items() if k in wanted and not failed(r)}
    todo = [k for k in keys if k not in kept]

    # the uploader first: a missing key is said before a model is loaded
    uploads = _uploader(opts.upload, lambda: policy_obj, client.target) if opts.upload else None
    policy_obj = resolve_policy(policy, opts)
    writer = RecordWriter(out_path, append=opts.resume) if out_path is not None else None
    bar = None
    if opts.progress and todo:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(keys), initial=len(kept), desc=escape_controls(f"eval {runtime.name}"),
                   unit="ep", file=sys.stderr, dynamic_ncols=True)
    generator, policy_name = as_generator(policy_obj), describe_policy(policy_obj)
    rules = Rules(max_replies=opts.max_turns, error_text=_trl.error_text,
                  tool_markup=getattr(policy_obj, "tool_markup", None))  # a chat template's, an endpoint's
    done: list[Episode] = []
    finished_event, gate = threading.Event(), asyncio.Semaphore(opts.concurrency)
    running = Counter(k[1] for k in todo)  # episodes of each task not done yet: group-scored once they all are

    async def run_one(key: EpisodeKey) -> None:
        async with gate:
            ep = runtime.episode(Task(split, key[1]), source="eval", rules=rules, metrics=False,
                                 writer=None if opts.score_groups else writer, task_tools=opts.per_task_tools,
                                 # group-scored: written and uploaded once scored, below
                                 uploads=(False if opts.score_groups else uploads) if uploads else None,
                                 repeat=key[2], policy=policy_name)
            attempts: list[Episode] = []
            try:
                ep, conversation = await play_task(ep, generator, attempts=attempts, flatten=opts.flatten_prompt,
                                                   timeout=opts.episode_timeout,
                                                   player=opts.harness.play if opts.harness is not None else None)
                ep.tokens = fidelity(conversation)
            except Exception as exc:  # recorded; a bug or an unexpected failure is not fatal for the others either
                if not isinstance(exc, ORSError | PolicyError | TimeoutError):
                    logger.warning("episode %s/%d/%d failed unexpectedly: %s", *key, exc, exc_info=True)
                ep = attempts[-1]
                ep.fail(exc)
            except BaseException:  # interrupted (Ctrl-C): not a result, so not recorded; resume reruns it
                await asyncio.shield(attempts[-1].close(keep=False))
                raise
            await ep.close()
        done.append(ep)
        running[key[1]] -= 1
        if opts.score_groups and not running[key[1]]:  # the task's last: score its group, then flush it at once
            await _episode.score_groups(group := [e for e in done if e.task.index == key[1]])
            for e in group:
                record = e.record()
                if writer is not None:
                    writer.write(record, images=e.images)
                if uploads is not None:
                    uploads.submit(record)
        if bar is not None:
            scored = [e.reward for e in done if e.reward is not None]
            if scored:
                bar.set_postfix(reward=f"{sum(scored) / len(scored):.3f}", refresh=False)
            bar.update(1)

    async def run_all() -> None:
        tasks = [asyncio.ensure_future(run_one(k)) for k in todo]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # every session closed before we return
            aclose = getattr(policy_obj, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
            finished_event.set()

    try:
        bg.run(run_all())
    except BaseException:  # Ctrl-C: `run` cancels the running episodes; wait (bounded) until their sessions are closed
        finished_event.wait(_CLEANUP_WAIT_S)
        raise
    finally:
        if bar is not None:
            bar.close()
        if uploads is not None:
            uploads.close()

    by_key = {**kept, **{(ep.task.split, int(ep.task.index or 0), int(ep.info.get("repeat", 0))): ep.record()
                         for ep in done}}
    threshold = DEFAULT_SUCCESS_THRESHOLD if opts.success_threshold is None else opts.success_threshold
    return EvalReport.from_episodes(
        [by_key[k] for k in keys if k in by_key], success_threshold=threshold, target=client.target.name,
        environment=runtime.name, split=split, policy=policy_name, num_resumed=len(kept),
        seconds=round(time.monotonic() - started, 3), output=os.fspath(out_path) if out_path is not None else None,
        uploads=uploads.counts() if uploads is not None else None)


def _uploader(upload: bool | str, policy: Any, target: Any) -> Any:
    """The uploader of one evaluation (a catalog target's key): the `policy()`'s name and, for a local model, size."""
    from ..protocol.upload import RolloutUploader

    def run_info() -> dict[str, Any]:
        model = getattr(policy(), "model", None)
        size = sum(p.numel() for p in model.parameters()) if callable(getattr(model, "parameters", None)) else None
        return {"model_name": describe_policy(policy()), "model_params": size, "run_type": "eval"}

    return RolloutUploader(api_key=str(target.api_key) if target.kind == "catalog" else None,
                           run_name=upload if isinstance(upload, str) else None, run_info=run_info)


@dataclass
class EvalReport:
    """What an evaluation measured (rates are shares of the episodes unless said otherwise).

    Attributes:
        target (`str`):
            The target evaluated (a catalog name or a server's URL).
        environment (`str` or `None`):
            The environment evaluated on that server, named as in its records and metrics.
        split (`str`):
            The split of its tasks.
        policy (`str`):
            The policy's name.
        num_episodes (`int`):
            Episodes in the report (run now or resumed).
        num_scored (`int`):
            Episodes with a (non-`None`) reward.
        mean_reward (`float` or `None`):
            Mean reward of the scored episodes (`None`: none was scored).
        coverage (`float`):
            `num_scored / num_episodes`.
        finished_rate (`float`):
            Episodes a tool result marked finished.
        tool_calls_per_episode (`float`):
            Mean tool calls per episode.
        tool_failures_per_episode (`float`):
            Mean failed tool calls per episode.
        turns_per_episode (`float`):
            Mean policy replies per episode.
        num_errors (`int`):
            Failed episodes (`"error"` as `unscored` or `end_reason`): those `resume` reruns.
        end_reasons (`dict[str, int]`):
            Episodes per end reason (`no_tool_calls`, `finished`, `max_turns`, `context_length`, `timeout`, `error`).
        num_resumed (`int`):
            Episodes read back from `output` rather than run.
        seconds (`float`):
            Wall time of this run.
        mean_group_reward (`float`, *optional*):
            Mean `/score_group` reward (with `score_groups`).
        success_rate (`float`, *optional*, defaults to `0.0`):
            Episodes whose reward reached `success_threshold` (unscored ones did not).
        success_threshold (`float`, *optional*, defaults to `DEFAULT_SUCCESS_THRESHOLD`):
            The reward of a success.
        pass_at_k (`dict[int, float]`, *optional*, defaults to `{}`):
            Unbiased pass@k over tasks, for k = 1 .. the fewest episodes of a task.
        pass_at_1_interval (`tuple[float, float]`, *optional*):
            95% interval of pass@1 over tasks (Wilson's, the tasks as the sample).
        tasks (`list[dict[str, Any]]`, *optional*, defaults to `[]`):
            Per task: `task`, `episodes`, `successes`, `pass_at_k`.
        no_tool_call_rate (`float`, *optional*, defaults to `0.0`):
            Opened episodes (the model saw them) without a tool call.
        num_unopened (`int`, *optional*, defaults to `0`):
            Episodes that never opened (the environment's failure, in `num_errors`).
        unparsed_turn_rate (`float`, *optional*, defaults to `0.0`):
            Share of replies whose tool-call markup (the policy's `tool_markup`) parsed to no call.
        malformed_calls (`int`, *optional*, defaults to `0`):
            Tool calls refused for malformed arguments.
        sessions_opened (`int`, *optional*, defaults to `0`):
            The episodes' sessions.
        session_seconds (`float`, *optional*, defaults to `0.0`):
            Seconds those sessions lived on the server (what a sandbox platform bills).
        session_seconds_unscored (`float`, *optional*, defaults to `0.0`):
            The part of `session_seconds` spent by unscored episodes.
        episode_retries (`int`, *optional*, defaults to `0`):
            Episodes replayed on a fresh session after infrastructure voided them (`episode_retries=`).
        output (`str`, *optional*):
            The episodes file.
        uploads (`dict[str, int]`, *optional*):
            With `upload`, episodes `sent`, `failed` and `dropped`.
        episodes (`list[dict[str, Any]]`, *optional*, defaults to `[]`):
            Every episode record, in task order.
    """

    target: str
    environment: str | None
    split: str
    policy: str
    num_episodes: int
    num_scored: int
    mean_reward: float | None
    coverage: float
    finished_rate: float
    tool_calls_per_episode: float
    tool_failures_per_episode: float
    turns_per_episode: float
    num_errors: int
    end_reasons: dict[str, int]
    num_resumed: int
    seconds: float
    mean_group_reward: float | None = None
    success_rate: float = 0.0
    success_threshold: float = DEFAULT_SUCCESS_THRESHOLD
    pass_at_k: dict[int, float] = field(default_factory=dict)
    pass_at_1_interval: tuple[float, float] | None = None
    tasks: list[dict[str, Any]] = field(default_factory=list, repr=False)
    no_tool_call_rate: float = 0.0
    num_unopened: int = 0
    unparsed_turn_rate: float = 0.0
    malformed_calls: int = 0
    sessions_opened: int = 0
    session_seconds: float = 0.0
    session_seconds_unscored: float = 0.0
    episode_retries: int = 0
    output: str | None = None
    uploads: dict[str, int] | None = None
    episodes: list[dict[str, Any]] = field(default_factory=list, repr=False)

    @classmethod
    def from_episodes(cls, episodes: list[dict[str, Any]], *, success_threshold: float = DEFAULT_SUCCESS_THRESHOLD,
                      **info: Any) -> EvalReport:
        """The report of episode records (in task order).

        Args:
            episodes (`list[dict[str, Any]]`):
                The episode records.
            success_threshold (`float`, *optional*, defaults to `DEFAULT_SUCCESS_THRESHOLD`):
                The reward of a success.
            **info:
                The other fields (`target`, `environment`, `split`, `policy`, `num_resumed`, `seconds` required).
        """
        stats, tasks, passed, interval = by_task(((task_label(r), r) for r in episodes), success_threshold)
        return cls(
            num_episodes=stats.episodes, num_scored=stats.scored, mean_reward=stats.mean_reward,
            coverage=stats.coverage, finished_rate=stats.share(stats.finished),
            tool_calls_per_episode=stats.share(stats.tool_calls),
            tool_failures_per_episode=stats.share(stats.tool_failures), turns_per_episode=stats.share(stats.turns),
            num_errors=sum(1 for e in episodes if failed(e)), end_reasons=dict(stats.end_reasons),
            mean_group_reward=stats.mean_group_reward, success_rate=stats.success_rate,
            success_threshold=success_threshold, episodes=episodes, pass_at_k=passed, pass_at_1_interval=interval,
            tasks=[{"task": task, "episodes": s.episodes, "successes": s.successes,
                    "pass_at_k": {k: pass_at_k(s.episodes, s.successes, k) for k in range(1, s.episodes + 1)}}
                   for task, s in tasks.items()],
            no_tool_call_rate=stats.no_call_rate, num_unopened=stats.unopened, unparsed_turn_rate=stats.unparsed_rate,
            malformed_calls=stats.malformed_calls, sessions_opened=stats.sessions,
            session_seconds=round(stats.session_seconds, 3),
            session_seconds_unscored=round(stats.session_seconds_unscored, 3),
            episode_retries=sum(int(e.get("replayed") or 0) for e in episodes), **info)

    def to_dict(self, *, episodes: bool = False) -> dict[str, Any]:
        """Every field as JSON-able data.

        Args:
            episodes (`bool`, *optional*, defaults to `False`):
                Include the episode records.
        """
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "episodes"}
        out["end_reasons"] = dict(self.end_reasons)
        if episodes:
            out["episodes"] = list(self.episodes)
        return out

    def summary(self) -> str:
        """A few readable lines, safe to print (the environment's control characters escaped)."""
        reward = "n/a (no episode was scored)" if self.mean_reward is None else f"{self.mean_reward:.4f}"
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.end_reasons.items())) or "-"
        lines = [
            f"Evaluated {self.num_episodes} episode(s) of {one_line(self.environment or self.target)} "
            f"(split {self.split!r}) with {self.policy}",
            f"  mean reward           {reward}" + (f"  (over {self.num_scored} scored)" if self.num_scored else ""),
            f"  success rate          {self.success_rate:.3f}  (reward >= {self.success_threshold:g})",
            *self._pass_lines(),
            f"  grading coverage      {self.coverage:.3f}",
            f"  finished rate         {self.finished_rate:.3f}",
            f"  tool calls / episode  {self.tool_calls_per_episode:.2f}",
            f"  tool failures / ep.   {self.tool_failures_per_episode:.2f}",
            f"  turns / episode       {self.turns_per_episode:.2f}",
            *_health_lines(self),
            f"  errors                {self.num_errors}",
            f"  end reasons           {reasons}",
            *([f"  mean group reward     {self.mean_group_reward:.4f}"] if self.mean_group_reward is not None else []),
            f"  session-seconds       {self.session_seconds:.1f}  ({self.session_seconds_unscored:.1f} unscored, "
            f"{self.sessions_opened} sessions)",
            f"  time                  {self.seconds:.1f} s",
            *(["  uploaded              " + ", ".join(f"{v} {k}" for k, v in self.uploads.items())]
              if self.uploads is not None else []),
            *([f"  resumed               {self.num_resumed} episode(s) from {self.output}"] if self.num_resumed else []),
            *([f"Episodes: {self.output}"] if self.output else []),
        ]
        return escape_controls("\n".join(lines))

    def _pass_lines(self, shown_tasks: int = 20) -> list[str]:
        if not self.pass_at_k:
            return []
        lo, hi = self.pass_at_1_interval or (0.0, 1.0)
        ks = "  ".join(f"pass@{k} {v:.3f}" for k, v in self.pass_at_k.items())
        lines = [f"  pass@k over {len(self.tasks)} task(s)  {ks}",
                 f"                        pass@1 95% interval over tasks [{lo:.3f}, {hi:.3f}]"]
        if len(self.pass_at_k) > 1:  # several episodes per task: each task's own
            for task in self.tasks[:shown_tasks]:
                values = " ".join(f"{v:.2f}" for v in task["pass_at_k"].values())
                lines.append(f"    {one_line(task['task']):<20}  {task['successes']}/{task['episodes']} succeeded"
                             f"  pass@1..{task['episodes']} {values}")
            if len(self.tasks) > shown_tasks:
                lines.append(f"    ... {len(self.tasks) - shown_tasks} more task(s) (--json has every task)")
        return lines


def _health_lines(report: Any) -> list[str]:
    """Tool-call health, and a warning where tool calls seem to fail silently (unopened: the environment's failure)."""
    lines = [f"  no tool call          {report.no_tool_call_rate:.3f} of episodes",
             f"  unparsed tool calls   {report.unparsed_turn_rate:.3f} of turns (tool-call markup that parsed to no "
             "call)",
             f"  malformed arguments   {report.malformed_calls} call(s)"]
    warnings = [f"{report.num_unopened} episode(s) failed to open (the environment's failure: the model never saw "
                "them)"] if report.num_unopened else []
    if report.no_tool_call_rate >= NO_CALL_WARNING:
        warnings.append(f"{report.no_tool_call_rate:.0%} of the episodes made no tool call")
    if report.unparsed_turn_rate > 0:
        warnings.append(f"{report.unparsed_turn_rate:.0%} of the turns wrote tool-call markup the parser did not "
                        "turn into a call")
    return lines + (["  warning: " + "; ".join(warnings)] if warnings else [])


def _weighted(name: str, doc: str) -> property:
    return property(lambda self: self._mean(lambda r: getattr(r, name)) or 0.0, doc=doc)


def _total(name: str, what: str) -> property:
    return property(lambda self: sum(getattr(r, name) for r in self.environments.values()),
                    doc=f"{what}, in every environment.")


@dataclass
class MixEvalReport:
    """What the evaluation of a mix measured (`OpenRewardMix.evaluate`): each environment's `EvalReport` and, as
    properties, the weighted means and totals over them.

    Attributes:
        environments (`dict[str, EvalReport]`):
            The report of each environment, by its name in the mix.
        weights (`dict[str, float]`):
            Each environment's weight, summing to 1: the mix's weights, else its share of the episodes.
    """

    environments: dict[str, EvalReport]
    weights: dict[str, float]

    @classmethod
    def of(cls, reports: Mapping[str, EvalReport], weights: Mapping[str, float] | None = None) -> MixEvalReport:
        """The report of a mix, from its environments' reports.

        Args:
            reports (`Mapping[str, EvalReport]`):
                The report of each environment, by its name in the mix.
            weights (`Mapping[str, float]`, *optional*):
                The mix's weights, normalised (an environment without one weighs 0); default: shares of the episodes.
        """
        raw = dict(weights) if weights else {name: float(r.num_episodes) for name, r in reports.items()}
        total = sum(raw.get(name, 0.0) for name in reports) or 1.0
        return cls(dict(reports), {name: raw.get(name, 0.0) / total for name in reports})

    def _mean(self, pick: Any) -> float | None:
        values = [(self.weights[n], v) for n, r in self.environments.items() if (v := pick(r)) is not None]
        weight = sum(w for w, _ in values)
        return sum(w * v for w, v in values) / weight if weight else None

    mean_reward = property(lambda self: self._mean(lambda r: r.mean_reward),
                           doc="The weighted mean reward over the environments with a scored episode, or `None`.")
    unscored_environments = property(lambda self: [n for n, r in self.environments.items() if r.mean_reward is None],
                                     doc="The environments none of whose episodes was scored: not in `mean_reward`.")
    mean_reward_weight = property(lambda self: sum(self.weights[n] for n, r in self.environments.items()
                                                   if r.mean_reward is not None),
                                  doc="The share of the weight `mean_reward` stands for (1.0: every environment).")
    success_rate = _weighted("success_rate", "The weighted success rate.")
    no_tool_call_rate = _weighted("no_tool_call_rate", "The weighted share of episodes without a tool call.")
    unparsed_turn_rate = _weighted("unparsed_turn_rate", "The weighted share of replies with unparsed tool calls.")
    malformed_calls = _total("malformed_calls", "Tool calls refused for malformed arguments")
    num_episodes = _total("num_episodes", "Episodes")
    num_resumed = _total("num_resumed", "Episodes resumed")
    num_errors = _total("num_errors", "Episodes that failed")
    num_unopened = _total("num_unopened", "Episodes that never opened")
    episodes = property(lambda self: [e for r in self.environments.values() for e in r.episodes],
                        doc="Every episode record, environment by environment.")

    @property
    def pass_at_k(self) -> dict[int, float]:
        """The weighted pass@k, for the k every environment has."""
        ks = set.intersection(*(set(r.pass_at_k) for r in self.environments.values())) if self.environments else set()
        return {k: self._mean(lambda r, k=k: r.pass_at_k[k]) or 0.0 for k in sorted(ks)}

    def to_dict(self, *, episodes: bool = False) -> dict[str, Any]:
        """`{"environments": {...}, "weights": {...}, "overall": {...}}` as JSON-able data.

        Args:
            episodes (`bool`, *optional*, defaults to `False`):
                Include the episode records in each environment's report.
        """
        return {"environments": {n: r.to_dict(episodes=episodes) for n, r in self.environments.items()},
                "weights": dict(self.weights),
                "overall": {name: getattr(self, name) for name in (
                    "mean_reward", "mean_reward_weight", "unscored_environments", "success_rate", "pass_at_k",
                    "no_tool_call_rate", "unparsed_turn_rate", "malformed_calls", "num_episodes", "num_errors",
                    "num_unopened")}}

    def summary(self) -> str:
        """Every environment's summary, then the weighted overall."""
        reward = "n/a" if self.mean_reward is None else f"{self.mean_reward:.4f}"
        if self.unscored_environments and self.mean_reward is not None:
            reward += (f"  (over {self.mean_reward_weight:.3f} of the weight: no episode of "
                       f"{', '.join(map(one_line, self.unscored_environments))} was scored)")
        weights = ", ".join(f"{one_line(n)} {w:.3f}" for n, w in self.weights.items())
        lines = [r.summary() for r in self.environments.values()]
        lines.append("\n".join([
            f"Overall, {len(self.environments)} environments weighted ({weights})",
            f"  mean reward           {reward}",
            f"  success rate          {self.success_rate:.3f}",
            *([f"  pass@k                {'  '.join(f'pass@{k} {v:.3f}' for k, v in self.pass_at_k.items())}"]
              if self.pass_at_k else []),
            *_health_lines(self),
        ]))
        return escape_controls("\n\n".join(lines))
