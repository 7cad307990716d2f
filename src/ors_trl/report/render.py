"""The page: one self-contained HTML file from the tallies, the sample and the curves, with `page.html`, `page.css` and
`page.js` inside (its Content-Security-Policy allows no other source but thumbnails' `data:` URLs). It opens with the
runs side by side (`runs`, `pairs`): a task is solved in a run at a success share >= 1/2, flipped when solved in one
run only; `paired_test` compares the shares. Record text is untrusted: it is HTML-escaped, episode bodies travel as
JSON with `<`, `>`, `&` escaped and are written with `textContent`, a thumbnail is kept only when its file hashes to
the record's SHA-256. The curves: trainer states' `log_history` metrics (TRL's, `env/...`, `eval/<name>/pass@k`,
`curriculum/...`) over steps as matplotlib's inline SVG (imported only to draw); a chart it cannot draw is a note.
"""

from __future__ import annotations

import hashlib
import html
import io
import json
import logging
import math
import re
import secrets
from array import array
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib.resources import files
from pathlib import Path
from string import Template
from typing import Any

from ..core.metrics import EpisodeStats, _number, _percentile
from ..core.records import _SHA256
from ..core.stats import paired_test, pass_over_tasks
from ..protocol.images import MAX_IMAGE_BYTES, thumbnail
from ..protocol.text import cut, repair
from .tally import EMBED_TEXT, SAMPLE_BYTES, Input, RunKey, Sample, Tally

logger = logging.getLogger("ors_trl")

#: The p-value under which a difference is called beyond noise.
ALPHA = 0.05
_DIGITS = re.compile(r"(\d+)")
_MAX_ROWS = 10_000  # per table of tasks or runs; the ones with the most episodes are shown
THUMB_SIZE = 160  # pixels on the longer side
THUMB_BYTES = 4 * 1024 * 1024  # thumbnails a page embeds, in all


def _data(name: str) -> str:
    """One of the package's data files (`page.html`, `page.css`, `page.js`)."""
    return files(__package__).joinpath(name).read_text(encoding="utf-8")


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _f(value: float | None, digits: int = 3) -> tuple[str, float | None]:
    """A number as a sortable cell: its text (`–`: none) and its value."""
    return ("–" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"), value


def _p(value: float | None) -> tuple[str, float | None]:
    """A share as a sortable cell, in percent."""
    return ("–" if value is None else f"{value:.1%}"), value


def task_order(key: tuple[str, str]) -> list[Any]:
    """An (environment, task) sort key that reads numbers as numbers: `test #2` before `test #19`."""
    return [[int(p) if i % 2 else p for i, p in enumerate(_DIGITS.split(text))] for text in key]


@dataclass
class Run:
    """One run's row: its counts, and pass@k over its tasks (k up to the fewest episodes of a task)."""

    key: RunKey
    name: str
    stats: EpisodeStats
    tasks: dict[tuple[str, str], EpisodeStats]
    pass_at_k: dict[int, float]
    interval: tuple[float, float] | None


@dataclass
class Pair:
    """A run against the baseline over the tasks both ran: each task's two cells, in task order."""

    base: Run
    other: Run
    tasks: list[tuple[tuple[str, str], EpisodeStats, EpisodeStats]]
    base_rate: float
    other_rate: float
    p: float
    method: str

    def changes(self) -> dict[tuple[str, str], float]:
        """Each shared task's change of success (the other run's share less the baseline's)."""
        return {task: b.success_rate - a.success_rate for task, a, b in self.tasks}

    def flipped(self, up: bool) -> list[tuple[str, str]]:
        """The tasks solved in the other run and not in the baseline (`up`), or the other way round."""
        return [task for task, a, b in self.tasks
                if (b if up else a).success_rate >= 0.5 > (a if up else b).success_rate]


def runs(tally: Tally) -> list[Run]:
    """Every run with episodes, in order: the labelled ones as labelled, then the others as first read."""
    return [Run(key, tally.run_names[key], stats, tally.cells[key], *pass_over_tasks(tally.cells[key].values()))
            for key, stats in tally.runs.items() if stats.episodes]


def pairs(rows: list[Run]) -> list[Pair]:
    """Each later run against the first, over the tasks both ran (runs that share none are left out)."""
    out = []
    for other in rows[1:]:
        base = rows[0]
        shared = sorted(((task, base.tasks[task], cell) for task, cell in other.tasks.items() if task in base.tasks),
                        key=lambda t: task_order(t[0]))
        if shared:
            p, method = paired_test([b.success_rate - a.success_rate for _, a, b in shared])
            out.append(Pair(base, other, shared, sum(a.success_rate for _, a, _ in shared) / len(shared),
                            sum(b.success_rate for _, _, b in shared) / len(shared), p, method))
    return out


def _table(headers: Sequence[str], rows: Iterable[Sequence[Any]], cls: str = "",
           row_attrs: Iterable[str] | None = None) -> str:
    """An HTML table; a cell is text, or a count or (text, sort value) for a sortable table. Every cell is escaped."""
    nums: set[int] = set()
    body = []
    attrs = iter(row_attrs or ())
    for row in rows:
        cells = []
        for i, cell in enumerate(row):
            if isinstance(cell, int):
                cell = str(cell), cell
            if isinstance(cell, tuple):
                nums.add(i)
                text, value = cell
                v = "" if value is None or (isinstance(value, float) and not math.isfinite(value)) else value
                cells.append(f'<td class=num data-v="{_e(v)}">{_e(text)}</td>')
            else:
                cells.append(f"<td>{_e(cell)}</td>")
        body.append(f"<tr{next(attrs, '')}>" + "".join(cells) + "</tr>")
    head = "".join(f"<th{' data-type=num' if i in nums else ''}>{_e(h)}</th>" for i, h in enumerate(headers))
    return f"<table class='{cls}'><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


_STATS_HEADS = ("episodes", "mean reward", "graded", "finished", "success rate", "tool calls / episode",
                "tool-call failures", "no tool call")
_MAX_RUN_COLUMNS = 8  # runs the per-task table gives a column each (the first ones, the baseline first)


def _stats_cells(s: EpisodeStats) -> list[Any]:
    """The `_STATS_HEADS` cells of one scope."""
    return [s.episodes, _f(s.mean_reward), _p(s.coverage), _p(s.share(s.finished)), _p(s.success_rate),
            _f(s.share(s.tool_calls), 2), s.tool_failures, _p(s.no_call_rate)]


def _of(x: EpisodeStats | None) -> tuple[str, float | None]:
    """A task's success in one run, as a cell: `50.0% of 2` (`–`: the run did not run it)."""
    return ("–", None) if x is None else (f"{_p(x.success_rate)[0]} of {x.episodes}", x.success_rate)


def _latency_rows(name: str, samples: dict[str, array[float]], envs: list[str]) -> list[list[Any]]:
    """p50, p90, p95, p99 and max over every environment, then per environment where there are several."""
    scopes = [("all environments", sorted(v for a in samples.values() for v in a))]
    scopes += [(env, sorted(samples.get(env, ()))) for env in envs] if len(envs) > 1 else []
    return [[name, scope, str(len(values)), *([f"{_percentile(values, q):.4f}" for q in (0.5, 0.9, 0.95, 0.99)]
                                              + [f"{values[-1]:.4f}"] if values else ["–"] * 5)]
            for scope, values in scopes]


def _where(t: Tally, run: Run) -> str:
    """Where a run's episodes ran: each environment, its splits, and its servers where it ran on several."""
    envs = sorted(t.places.get(run.key, {}).items())
    return cut("; ".join(f"{env} {', '.join(sorted(splits))}"
                         + (f" at {', '.join(sorted(hosts))}" if len(t.hosts(env)) > 1 else "")
                         for env, (splits, hosts) in envs), 300)


def _headline(rows: list[Run], pairs: list[Pair]) -> str:
    """The answer: each run against the baseline (the tasks that flipped), else each run's success."""
    out = []
    for p in pairs:
        change, beyond = p.other_rate - p.base_rate, p.p < ALPHA
        verdict = ("better" if change > 0 else "worse") if beyond else "noise"
        text = (f"{p.other.name} vs {p.base.name}: success {p.base_rate:.1%} → {p.other_rate:.1%} "
                f"({100 * change:+.1f} points) over {len(p.tasks)} shared task(s); paired test over tasks "
                f"p = {p.p:.3g} ({p.method}): {'beyond' if beyond else 'within'} noise (p < {ALPHA:g} is beyond).")
        out.append(f"<p class=headline data-verdict={verdict}>{_e(text)}</p>")
        for up, what in ((True, "solved now, not before"), (False, "solved before, not now")):
            flipped = p.flipped(up)
            names = ", ".join(f"{env} {task}" for env, task in flipped[:12]) + (" …" if len(flipped) > 12 else "")
            out.append(f"<p class='flipped {'up' if up else 'down'}'>Flipped, {what}: {len(flipped)}"
                       + (f" ({_e(names)})" if flipped else "") + "</p>")
    if not pairs:
        if len(rows) > 1:
            out.append("<p class=note>The runs share no task, so none is compared task by task.</p>")
        for r in rows[:12]:
            one, (lo, hi) = r.pass_at_k.get(1), r.interval or (None, None)
            over = f"; pass@1 {one:.3f} [{lo:.2f}, {hi:.2f}] over tasks" if lo is not None and one is not None else ""
            done = f"{r.name}: success {r.stats.success_rate:.1%} of {r.stats.episodes} episode(s)"
            out.append(f"<p class=headline data-verdict=none>{_e(f'{done} over {len(r.tasks)} task(s){over}.')}</p>")
    return "".join(out)


def _runs(t: Tally, rows: list[Run]) -> str:
    """A row per run, each apart (evaluations before and after, training): never pooled."""
    k_max = max((max(r.pass_at_k, default=1) for r in rows), default=1)

    def row(r: Run) -> list[Any]:
        s, one, k = r.stats, r.pass_at_k.get(1), max(r.pass_at_k, default=1)
        lo, hi = r.interval or (None, None)
        return [r.name, _where(t, r), s.episodes, len(r.tasks), _p(s.success_rate),
                (_f(one)[0] + (f" [{lo:.2f}, {hi:.2f}]" if lo is not None else ""), one),
                (f"pass@{k} {_f(r.pass_at_k[k])[0]}" if k > 1 else "–", r.pass_at_k.get(k) if k > 1 else None),
                _f(s.mean_reward), _p(s.coverage)]

    heads = ["run", "environment and split", "episodes", "tasks", "success rate", "pass@1 [95% over tasks]",
             f"pass@k (k ≤ {k_max})", "mean reward", "graded"]
    return (_table(heads, map(row, rows[:_MAX_ROWS]), "sortable runs")
            + f"<p class=note>Success: reward &ge; {t.success_threshold:g}, over every episode (an unscored one "
              "counts as no success); mean reward over the graded ones. A training run's episodes are the "
              "rollouts training scored, on its own tasks.</p>")


def _tasks(t: Tally, rows: list[Run], pairs: list[Pair]) -> str:
    """Every task in its number's order, collapsed: each run's success (one run: all its counts) and each pair's
    change; grouped by the first pair's change (improved, worse, unchanged, not in both)."""
    shown = rows[:_MAX_RUN_COLUMNS]
    ranked = sorted(t.tasks.items(), key=lambda kv: (-kv[1].episodes, task_order(kv[0])))
    items = sorted(ranked[:_MAX_ROWS], key=lambda kv: task_order(kv[0]))
    pairs = [p for p in pairs if p.other in shown]
    changes = [p.changes() for p in pairs]
    single = len(shown) == 1
    heads = ["environment", "task", *(_STATS_HEADS if single else [f"success: {r.name}" for r in shown]),
             *(f"change, points: {p.other.name} vs {p.base.name}" for p in pairs), "in sample"]

    def row(key: tuple[str, str], x: EpisodeStats) -> list[Any]:
        cells = _stats_cells(x) if single else [_of(r.tasks.get(key)) for r in shown]
        moves = [(f"{100 * c[key]:+.1f}", c[key]) if key in c else ("–", None) for c in changes]
        return [*key, *cells, *moves, t.embedded[key]]

    first = changes[0] if changes else {}
    groups = ([("Improved", lambda k: first.get(k, 0) > 0), ("Worse", lambda k: first.get(k, 0) < 0),
               ("Unchanged", lambda k: first.get(k) == 0),
               (f"Not run by both {pairs[0].base.name} and {pairs[0].other.name}", lambda k: k not in first)]
              if first else [("", lambda k: True)])
    parts, counts = [], []
    for title, member in groups:
        group = [(k, x) for k, x in items if member(k)]
        counts.append(f"{len(group)} {title[:1].lower() + title[1:]}")
        if group or not title:
            parts.append((f"<h3>{_e(title)}: {len(group)}</h3>" if title else "") + _table(
                heads, (row(k, x) for k, x in group), "sortable tasks",
                (f' class=task data-env="{_e(k[0])}" data-task="{_e(k[1])}"' for k, _ in group)))
    what = f"{len(items)} task(s), in their numbers' order" + (
        f"; {pairs[0].other.name} vs {pairs[0].base.name}: " + ", ".join(counts) if first else "")
    note = (f"<p class=note>The {_MAX_ROWS} tasks with the most episodes of {len(ranked)}.</p>"
            if len(ranked) > _MAX_ROWS else "")
    runs_note = (f"<p class=note>The first {_MAX_RUN_COLUMNS} runs of {len(rows)} have a column.</p>"
                 if len(rows) > _MAX_RUN_COLUMNS else "")
    return (f"<details id=task-table><summary>Per task: {_e(what)}</summary>{note}{runs_note}<p class=note>Click a "
            "header to sort, a row to browse that task's episodes.</p>" + "".join(parts) + "</details>")


def _diagnostics(t: Tally, rows: list[Run]) -> str:
    """Tool-call and episode health per run, why episodes ended per run, per environment and run, and latency."""
    shown = rows[:_MAX_RUN_COLUMNS]
    health = [[r.name, _p(r.stats.share(r.stats.finished)), _f(r.stats.share(r.stats.tool_calls), 2),
               r.stats.tool_failures, _p(r.stats.no_call_rate), _p(r.stats.unparsed_rate), r.stats.malformed_calls,
               _f(r.stats.mean_group_reward),
               (f"{r.stats.session_seconds:.0f} ({r.stats.session_seconds_unscored:.0f} unscored)",
                r.stats.session_seconds)] for r in rows[:_MAX_ROWS]]
    reasons: dict[RunKey, Counter[str]] = {
        r.key: Counter({**{f"end: {k}": n for k, n in r.stats.end_reasons.items()},
                        **{f"unscored: {k}": n for k, n in r.stats.unscored.items()}, **t.run_failures[r.key]})
        for r in shown}
    kinds = sorted({k for c in reasons.values() for k in c}, key=lambda k: (k.split(":")[0], -sum(
        c[k] for c in reasons.values()), k))
    per_env: dict[tuple[str, str], EpisodeStats] = {}
    for run, cells in t.cells.items():
        for (env, _), stats in cells.items():
            per_env.setdefault((env, t.run_names[run]), EpisodeStats(t.success_threshold)).merge(stats)
    envs = sorted(t.envs)
    latency = (_latency_rows("session open (timings.open)", t.open_s, envs)
               + _latency_rows("tool call (seconds)", t.call_s, envs))
    return ("<h3>Tool calls per run</h3>"
            + _table(["run", "finished", "tool calls / episode", "tool-call failures", "no tool call",
                      "unparsed turns", "malformed calls", "mean group reward", "session-seconds"], health,
                     "sortable health")
            + "<h3>Why episodes ended, went unscored or failed, per run (end_reason, unscored, error.kind; a "
              "terminal tool's grading included)</h3>"
            + _table(["what", *(r.name for r in shown)], ([k, *(reasons[r.key][k] for r in shown)] for k in kinds),
                     "sortable reasons")
            + ("<h3>Per environment and run</h3>" + _table(
                ["environment", "run", *_STATS_HEADS], ([*key, *_stats_cells(x)] for key, x in sorted(
                    per_env.items(), key=lambda kv: task_order(kv[0]))[:_MAX_ROWS]), "sortable")
               if len(envs) > 1 else "")
            + "<h3>Latency over every run, seconds</h3>"
            + _table(["what", "scope", "n", "p50", "p90", "p95", "p99", "max"], latency))


def _shown(t: Tally, sample: Sample) -> str:
    """What the episode browser holds, said above it."""
    n, m = len(sample.episodes), t.total.episodes
    if not m:
        return "No episode records were given: pass an episode log or an eval output to browse episodes."
    if n == m:
        shown = f"Showing all {m} episodes."
    else:
        why = (f"the page embeds at most {SAMPLE_BYTES // 2**20} MB of episode bodies" if sample.left_out
               else f"--max-episodes {t.max_episodes}")
        shown = (f"Showing {n} of {m} episodes (sample; {why}). The tables above count every "
                 "episode; the sample is chosen deterministically and keeps examples of every failure, error, "
                 "unscored and end reason, environment and run.")
    if sample.clipped:
        shown += (f" {sample.clipped} episode(s) too large for the {SAMPLE_BYTES // 2**20} MB of episode bodies a "
                  f"page embeds are shown with every text cut to {EMBED_TEXT:,} characters (marked).")
    return shown


def _json_script(data: Any) -> str:
    """JSON safe inside `<script type=application/json>`: no `<`, `>`, `&` (so no `</script>`, no `<!--`)."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False, default=str)
    return (text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def _thumbnail(folders: Sequence[Path], sha: str, entry: Mapping[str, Any]) -> str | None:
    """The thumbnail of one recorded image, from the first episode input's folder holding its file."""
    name = entry.get("file")
    folder_name, _, file_name = name.partition("/") if isinstance(name, str) else ("", "", "")
    if not folder_name.endswith(".images") or "\\" in name or "/" in file_name or file_name.split(".")[0] != sha:
        return None  # only `<log>.images/<sha256>.<ext>` beside an input, as the writer names it
    for folder in folders:
        path = folder / name
        try:
            if not path.is_file() or path.stat().st_size > MAX_IMAGE_BYTES:
                continue
            raw = path.read_bytes()
        except OSError:
            continue
        if hashlib.sha256(raw).hexdigest() == sha:
            return thumbnail(raw, str(entry.get("mime_type") or ""), THUMB_SIZE)
    return None


def thumbnails(items: Sequence[Input], sample: Sample) -> None:
    """Each embedded episode's thumbnails (`ep["thumbs"]`: hash -> PNG `data:` URL), `THUMB_BYTES` in all."""
    folders = [i.path.parent for i in items if i.kind == "episodes"]
    made: dict[str, str | None] = {}
    left = THUMB_BYTES
    for ep in sample.episodes:
        images = ep["rec"].get("images")
        thumbs = {}
        for sha, entry in (images.items() if isinstance(images, dict) else ()):
            if not isinstance(entry, dict) or not _SHA256.fullmatch(str(sha)):
                continue
            if sha not in made:
                made[sha] = _thumbnail(folders, sha, entry)
            url = made[sha]
            if url is not None and len(url) <= left:
                thumbs[sha], left = url, left - len(url)
        if thumbs:
            ep["thumbs"] = thumbs


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


def _chart_of(key: str) -> tuple[str, str] | None:
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
                    where := _chart_of(key)):
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
    svg = re.sub(r'(<svg\b[^>]*?) width="[^"]*" height="[^"]*"', rf'\1 role="img" aria-label="{_e(title)}"',
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
        return f"<p class=note>The trainer log ({_e(where)}) {what}: no curves to draw.</p>", 0
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
                figures.append(f"<p class=note>{_e(title)}: could not be drawn ({type(exc).__name__}).</p>")
    note = f"<p class=note>From {_e(where)}: {steps} logged step(s).</p>"
    return note + "<div class=charts>" + "".join(figures) + "</div>", steps


def render(items: Sequence[Input], tally: Tally, sample: Sample, skipped: Counter[str],
           title: str | None) -> tuple[str, int]:
    """The page, and the number of logged training steps its curves draw."""
    thumbnails(items, sample)
    rows = runs(tally)
    compared = pairs(rows)
    curves_html, steps = curves([i for i in items if i.kind == "trainer_state"])
    envs = sorted(tally.envs)
    page_title = title or ("ors-trl report: " + cut(", ".join(envs), 80) if envs else "ors-trl report")
    reasons = ", ".join(f"{v} {k}" for k, v in sorted(skipped.items(), key=lambda kv: (-kv[1], kv[0])))
    skipped_note = (f"<p class=note id=skipped>{skipped.total()} record(s) skipped: {_e(reasons)}.</p>"
                    if skipped else "")
    none = "<p class=note>No episodes.</p>"  # the headline, runs and diagnostics of a page without episodes
    sources = "".join(f"<li><code>{_e(i.path)}</code> ({'trainer state' if i.kind == 'trainer_state' else 'episodes'})"
                      "</li>" for i in items)
    page = Template(_data("page.html")).substitute(
        title=_e(page_title), nonce=secrets.token_urlsafe(16), css=_data("page.css"), js=_data("page.js"),
        generated=_e(datetime.now(UTC).isoformat(timespec="seconds")), sources=sources,
        headline=(_headline(rows, compared) if rows else none) + skipped_note, curves=curves_html,
        runs=_runs(tally, rows) if rows else none, diagnostics=_diagnostics(tally, rows) if rows else none,
        tasks=_tasks(tally, rows, compared),
        shown=_e(_shown(tally, sample)), data=_json_script(sample.episodes),
    )
    return repair(page), steps  # repair: a title or a file name may hold a lone surrogate
