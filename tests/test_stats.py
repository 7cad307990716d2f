"""The statistics behind pass@k and the comparison of runs, checked against brute force: pass@k by enumerating every
k-subset of a task's episodes, the paired test by enumerating every sign pattern, the interval against its bounds."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from ors_trl import ConfigurationError
from ors_trl.core.stats import check_threshold, paired_test, pass_at_k, pass_at_ks, wilson


def brute_pass_at_k(outcomes: list[bool], k: int) -> float:
    """The share of k-subsets of the episodes holding at least one success."""
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_is_the_share_of_k_subsets_with_a_success(n: int) -> None:
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(outcomes, k), abs=1e-12), (n, c, k)


def test_pass_at_k_over_tasks_is_the_mean_up_to_the_fewest_episodes() -> None:
    rng = random.Random(7)
    tasks = [[rng.random() < p for _ in range(n)] for p, n in ((0.1, 5), (0.5, 4), (0.9, 6), (0.0, 4), (1.0, 7))]
    got = pass_at_ks((len(t), sum(t)) for t in tasks)
    assert list(got) == [1, 2, 3, 4]  # the fewest episodes of a task: 4
    for k, value in got.items():
        assert value == pytest.approx(sum(brute_pass_at_k(t, k) for t in tasks) / len(tasks), abs=1e-12)
    assert pass_at_ks([]) == {} and pass_at_ks([(0, 0)]) == {}
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)
    # exact for many episodes too (big binomials, no overflow or cancellation)
    assert pass_at_k(400, 1, 200) == pytest.approx(0.5) and pass_at_k(1000, 0, 500) == 0.0


def test_wilson_interval() -> None:
    lo, hi = wilson(0.5, 20)
    assert lo < 0.5 < hi and hi - 0.5 == pytest.approx(0.5 - lo)  # symmetric at one half
    assert wilson(0.0, 10)[0] == 0.0 and 0.0 < wilson(0.0, 10)[1] < 0.35  # never degenerate at the edges
    assert wilson(1.0, 10)[1] == pytest.approx(1.0) and wilson(1.0, 10)[0] > 0.65
    assert wilson(0.3, 1000)[1] - wilson(0.3, 1000)[0] < wilson(0.3, 50)[1] - wilson(0.3, 50)[0]
    # coverage: over many binomial draws the 95% interval holds the true share about 95% of the time
    rng = random.Random(1)
    held = sum(lo <= 0.3 <= hi for lo, hi in (wilson(sum(rng.random() < 0.3 for _ in range(40)) / 40, 40)
                                              for _ in range(2000)))
    assert 0.92 < held / 2000 < 0.98


def brute_paired(differences: list[float]) -> float:
    observed = abs(sum(differences))
    patterns = list(itertools.product((1, -1), repeat=len(differences)))
    return sum(abs(sum(s * d for s, d in zip(signs, differences, strict=True))) >= observed - 1e-9
               for signs in patterns) / len(patterns)


def test_paired_test_is_the_exact_sign_flip_test() -> None:
    cases = [[1, 1, 1, 1, 1, 1], [1, -1, 1, 1, 0, 0, 1], [0.5, 0.25, -0.25, 1, 0.75, 0.5, 0.25, -1], [0.0, 0.0],
             [1.0] * 10 + [-1.0] * 2]
    for diffs in cases:
        p, method = paired_test(diffs)
        assert method == "exact" and p == pytest.approx(brute_paired(diffs)), diffs
    assert paired_test([1, 1, 1, 1, 1, 1])[0] == pytest.approx(2 / 64)  # the two-sided sign test
    assert paired_test([])[0] == 1.0


def test_paired_test_many_distinct_differences_uses_the_normal_approximation() -> None:
    rng = random.Random(3)
    diffs = [rng.gauss(0.3, 1.0) for _ in range(60)]  # continuous values: the sums never coincide
    p, method = paired_test(diffs)
    z = abs(sum(diffs)) / math.sqrt(sum(d * d for d in diffs))
    assert method == "normal" and p == pytest.approx(math.erfc(z / math.sqrt(2)))


def test_threshold_outside_the_rewards_seen_is_refused() -> None:
    check_threshold(1.0, [0.0, 1.0, None])
    check_threshold(0.5, [0.0, 1.0])
    check_threshold(5.0, [None, None])  # nothing scored: nothing to check
    with pytest.raises(ConfigurationError, match=r"outside the rewards seen \(0 to 1\): no episode"):
        check_threshold(2.0, [0.0, 1.0])
    with pytest.raises(ConfigurationError, match="every episode would count as a success"):
        check_threshold(-1.0, [0.0, 0.5])
