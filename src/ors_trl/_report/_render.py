"""The page: one self-contained HTML file from the tallies, the sample and the curves.

The skeleton, the styles and the script are the package's data files `page.html`, `page.css` and `page.js`,
put inside the page, so nothing is fetched when it opens (its Content-Security-Policy forbids any other
source). Record text is untrusted: whatever is rendered here is HTML-escaped, the episode bodies travel
as JSON in a `<script type="application/json">` block with `<`, `>` and `&` escaped, and the page's
script writes them with `textContent` only. Records are shown as written (secrets were masked before
they were written): nothing is unescaped and nothing else is read.

Definitions: an episode is graded when its reward is not None; mean reward is over graded episodes;
success is a reward at or above the threshold, and a success rate is over every episode.
"""

from __future__ import annotations

import html
import json
import math
import secrets
from array import array
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from importlib.resources import files
from string import Template
from typing import Any

from .._metrics import EpisodeStats, _percentile
from .._text import repair, shorten
from ._charts import curves
from ._inputs import Input
from ._tally import EMBED_TEXT, SAMPLE_BYTES, Sample, Tally

_MAX_ROWS = 10_000  # per table of tasks or runs; the ones with the most episodes are shown


def _data(name: str) -> str:
    """One of the package's data files (`page.html`, `page.css`, `page.js`)."""
    return files(__package__).joinpath(name).read_text(encoding="utf-8")


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _fmt(value: float | None, digits: int = 3) -> str:
    return "–" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value:.1%}"


def _table(headers: Sequence[str], rows: Iterable[Sequence[Any]], cls: str = "",
           row_attrs: Iterable[str] | None = None) -> str:
    """An HTML table; a cell is text, or (text, sort value) for a sortable table. Every cell is escaped."""
    nums = set()
    body = []
    attrs = iter(row_attrs or ())
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
        body.append(f"<tr{next(attrs, '')}>" + "".join(cells) + "</tr>")
    head = "".join(f"<th{' data-type=num' if i in nums else ''}>{_e(h)}</th>" for i, h in enumerate(headers))
    return f"<table class='{cls}'><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


_STATS_HEADS = ("episodes", "mean reward", "graded", "finished", "success rate", "tool calls / episode",
                "tool-call failures")


def _stats_cells(s: EpisodeStats) -> list[tuple[str, float | None]]:
    """The `_STATS_HEADS` cells of one scope."""
    calls = s.share(s.tool_calls)
    return [(str(s.episodes), s.episodes), (_fmt(s.mean_reward), s.mean_reward), (_pct(s.coverage), s.coverage),
            (_pct(s.share(s.finished)), s.share(s.finished)), (_pct(s.success_rate), s.success_rate),
            (_fmt(calls, 2), calls), (str(s.tool_failures), s.tool_failures)]


def _most(scopes: Mapping[Any, EpisodeStats], what: str) -> tuple[list[tuple[Any, EpisodeStats]], str]:
    """The scopes with the most episodes (at most `_MAX_ROWS`), and a note when some were left out."""
    items = sorted(scopes.items(), key=lambda kv: (-kv[1].episodes, kv[0]))
    if len(items) <= _MAX_ROWS:
        return items, ""
    return items[:_MAX_ROWS], f"<p class=note>The {_MAX_ROWS} {what} with the most episodes of {len(items)}.</p>"


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


def _summary(t: Tally) -> str:
    s = t.total
    envs = sorted(t.envs)
    cards = [
        ("environments", str(len(envs)), ", ".join(envs) or "–"),
        ("runs", str(len(t.runs)), "by source: " + ", ".join(f"{k} {n}" for k, n in t.sources.most_common())),
        ("episodes", str(s.episodes), f"{len(t.tasks)} task(s)"),
        ("mean reward", _fmt(s.mean_reward), f"over {s.scored} graded episode(s)"),
        ("success rate", _pct(s.success_rate), f"reward ≥ {t.success_threshold:g}, of every episode"),
        ("graded", _pct(s.coverage), "reward is not None"),
        ("finished", _pct(s.share(s.finished)), "the environment said the episode is over"),
        ("tool calls", str(s.tool_calls), f"{_fmt(s.share(s.tool_calls), 2)} per episode"),
        ("tool-call failures", str(s.tool_failures),
         _pct(s.tool_failures / s.tool_calls) + " of calls" if s.tool_calls else "–"),
    ]
    if s.group_scored:
        cards.append(("group-scored", str(s.group_scored), "episodes with a group_reward"))
    if s.sessions:
        cards.append(("session-seconds", f"{s.session_seconds:.0f}",
                      f"{s.session_seconds_unscored:.0f} on unscored episodes; {s.sessions} session(s)"))
    out = ["<div class=cards>"]
    out += [f"<div class=card><div class=k>{_e(k)}</div><div class=v>{_e(v)}</div><div class=h>{_e(h)}</div></div>"
            for k, v, h in cards]
    out.append("</div><div class=boxes>")
    out.append(_counts("Tool-call failures by reason (error.kind; a terminal tool's grading included)",
                       t.call_failures, s.tool_calls, "calls"))
    out.append(_counts("Episode errors (error.kind)", t.episode_errors, s.episodes, "episodes"))
    out.append(_counts("End reasons (end_reason)", s.end_reasons, s.episodes, "episodes"))
    out.append(_counts("Unscored reasons (unscored)", s.unscored, s.episodes, "episodes"))
    out.append("</div>")
    out.append("<h3>Per environment</h3>")
    out.append(_table(["environment", *_STATS_HEADS], ([env, *_stats_cells(x)] for env, x in sorted(t.envs.items())),
                      "sortable"))
    runs, note = _most(t.runs, "runs")
    out.append("<h3>Per run</h3>" + note)
    out.append(_table(["run", *_STATS_HEADS], ([run, *_stats_cells(x)] for run, x in runs), "sortable"))
    lat = _latency_rows("session open (timings.open)", t.open_s, envs) + _latency_rows(
        "tool call (seconds)", t.call_s, envs)
    out.append("<h3>Latency, seconds</h3>")
    out.append(_table(["what", "scope", "n", "p50", "p90", "p95", "p99", "max"], lat))
    return "".join(out)


def _tasks(t: Tally) -> str:
    items, note = _most(t.tasks, "tasks")
    rows = [[env, task, *_stats_cells(x), (str(t.embedded[(env, task)]), t.embedded[(env, task)])]
            for (env, task), x in items]
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


def render(items: Sequence[Input], tally: Tally, sample: Sample, skipped: Counter[str],
           title: str | None) -> tuple[str, int]:
    """The page, and the number of logged training steps its curves draw."""
    curves_html, steps = curves([i for i in items if i.kind == "trainer_state"])
    envs = sorted(tally.envs)
    page_title = title or ("ors-trl report: " + shorten(", ".join(envs), 80) if envs else "ors-trl report")
    skipped_note = ""
    if skipped:
        skipped_note = (f"<p class=note id=skipped>{skipped.total()} record(s) skipped: "
                        + _e(", ".join(f"{v} {k}" for k, v in sorted(skipped.items(), key=lambda kv: (-kv[1], kv[0]))))
                        + ".</p>")
    sources = "".join(f"<li><code>{_e(i.path)}</code> ({'trainer state' if i.kind == 'trainer_state' else 'episodes'})"
                      "</li>" for i in items)
    page = Template(_data("page.html")).substitute(
        title=_e(page_title), nonce=secrets.token_urlsafe(16), css=_data("page.css"), js=_data("page.js"),
        generated=_e(datetime.now(UTC).isoformat(timespec="seconds")), sources=sources,
        summary=skipped_note + _summary(tally), curves=curves_html, tasks=_tasks(tally),
        shown=_e(_shown(tally, sample)), data=_json_script(sample.episodes),
    )
    return repair(page), steps  # repair: a title or a file name may hold a lone surrogate
