"""How an episode's per-call rewards become its reward (design decision 15), and the returns per turn: the user
chooses the rule (`OpenRewardSpec(reward=...)`: `last`, the default, `sum`, `max`, `discounted:<gamma>` or a
callable); every reader of a reward reads `Episode.reward`, which applies it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..protocol.errors import ConfigurationError

__all__ = ["RewardRule", "reward_rule"]

_SIMPLE: dict[str, Callable[[list[float], Any], float]] = {
    "last": lambda scored, _: scored[-1], "sum": lambda scored, _: sum(scored), "max": lambda scored, _: max(scored)}
RULES = (*_SIMPLE, "discounted")


@dataclass(frozen=True)
class RewardRule:
    """A rule from per-call rewards (in call order, `None` where a call gave none) to the episode's reward; `None`
    when nothing was scored. `name` is what records and logs call it."""

    name: str
    fn: Callable[[list[float], Any], float | None] = field(repr=False)

    def __call__(self, rewards: Sequence[float | None], episode: Any = None) -> float | None:
        scored = [r for r in rewards if r is not None]
        if not scored:
            return None
        out = self.fn(list(rewards) if self.name.startswith("callable") else scored, episode)
        if out is None:
            return None
        if isinstance(out, bool) or not isinstance(out, int | float) or not math.isfinite(out):
            raise ConfigurationError(f"the reward rule {self.name} returned {out!r}, not a finite number or None")
        return float(out)

    def returns(self, rewards: Sequence[float | None], episode: Any = None) -> list[float]:
        """Per call, the rule over the rewards from that call on (0.0 where none is left), `episode` handed to a
        callable as `__call__` hands it: per-turn credit."""
        return [self(rewards[k:], episode) or 0.0 for k in range(len(rewards))]


def reward_rule(rule: str | Callable[..., float | None] | RewardRule | None) -> RewardRule:
    """The rule `OpenRewardSpec(reward=...)` names: `"last"`, `"sum"`, `"max"`, `"discounted:<gamma>"` (gamma in
    (0, 1], over the scored calls in order), or `f(rewards, episode) -> float | None` (all per-call rewards, `None`
    where absent, and the `Episode`); `None` is `"last"`."""
    if isinstance(rule, RewardRule):
        return rule
    rule = "last" if rule is None else rule
    if isinstance(rule, str) and rule in _SIMPLE:
        return RewardRule(rule, _SIMPLE[rule])
    if isinstance(rule, str) and rule.startswith("discounted"):
        try:
            gamma = float(rule.partition(":")[2] or 0.99)
        except ValueError:
            gamma = math.nan
        if not 0 < gamma <= 1:
            raise ConfigurationError(
                f"reward={rule!r}: the discount must be a number in (0, 1], e.g. 'discounted:0.99'")
        return RewardRule(f"discounted:{gamma:g}", lambda scored, _: sum(r * gamma**k for k, r in enumerate(scored)))
    if callable(rule):
        return RewardRule(f"callable:{getattr(rule, '__qualname__', type(rule).__name__)}", rule)
    raise ConfigurationError(f"reward must be one of {', '.join(RULES)} ('discounted:<gamma>'), or a callable "
                             f"f(rewards, episode) -> float | None; got {rule!r}")
