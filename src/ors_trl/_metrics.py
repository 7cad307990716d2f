"""What the environment did, measured once, per environment: the numbers behind the training logs.

Episodes (`ors_trl._episode`, whatever drives them) record events here: session opens, tool
calls, finished episodes, group scorings. `EnvMetrics.flush()` turns what accumulated since the
last flush into flat scalar metrics named `env/<name>/<metric>` (and `env/<metric>` over all
environments), which the reward functions hand to the trainer's `log_metric`.
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from dataclasses import dataclass, field

__all__ = ["FAILURE_KINDS", "UNSCORED_REASONS", "EnvMetrics"]

#: Failure reasons counted separately (anything else is counted as "failed").
FAILURE_KINDS = ("refused", "failed", "expired", "transport", "timeout", "protocol")
#: Why an episode has no reward (see `Episode.unscored`), each counted as `unscored/<reason>`.
UNSCORED_REASONS = ("no_reward", "cut_off", "error", "timeout")


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def failure_kind(kind: str) -> str:
    """Bucket an `ORSError.kind` into one of `FAILURE_KINDS` (anything else is "failed")."""
    return kind if kind in FAILURE_KINDS else "failed"


@dataclass
class _Window:
    open_latency: list[float] = field(default_factory=list)
    open_failures: int = 0
    call_latency: list[float] = field(default_factory=list)
    calls: int = 0
    terminal_latency: list[float] = field(default_factory=list)
    terminal_calls: int = 0
    failures: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    episodes: int = 0
    scored: int = 0
    reward_sum: float = 0.0
    finished: int = 0
    episode_calls: int = 0
    unscored: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    groups: int = 0
    group_failures: int = 0


class EnvMetrics:
    """Thread-safe accumulator; one per spec or mix, shared by its adapters and engine.

    `open_sessions` is a callable returning the current number of open sessions (a gauge).
    """

    #: Bound on stored latency samples per window, so a huge step cannot grow memory without limit.
    MAX_SAMPLES = 100_000

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._windows: dict[str, _Window] = defaultdict(_Window)
        self._gauges: dict[str, object] = {}

    def set_open_sessions_gauge(self, env: str, gauge: object) -> None:
        self._gauges[env] = gauge

    def record_open(self, env: str, seconds: float | None, error_kind: str | None = None) -> None:
        with self._lock:
            w = self._windows[env]
            if error_kind is not None:
                w.open_failures += 1
                w.failures[failure_kind(error_kind)] += 1
            elif seconds is not None and len(w.open_latency) < self.MAX_SAMPLES:
                w.open_latency.append(seconds)

    def record_call(self, env: str, seconds: float, error_kind: str | None = None, *, terminal: bool = False) -> None:
        """One tool call of the model, or (`terminal`) the harness's call of the environment's hidden terminal
        tool: counted apart (`terminal_calls`, `terminal_call_s`), as the model never called it."""
        with self._lock:
            w = self._windows[env]
            if terminal:
                w.terminal_calls += 1
            else:
                w.calls += 1
            latency = w.terminal_latency if terminal else w.call_latency
            if len(latency) < self.MAX_SAMPLES:
                latency.append(seconds)
            if error_kind is not None:
                w.failures[failure_kind(error_kind)] += 1

    def record_episode(self, env: str, *, reward: float | None, finished: bool, calls: int,
                       unscored: str | None = None) -> None:
        with self._lock:
            w = self._windows[env]
            w.episodes += 1
            w.episode_calls += calls
            w.finished += int(finished)
            if reward is not None:
                w.scored += 1
                w.reward_sum += reward
            else:
                w.unscored[unscored or "no_reward"] += 1

    def record_group(self, env: str, *, ok: bool) -> None:
        """One GRPO group sent to `/score_group` (scored, or failed: its rollouts get None)."""
        with self._lock:
            w = self._windows[env]
            w.groups += 1
            w.group_failures += int(not ok)

    def snapshot(self, *, reset: bool) -> dict[str, _Window]:
        with self._lock:
            windows = dict(self._windows)
            if reset:
                self._windows = defaultdict(_Window)
        return windows

    def flush(self) -> dict[str, float]:
        """Metrics since the last flush, then start a new window. Environments without activity are omitted."""
        return self.summarize(self.snapshot(reset=True), gauges=self._gauges)

    @staticmethod
    def summarize(windows: dict[str, _Window], gauges: dict[str, object] | None = None) -> dict[str, float]:
        out: dict[str, float] = {}
        total = _Window()
        for env, w in sorted(windows.items()):
            out.update(_window_metrics(f"env/{env}/", w))
            total.open_latency += w.open_latency
            total.open_failures += w.open_failures
            total.call_latency += w.call_latency
            total.calls += w.calls
            total.terminal_latency += w.terminal_latency
            total.terminal_calls += w.terminal_calls
            for k, v in w.failures.items():
                total.failures[k] += v
            total.episodes += w.episodes
            total.scored += w.scored
            total.reward_sum += w.reward_sum
            total.finished += w.finished
            total.episode_calls += w.episode_calls
            for k, v in w.unscored.items():
                total.unscored[k] += v
            total.groups += w.groups
            total.group_failures += w.group_failures
        if len(windows) > 1:
            out.update(_window_metrics("env/", total))
        for env, gauge in sorted((gauges or {}).items()):
            try:
                out[f"env/{env}/sessions_open"] = float(gauge())  # type: ignore[operator]
            except Exception:  # a gauge must never break logging
                continue
        return out


def _window_metrics(prefix: str, w: _Window) -> dict[str, float]:
    out: dict[str, float] = {}
    if w.episodes:
        out[prefix + "episodes"] = float(w.episodes)
        out[prefix + "reward_mean"] = w.reward_sum / w.scored if w.scored else float("nan")
        out[prefix + "graded_fraction"] = w.scored / w.episodes
        out[prefix + "finished_fraction"] = w.finished / w.episodes
        out[prefix + "tool_calls_per_episode"] = w.episode_calls / w.episodes
        for reason in UNSCORED_REASONS:
            out[prefix + f"unscored/{reason}"] = float(w.unscored.get(reason, 0))
        if w.unscored.get("timeout"):
            out[prefix + "timed_out_fraction"] = w.unscored["timeout"] / w.episodes
    if w.groups:
        out[prefix + "groups_scored"] = float(w.groups - w.group_failures)
        out[prefix + "group_failures"] = float(w.group_failures)
    if w.calls:
        out[prefix + "tool_calls"] = float(w.calls)
    if w.terminal_calls:
        out[prefix + "terminal_calls"] = float(w.terminal_calls)
    if w.calls or w.terminal_calls or w.failures:
        for kind in FAILURE_KINDS:
            out[prefix + f"failures/{kind}"] = float(w.failures.get(kind, 0))
    if w.open_failures:
        out[prefix + "session_open_failures"] = float(w.open_failures)
    if w.open_latency:
        out[prefix + "session_open_s/p50"] = _percentile(w.open_latency, 0.5)
        out[prefix + "session_open_s/p95"] = _percentile(w.open_latency, 0.95)
    for name, latency in (("tool_call_s", w.call_latency), ("terminal_call_s", w.terminal_latency)):
        if latency:
            out[prefix + f"{name}/p50"] = _percentile(latency, 0.5)
            out[prefix + f"{name}/p95"] = _percentile(latency, 0.95)
    return out
