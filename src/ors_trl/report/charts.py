"""The curves: training metrics over steps from trainer states' `log_history` (TRL's, `EnvMetrics`' `env/...`,
`eval/<name>/pass@k`, `curriculum/...`), several runs together, drawn as inline SVG by matplotlib (imported only to
draw); a chart it cannot draw is a note, the rest of the page stands.
"""

from __future__ import annotations

import html
import io
import logging
import math
import re
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from ..core.metrics import _number
from ..protocol.text import cut, repair
from .inputs import Input

logger = logging.getLogger("ors_trl")

_MAX_POINTS = 2000  # per curve; longer ones are thinned evenly

# `env/[<name>/]<metric>` as EnvMetrics names them; no name is the total over a mix.
_METRIC_KEY = re.compile(r"^env/(?:(.+?)/)??(reward_mean|graded_fraction|finished_fraction|tool_calls_per_episode|"
                         r"no_tool_call_fraction|unparsed_turn_fraction|"
                         r"failures/[\w.-]+|session_open_failures|session_open_s/p\d+|tool_call_s/p\d+|"
                         r"session_seconds(?:_unscored)?)$")
_EVAL_KEY = re.compile(r"^eval/(.+)/(pass@\d+)$")  # evaluation during training (`spec.eval_callback`)
_POOL_KEY = re.compile(r"^curriculum/(.+)/(unseen|mixed|solved|unsolved|zero_std_fraction)$")  # task sampling
_CHARTS = (
    ("heldout", "Held-out pass@k during training (evaluation every N steps)"),
    ("reward", "Reward (mean over graded episodes)"),
    ("graded", "Graded fraction (solid) and finished fraction (dashed)"),
    ("calls", "Tool calls per episode"),
    ("health", "Episodes without a tool call (solid), turns whose tool-call markup did not parse (dashed)"),
    ("failures", "Tool-call failures per logging step"),
    ("latency", "Latency, seconds: p50 (solid), p95 (dashed)"),
    ("cost", "Session-seconds per logging step (dashed: of episodes scored None)"),
    ("spread", "Share of groups with zero reward spread (GRPO learns nothing from them)"),
    ("pools", "Task sampling: tasks per pool (unseen, mixed, solved, unsolved)"),
)


_TRL_KEYS = {"reward": ("reward", "TRL reward (every rollout)"),
             "tools/call_frequency": ("calls", "TRL tools/call_frequency"),
             "frac_reward_zero_std": ("spread", "TRL frac_reward_zero_std (every group)")}
#: `env/` metrics drawn as (chart, series name after the environment's).
_ENV_KEYS = {"reward_mean": ("reward", ""), "tool_calls_per_episode": ("calls", ""),
             "graded_fraction": ("graded", " graded"), "finished_fraction": ("graded", " finished"),
             "no_tool_call_fraction": ("health", " no call"), "unparsed_turn_fraction": ("health", " unparsed"),
             "session_seconds": ("cost", " all"), "session_seconds_unscored": ("cost", " unscored")}


def _where(key: str) -> tuple[str, str] | None:
    """The chart and the series a logged key is drawn in, if any."""
    if key in _TRL_KEYS:
        return _TRL_KEYS[key]
    if m := _POOL_KEY.match(key):
        return ("spread", f"{m[1]} (drawn groups)") if m[2] == "zero_std_fraction" else ("pools", f"{m[1]} {m[2]}")
    if m := _EVAL_KEY.match(key):
        return "heldout", f"{m[1]} {m[2]}"
    if not (m := _METRIC_KEY.match(key)):
        return None
    env, metric = m[1] or "all environments", m[2]
    if metric in _ENV_KEYS:
        return _ENV_KEYS[metric][0], env + _ENV_KEYS[metric][1]
    if metric.startswith("failures/") or metric == "session_open_failures":
        return "failures", f"{env}: {metric.removeprefix('failures/')}"
    what, q = metric.split("/")
    return "latency", f"{env} {'session open' if what.startswith('session') else 'tool call'} {q}"


def _series(state: dict[str, Any], label: str) -> tuple[dict[str, dict[str, list[tuple[float, float]]]], int]:
    """Chart -> series name -> (step, value) points from one trainer state's `log_history`; and its step count."""
    charts: dict[str, dict[str, list[tuple[float, float]]]] = {name: defaultdict(list) for name, _ in _CHARTS}
    steps = set()
    for entry in state.get("log_history") or []:
        if not isinstance(entry, dict) or (step := _number(entry.get("step"))) is None:
            continue
        for key, value in entry.items():
            if isinstance(key, str) and not isinstance(value, bool) and isinstance(value, int | float) and (
                    where := _where(key)):
                name = where[1] if not label else f"{label}: {where[1]}"
                charts[where[0]][name].append((step, float(value)))  # NaN (nothing scored that step): a gap
                steps.add(step)
    failing = {k: v for k, v in charts["failures"].items() if any(y for _, y in v)}
    if not failing and charts["failures"]:  # none at all: one flat line per environment says so
        totals: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
        for name, points in charts["failures"].items():
            for step, y in points:
                totals[name.rsplit(": ", 1)[0] + ": every kind"][step] += y
        failing = {name: sorted(by_step.items()) for name, by_step in totals.items()}
    charts["failures"] = failing
    return charts, len(steps)


_VARIANT = re.compile(r" (graded|finished|p\d+|no call|unparsed|all|unscored)$")


def _svg(chart: dict[str, list[tuple[float, float]]], title: str, uid: str) -> str:
    """One chart as inline SVG (matplotlib, imported here only), its ids made unique in the page."""
    import matplotlib
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    # text.parse_math off: a `$` in a metric or run name is text, not mathtext (which fails on most of them)
    style = {"svg.hashsalt": uid, "svg.fonttype": "none", "font.size": 8, "text.parse_math": False}
    with matplotlib.rc_context(style):
        fig = Figure(figsize=(6.2, 3.3), layout="constrained")
        ax = fig.add_subplot()
        colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
        groups: dict[str, str] = {}  # one colour per environment; the metric's variant is the line style
        for name, points in sorted(chart.items()):
            color = groups.setdefault(_VARIANT.sub("", name), colors[len(groups) % len(colors)])
            points.sort()
            if len(points) > _MAX_POINTS:  # thin evenly, keep the last point
                stride = math.ceil(len(points) / _MAX_POINTS)
                points = points[::stride] + ([points[-1]] if (len(points) - 1) % stride else [])
            line = "--" if name.endswith((" finished", " p95", " p99", " unparsed", " unscored")) else "-"
            ax.plot([p[0] for p in points], [p[1] for p in points], line, color=color, label=repair(cut(name, 60)),
                    marker="." if len(points) < 40 else None, linewidth=1.3)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("training step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if chart:
            ax.legend(fontsize=7, loc="best")
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    svg = buf.getvalue()
    svg = svg[svg.index("<svg"):]  # no XML prolog, no DOCTYPE (its DTD URL)
    svg = re.sub(r'(<svg\b[^>]*?) width="[^"]*" height="[^"]*"', rf'\1 role="img" aria-label="{html.escape(title)}"',
                 svg, count=1)
    svg = re.sub(r'\bid="([^"]+)"', rf'id="{uid}-\1"', svg)
    return re.sub(r'(href="#|url\(#)([^")]+)', rf"\g<1>{uid}-\2", svg)


def curves(states: Sequence[Input]) -> tuple[str, int]:
    """The curves section's body, and the number of logged steps drawn."""
    if not states:
        return ("<p class=note>No trainer log given: pass a trainer output folder or its trainer_state.json to draw "
                "curves over training steps.</p>"), 0
    merged: dict[str, dict[str, list[tuple[float, float]]]] = {name: {} for name, _ in _CHARTS}
    steps = 0
    for item in states:
        charts, n = _series(item.state or {}, item.label if len(states) > 1 else "")
        steps = max(steps, n)
        for name, series in charts.items():
            merged[name].update(series)
    where = ", ".join(str(s.path) for s in states)
    if not any(merged.values()):
        entries = sum(len(s.state.get("log_history") or []) for s in states if s.state)
        what = (f"has {entries} log_history entries but no reward or env/ metrics" if entries
                else "has no log_history")
        return f"<p class=note>The trainer log ({html.escape(where)}) {what}: no curves to draw.</p>", 0
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return ("<p class=note>Curves need matplotlib, which is not installed: <code>pip install "
                "'ors-trl[report]'</code>.</p>"), steps
    figures = []
    for i, (name, title) in enumerate(_CHARTS):
        if merged[name]:
            try:
                figures.append(f"<figure class=chart>{_svg(merged[name], title, f'c{i}')}</figure>")
            except Exception as exc:  # matplotlib refused something in the log: the rest of the page stands
                logger.warning("report: the chart %r could not be drawn: %s: %s", title, type(exc).__name__, exc)
                figures.append(f"<p class=note>{html.escape(title)}: could not be drawn ({type(exc).__name__}).</p>")
    note = f"<p class=note>From {html.escape(where)}: {steps} logged step(s).</p>"
    return note + "<div class=charts>" + "".join(figures) + "</div>", steps

