"""Static task selection: keep the tasks whose known mean reward lies in a range (`OpenRewardSpec(difficulty=...)`),
known from an `ors-trl eval --output` file, an episode log, a `{task_index: mean}` mapping or the OpenReward platform
(`PlatformDifficulty`). Unscored episodes are left out of a mean; tasks with no data are kept.
"""

from __future__ import annotations

import logging
import math
import os
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..core.records import read_records
from ..protocol.errors import ConfigurationError
from .selection import is_int

__all__ = ["Difficulty", "PlatformDifficulty", "bins", "check_range", "describe", "histogram", "known_rewards",
           "platform_known", "select_by_difficulty"]

logger = logging.getLogger("ors_trl")


@dataclass(frozen=True)
class PlatformDifficulty:
    """The OpenReward platform's per-task difficulty as `difficulty_from=` (catalog environments only).

    Args:
        model_name (`str`, *optional*):
            Only rollouts logged under this model name.
        min_model_params (`int`, *optional*):
            Only rollouts of models with at least this many parameters.
        max_model_params (`int`, *optional*):
            Only rollouts of models with at most this many parameters.
        training_stage (`str`, *optional*):
            Only rollouts of this stage: `"pretrained"`, `"sft"` or `"rl"`.
    """

    model_name: str | None = None
    min_model_params: int | None = None
    max_model_params: int | None = None
    training_stage: Literal["pretrained", "sft", "rl"] | None = None

    def __post_init__(self) -> None:
        if self.training_stage not in (None, "pretrained", "sft", "rl"):
            raise ConfigurationError(
                f'training_stage must be "pretrained", "sft" or "rl", got {self.training_stage!r}')
        for name in ("min_model_params", "max_model_params"):
            value = getattr(self, name)
            if value is not None and not is_int(value, 0):
                raise ConfigurationError(f"{name} must be a non-negative int, got {value!r}")

    def params(self) -> dict[str, str]:
        """The query parameters of the platform's `task-difficulty` endpoint."""
        return {k: str(v) for k, v in vars(self).items() if v is not None}


@dataclass(frozen=True)
class Difficulty:
    """What is known of a task: its mean reward over `count` scored episodes (or logged rollouts)."""

    mean: float
    count: int


def check_range(difficulty: Any) -> tuple[float, float]:
    """`difficulty=(low, high)` checked."""
    try:
        low, high = (float(x) for x in difficulty)
    except (TypeError, ValueError):
        raise ConfigurationError(f"difficulty must be a (low, high) pair of numbers, got {difficulty!r}") from None
    if not (math.isfinite(low) and math.isfinite(high)) or low > high:
        raise ConfigurationError(f"difficulty must be (low, high) with finite low <= high, got {difficulty!r}")
    return low, high


def known_rewards(source: str | os.PathLike[str] | Mapping[int, float], *, split: str,
                  environment: str | None = None) -> dict[int, Difficulty]:
    """Per task index of `split`: the mean reward a log recorded (of `environment`'s), or a mapping's value."""
    if isinstance(source, Mapping):
        out = {}
        for task, mean in source.items():
            if not is_int(task) or not isinstance(mean, int | float) or not math.isfinite(mean):
                raise ConfigurationError(f"difficulty_from as a mapping takes {{task_index: mean reward}}, got "
                                         f"{task!r}: {mean!r}")
            out[task] = Difficulty(float(mean), 1)
        return out
    path = Path(source)
    if not path.is_file():
        raise ConfigurationError(f"difficulty_from: {path} is not a file; pass an `ors-trl eval --output` file, an "
                                 "episode log, a {task_index: mean reward} mapping, or PlatformDifficulty() for a "
                                 "catalog environment.")
    skipped: Counter[str] = Counter()
    rewards: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    records = 0
    for record in read_records(path, skipped):
        records += 1
        if record.get("split") != split or not isinstance(record.get("task_index"), int):
            continue
        reward = record.get("reward")
        if isinstance(reward, int | float) and not isinstance(reward, bool) and math.isfinite(reward):
            rewards[str(record.get("environment") or "")][record["task_index"]].append(float(reward))
    if not records:
        raise ConfigurationError(f"difficulty_from: {path} holds no episode record ({sum(skipped.values())} lines "
                                 "that are not one); pass an `ors-trl eval --output` file or an episode log.")
    envs = sorted(rewards)
    if environment is not None and len(envs) > 1:
        envs = [e for e in envs if e.lower() == environment.lower()]
    if len(envs) != 1:
        found = ", ".join(sorted(rewards)) or "none"
        raise ConfigurationError(f"difficulty_from: {path} has no scored episodes of split {split!r}"
                                 + (f" of environment {environment!r}" if environment and rewards else "")
                                 + f" (environments with scored episodes of it: {found}).")
    return {task: Difficulty(sum(r) / len(r), len(r)) for task, r in rewards[envs[0]].items()}


def select_by_difficulty(indices: Sequence[int], known: Mapping[int, Difficulty], low: float, high: float, *,
                         name: str, source: str) -> list[int]:
    """The indices whose known mean lies in `[low, high]`, and those with no data; one log line says so."""
    kept = [i for i in indices if i not in known or low <= known[i].mean <= high]
    unknown = sum(1 for i in indices if i not in known)
    means = [d.mean for d in known.values()]
    if (low < 0 or high > 1) and means and all(0 <= m <= 1 for m in means):
        logger.warning("%s: difficulty=(%g, %g) reaches outside [0, 1], but every known mean reward lies within it "
                       "(binary or [0, 1] rewards?): that part of the range matches nothing.", name, low, high)
    if not kept:
        raise ConfigurationError(
            f"{name}: difficulty=({low:g}, {high:g}) keeps none of the {len(indices)} selected tasks (known from "
            f"{source}: {histogram(means)}); widen the range, or select other tasks.")
    logger.warning("%s: difficulty=(%g, %g) from %s keeps %d of %d tasks (%d of them with no data, kept).",
                   name, low, high, source, len(kept), len(indices), unknown)
    return kept


def bins(means: Sequence[float], count: int = 5) -> list[dict[str, float]]:
    """`count` equal bins over the means' range (`[0, 1]` when within), the last one closed."""
    if not means:
        return []
    low, high = min(0.0, min(means)), max(1.0, max(means))
    width = (high - low) / count
    tally = Counter(min(int((m - low) / width), count - 1) for m in means)
    return [{"low": low + b * width, "high": low + (b + 1) * width, "tasks": tally[b]} for b in range(count)]


def histogram(means: Sequence[float], count: int = 5) -> str:
    """`bins` in one line: `[0, 0.2): 3, ..., [0.8, 1]: 4`."""
    parts = bins(means, count)
    return ", ".join(f"[{b['low']:.3g}, {b['high']:.3g}{']' if i == len(parts) - 1 else ')'}: {b['tasks']}"
                     for i, b in enumerate(parts)) or "no task with data"


async def platform_known(client: Any, split: str, source: PlatformDifficulty) -> tuple[dict[int, Difficulty], str]:
    """The platform's per-task difficulty of `split` as what is known of each task, and where it came from."""
    params = source.params()
    raw = await client.task_difficulty(split, params)
    filters = ", ".join(f"{k}={v}" for k, v in params.items())
    return ({i: Difficulty(mean, n) for i, (mean, n) in raw.items()},
            "the OpenReward platform" + (f" ({filters})" if filters else ""))


async def describe(target: str, split: str, source: Any, *, environment: str | None = None,
                   **client_options: Any) -> dict[str, Any]:
    """What is known of a split's difficulty, for `ors-trl inspect --difficulty` (`client_options`: AsyncClient's)."""
    from ..protocol.client import AsyncClient

    async with AsyncClient(target, env_name=environment, **client_options) as client:
        if isinstance(source, PlatformDifficulty):
            known, where = await platform_known(client, split, source)
        else:
            known, where = known_rewards(source, split=split, environment=environment), str(source)
        total = await client.num_tasks(split)
    means = [d.mean for d in known.values()]
    return {"split": split, "source": where, "tasks": total, "with_data": len(known),
            "episodes": sum(d.count for d in known.values()), "mean": sum(means) / len(means) if means else None,
            "bins": bins(means, 10)}
