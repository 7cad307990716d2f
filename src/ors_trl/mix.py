"""`OpenRewardMix`: several ORS environments in one training run.

    mix = OpenRewardMix({"terminal": OpenRewardSpec("kanishk/EndlessTerminals", num_tasks=64),
                         "math": OpenRewardSpec("http://127.0.0.1:8000", env_name="sparseenvironment")},
                        weights={"terminal": 0.75, "math": 0.25})
    GRPOTrainer(..., train_dataset=mix.train_dataset, environment_factory=mix.environment_factory,
                reward_funcs=mix.reward_funcs)

The dataset carries TRL's `environment` routing column, the factory is the `{name: factory}` dict TRL accepts (TRL
then renders each environment's tools only for that environment's rows), and the reward functions score every rollout
with its own environment. Metrics are reported per environment (`env/<name>/...`) and over all of them (`env/...`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

from .core.metrics import EnvMetrics
from .protocol.errors import ConfigurationError, checked_keywords
from .spec import OpenRewardSpec, _check, _train_dataset, _TrainerInputs, _writer

if TYPE_CHECKING:
    from datasets import Dataset, IterableDataset

    from .evaluation.runner import EvalOptions, MixEvalReport

__all__ = ["OpenRewardMix"]

def _key(name: str) -> str:
    return re.sub(r"[^0-9A-Za-z_.-]+", "_", name).strip("_") or "env"


class OpenRewardMix(_TrainerInputs):
    """Combine several `OpenRewardSpec`s into one set of `GRPOTrainer` inputs.

    Args:
        specs (`Sequence[OpenRewardSpec]` or `Mapping[str, OpenRewardSpec]`):
            A list of specs (named after each spec's environment) or a `{name: spec}` dict.
        weights (`Sequence[float]` or `Mapping[str, float]`, *optional*):
            Each environment's share of the dataset (rows repeated or subsampled, seeded; with task sampling, of the
            draws), a list aligned with `specs` or a `{name: weight}` dict. `None` keeps every spec's tasks once.
        seed (`int`, *optional*, defaults to `0`):
            Seed for that sampling.
        episode_log (`str`, *optional*):
            As for `OpenRewardSpec`, for every environment's episodes.
        unscored_reward (`float`, *optional*):
            As for `OpenRewardSpec`.
        gather_window (`float`, *optional*):
            As for `OpenRewardSpec`, for the whole mix; `None`: the specs' own (which must agree).

    The specs' `success_threshold`s must agree: the mix's metrics count successes with it.
    """

    _what = "mix"
    _unscored_groups = "group_reward_func needs score_groups=True on at least one spec of the mix"
    _parts = property(lambda self: self.specs)
    _unscored_reward = property(lambda self: self.unscored_reward)

    @checked_keywords
    def __init__(self, specs: Sequence[OpenRewardSpec] | Mapping[str, OpenRewardSpec], *,
                 weights: Sequence[float] | Mapping[str, float] | None = None, seed: int = 0,
                 episode_log: str | None = None, unscored_reward: float | None = None,
                 gather_window: float | None = None) -> None:
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
        _check(0, integer=False, optional=True, gather_window=gather_window)
        self.gather_window = gather_window
        thresholds = {spec.runtime.metrics.success_threshold for _, spec in named}
        if len(thresholds) > 1:
            raise ConfigurationError(f"the specs of this mix count success differently (success_threshold "
                                     f"{sorted(thresholds)}); give them one success_threshold")
        self.metrics = EnvMetrics(thresholds.pop())
        writer = _writer(episode_log)
        for name, spec in self.specs.items():
            spec.runtime.rename(name, self.metrics, writer)
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
        if any(w < 0 or not math.isfinite(w) for w in values) or sum(values) <= 0:
            raise ConfigurationError("weights must be finite non-negative numbers with a positive sum")
        return values

    @cached_property
    def train_dataset(self) -> Dataset | IterableDataset:
        """Every environment's tasks with TRL's `environment` routing column, in the mixture's proportions; with a
        spec's `task_sampling`, an endless `datasets.IterableDataset` whose rows draw their environment by the
        weights, then their task by its sampler (seeded passes for the uniform specs)."""
        dataset, self.dataset_notes = _train_dataset(self.specs, "mix", self.weights, self.seed)
        return dataset

    @cached_property
    def environment_factory(self) -> dict[str, Callable[[], Any]]:
        """`{name: factory}`, the multi-environment form of TRL's `environment_factory`."""
        return {name: spec.environment_factory for name, spec in self.specs.items()}

    def evaluate(self, policy: Any, options: EvalOptions | None = None, **kwargs: Any) -> MixEvalReport:
        """Evaluate `policy` on each environment of the mix in turn, through its spec's `evaluate`; `output` is one
        file for every environment's episodes (each names its environment). The `MixEvalReport` holds each
        environment's `EvalReport` and the overall numbers, weighted by the mix's weights (else by episodes).

        Args:
            policy (`str`, a `(model, tokenizer)` pair or a `Policy`):
                What to evaluate, as for `OpenRewardSpec.evaluate`.
            options (`EvalOptions`, *optional*):
                How to run, for every environment; `**kwargs` set its fields (`EvalOptions` documents them).
        """
        from .evaluation.policies import resolve_policy
        from .evaluation.runner import EvalOptions, MixEvalReport, check_support

        opts = EvalOptions.of(options, **kwargs)
        for spec in self.specs.values():  # said before any environment plays (hours, maybe), not after
            _ = spec._tools  # discovers what the environment supports
            check_support(spec._runtime, opts)
        loaded = resolve_policy(policy, opts)  # once for every environment
        reports = {name: spec.evaluate(loaded, opts, resume=opts.resume or (i > 0 and opts.output is not None),
                                       overwrite=opts.overwrite and i == 0, _others=list(self.specs))
                   for i, (name, spec) in enumerate(self.specs.items())}
        return MixEvalReport.of(reports, dict(zip(self.specs, self.weights, strict=True)) if self.weights else None)
