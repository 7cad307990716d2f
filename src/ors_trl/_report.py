"""`ors-trl report`: one self-contained HTML page of what the episodes did and how training went.

    write_report(["episodes.jsonl", "eval.jsonl", "./trainer-output"], "report.html")

Inputs are recognised by content, not by name: JSON lines of episode records (training's
`episode_log=`, `ors-trl eval --output`: record versions 2 and 1, and the flat `calls` records of
older training logs) and trainer states (a `trainer_state.json`, or a trainer output folder holding
one, also in its latest `checkpoint-*`). The page has a summary of every episode, curves over
training steps from `log_history`, a sortable per-task table and a browser of episode bodies.

Records are streamed: every episode is counted, but only a bounded, deterministic sample of
episode bodies is kept and embedded (`max_episodes`, and at most `_SAMPLE_BYTES` of JSON), so a
100,000-episode log still makes a page a browser opens. The sample is the episodes of smallest
hash (a stable pseudo-random pick), after a few reserved for each failure kind, episode error,
unscored reason, end reason, environment and run, so that every kind of problem has an example.

Nothing is fetched when the page opens: styles, the script and the charts (matplotlib rendered to
inline SVG, imported only here and only when there are curves) are inside it, and its
Content-Security-Policy forbids any other source. Record text is untrusted: whatever the page
renders on the server is HTML-escaped, the episode bodies travel as JSON in a
`<script type="application/json">` block with `<`, `>` and `&` escaped, and the page's script
writes them with `textContent` only. Records are shown as written (secrets were masked before
they were written): nothing is unescaped and nothing else is read.

Whatever the inputs hold, the page is written: a line that is not a record (cut, corrupt, nested too
deeply, foreign) is skipped and counted on the page; the embedded bodies are made JSON-safe (`jsonable`:
lone surrogates repaired, NaN spelled as text, nesting bounded); a chart matplotlib cannot draw is a note.
The page never replaces one of its inputs, and is written through a private temporary file.

Definitions: an episode is graded when its reward is not None; mean reward is over graded
episodes; success (per-task table) is `reward > 0`.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import html
import io
import json
import logging
import math
import os
import re
import secrets
import stat
import tempfile
from array import array
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ._exceptions import ConfigurationError
from ._metrics import _percentile
from ._records import jsonable, parse_line, read_records
from ._text import repair, shorten, show_json

__all__ = ["DEFAULT_MAX_EPISODES", "ReportSummary", "write_report"]

logger = logging.getLogger("ors_trl")

#: Episode bodies embedded in the page unless told otherwise.
DEFAULT_MAX_EPISODES = 2000
_SAMPLE_BYTES = 12 * 1024 * 1024  # embedded episode JSON stops here whatever max_episodes says (page < 20 MB)
_EMBED_TEXT = 100_000  # an episode too large for what is left of the budget is embedded with its texts cut to this
_RESERVED_PER_KIND = 5  # episodes kept for each failure kind, unscored reason, end reason, environment, run
_MAX_KINDS = 200  # distinct kinds reserved for (record values are untrusted: bound them)
_MAX_TASK_ROWS = 10_000
_MAX_POINTS = 2000  # per curve; longer ones are thinned evenly
_LONG_LINE = 64 * 1024 * 1024  # a line longer than this is not an episode record
_MAX_STATE_BYTES = 1024 ** 3


@dataclass
class ReportSummary:
    """What `write_report` wrote: the counts behind the page and where it is."""

    output: str
    episodes: int
    embedded: int
    environments: list[str]
    runs: int
    tasks: int
    trainer_states: int
    log_steps: int
    bytes: int
    skipped: int = 0
    skipped_reasons: dict[str, int] = field(default_factory=dict)


# -- inputs ---------------------------------------------------------------------------------------------


@dataclass
class _Input:
    path: Path
    kind: str  # "episodes" | "trainer_state"
    label: str
    state: dict[str, Any] | None = None


def _is_record(obj: Any) -> bool:
    """A JSON object shaped like an episode record of any version."""
    return isinstance(obj, dict) and ("turns" in obj or "calls" in obj or (
        "reward" in obj and ("environment" in obj or "task_index" in obj)))


def _trainer_state_in(folder: Path) -> Path | None:
    """A trainer output folder's `trainer_state.json`: its own, else the latest checkpoint's."""
    if (folder / "trainer_state.json").is_file():
        return folder / "trainer_state.json"
    checkpoints = [p for p in folder.glob("checkpoint-*") if (p / "trainer_state.json").is_file()]
    if not checkpoints:
        return None
    latest = max(checkpoints, key=lambda p: (int(p.name.rsplit("-", 1)[1]) if p.name.rsplit("-", 1)[1].isdigit()
                                            else -1, p.name))
    return latest / "trainer_state.json"


def _state_label(path: Path) -> str:
    parent = path.parent
    return (parent.parent if parent.name.startswith("checkpoint-") else parent).name or str(parent)


_EXPECTED = ("expected JSON lines of episode records (episode_log=, ors-trl eval --output), a trainer output folder, "
             "or a trainer_state.json")


def _recognise(raw: str | os.PathLike[str]) -> _Input:
    """What one input is, by content; a ConfigurationError says clearly why it is none of them."""
    path = Path(raw)
    if not path.exists():
        raise ConfigurationError(f"{path}: no such file or folder")
    if path.is_dir():
        state = _trainer_state_in(path)
        if state is None:
            raise ConfigurationError(f"{path}: a folder without trainer_state.json (nor in checkpoint-*/); {_EXPECTED}")
        return _recognise_state(state, _state_label(state))
    try:
        with path.open("rb") as fh:
            head = [fh.readline(_LONG_LINE) for _ in range(20)]
    except OSError as exc:
        raise ConfigurationError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
    lines = [line for line in head if line.strip()]
    if not lines:
        logger.warning("%s is empty: no episodes in it", path)
        return _Input(path, "episodes", path.name)
    for line in lines:
        obj, _ = parse_line(line)  # None: a cut line, a pretty-printed document, not JSON at all
        if isinstance(obj, dict) and isinstance(obj.get("log_history"), list):
            return _Input(path, "trainer_state", _state_label(path), obj)
        if _is_record(obj):
            return _Input(path, "episodes", path.name)
    if lines[0].lstrip().startswith(b"{"):
        return _recognise_state(path, _state_label(path))
    raise ConfigurationError(f"{path}: not an episode log, eval output or trainer state; {_EXPECTED}")


def _recognise_state(path: Path, label: str) -> _Input:
    try:
        if path.stat().st_size > _MAX_STATE_BYTES:
            raise ConfigurationError(f"{path}: too large for a trainer state")
        doc, _ = parse_line(path.read_bytes())
    except OSError as exc:
        raise ConfigurationError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("log_history"), list):
        raise ConfigurationError(f"{path}: not an episode log, eval output or trainer state (no episode records, "
                                 f"no log_history); {_EXPECTED}")
    return _Input(path, "trainer_state", label, doc)


def _recognise_all(inputs: Sequence[str | os.PathLike[str]]) -> list[_Input]:
    found: dict[Path, _Input] = {}
    for raw in inputs:
        item = _recognise(raw)
        found.setdefault(item.path.resolve(), item)  # a folder and its own trainer_state.json count once
    return list(found.values())


# -- episodes: normalise, count, sample ------------------------------------------------------------------


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _normalise(record: dict[str, Any]) -> dict[str, Any]:
    """A record of any version in the shape `Episode.record()` writes: the flat `calls` of old training logs
    (`tool`, `arguments`, `output` or `error` text, `error_kind`) become one turn of tool calls."""
    if "turns" in record or not isinstance(record.get("calls"), list):
        return record
    calls = []
    for c in record["calls"]:
        if not isinstance(c, dict):
            continue
        entry: dict[str, Any] = {"name": c.get("tool", c.get("name")), "arguments": c.get("arguments")}
        entry.update({k: c[k] for k in ("output", "reward", "finished", "metadata", "seconds") if k in c})
        if c.get("error") is not None or c.get("error_kind"):
            entry["error"] = {"kind": c.get("error_kind") or "failed", "message": c.get("error")}
        calls.append(entry)
    out = {k: v for k, v in record.items() if k != "calls"}
    out["turns"] = [{"index": 0, "assistant": None, "tool_calls": calls}]
    out.setdefault("tool_calls", len(calls))
    out.setdefault("tool_failures", sum(1 for c in calls if "error" in c))
    return out


def _calls(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Every tool call entry of a (normalised) record, the terminal tool's `final` call last."""
    out = [c for t in record.get("turns") or [] if isinstance(t, dict)
           for c in (t.get("tool_calls") or []) if isinstance(c, dict)]
    final = record.get("final")
    if isinstance(final, dict) and final.get("tool"):
        out.append(final)
    return out


def _kind(error: Any, fallback: str) -> str:
    if isinstance(error, dict):
        return _label(error.get("kind") or fallback)
    return fallback


def _label(value: Any, limit: int = 200) -> str:
    """A record value as a short label: text as it is, a number or None as `str` gives it, anything else as JSON."""
    if not isinstance(value, str):
        value = str(value) if value is None or isinstance(value, int | float) else show_json(jsonable(value), limit)
    return shorten(value, limit)


def _task_label(record: dict[str, Any]) -> str:
    split = _label(record.get("split") or "-")
    if record.get("task_spec") is not None:
        return f"{split} spec {_label(record['task_spec'], 60)}"
    return f"{split} #{_label(record.get('task_index'))}"


@dataclass
class _Tally:
    """Counts over the episodes of one scope (everything, one environment, one task)."""

    episodes: int = 0
    graded: int = 0
    reward_sum: float = 0.0
    successes: int = 0
    finished: int = 0
    calls: int = 0
    failures: int = 0
    embedded: int = 0

    def add(self, reward: float | None, finished: bool, calls: int, failures: int) -> None:
        self.episodes += 1
        self.finished += finished
        self.calls += calls
        self.failures += failures
        if reward is not None:
            self.graded += 1
            self.reward_sum += reward
            self.successes += reward > 0

    @property
    def mean_reward(self) -> float | None:
        return self.reward_sum / self.graded if self.graded else None

    def share(self, n: int) -> float | None:
        return n / self.episodes if self.episodes else None


@dataclass
class _Episodes:
    """Everything the page says about episodes, built in one pass over the records."""

    max_episodes: int
    total: _Tally = field(default_factory=_Tally)
    envs: dict[str, _Tally] = field(default_factory=lambda: defaultdict(_Tally))
    tasks: dict[tuple[str, str], _Tally] = field(default_factory=lambda: defaultdict(_Tally))
    runs: Counter[str] = field(default_factory=Counter)
    sources: Counter[str] = field(default_factory=Counter)
    call_failures: Counter[str] = field(default_factory=Counter)
    episode_errors: Counter[str] = field(default_factory=Counter)
    end_reasons: Counter[str] = field(default_factory=Counter)
    unscored: Counter[str] = field(default_factory=Counter)
    open_s: dict[str, array[float]] = field(default_factory=lambda: defaultdict(lambda: array("d")))
    call_s: dict[str, array[float]] = field(default_factory=lambda: defaultdict(lambda: array("d")))
    group_rewards: int = 0
    seq: int = 0
    _sample: list[tuple[int, int, dict[str, Any]]] = field(default_factory=list)  # max-heap by hash
    _reserved: dict[str, list[tuple[int, int, dict[str, Any]]]] = field(default_factory=dict)

    def add(self, record: dict[str, Any], source: str) -> None:
        """Count one record and offer it to the sample."""
        rec = _normalise(record)
        env = _label(rec.get("environment") or rec.get("target") or "(unknown)")
        run = _label(rec.get("run") or source)
        task = _task_label(rec)
        reward = _number(rec.get("reward"))
        error = rec.get("error")
        unscored = rec.get("unscored") or (None if reward is not None else "error" if error else "no_reward")
        unscored = _label(unscored) if unscored else None
        end = _label(rec.get("end_reason") or "(none)")
        calls = _calls(rec)
        fails = [_kind(c["error"], "failed") for c in calls if c.get("error")]
        n_calls = rec.get("tool_calls") if isinstance(rec.get("tool_calls"), int) else len(calls)
        finished = bool(rec.get("finished"))
        tags = sorted({f"failure: {k}" for k in fails} | ({f"error: {_kind(error, 'error')}"} if error else set())
                      | ({f"unscored: {unscored}"} if unscored else set()))
        key = f"{self.seq + 1}|{run}|{_label(rec.get('started_at'))}|{env}|{task}".encode("utf-8", "replace")

        for tally in (self.total, self.envs[env], self.tasks[(env, task)]):
            tally.add(reward, finished, n_calls, len(fails))
        self.runs[run] += 1
        self.sources[str(rec.get("source") or "-")] += 1
        self.call_failures.update(fails)
        if error:
            self.episode_errors[_kind(error, "error")] += 1
        self.end_reasons[end] += 1
        if unscored:
            self.unscored[unscored] += 1
        if _number(rec.get("group_reward")) is not None:
            self.group_rewards += 1
        timings = rec.get("timings")
        if isinstance(timings, dict) and (opened := _number(timings.get("open"))) is not None:
            self.open_s[env].append(opened)
        for c in calls:
            if (seconds := _number(c.get("seconds"))) is not None:
                self.call_s[env].append(seconds)

        self.seq += 1
        h = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")
        item = (-h, self.seq, {"env": env, "task": task, "run": run, "reward": reward, "tags": tags, "rec": rec})
        self._offer(self._sample, item, self.max_episodes)
        if self.max_episodes:
            for kind in (*tags, f"end: {end}", f"env: {env}", f"run: {run}"):
                bucket = self._reserved.get(kind)
                if bucket is None:
                    if len(self._reserved) >= _MAX_KINDS:
                        continue
                    bucket = self._reserved[kind] = []
                self._offer(bucket, item, _RESERVED_PER_KIND)

    @staticmethod
    def _offer(heap: list[tuple[int, int, dict[str, Any]]], item: tuple[int, int, dict[str, Any]], size: int) -> None:
        if len(heap) < size:
            heapq.heappush(heap, item)
        elif size and item[0] > heap[0][0]:  # smaller hash than the largest kept
            heapq.heapreplace(heap, item)

    def sample(self) -> tuple[list[dict[str, Any]], int, int]:
        """The embedded episodes in input order; how many of them the byte bound made embed with their long texts
        cut, and how many it left out.

        First, round-robin over the kinds, the reserved episodes (up to half the sample, at least one per
        kind where the sample has room); then the rest by hash. An episode too large for what is left of the
        byte budget is embedded with its texts cut (marked), else left out; the ones after it still get their turn."""
        by_hash = sorted(self._sample, reverse=True)
        buckets = [sorted(b, reverse=True) for _, b in sorted(self._reserved.items())]
        reserve = min(self.max_episodes, max(len(buckets), self.max_episodes // 2))
        order: dict[int, dict[str, Any]] = {}
        for r in range(_RESERVED_PER_KIND):
            for bucket in buckets:
                if len(order) < reserve and r < len(bucket):
                    order.setdefault(bucket[r][1], bucket[r][2])
        for _, seq, ep in by_hash:
            if len(order) >= self.max_episodes:
                break
            order.setdefault(seq, ep)
        chosen, size, clipped, left_out = [], 0, 0, 0
        for seq, ep in order.items():
            rec = ep["rec"]
            ep["rec"] = jsonable(rec)  # JSON.parse-able: no NaN, no lone surrogate, bounded depth
            n = len(json.dumps(ep, ensure_ascii=False))
            if size + n > _SAMPLE_BYTES:
                ep["rec"] = jsonable(rec, max_text=_EMBED_TEXT, fields=None)
                n = len(json.dumps(ep, ensure_ascii=False))
                if size + n > _SAMPLE_BYTES:
                    left_out += 1
                    continue
                clipped += 1
            size += n
            chosen.append((seq, ep))
        chosen.sort(key=lambda x: x[0])
        for _, ep in chosen:
            self.tasks[(ep["env"], ep["task"])].embedded += 1
        return [dict(ep, id=i) for i, (_, ep) in enumerate(chosen)], clipped, left_out


# -- curves -------------------------------------------------------------------------------------------------

# `env/[<name>/]<metric>` as EnvMetrics names them; no name is the total over a mix.
_METRIC_KEY = re.compile(r"^env/(?:(.+?)/)??(reward_mean|graded_fraction|finished_fraction|tool_calls_per_episode|"
                         r"failures/[\w.-]+|session_open_failures|session_open_s/p\d+|tool_call_s/p\d+)$")
_CHARTS = (
    ("reward", "Reward (mean over graded episodes)"),
    ("graded", "Graded fraction (solid) and finished fraction (dashed)"),
    ("calls", "Tool calls per episode"),
    ("failures", "Tool-call failures per logging step"),
    ("latency", "Latency, seconds: p50 (solid), p95 (dashed)"),
)


def _series(state: dict[str, Any], label: str) -> tuple[dict[str, dict[str, list[tuple[float, float]]]], int]:
    """Chart -> series name -> (step, value) points from one trainer state's `log_history`; and its step count."""
    charts: dict[str, dict[str, list[tuple[float, float]]]] = {name: defaultdict(list) for name, _ in _CHARTS}
    steps = set()
    for entry in state.get("log_history") or []:
        if not isinstance(entry, dict) or (step := _number(entry.get("step"))) is None:
            continue
        for key, value in entry.items():
            if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            y = float(value)  # NaN (nothing scored that step) is a gap in the line
            where: tuple[str, str] | None = None
            if key == "reward":
                where = ("reward", "TRL reward (every rollout)")
            elif key == "tools/call_frequency":
                where = ("calls", "TRL tools/call_frequency")
            elif m := _METRIC_KEY.match(key):
                env, metric = m.group(1) or "all environments", m.group(2)
                if metric == "reward_mean":
                    where = ("reward", env)
                elif metric in ("graded_fraction", "finished_fraction"):
                    where = ("graded", f"{env} {metric.split('_')[0]}")
                elif metric == "tool_calls_per_episode":
                    where = ("calls", env)
                elif metric.startswith("failures/") or metric == "session_open_failures":
                    where = ("failures", f"{env}: {metric.removeprefix('failures/')}")
                else:
                    what, q = metric.split("/")
                    where = ("latency", f"{env} {'session open' if what.startswith('session') else 'tool call'} {q}")
            if where is not None:
                name = where[1] if not label else f"{label}: {where[1]}"
                charts[where[0]][name].append((step, y))
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


_VARIANT = re.compile(r" (graded|finished|p\d+)$")


def _svg(chart: dict[str, list[tuple[float, float]]], title: str, uid: str) -> str:
    """One chart as inline SVG (matplotlib, imported here only), its ids made unique in the page."""
    import matplotlib
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    # text.parse_math off: a `$` in a metric or run name is text, not mathtext (which fails on most of them)
    with matplotlib.rc_context({"svg.hashsalt": uid, "svg.fonttype": "none", "font.size": 8, "text.parse_math": False}):
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
            style = "--" if name.endswith((" finished", " p95", " p99")) else "-"
            ax.plot([p[0] for p in points], [p[1] for p in points], style, color=color, label=repair(shorten(name, 60)),
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


def _curves(states: list[_Input]) -> tuple[str, int]:
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
        what = "has no log_history" if not entries else f"has {entries} log_history entries but no reward or env/ metrics"
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
                figures.append(f"<p class=note>{_e(title)}: could not be drawn ({_e(type(exc).__name__)}).</p>")
    note = f"<p class=note>From {html.escape(where)}: {steps} logged step(s).</p>"
    return note + "<div class=charts>" + "".join(figures) + "</div>", steps


# -- the page -------------------------------------------------------------------------------------------------


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _fmt(value: float | None, digits: int = 3) -> str:
    return "–" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value:.1%}"


def _table(headers: Sequence[str], rows: Iterable[Sequence[Any]], cls: str = "") -> str:
    """An HTML table; a cell is text, or (text, sort value) for a sortable table. Every cell is escaped."""
    nums = set()
    body = []
    for row in rows:
        cells = []
        for i, cell in enumerate(row):
            if isinstance(cell, tuple):
                nums.add(i)
                text, value = cell
                v = "" if value is None or (isinstance(value, float) and not math.isfinite(value)) else value
                cells.append(f'<td class=num data-v="{_e(v)}">{_e(text)}</td>')
            else:
                cells.append(f"<td>{_e(cell)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    head = "".join(f"<th{' data-type=num' if i in nums else ''}>{_e(h)}</th>" for i, h in enumerate(headers))
    return f"<table class='{cls}'><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _counts(title: str, counter: Counter[str], total: int, what: str) -> str:
    rows = [(k, (str(n), n), (_pct(n / total if total else None), n)) for k, n in counter.most_common()]
    body = _table(["reason", "count", f"of {what}"], rows) if rows else "<p class=note>none</p>"
    return f"<div class=box><h3>{_e(title)}</h3>{body}</div>"


def _latency_rows(name: str, samples: dict[str, array[float]], envs: list[str]) -> list[list[Any]]:
    rows = []
    scopes = [("all environments", [v for a in samples.values() for v in a])]
    if len(envs) > 1:
        scopes += [(env, list(samples.get(env, ()))) for env in envs]
    for scope, values in scopes:
        values.sort()
        qs = [(f"{_percentile(values, q):.4f}" if values else "–") for q in (0.5, 0.9, 0.95, 0.99)]
        rows.append([name, scope, str(len(values)), *qs, f"{values[-1]:.4f}" if values else "–"])
    return rows


def _summary(eps: _Episodes) -> str:
    t = eps.total
    envs = sorted(eps.envs)
    cards = [
        ("environments", str(len(envs)), ", ".join(envs) or "–"),
        ("runs", str(len(eps.runs)), "by source: " + ", ".join(f"{k} {n}" for k, n in eps.sources.most_common())),
        ("episodes", str(t.episodes), f"{len(eps.tasks)} task(s)"),
        ("mean reward", _fmt(t.mean_reward), f"over {t.graded} graded episode(s)"),
        ("graded", _pct(t.share(t.graded)), "reward is not None"),
        ("finished", _pct(t.share(t.finished)), "the environment said the episode is over"),
        ("tool calls", str(t.calls), f"{_fmt(t.calls / t.episodes if t.episodes else None, 2)} per episode"),
        ("tool-call failures", str(sum(eps.call_failures.values())),
         _pct(sum(eps.call_failures.values()) / t.calls) + " of calls" if t.calls else "–"),
    ]
    if eps.group_rewards:
        cards.append(("group-scored", str(eps.group_rewards), "episodes with a group_reward"))
    out = ["<div class=cards>"]
    out += [f"<div class=card><div class=k>{_e(k)}</div><div class=v>{_e(v)}</div><div class=h>{_e(h)}</div></div>"
            for k, v, h in cards]
    out.append("</div><div class=boxes>")
    out.append(_counts("Tool-call failures by reason (error.kind)", eps.call_failures, t.calls, "calls"))
    out.append(_counts("Episode errors (error.kind)", eps.episode_errors, t.episodes, "episodes"))
    out.append(_counts("End reasons (end_reason)", eps.end_reasons, t.episodes, "episodes"))
    out.append(_counts("Unscored reasons (unscored)", eps.unscored, t.episodes, "episodes"))
    out.append("</div>")
    rows = [[env, (str(x.episodes), x.episodes), (_fmt(x.mean_reward), x.mean_reward),
             (_pct(x.share(x.graded)), x.share(x.graded)), (_pct(x.share(x.finished)), x.share(x.finished)),
             (_pct(x.successes / x.graded if x.graded else None), x.successes / x.graded if x.graded else None),
             (_fmt(x.calls / x.episodes if x.episodes else None, 2), x.calls / x.episodes if x.episodes else None),
             (str(x.failures), x.failures)] for env, x in sorted(eps.envs.items())]
    out.append("<h3>Per environment</h3>")
    out.append(_table(["environment", "episodes", "mean reward", "graded", "finished", "success (of graded)",
                       "tool calls / episode", "tool-call failures"], rows, "sortable"))
    lat = _latency_rows("session open (timings.open)", eps.open_s, envs) + _latency_rows(
        "tool call (seconds)", eps.call_s, envs)
    out.append("<h3>Latency, seconds</h3>")
    out.append(_table(["what", "scope", "n", "p50", "p90", "p95", "p99", "max"], lat))
    return "".join(out)


def _tasks(eps: _Episodes) -> str:
    items = sorted(eps.tasks.items(), key=lambda kv: (-kv[1].episodes, kv[0]))
    note = ""
    if len(items) > _MAX_TASK_ROWS:
        note = f"<p class=note>The {_MAX_TASK_ROWS} tasks with the most attempts of {len(items)}.</p>"
        items = items[:_MAX_TASK_ROWS]
    rows = []
    for (env, task), x in items:
        rate = x.successes / x.episodes if x.episodes else None
        cells = [(f"<td>{_e(env)}</td><td>{_e(task)}</td>")]
        for text, value in ((str(x.episodes), x.episodes), (_pct(rate), rate), (_fmt(x.mean_reward), x.mean_reward),
                            (str(x.graded), x.graded), (str(x.failures), x.failures), (str(x.embedded), x.embedded)):
            cells.append(f'<td class=num data-v="{_e("" if value is None else value)}">{_e(text)}</td>')
        rows.append(f'<tr class=task data-env="{_e(env)}" data-task="{_e(task)}">{"".join(cells)}</tr>')
    heads = ["environment", "task", "attempts", "success rate", "mean reward", "graded", "tool-call failures",
             "in sample"]
    head = "".join(f"<th{' data-type=num' if i > 1 else ''}>{_e(h)}</th>" for i, h in enumerate(heads))
    return (note + "<p class=note>Success: reward &gt; 0 (success rate is over every attempt; mean reward over graded "
            "ones). Click a header to sort, a row to browse that task's episodes.</p>"
            f"<table class='sortable tasks'><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>")


def _json_script(data: Any) -> str:
    """JSON safe inside `<script type=application/json>`: no `<`, `>`, `&` (so no `</script>`, no `<!--`)."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False, default=str)
    return (text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def write_report(inputs: Sequence[str | os.PathLike[str]], output: str | os.PathLike[str], *,
                 max_episodes: int = DEFAULT_MAX_EPISODES, title: str | None = None) -> ReportSummary:
    """Write one self-contained HTML page about `inputs` (see the module docstring) to `output`.

    Args:
        inputs: episode logs and eval outputs (JSON lines), trainer output folders, trainer_state.json files;
            any number, recognised by content.
        output: the HTML file to write (replaced whole, at once).
        max_episodes: episode bodies embedded in the page (a deterministic sample; 0: none).
        title: the page's title (default: names the environments).

    Returns:
        A `ReportSummary`. Raises `ConfigurationError` for an input that is missing, unreadable or not a log, and
        for an `output` that is one of the inputs.
    """
    if isinstance(max_episodes, bool) or not isinstance(max_episodes, int) or max_episodes < 0:
        raise ConfigurationError(f"max_episodes must be an int >= 0, got {max_episodes!r}")
    if not inputs:
        raise ConfigurationError("no inputs given")
    items = _recognise_all(inputs)
    out = Path(output)
    _check_not_an_input(out, items)
    eps = _Episodes(max_episodes)
    skipped: Counter[str] = Counter()
    for item in items:
        if item.kind == "episodes":
            for record in read_records(item.path, skipped):
                if not _is_record(record):
                    skipped["not an episode record"] += 1
                    continue
                try:
                    eps.add(record, item.label)
                except Exception as exc:  # a record shaped like no version: counted on the page, the rest stands
                    skipped[f"unreadable as an episode ({type(exc).__name__})"] += 1
    sample, clipped, left_out = eps.sample()
    states = [i for i in items if i.kind == "trainer_state"]
    curves, steps = _curves(states)
    envs = sorted(eps.envs)
    page_title = title or ("ors-trl report: " + shorten(", ".join(envs), 80) if envs else "ors-trl report")

    n, m = len(sample), eps.total.episodes
    if not m:
        shown = "No episode records were given: pass an episode log or an eval output to browse episodes."
    elif n == m:
        shown = f"Showing all {m} episodes."
    else:
        why = (f"the page embeds at most {_SAMPLE_BYTES // 2**20} MB of episode bodies" if left_out
               else f"--max-episodes {max_episodes}")
        shown = (f"Showing {n} of {m} episodes (sample; {why}). The summary and the task table count every "
                 "episode; the sample is chosen deterministically and keeps examples of every failure, error, "
                 "unscored and end reason, environment and run.")
    if clipped:
        shown += (f" {clipped} episode(s) too large for the {_SAMPLE_BYTES // 2**20} MB of episode bodies a page "
                  f"embeds are shown with every text cut to {_EMBED_TEXT:,} characters (marked).")
    skipped_note = ""
    if skipped:
        skipped_note = (f"<p class=note id=skipped>{skipped.total()} record(s) skipped: "
                        + _e(", ".join(f"{v} {k}" for k, v in sorted(skipped.items(), key=lambda kv: (-kv[1], kv[0]))))
                        + ".</p>")
    nonce = secrets.token_urlsafe(16)
    sources = "".join(f"<li><code>{_e(i.path)}</code> ({'trainer state' if i.kind == 'trainer_state' else 'episodes'})"
                      "</li>" for i in items)
    page = _PAGE.format(
        title=_e(page_title), nonce=nonce, css=_CSS, js=_JS,
        generated=_e(datetime.now(UTC).isoformat(timespec="seconds")), sources=sources,
        summary=skipped_note + _summary(eps), curves=curves, tasks=_tasks(eps), shown=_e(shown),
        data=_json_script(sample),
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(out, repair(page).encode("utf-8"))  # repair: a title or a file name may hold a lone surrogate
    return ReportSummary(output=os.fspath(out), episodes=m, embedded=n, environments=envs, runs=len(eps.runs),
                         tasks=len(eps.tasks), trainer_states=len(states), log_steps=steps,
                         bytes=out.stat().st_size, skipped=skipped.total(), skipped_reasons=dict(skipped))


def _check_not_an_input(out: Path, items: list[_Input]) -> None:
    """Refuse to write the page over a file it is made from (also through a link or another path to it)."""
    for item in items:
        with contextlib.suppress(OSError):  # an output that does not exist (or cannot be looked at) is no input
            if os.path.samefile(out, item.path):
                raise ConfigurationError(f"the output {out} is the input {item.path}: writing the page there would "
                                         "replace it; pass another --output")


def _write_atomic(path: Path, data: bytes) -> None:
    """`data` as `path`, whole or not at all: written to a private temporary file beside it (`mkstemp`: a name
    nobody can predict, created 0600, never through a link someone planted), given the mode `path` has (else the
    usual 0666 less the umask), then renamed over `path`, so a reader never sees half a page."""
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError:
        mask = os.umask(0o022)  # reading the umask means setting it (pip does the same)
        os.umask(mask)
        mode = 0o666 & ~mask
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            os.fchmod(fh.fileno(), mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# -- templates --------------------------------------------------------------------------------------------------
# Filled with str.format: the CSS and the script go in as values, so their braces need no doubling.

_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; script-src 'nonce-{nonce}'; \
style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'">
<title>{title}</title>
<style>{css}</style></head>
<body>
<pre id="js-errors" hidden></pre>
<script nonce="{nonce}">
window.addEventListener("error", function (e) {{
  var box = document.getElementById("js-errors");
  box.hidden = false;
  box.textContent += "JavaScript error: " + (e.message || e) + "\\n";
  document.body.setAttribute("data-js-error", "1");
}});
</script>
<header><h1>{title}</h1>
<p class=note>Generated {generated} by ors-trl from:</p><ul class=sources>{sources}</ul>
<nav><a href="#summary">Summary</a> <a href="#curves">Curves</a> <a href="#tasks">Tasks</a>
<a href="#episodes">Episodes</a></nav></header>
<main>
<section id="summary"><h2>Summary</h2>{summary}</section>
<section id="curves"><h2>Curves over training steps</h2>{curves}</section>
<section id="tasks"><h2>Tasks</h2>{tasks}</section>
<section id="episodes"><h2>Episodes</h2>
<p class=note id="sample-note">{shown}</p>
<div class=filters>
<label>environment <select id="f-env"><option value="">all</option></select></label>
<label>task <select id="f-task"><option value="">all</option></select></label>
<label>run <select id="f-run"><option value="">all</option></select></label>
<label>failure <select id="f-fail"><option value="">all</option><option value="*">any failure or unscored</option>
</select></label>
<label>reward &ge; <input id="f-min" type="number" step="any"></label>
<label>reward &le; <input id="f-max" type="number" step="any"></label>
<button id="f-clear" type="button">clear</button>
<button id="f-expand" type="button">expand shown</button>
</div>
<p id="episode-count" class=note></p>
<div id="episode-list"></div>
<button id="more" type="button" hidden>show more</button>
</section>
</main>
<script type="application/json" id="episode-data">{data}</script>
<script nonce="{nonce}">{js}</script>
</body></html>
"""

_CSS = """
:root { --fg: #1d2330; --muted: #5b6475; --line: #d9dde5; --bg2: #f5f7fa; --bad: #b42318; --good: #067647;
  --warn: #b54708; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: var(--fg); }
body { margin: 0 auto; max-width: 1400px; padding: 0 20px 40px; }
header h1 { font-size: 22px; margin: 18px 0 4px; }
h2 { font-size: 18px; border-bottom: 1px solid var(--line); padding-bottom: 4px; margin-top: 28px; }
h3 { font-size: 14px; margin: 14px 0 6px; }
nav a { margin-right: 14px; }
.note { color: var(--muted); margin: 4px 0; }
.sources { margin: 0 0 8px; color: var(--muted); font-size: 12px; }
code, pre { font: 12px/1.4 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
pre { white-space: pre-wrap; word-break: break-word; margin: 2px 0; background: var(--bg2); padding: 6px 8px;
  border-radius: 4px; max-height: 480px; overflow: auto; }
.cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(170px, 1fr)); gap: 10px; }
.card { border: 1px solid var(--line); border-radius: 6px; padding: 8px 10px; }
.card .k { color: var(--muted); font-size: 12px; } .card .v { font-size: 20px; font-weight: 600; }
.card .h { color: var(--muted); font-size: 11px; overflow-wrap: anywhere; }
.boxes { display: flex; flex-wrap: wrap; gap: 16px; } .box { min-width: 240px; }
table { border-collapse: collapse; font-size: 13px; margin: 4px 0 8px; }
th, td { border: 1px solid var(--line); padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: var(--bg2); } td.num { text-align: right; font-variant-numeric: tabular-nums; }
table.sortable th { cursor: pointer; user-select: none; }
th[aria-sort=ascending]::after { content: " \\25B2"; } th[aria-sort=descending]::after { content: " \\25BC"; }
tr.task { cursor: pointer; } tr.task:hover { background: #eef3ff; }
.charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(520px, 1fr)); gap: 12px; }
figure.chart { margin: 0; border: 1px solid var(--line); border-radius: 6px; padding: 4px; }
figure.chart svg { width: 100%; height: auto; }
.filters { display: flex; flex-wrap: wrap; gap: 10px; align-items: center; background: var(--bg2); padding: 8px;
  border-radius: 6px; position: sticky; top: 0; z-index: 1; }
.filters select { max-width: 260px; } .filters input { width: 80px; }
details.episode { border: 1px solid var(--line); border-radius: 6px; margin: 6px 0; }
details.episode > summary { padding: 6px 10px; cursor: pointer; }
details.episode[open] > summary { border-bottom: 1px solid var(--line); background: var(--bg2); }
.ep-body { padding: 6px 12px 10px; }
.tag { display: inline-block; padding: 0 6px; border-radius: 9px; font-size: 11px; margin-left: 4px;
  border: 1px solid var(--line); }
.tag.bad { color: var(--bad); border-color: var(--bad); } .tag.good { color: var(--good); border-color: var(--good); }
.tag.warn { color: var(--warn); border-color: var(--warn); }
.label { color: var(--muted); font-size: 12px; margin-top: 6px; }
.turn { border-left: 3px solid var(--line); padding-left: 10px; margin: 8px 0; }
.call { border: 1px solid var(--line); border-radius: 4px; padding: 4px 8px; margin: 6px 0; }
.call.failed { border-color: var(--bad); } .err { color: var(--bad); }
.kv { color: var(--muted); font-size: 12px; } .kv b { color: var(--fg); font-weight: 600; }
#js-errors { color: var(--bad); border: 1px solid var(--bad); }
"""

_JS = r"""
(function () {
  "use strict";
  var EPISODES = JSON.parse(document.getElementById("episode-data").textContent);
  var PAGE = 50, LONG = 800;
  var $ = function (id) { return document.getElementById(id); };
  var list = $("episode-list"), more = $("more"), count = $("episode-count");
  var filters = { env: $("f-env"), task: $("f-task"), run: $("f-run"), fail: $("f-fail"), min: $("f-min"),
                  max: $("f-max") };

  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function fmt(x) {
    if (x === null || x === undefined) return "–";
    if (typeof x === "number") return Number.isInteger(x) ? String(x) : String(Math.round(x * 10000) / 10000);
    return String(x);
  }
  function show(v) {
    if (typeof v === "string") return v;
    try { return JSON.stringify(v, null, 2); } catch (err) { return String(v); }
  }
  function tag(text, cls) { return el("span", "tag " + (cls || ""), text); }
  function kv(parent, pairs) {
    var line = el("div", "kv");
    pairs.forEach(function (p) {
      if (p[1] === undefined || p[1] === null || p[1] === "") return;
      line.appendChild(document.createTextNode(p[0] + " "));
      line.appendChild(el("b", null, fmt(p[1])));
      line.appendChild(document.createTextNode("   "));
    });
    if (line.childNodes.length) parent.appendChild(line);
  }
  // Text as it is in the record; long text collapsed (whole, never cut).
  function block(parent, label, value, cls) {
    if (value === undefined || value === null) return;
    var s = show(value), lines = s.split("\n").length;
    if (s.length > LONG || lines > 16) {
      var d = el("details", cls), sum = el("summary", "label");
      sum.textContent = label + " (" + s.length + " characters, " + lines + " lines): " +
        s.slice(0, 100).replace(/\s+/g, " ") + "…";
      d.appendChild(sum);
      d.appendChild(el("pre", null, s));
      parent.appendChild(d);
    } else {
      parent.appendChild(el("div", "label", label));
      parent.appendChild(el("pre", cls, s));
    }
  }
  function errorLine(parent, error, prefix) {
    if (!error) return;
    var text = typeof error === "object" ? (error.kind || "error") + (error.reason ? " (" + error.reason + ")" : "") +
      ": " + (error.message === undefined ? "" : show(error.message)) : show(error);
    parent.appendChild(el("div", "err", prefix + text));
  }
  function call(parent, c, title) {
    var box = el("div", "call" + (c.error ? " failed" : ""));
    var head = el("div");
    head.appendChild(el("b", null, title + (c.name !== undefined && c.name !== null ? c.name : c.tool || "?")));
    if (c.remote_name && c.remote_name !== c.name) head.appendChild(el("span", "kv", "  → remote tool " + c.remote_name));
    if (c.error) head.appendChild(tag("failed: " + (c.error.kind || "error"), "bad"));
    if (c.skipped) head.appendChild(tag("skipped", "warn"));
    box.appendChild(head);
    kv(box, [["reward", c.reward], ["finished", c.finished], ["seconds", c.seconds], ["id", c.id]]);
    if (c.message !== undefined) block(box, "final message", c.message);
    if (c.arguments !== undefined) block(box, "arguments", c.arguments);
    if (c.remote_arguments !== undefined) block(box, "arguments on the wire", c.remote_arguments);
    errorLine(box, c.error, "failure: ");
    if (c.skipped) box.appendChild(el("div", "kv", c.skipped));
    block(box, "output", c.output);
    if (c.metadata !== undefined && c.metadata !== null) block(box, "metadata", c.metadata);
    parent.appendChild(box);
  }
  var SHOWN = {version: 1, run: 1, source: 1, environment: 1, split: 1, task_index: 1, started_at: 1, system: 1,
    prompt: 1, turns: 1, final: 1, reward: 1, group_reward: 1, finished: 1, end_reason: 1, unscored: 1,
    tool_calls: 1, tool_failures: 1, error: 1, timings: 1};
  function body(ep) {
    var r = ep.rec, b = el("div", "ep-body");
    kv(b, [["environment", ep.env], ["task", ep.task], ["run", ep.run], ["source", r.source],
           ["started", r.started_at], ["record version", r.version]]);
    kv(b, [["reward", r.reward], ["group reward", r.group_reward], ["finished", r.finished],
           ["end reason", r.end_reason], ["unscored", r.unscored], ["tool calls", r.tool_calls],
           ["failed", r.tool_failures]]);
    if (r.timings && typeof r.timings === "object") {
      kv(b, Object.keys(r.timings).map(function (k) { return ["time " + k + " (s)", r.timings[k]]; }));
    }
    errorLine(b, r.error, "episode error: ");
    block(b, "system", r.system);
    block(b, "prompt", r.prompt);
    (Array.isArray(r.turns) ? r.turns : []).forEach(function (t, i) {
      if (!t || typeof t !== "object") return;
      var turn = el("div", "turn");
      turn.appendChild(el("div", "label", "turn " + (t.index === undefined ? i : t.index) +
        (t.generation_seconds !== undefined ? " (generation " + fmt(t.generation_seconds) + " s)" : "")));
      if (t.assistant !== null && t.assistant !== undefined && t.assistant !== "") block(turn, "assistant", t.assistant);
      (Array.isArray(t.tool_calls) ? t.tool_calls : []).forEach(function (c) {
        if (c && typeof c === "object") call(turn, c, "tool call: ");
      });
      b.appendChild(turn);
    });
    if (r.final && typeof r.final === "object") {
      if (r.final.tool) call(b, r.final, "final message → terminal tool: ");
      else block(b, "final message", r.final.message);
    }
    if (Array.isArray(r.rewards) && r.rewards.length) block(b, "rewards per call", JSON.stringify(r.rewards));
    var rest = {};
    Object.keys(r).forEach(function (k) { if (!SHOWN[k] && k !== "rewards" && r[k] !== null) rest[k] = r[k]; });
    if (Object.keys(rest).length) block(b, "other fields", rest);
    return b;
  }
  function row(ep) {
    var d = el("details", "episode"), s = el("summary"), r = ep.rec;
    d.id = "episode-" + ep.id;
    s.appendChild(el("b", null, ep.env + " · " + ep.task));
    s.appendChild(document.createTextNode("  reward " + fmt(ep.reward)));
    if (r.group_reward !== undefined && r.group_reward !== null) s.appendChild(document.createTextNode(
      " · group " + fmt(r.group_reward)));
    s.appendChild(tag(r.end_reason || "no end reason", r.finished ? "good" : ""));
    ep.tags.forEach(function (t) { s.appendChild(tag(t, t.indexOf("unscored") === 0 ? "warn" : "bad")); });
    s.appendChild(el("span", "kv", "  " + fmt(r.tool_calls) + " call(s) · run " + ep.run));
    d.appendChild(s);
    d.addEventListener("toggle", function () {
      if (d.open && d.childNodes.length === 1) d.appendChild(body(ep));
    });
    return d;
  }
  function num(input) { var v = parseFloat(input.value); return isNaN(v) ? null : v; }
  function matches(ep) {
    var f = filters, lo = num(f.min), hi = num(f.max);
    if (f.env.value && ep.env !== f.env.value) return false;
    if (f.task.value && ep.task !== f.task.value) return false;
    if (f.run.value && ep.run !== f.run.value) return false;
    if (f.fail.value === "*" && !ep.tags.length) return false;
    if (f.fail.value && f.fail.value !== "*" && ep.tags.indexOf(f.fail.value) < 0) return false;
    if ((lo !== null || hi !== null) && ep.reward === null) return false;
    if (lo !== null && ep.reward < lo) return false;
    if (hi !== null && ep.reward > hi) return false;
    return true;
  }
  var filtered = [], shown = 0;
  function page() {
    var end = Math.min(filtered.length, shown + PAGE);
    for (var i = shown; i < end; i++) list.appendChild(row(filtered[i]));
    shown = end;
    more.hidden = shown >= filtered.length;
  }
  function apply() {
    filtered = EPISODES.filter(matches);
    list.replaceChildren();
    shown = 0;
    page();
    count.textContent = filtered.length + " of " + EPISODES.length + " embedded episode(s) match." +
      (filtered.length || !filters.task.value ? "" : " No episode of this task is in the embedded sample.");
  }
  function options(select, values) {  // keeps the fixed options ("all", "any failure")
    var keep = select.value;
    Array.from(select.options).forEach(function (o) { if (o.value && o.value !== "*") o.remove(); });
    values.forEach(function (v) { var o = el("option", null, v); o.value = v; select.appendChild(o); });
    select.value = values.indexOf(keep) >= 0 ? keep : "";
  }
  function uniq(key, eps) {
    var seen = {};
    eps.forEach(function (ep) { [].concat(ep[key]).forEach(function (v) { seen[v] = 1; }); });
    return Object.keys(seen).sort();
  }
  function taskOptions() {
    var env = filters.env.value;
    options(filters.task, uniq("task", EPISODES.filter(function (ep) { return !env || ep.env === env; })));
  }
  options(filters.env, uniq("env", EPISODES));
  options(filters.run, uniq("run", EPISODES));
  options(filters.fail, uniq("tags", EPISODES));
  taskOptions();
  filters.env.addEventListener("change", function () { taskOptions(); apply(); });
  ["task", "run", "fail"].forEach(function (k) { filters[k].addEventListener("change", apply); });
  ["min", "max"].forEach(function (k) { filters[k].addEventListener("input", apply); });
  $("f-clear").addEventListener("click", function () {
    ["env", "run", "fail", "min", "max"].forEach(function (k) { filters[k].value = ""; });
    taskOptions(); filters.task.value = ""; apply();
  });
  function expand() { list.querySelectorAll("details.episode").forEach(function (d) { d.open = true; }); }
  $("f-expand").addEventListener("click", expand);
  more.addEventListener("click", page);

  document.querySelectorAll("table.sortable").forEach(function (table) {
    var heads = table.tHead.rows[0].cells;
    Array.from(heads).forEach(function (th, col) {
      th.addEventListener("click", function () {
        var up = th.getAttribute("aria-sort") !== "ascending", numeric = th.getAttribute("data-type") === "num";
        Array.from(heads).forEach(function (h) { h.removeAttribute("aria-sort"); });
        th.setAttribute("aria-sort", up ? "ascending" : "descending");
        var rows = Array.from(table.tBodies[0].rows);
        rows.sort(function (a, b) {
          var x = a.cells[col], y = b.cells[col], c;
          if (numeric) {
            var p = parseFloat(x.getAttribute("data-v")), q = parseFloat(y.getAttribute("data-v"));
            p = isNaN(p) ? -Infinity : p; q = isNaN(q) ? -Infinity : q;
            c = p === q ? 0 : (p < q ? -1 : 1);
          } else {
            c = x.textContent.localeCompare(y.textContent);
          }
          return up ? c : -c;
        });
        rows.forEach(function (r) { table.tBodies[0].appendChild(r); });
      });
    });
  });
  document.querySelectorAll("tr.task").forEach(function (tr) {
    tr.addEventListener("click", function () {
      filters.env.value = tr.getAttribute("data-env");
      taskOptions();
      var task = tr.getAttribute("data-task");
      if (Array.from(filters.task.options).every(function (o) { return o.value !== task; })) {
        var o = el("option", null, task); o.value = task; filters.task.appendChild(o);
      }
      filters.task.value = task;
      ["run", "fail", "min", "max"].forEach(function (k) { filters[k].value = ""; });
      apply();
      $("episodes").scrollIntoView();
    });
  });
  apply();
  if (location.hash === "#expand") expand();
  document.body.setAttribute("data-report-ready", "1");
})();
"""
