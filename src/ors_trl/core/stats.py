"""Statistics over tasks: the unbiased pass@k (1 - C(n-c, k) / C(n, k), Chen et al., 2021; over tasks, the mean),
an interval for pass@1 and a paired test between two runs, both with tasks as the sample.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

from ..protocol.errors import ConfigurationError
from ..protocol.text import label, task_label
from .metrics import EpisodeStats

__all__ = ["check_threshold", "label", "paired_test", "pass_at_k", "pass_at_ks", "pass_over_tasks", "task_label",
           "wilson"]

_Z95 = 1.959963984540054  # the standard normal's 97.5% quantile
_MAX_SUMS = 200_000  # distinct partial sums the exact paired test keeps before it uses the normal approximation


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one task with `n` episodes, `c` of them successes (`0 < k <= n`)."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_at_ks(counts: Iterable[tuple[int, int]]) -> dict[int, float]:
    """pass@k over tasks given as `(n, c)` pairs, for k = 1 .. the fewest episodes of a task; `{}` for no task."""
    pairs = [(n, c) for n, c in counts if n > 0]
    if not pairs:
        return {}
    return {k: sum(pass_at_k(n, c, k) for n, c in pairs) / len(pairs) for k in range(1, min(n for n, _ in pairs) + 1)}


def pass_over_tasks(tasks: Collection[Any]) -> tuple[dict[int, float], tuple[float, float] | None]:
    """pass@k over tasks (each an `EpisodeStats`) and the 95% interval of pass@1 (`wilson`; None for no task)."""
    passed = pass_at_ks((t.episodes, t.successes) for t in tasks)
    return passed, (wilson(passed[1], len(tasks)) if passed else None)


def wilson(p: float, n: int) -> tuple[float, float]:
    """The 95% Wilson score interval of a share `p` of `n`; for the mean pass@1 of `n` tasks it is exact with one
    episode per task and conservative with several (a per-task pass@1 with mean p varies at most p(1 - p))."""
    if n <= 0:
        return (0.0, 1.0)
    z2 = _Z95 * _Z95
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = _Z95 * math.sqrt(max(p * (1 - p), 0.0) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def paired_test(differences: Sequence[float]) -> tuple[float, str]:
    """Two-sided p-value that the mean of paired per-task differences is zero, by a sign-flip permutation test:
    `"exact"` while the distinct sums stay few, else its `"normal"` approximation."""
    d = [x for x in differences if x != 0]
    if not d:
        return 1.0, "exact"
    observed = abs(sum(d))
    sums: dict[float, int] = {0.0: 1}
    for x in d:
        grown: defaultdict[float, int] = defaultdict(int)
        for s, ways in sums.items():
            grown[round(s + x, 9)] += ways
            grown[round(s - x, 9)] += ways
        sums = grown
        if len(sums) > _MAX_SUMS:
            z = observed / math.sqrt(sum(x * x for x in d))
            return math.erfc(z / math.sqrt(2)), "normal"
    return sum(ways for s, ways in sums.items() if abs(s) >= observed - 1e-9) / 2 ** len(d), "exact"


def check_threshold(threshold: float, rewards: Iterable[float | None]) -> None:
    """Refuse a success threshold outside the rewards seen (every episode, or none, would succeed)."""
    scored = [r for r in rewards if r is not None and math.isfinite(r)]
    if scored and not min(scored) <= threshold <= max(scored):
        raise ConfigurationError(
            f"success threshold {threshold:g} is outside the rewards seen ({min(scored):g} to {max(scored):g}): "
            f"{'no' if threshold > max(scored) else 'every'} episode would count as a success. Pass a threshold "
            "within them (the default 1.0 suits environments that reward 0 or 1).")


def by_task(episodes: Iterable[tuple[Any, Any]], success_threshold: float,
            count: Callable[[EpisodeStats, Any], None] = EpisodeStats.add_record
            ) -> tuple[EpisodeStats, dict[Any, EpisodeStats], dict[int, float], tuple[float, float] | None]:
    """`(task, episode)` pairs counted overall and per task (`count`), then `pass_over_tasks`: an eval's report."""
    stats = EpisodeStats(success_threshold)
    tasks: dict[Any, EpisodeStats] = {}
    for task, episode in episodes:
        count(stats, episode)
        count(tasks.setdefault(task, EpisodeStats(success_threshold)), episode)
    return stats, tasks, *pass_over_tasks(tasks.values())
