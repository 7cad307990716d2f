"""What the environment did, measured once: `EpisodeStats` is the one tally of episodes (one definition of success: a
reward at or above `success_threshold`; tool-call health, which fails silently); `EnvMetrics.flush()` turns the
events since the last flush into scalars named `env/<name>/<metric>` (and `env/<metric>` over all environments).
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, get_args

from .records import Unscored

__all__ = ["DEFAULT_SUCCESS_THRESHOLD", "FAILURE_KINDS", "UNSCORED_REASONS", "EnvMetrics", "EpisodeStats",
           "tool_health"]

logger = logging.getLogger("ors_trl")

#: Failure reasons counted separately (anything else is counted as "failed").
FAILURE_KINDS = ("refused", "failed", "expired", "transport", "timeout", "protocol")
#: Why an episode has no reward (see `Episode.unscored`), each counted as `unscored/<reason>`.
UNSCORED_REASONS: tuple[str, ...] = get_args(Unscored)
#: An episode succeeded when its reward is at least this (a binary environment's 1.0).
DEFAULT_SUCCESS_THRESHOLD = 1.0
#: The share of a step's episodes without a tool call that is warned about once it was below it.
NO_CALL_WARNING = 0.5
#: The refusal reason of a call whose arguments are malformed (not an object, or not the tool's schema).
MALFORMED = "input_validation"


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def tool_health(turns: Any) -> tuple[int, int]:
    """Of a record's turns: how many held unparsed tool-call markup, and how many calls had malformed arguments."""
    unparsed = malformed = 0
    for turn in turns if isinstance(turns, list) else ():
        if isinstance(turn, dict):
            unparsed += turn.get("unparsed") is True
            calls = turn.get("tool_calls")
            malformed += sum(1 for c in calls if isinstance(c, dict) and isinstance(c.get("error"), dict)
                             and c["error"].get("reason") == MALFORMED) if isinstance(calls, list) else 0
    return unparsed, malformed


@dataclass(slots=True)
class EpisodeStats:
    """Counts over a set of episodes (success: a reward at or above `success_threshold`) and, live, what their opens,
    calls and groups did: one tally, for `EnvMetrics`' windows and for reports over records."""

    success_threshold: float = DEFAULT_SUCCESS_THRESHOLD
    episodes: int = 0
    scored: int = 0
    reward_sum: float = 0.0
    successes: int = 0
    finished: int = 0
    tool_calls: int = 0
    tool_failures: int = 0
    turns: int = 0
    group_scored: int = 0
    group_reward_sum: float = 0.0
    no_calls: int = 0
    unopened: int = 0
    unparsed_turns: int = 0
    malformed_calls: int = 0
    sessions: int = 0
    session_seconds: float = 0.0
    session_seconds_unscored: float = 0.0
    end_reasons: Counter[str] = field(default_factory=Counter)
    unscored: Counter[str] = field(default_factory=Counter)
    open_latency: list[float] = field(default_factory=list)
    opens: int = 0
    open_failures: int = 0
    call_latency: list[float] = field(default_factory=list)
    calls: int = 0  # tool calls sent or refused (`tool_calls` counts the episodes' own)
    terminal_latency: list[float] = field(default_factory=list)
    terminal_calls: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    groups: int = 0
    group_failures: int = 0
    retries: int = 0  # episodes replayed on a fresh session after a failure (`episode_retries`)
    dropped_groups: int = 0  # GRPO groups trained on none of their episodes (`failed_groups="drop"`)
    tokens: Counter[str] = field(default_factory=Counter)  # generated, masked, rows, inexact (token fidelity)

    def add_record(self, record: Mapping[str, Any], *, sessions: bool = True) -> None:
        """Count one episode record (any version; malformed fields count as absent); `sessions`: its session-seconds
        too (a live episode's are counted as they are spent)."""
        def count(key: str) -> int:
            value = _number(record.get(key))
            return int(value) if value is not None and value >= 0 else 0

        turns = record.get("turns") if isinstance(record.get("turns"), list) else []
        reward, calls, timings = _number(record.get("reward")), count("tool_calls"), record.get("timings")
        session = _number(timings.get("session")) if sessions and isinstance(timings, dict) else None
        if session is not None and session >= 0:
            self.sessions += 1
            self.session_seconds += session
            self.session_seconds_unscored += session if reward is None else 0.0
        opened = record.get("prompt", "") is not None  # no prompt: the episode never opened
        unparsed, malformed = tool_health(turns)
        self.episodes += 1
        self.finished += record.get("finished") is True
        self.tool_calls += calls
        self.tool_failures += count("tool_failures")
        self.turns += len(turns)
        self.unopened += not opened
        self.no_calls += opened and calls == 0
        self.unparsed_turns += unparsed
        self.malformed_calls += malformed
        if (end := record.get("end_reason")) is not None:
            self.end_reasons[str(end)] += 1
        if reward is not None:
            self.scored += 1
            self.reward_sum += reward
            self.successes += reward >= self.success_threshold
        else:
            unscored = record.get("unscored")
            self.unscored[unscored if isinstance(unscored, str) and unscored else "no_reward"] += 1
        if (group := _number(record.get("group_reward"))) is not None:
            self.group_scored += 1
            self.group_reward_sum += group

    def merge(self, other: EpisodeStats) -> None:
        """Add `other`'s counts, latency samples and Counters (the same success threshold is assumed)."""
        for f in fields(self):
            if f.name != "success_threshold":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @property
    def mean_reward(self) -> float | None:
        """Mean reward over the scored episodes (None: none was)."""
        return self.reward_sum / self.scored if self.scored else None

    @property
    def mean_group_reward(self) -> float | None:
        return self.group_reward_sum / self.group_scored if self.group_scored else None

    def share(self, n: float) -> float:
        """`n` per episode (0.0 for no episodes)."""
        return n / self.episodes if self.episodes else 0.0

    @property
    def coverage(self) -> float:
        """Grading coverage: the share of episodes the environment scored."""
        return self.share(self.scored)

    @property
    def success_rate(self) -> float:
        """The share of episodes that succeeded (unscored ones count as failures)."""
        return self.share(self.successes)

    @property
    def no_call_rate(self) -> float:
        """The share of the opened episodes (the model saw them) in which the model made no tool call."""
        opened = self.episodes - self.unopened
        return self.no_calls / opened if opened > 0 else 0.0

    @property
    def unparsed_rate(self) -> float:
        """The share of model turns whose tool-call markup parsed to no call (the parser's failures)."""
        return self.unparsed_turns / self.turns if self.turns else 0.0


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


class EnvMetrics:
    """Thread-safe accumulator of what the environments did, one per spec or mix (`spec.metrics`); `flush()` turns it
    into the `env/...` metrics TRL logs.

    Args:
        success_threshold (`float`, *optional*, defaults to `DEFAULT_SUCCESS_THRESHOLD`):
            The reward at or above which an episode counts as a success (`success_rate`).
        no_call_warning (`float`, *optional*, defaults to `NO_CALL_WARNING`):
            The share of a step's opened episodes without a tool call that is warned about (once it was below).
    """

    #: Bound on stored latency samples per window, so a huge step cannot grow memory without limit.
    MAX_SAMPLES = 100_000

    def __init__(self, success_threshold: float = DEFAULT_SUCCESS_THRESHOLD,
                 no_call_warning: float = NO_CALL_WARNING) -> None:
        self.success_threshold = success_threshold
        self.no_call_warning = no_call_warning
        self._calling: set[str] = set()  # environments whose last step was below the warning share
        self._lock = threading.Lock()
        self._window = functools.partial(EpisodeStats, success_threshold)
        self._windows: dict[str, EpisodeStats] = defaultdict(self._window)
        self._gauges: dict[int, tuple[Callable[[], str], Callable[[], int]]] = {}  # owner -> (its name, the gauge)

    def _set_open_sessions_gauge(self, owner: int, name: Callable[[], str], gauge: Callable[[], int]) -> None:
        """Report `gauge()` as `env/<name()>/sessions_open` at every flush (the name read then)."""
        self._gauges[owner] = (name, gauge)

    def _count(self, env: str, latency: str | None = None, seconds: float | None = None, failure: str | None = None,
               **counts: int) -> None:
        """Add `counts` to `env`'s counts of those names, `seconds` to its `latency` samples (None: no sample) and a
        failure of the `ORSError.kind` `failure`: how each event (an open, a call, a retry, a group) is counted."""
        with self._lock:
            w = self._windows[env]
            for name, n in counts.items():
                setattr(w, name, getattr(w, name) + n)
            samples = getattr(w, latency) if latency is not None else None
            if samples is not None and seconds is not None and len(samples) < self.MAX_SAMPLES:
                samples.append(seconds)
            if failure is not None:
                w.failures[failure if failure in FAILURE_KINDS else "failed"] += 1

    def _record_episode(self, env: str, record: Mapping[str, Any]) -> None:
        """One finished episode (`Episode.record()`): its counts and token fidelity; its session-seconds were counted
        as they were spent (`_record_session`)."""
        tokens = record.get("tokens")
        with self._lock:
            w = self._windows[env]
            w.add_record(record, sessions=False)
            if tokens:
                w.tokens.update({k: int(tokens.get(k) or 0) for k in ("generated", "masked", "rows")})
                w.tokens["inexact"] += tokens.get("exact") is False

    def _record_session(self, env: str, seconds: float, *, unscored: bool) -> None:
        """Seconds an episode's session spent on the server since the last count."""
        self._count(env, session_seconds=seconds, session_seconds_unscored=seconds if unscored else 0.0)

    def _absorb(self, other: EnvMetrics) -> None:
        """Move what `other` accumulated into these (counts kept apart until they turned out to belong here)."""
        for env, window in other._snapshot(reset=True).items():
            with self._lock:
                self._windows[env].merge(window)

    def _snapshot(self, *, reset: bool) -> dict[str, EpisodeStats]:
        """What accumulated since the last reset, by environment (`reset`: start a new window)."""
        with self._lock:
            windows = dict(self._windows)
            if reset:
                self._windows = defaultdict(self._window)
        return windows

    def flush(self) -> dict[str, float]:
        """The metrics since the last flush (environments without activity omitted), then start a new window; warn
        once the share of a step's episodes without a tool call crosses `no_call_warning` from below."""
        windows = self._snapshot(reset=True)
        self._watch(windows)
        out: dict[str, float] = {}
        total = self._window()
        for env, w in sorted(windows.items()):
            out.update(stats_metrics(f"env/{env}/", w))
            total.merge(w)
        if len(windows) > 1:
            out.update(stats_metrics("env/", total))
        for name, gauge in list(self._gauges.values()):
            try:
                out[f"env/{name()}/sessions_open"] = float(gauge())
            except Exception:  # a gauge must never break logging
                continue
        return out

    def _watch(self, windows: dict[str, EpisodeStats]) -> None:
        for env, s in sorted(windows.items()):
            if not s.episodes:
                continue
            if s.no_call_rate < self.no_call_warning:
                self._calling.add(env)
            elif env in self._calling:
                self._calling.discard(env)
                logger.warning(
                    "%s: %.0f%% of this step's %d episode(s) made no tool call (it was under %.0f%% before); %d of "
                    "%d model turn(s) held tool-call markup that parsed to no call, %d call(s) had malformed "
                    "arguments. The model may have stopped calling tools, or its calls no longer parse.", env,
                    100 * s.no_call_rate, s.episodes, 100 * self.no_call_warning, s.unparsed_turns, s.turns,
                    s.malformed_calls)


def stats_metrics(prefix: str, s: EpisodeStats) -> dict[str, float]:
    """The metrics of `s` (reward, grading, success, tool calls and their health, and what was live) as
    `prefix<metric>`."""
    out: dict[str, float] = {}
    if s.episodes:
        out.update(episodes=float(s.episodes), reward_mean=s.mean_reward if s.mean_reward is not None else math.nan,
                   graded_fraction=s.coverage, success_rate=s.success_rate, finished_fraction=s.share(s.finished),
                   tool_calls_per_episode=s.share(s.tool_calls), no_tool_call_fraction=s.no_call_rate,
                   unparsed_turn_fraction=s.unparsed_rate, malformed_calls=float(s.malformed_calls))
        out.update({f"unscored/{reason}": float(s.unscored.get(reason, 0)) for reason in UNSCORED_REASONS})
        if s.unscored.get("timeout"):
            out["timed_out_fraction"] = s.share(s.unscored["timeout"])
    if s.groups:
        out.update(groups_scored=float(s.groups - s.group_failures), group_failures=float(s.group_failures))
    if s.retries or s.dropped_groups:
        out.update(episode_retries=float(s.retries), dropped_groups=float(s.dropped_groups))
    if (t := s.tokens)["generated"]:
        out.update({"tokens/generated": float(t["generated"]), "tokens/masked_fraction": t["masked"] / t["generated"],
                    "tokens/rows_per_episode": t["rows"] / max(s.episodes, 1), "tokens/inexact_episodes": float(
                        t["inexact"])})
    if s.calls:
        out["tool_calls"] = float(s.calls)
    if s.terminal_calls:
        out["terminal_calls"] = float(s.terminal_calls)
    if s.calls or s.terminal_calls or s.failures:
        out.update({f"failures/{kind}": float(s.failures.get(kind, 0)) for kind in FAILURE_KINDS})
    if s.opens:
        out["sessions_opened"] = float(s.opens)
    if s.session_seconds:
        out.update(session_seconds=s.session_seconds, session_seconds_unscored=s.session_seconds_unscored)
    if s.open_failures:
        out["session_open_failures"] = float(s.open_failures)
    for name, latency in (("session_open_s", s.open_latency), ("tool_call_s", s.call_latency),
                          ("terminal_call_s", s.terminal_latency)):
        if latency:
            out.update({f"{name}/p50": _percentile(latency, 0.5), f"{name}/p95": _percentile(latency, 0.95)})
    return {prefix + name: value for name, value in out.items()}
