"""Runs side by side: a row per run (success, pass@k with an interval over tasks, tool-call health) and, for every
run sharing tasks with the first one (the baseline), the tasks that changed, those that flipped, and a paired test.

A task's success is its share of successful episodes (its pass@1); it is solved at a share of at least one half,
and flipped when solved in one run and not the other. The test (`ors_trl.core.stats.paired_test`, a sign-flip
permutation test) compares the two runs' per-task shares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.metrics import EpisodeStats
from ..core.stats import paired_test, pass_over_tasks
from .tally import RunKey, Tally

#: The p-value under which a difference is called beyond noise.
ALPHA = 0.05


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
    """A run against the baseline over the tasks both ran: each task's two cells, largest change first."""

    base: Run
    other: Run
    tasks: list[tuple[tuple[str, str], EpisodeStats, EpisodeStats]]
    base_rate: float
    other_rate: float
    p: float
    method: str

    def flipped(self, up: bool) -> list[tuple[str, str]]:
        """The tasks solved in the other run and not in the baseline (`up`), or the other way round."""
        return [task for task, a, b in self.tasks
                if (b if up else a).success_rate >= 0.5 > (a if up else b).success_rate]


def runs(tally: Tally) -> list[Run]:
    """Every run with episodes, in order: the labelled ones as labelled, then the others as first read."""
    cells: dict[RunKey, dict[tuple[str, str], EpisodeStats]] = {}
    for (run, env, task), stats in tally.run_tasks.items():
        cells.setdefault(run, {})[(env, task)] = stats
    out = []
    for key, stats in tally.runs.items():
        if not stats.episodes:
            continue
        tasks = cells.get(key, {})
        out.append(Run(key, tally.run_names[key], stats, tasks, *pass_over_tasks(tasks.values())))
    return out


def pairs(rows: list[Run]) -> list[Pair]:
    """Each later run against the first, over the tasks both ran (runs that share none are left out)."""
    if len(rows) < 2:
        return []
    base, out = rows[0], []
    for other in rows[1:]:
        shared = [(task, base.tasks[task], cell) for task, cell in other.tasks.items() if task in base.tasks]
        if not shared:
            continue
        diffs = {task: b.success_rate - a.success_rate for task, a, b in shared}
        shared.sort(key=lambda t: (-abs(diffs[t[0]]), -diffs[t[0]], t[0]))
        p, method = paired_test([diffs[task] for task, _, _ in shared])
        out.append(Pair(base, other, shared, sum(a.success_rate for _, a, _ in shared) / len(shared),
                        sum(b.success_rate for _, _, b in shared) / len(shared), p, method))
    return out


def headline(pair: Pair) -> dict[str, Any]:
    """The pair in words and numbers, for the page's first lines."""
    change, beyond = pair.other_rate - pair.base_rate, pair.p < ALPHA
    return {
        "text": (f"{pair.other.name} vs {pair.base.name}: success {pair.base_rate:.1%} → {pair.other_rate:.1%} "
                 f"({100 * change:+.1f} points) over {len(pair.tasks)} shared task(s); paired test over tasks "
                 f"p = {pair.p:.3g} ({pair.method}): {'beyond' if beyond else 'within'} noise (p < {ALPHA:g} is "
                 "beyond)."),
        "verdict": ("better" if change > 0 else "worse") if beyond else "noise",
    }
