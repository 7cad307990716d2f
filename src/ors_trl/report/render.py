"""The page: one self-contained HTML file from the tallies, the sample and the curves.

The package's data files `page.html`, `page.css` and `page.js` are put inside it: its Content-Security-Policy
forbids any other source but the thumbnails' PNG `data:` URLs. Record text is untrusted: whatever is rendered here
is HTML-escaped, the episode bodies travel as JSON with `<`, `>` and `&` escaped, and the page's script writes them
with `textContent` only. A thumbnail is kept only when its file's bytes hash to the record's SHA-256.
"""

from __future__ import annotations

import hashlib
import html
import json
import math
import secrets
from array import array
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from importlib.resources import files
from pathlib import Path
from string import Template
from typing import Any

from ..core.metrics import EpisodeStats, _percentile
from ..core.records import _SHA256
from ..protocol.images import MAX_IMAGE_BYTES, thumbnail
from ..protocol.text import cut, repair
from . import compare as _compare
from .charts import curves
from .inputs import Input
from .tally import EMBED_TEXT, SAMPLE_BYTES, Sample, Tally

_MAX_ROWS = 10_000  # per table of tasks or runs; the ones with the most episodes are shown
THUMB_SIZE = 160  # pixels on the longer side
THUMB_BYTES = 4 * 1024 * 1024  # thumbnails a page embeds, in all


def _data(name: str) -> str:
    """One of the package's data files (`page.html`, `page.css`, `page.js`)."""
    return files(__package__).joinpath(name).read_text(encoding="utf-8")


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _fmt(value: float | None, digits: int = 3) -> str:
    return "–" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value:.1%}"


def _f(value: float | None, digits: int = 3) -> tuple[str, float | None]:
    return _fmt(value, digits), value


def _p(value: float | None) -> tuple[str, float | None]:
    return _pct(value), value


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


def _stats_cells(s: EpisodeStats) -> list[Any]:
    """The `_STATS_HEADS` cells of one scope."""
    return [s.episodes, _f(s.mean_reward), _p(s.coverage), _p(s.share(s.finished)), _p(s.success_rate),
            _f(s.share(s.tool_calls), 2), s.tool_failures, _p(s.no_call_rate)]


def _counts(title: str, counter: Counter[str], total: int, what: str) -> str:
    rows = [(k, n, (_pct(n / total if total else None), n)) for k, n in counter.most_common()]
    body = _table(["reason", "count", f"of {what}"], rows) if rows else "<p class=note>none</p>"
    return f"<div class=box><h3>{_e(title)}</h3>{body}</div>"


def _latency_rows(name: str, samples: dict[str, array[float]], envs: list[str]) -> list[list[Any]]:
    """p50, p90, p95, p99 and max over every environment, then per environment where there are several."""
    scopes = [("all environments", sorted(v for a in samples.values() for v in a))]
    scopes += [(env, sorted(samples.get(env, ()))) for env in envs] if len(envs) > 1 else []
    return [[name, scope, str(len(values)), *([f"{_percentile(values, q):.4f}" for q in (0.5, 0.9, 0.95, 0.99)]
                                              + [f"{values[-1]:.4f}"] if values else ["–"] * 5)]
            for scope, values in scopes]


def _summary(t: Tally) -> str:
    s = t.total
    envs = sorted(t.envs)
    cards = [
        ("environments", str(len(envs)), ", ".join(envs) or "–"),
        ("runs", str(sum(1 for r in t.runs.values() if r.episodes)),
         "by source: " + ", ".join(f"{k} {n}" for k, n in t.sources.most_common())),
        ("episodes", str(s.episodes), f"{len(t.tasks)} task(s)"),
        ("mean reward", _fmt(s.mean_reward), f"over {s.scored} graded episode(s)"),
        ("success rate", _pct(s.success_rate), f"reward ≥ {t.success_threshold:g}, of every episode"),
        ("graded", _pct(s.coverage), "reward is not None"),
        ("finished", _pct(s.share(s.finished)), "the environment said the episode is over"),
        ("tool calls", str(s.tool_calls), f"{_fmt(s.share(s.tool_calls), 2)} per episode"),
        ("tool-call failures", str(s.tool_failures),
         _pct(s.tool_failures / s.tool_calls) + " of calls" if s.tool_calls else "–"),
        ("no tool call", _pct(s.no_call_rate), "of episodes: the model called no tool"),
        ("unparsed tool calls", str(s.unparsed_turns),
         f"{_pct(s.unparsed_rate)} of model turns wrote tool-call markup that parsed to no call"),
        ("malformed arguments", str(s.malformed_calls), "calls refused: arguments not the tool's schema"),
    ]
    if s.group_scored:
        cards.append(("group-scored", str(s.group_scored), "episodes with a group_reward"))
    if s.sessions:
        cards.append(("session-seconds", f"{s.session_seconds:.0f}",
                      f"{s.session_seconds_unscored:.0f} on unscored episodes; {s.sessions} session(s)"))
    counts = [("Tool-call failures by reason (error.kind; a terminal tool's grading included)", t.call_failures,
               s.tool_calls, "calls"), ("Episode errors (error.kind)", t.episode_errors, s.episodes, "episodes"),
              ("End reasons (end_reason)", s.end_reasons, s.episodes, "episodes"),
              ("Unscored reasons (unscored)", s.unscored, s.episodes, "episodes")]
    latency = (_latency_rows("session open (timings.open)", t.open_s, envs)
               + _latency_rows("tool call (seconds)", t.call_s, envs))
    return ("<div class=cards>" + "".join(f"<div class=card><div class=k>{_e(k)}</div><div class=v>{_e(v)}</div>"
                                          f"<div class=h>{_e(h)}</div></div>" for k, v, h in cards)
            + "</div><div class=boxes>" + "".join(_counts(*c) for c in counts) + "</div><h3>Per environment</h3>"
            + _table(["environment", *_STATS_HEADS], ([env, *_stats_cells(x)] for env, x in sorted(t.envs.items())),
                     "sortable")
            + "<h3>Latency, seconds</h3>" + _table(["what", "scope", "n", "p50", "p90", "p95", "p99", "max"], latency))


def _runs(t: Tally) -> str:
    """The first section: a row per run, then each run against the first one, task by task."""
    rows = _compare.runs(t)
    if not rows:
        return "<p class=note>No episodes.</p>"
    pairs = _compare.pairs(rows)
    out = [f"<p class=headline data-verdict={h['verdict']}>{_e(h['text'])}</p>" for h in map(_compare.headline, pairs)]
    if len(rows) > 1 and not pairs:
        out.append("<p class=note>The runs share no task, so none is compared task by task.</p>")
    k_max = max((max(r.pass_at_k, default=1) for r in rows), default=1)

    def row(r: _compare.Run) -> list[Any]:
        s, one, k = r.stats, r.pass_at_k.get(1), max(r.pass_at_k, default=1)
        lo, hi = r.interval or (None, None)
        return [r.name, s.episodes, len(r.tasks), _p(s.success_rate),
                (_fmt(one) + (f" [{lo:.2f}, {hi:.2f}]" if lo is not None else ""), one),
                (f"pass@{k} {_fmt(r.pass_at_k[k])}" if k > 1 else "–", r.pass_at_k.get(k) if k > 1 else None),
                _f(s.mean_reward), _p(s.coverage), _f(s.share(s.tool_calls), 2), _p(s.no_call_rate),
                _p(s.unparsed_rate), s.malformed_calls]

    def of(x: EpisodeStats) -> tuple[str, float]:
        return f"{_pct(x.success_rate)} of {x.episodes}", x.success_rate

    heads = ["run", "episodes", "tasks", "success rate", "pass@1 [95% over tasks]", f"pass@k (k ≤ {k_max})",
             "mean reward", "graded", "tool calls / episode", "no tool call", "unparsed turns", "malformed calls"]
    out.append("<h3>Per run</h3>" + _table(heads, map(row, rows[:_MAX_ROWS]), "sortable runs"))
    for p in pairs:
        out.append(f"<h3>{_e(p.other.name)} vs {_e(p.base.name)}, per task (largest change first)</h3>")
        for up, what in ((True, "solved now, not before"), (False, "solved before, not now")):
            flipped = p.flipped(up)
            names = ", ".join(f"{env} {task}" for env, task in flipped[:12]) + (" …" if len(flipped) > 12 else "")
            out.append(f"<p class='flipped {'up' if up else 'down'}'>Flipped, {what}: {len(flipped)}"
                       + (f" ({_e(names)})" if flipped else "") + "</p>")
        rows_html = [[env, task, of(a), of(b), (f"{100 * (b.success_rate - a.success_rate):+.1f}",
                                                b.success_rate - a.success_rate)]
                     for (env, task), a, b in p.tasks[:_MAX_ROWS]]
        out.append(_table(["environment", "task", f"success: {p.base.name}", f"success: {p.other.name}",
                           "change (points)"], rows_html, "sortable compare"))
    return "".join(out)


def _tasks(t: Tally) -> str:
    ranked = sorted(t.tasks.items(), key=lambda kv: (-kv[1].episodes, kv[0]))  # the most episodes first
    items = ranked[:_MAX_ROWS]
    note = (f"<p class=note>The {_MAX_ROWS} tasks with the most episodes of {len(ranked)}.</p>"
            if len(ranked) > _MAX_ROWS else "")
    rows = [[env, task, *_stats_cells(x), t.embedded[(env, task)]] for (env, task), x in items]
    attrs = [f' class=task data-env="{_e(env)}" data-task="{_e(task)}"' for (env, task), _ in items]
    return (note + f"<p class=note>Success: reward &ge; {t.success_threshold:g} (success rate is over every "
            "episode, an unscored one counts as no success; mean reward over graded ones). Click a header to sort, a "
            "row to browse that task's episodes.</p>"
            + _table(["environment", "task", *_STATS_HEADS, "in sample"], rows, "sortable tasks", attrs))


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
        shown = (f"Showing {n} of {m} episodes (sample; {why}). The summary and the task table count every "
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


def render(items: Sequence[Input], tally: Tally, sample: Sample, skipped: Counter[str],
           title: str | None) -> tuple[str, int]:
    """The page, and the number of logged training steps its curves draw."""
    thumbnails(items, sample)
    curves_html, steps = curves([i for i in items if i.kind == "trainer_state"])
    envs = sorted(tally.envs)
    page_title = title or ("ors-trl report: " + cut(", ".join(envs), 80) if envs else "ors-trl report")
    reasons = ", ".join(f"{v} {k}" for k, v in sorted(skipped.items(), key=lambda kv: (-kv[1], kv[0])))
    skipped_note = (f"<p class=note id=skipped>{skipped.total()} record(s) skipped: {_e(reasons)}.</p>"
                    if skipped else "")
    sources = "".join(f"<li><code>{_e(i.path)}</code> ({'trainer state' if i.kind == 'trainer_state' else 'episodes'})"
                      "</li>" for i in items)
    page = Template(_data("page.html")).substitute(
        title=_e(page_title), nonce=secrets.token_urlsafe(16), css=_data("page.css"), js=_data("page.js"),
        generated=_e(datetime.now(UTC).isoformat(timespec="seconds")), sources=sources,
        runs=_runs(tally), summary=skipped_note + _summary(tally), curves=curves_html, tasks=_tasks(tally),
        shown=_e(_shown(tally, sample)), data=_json_script(sample.episodes),
    )
    return repair(page), steps  # repair: a title or a file name may hold a lone surrogate
