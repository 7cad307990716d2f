"""`OpenRewardMix`: several ORS environments in one training run.

    mix = OpenRewardMix({"terminal": OpenRewardSpec("kanishk/EndlessTerminals", num_tasks=64),
                         "math": OpenRewardSpec("http://127.0.0.1:8000", env_name="sparseenvironment")},
                        weights={"terminal": 0.75, "math": 0.25})
    GRPOTrainer(..., train_dataset=mix.train_dataset, environment_factory=mix.environment_factory,
                reward_funcs=mix.reward_funcs)

The dataset carries TRL's `environment` routing column, the factory is the `{name: factory}` dict
TRL accepts (TRL then renders each environment's tools only for that environment's rows), and the
reward function scores every rollout with its own environment's reward. Metrics are reported per
environment (`env/<name>/...`) and over all of them (`env/...`).
"""

from __future__ import annotations

import json
import logging
import random
import re
from collections.abc import Callable, Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

from ._engine import TASK_KEY, RolloutEngine
from ._exceptions import ConfigurationError
from ._loop import get_loop
from ._metrics import EnvMetrics
from ._spec import RESERVED_COLUMNS, OpenRewardSpec, reward_function, task_columns

if TYPE_CHECKING:
    from datasets import Dataset

__all__ = ["OpenRewardMix"]

logger = logging.getLogger("ors_trl")

#: The column TRL routes rows by in multi-environment mode.
ENVIRONMENT_COLUMN = "environment"


def _key(name: str) -> str:
    return re.sub(r"[^0-9A-Za-z_.-]+", "_", name).strip("_") or "env"


def mixture_counts(sizes: Sequence[int], weights: Sequence[float]) -> list[int]:
    """Rows per environment so that their shares follow `weights`, keeping the total at `sum(sizes)`.

    Largest-remainder rounding; every environment with a positive weight keeps at least one row.
    """
    total = sum(sizes)
    wsum = sum(weights)
    raw = [total * w / wsum for w in weights]
    counts = [int(r) for r in raw]
    for i in sorted(range(len(raw)), key=lambda i: raw[i] - counts[i], reverse=True)[: total - sum(counts)]:
        counts[i] += 1
    return [max(c, 1) if w > 0 else 0 for c, w in zip(counts, weights, strict=True)]


def sample_rows(n_rows: int, count: int, rng: random.Random) -> list[int]:
    """`count` row positions out of `n_rows`: whole passes over the rows, then a seeded sample of the rest."""
    out = list(range(n_rows)) * (count // n_rows)
    out += sorted(rng.sample(range(n_rows), count % n_rows))
    return out


class OpenRewardMix:
    """Combine several `OpenRewardSpec`s into one set of `GRPOTrainer` inputs.

    Args:
        specs: a list of specs (named after each spec's environment) or a `{name: spec}` dict.
        weights: sampling weights, as a list aligned with `specs` or a `{name: weight}` dict: the
            share of the dataset each environment gets (rows are repeated or subsampled to match,
            deterministically for `seed`). None keeps every spec's tasks once.
        seed: seed for that sampling.
        episode_log: a JSON-lines file receiving every finished episode of every environment.
        unscored_reward: as on `OpenRewardSpec`: the reward of rollouts never scored (None: unscored).
    """

    def __init__(self, specs: Sequence[OpenRewardSpec] | Mapping[str, OpenRewardSpec], *,
                 weights: Sequence[float] | Mapping[str, float] | None = None, seed: int = 0,
                 episode_log: str | None = None, unscored_reward: float | None = None) -> None:
        if isinstance(specs, Mapping):
            named = [(str(k), v) for k, v in specs.items()]
        else:
            named = []
            taken: set[str] = set()
            for spec in specs:
                base = _key(spec.name) if isinstance(spec, OpenRewardSpec) else "env"
                name, n = base, 2
                while name in taken:
                    name, n = f"{base}_{n}", n + 1
                taken.add(name)
                named.append((name, spec))
        if not named:
            raise ConfigurationError("OpenRewardMix needs at least one OpenRewardSpec")
        for name, spec in named:
            if not isinstance(spec, OpenRewardSpec):
                raise ConfigurationError(f"{name!r} is a {type(spec).__name__}, not an OpenRewardSpec")
        if len({id(s) for _, s in named}) != len(named):
            raise ConfigurationError("the same OpenRewardSpec object appears twice; create one spec per entry")
        self.specs: dict[str, OpenRewardSpec] = dict(named)
        if len(self.specs) != len(named):
            raise ConfigurationError("environment names in a mix must be unique")
        self.weights = self._weights(weights)
        self.seed = seed
        self.unscored_reward = None if unscored_reward is None else float(unscored_reward)
        self.metrics = EnvMetrics()
        recorder = None
        if episode_log is not None:
            from ._records import EpisodeRecorder

            recorder = EpisodeRecorder(episode_log)
        for name, spec in self.specs.items():
            rt = spec._runtime
            rt.name = name
            rt.metrics = self.metrics
            self.metrics.set_open_sessions_gauge(name, lambda rt=rt: rt.client.open_sessions)
            if recorder is not None:
                rt.recorder = recorder
        self.dataset_notes: list[str] = []

    def __repr__(self) -> str:
        return f"OpenRewardMix({list(self.specs)}, weights={self.weights})"

    def _weights(self, weights: Sequence[float] | Mapping[str, float] | None) -> list[float] | None:
        if weights is None:
            return None
        if isinstance(weights, Mapping):
            unknown = set(weights) - set(self.specs)
            if unknown:
                raise ConfigurationError(f"weights name unknown environments {sorted(unknown)}; known: {list(self.specs)}")
            values = [float(weights.get(name, 0.0)) for name in self.specs]
        else:
            values = [float(w) for w in weights]
            if len(values) != len(self.specs):
                raise ConfigurationError(f"got {len(values)} weights for {len(self.specs)} environments")
        if any(w < 0 or w != w for w in values) or sum(values) <= 0:
            raise ConfigurationError("weights must be non-negative numbers with a positive sum")
        return values

    # -- trainer inputs ----------------------------------------------------------------------------

    @cached_property
    def train_dataset(self) -> Dataset:
        """Every environment's tasks with TRL's `environment` routing column, in the mixture's proportions."""
        from datasets import Dataset

        async def fetch_all() -> list[tuple[list[int], list[Any]]]:
            import asyncio

            return list(await asyncio.gather(*(spec._fetch_tasks() for spec in self.specs.values())))

        fetched = get_loop().run(fetch_all())
        names = list(self.specs)
        sizes = [len(indices) for indices, _ in fetched]
        counts = sizes if self.weights is None else mixture_counts(sizes, self.weights)
        rng = random.Random(self.seed)
        env_col: list[str] = []
        index_col: list[int] = []
        prompts: list[list[dict[str, Any]]] = []
        tasks: list[Any] = []
        for name, (indices, specs_tasks), count in zip(names, fetched, counts, strict=True):
            if not indices:
                continue
            spec = self.specs[name]
            for pos in sample_rows(len(indices), count, rng):
                index = indices[pos]
                env_col.append(name)
                index_col.append(index)
                identity = json.dumps({"env": name, "split": spec.split, "index": index})
                prompts.append([{"role": "user", "content": "", TASK_KEY: identity}])
                tasks.append(specs_tasks[pos] if spec._include_metadata else {})
        rows: dict[str, list[Any]] = {"prompt": prompts, "task_index": index_col, ENVIRONMENT_COLUMN: env_col}
        columns, notes = task_columns(tasks, RESERVED_COLUMNS | {ENVIRONMENT_COLUMN})
        self.dataset_notes = notes
        for note in notes:
            (logger.info if "is reserved" in note else logger.warning)("mix: %s", note)
        rows.update(columns)
        return Dataset.from_dict(rows)

    @cached_property
    def environment_factory(self) -> dict[str, Callable[[], Any]]:
        """`{name: factory}`, the multi-environment form of TRL's `environment_factory`."""
        return {name: spec.environment_factory for name, spec in self.specs.items()}

    @property
    def reward_funcs(self) -> Callable[..., list[float | None]]:
        """Each rollout's own environment's outcome reward (picklable)."""
        return reward_function(self.unscored_reward)

    @cached_property
    def rollout_func(self) -> RolloutEngine:
        """The concurrent rollout engine over every environment of the mix (use instead of environment_factory)."""
        first = next(iter(self.specs.values()))
        return RolloutEngine(
            {name: spec.engine_environment() for name, spec in self.specs.items()},
            max_concurrent_tool_calls=first._max_concurrent_tool_calls,
            episode_timeout=first._episode_timeout,
        )

    @cached_property
    def callbacks(self) -> list[Any]:
        """Trainer callbacks: release sessions after each step and close them all at the end of training."""
        from ._callback import SessionCleanupCallback

        return [SessionCleanupCallback([spec._runtime for spec in self.specs.values()])]

    def close(self) -> None:
        """Close every session of every environment."""
        for spec in self.specs.values():
            spec.close()
