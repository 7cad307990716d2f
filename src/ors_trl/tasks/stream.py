"""The `train_dataset` of a spec (or mix) with `task_sampling` other than "uniform": an endless stream of task rows,
each drawn by a sampler as TRL reads it, a batch or two before its group runs (`shuffle` is a no-op: a buffer would
draw far ahead). On resume, trained steps read a filler row, then the pending draws are replayed.
"""

from __future__ import annotations

import itertools
import random
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from datasets import Dataset, IterableDataset

from ..protocol.errors import ConfigurationError
from .sampling import Curriculum, mirror_path, rng_state, set_rng_state

__all__ = ["DrawSource", "TaskStream", "sampled_stream"]

#: Draws kept for a resume when the trainer's batching is not GRPO's (the position trained on is then unknown).
MAX_PENDING = 4096


class NotMapStyleError(ConfigurationError, TypeError):
    """A task stream was asked for its length or a row by index (a consumer that needs a map-style dataset)."""


class TaskStream(IterableDataset):
    """Rows drawn as they are read: no length, no indexing (a `ConfigurationError`, also a `TypeError`, says so)."""

    def shuffle(self, *args: Any, **kwargs: Any) -> TaskStream:
        """The stream itself: a shuffle buffer would draw far ahead of the rewards."""
        return self

    def __len__(self) -> int:
        raise NotMapStyleError(
            "task_sampling= gives an IterableDataset whose rows are drawn as training goes: it has no length or "
            "indexing. Train with TRL >= 1.16's GRPOTrainer (or AsyncGRPOTrainer) and GRPOConfig(max_steps=N), or use "
            "task_sampling='uniform' for a trainer that needs a map-style Dataset.")

    def __getitem__(self, key: Any) -> Any:
        return len(self)


def _rows(source: DrawSource) -> Iterator[dict[str, Any]]:
    for position in itertools.count():
        yield source.row(position)


class DrawSource:
    """Draws the stream's rows: an environment by weight (by default its number of tasks), then a task by its
    curriculum. `where`: (environment, task) -> row of `rows`; `owners`: the specs by environment (`None`: a lone
    spec); `on_bind` is called with the source at each reading's first read until it binds (sets it None): the TRL
    layer finds its trainer there, also after a look at a row before training."""

    def __init__(self, rows: Dataset, where: Mapping[tuple[str | None, int], int], owners: Mapping[str | None, Any],
                 *, weights: list[float] | None = None, seed: int = 0,
                 on_bind: Callable[[DrawSource], None] | None = None) -> None:
        self.rows, self.where, self.owners = rows, dict(where), dict(owners)
        self.envs = list(self.owners)
        counts = [sum(1 for env, _ in self.where if env == name) for name in self.envs]
        self.weights = weights if weights is not None else [float(c) for c in counts]
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.on_bind = on_bind  # None once bound
        self.drew = False  # this process has read the stream (TRL's async trainer reads it in its worker only)
        self._tracking = True
        self._skip = 0  # reads to answer with a filler (the steps a resumed trainer drops)
        self._replay: deque[tuple[str | None, int]] = deque()  # drawn before the checkpoint, not yet trained on
        self._recent: deque[tuple[int, str | None, int]] = deque()  # (position, env, task) drawn since `consumed`
        self._consumed = 0

    @property
    def curricula(self) -> dict[str | None, Curriculum]:
        """Each environment's curriculum (its spec's, which its episodes report to)."""
        return {env: spec.curriculum for env, spec in self.owners.items()}

    def __reduce__(self) -> tuple[Any, ...]:
        """A copy for TRL's async rollout worker: it draws on from this state, its curricula writing mirror files."""
        for c in self.curricula.values():
            c.mirror = c.mirror or mirror_path(c.name)
        mirrors = {env: c.mirror for env, c in self.curricula.items()}
        samplers = {env: c.sampler for env, c in self.curricula.items()}
        return (_rebuild, (self.rows, self.where, self.owners, samplers, mirrors, self.weights, self.state_dict()))

    def row(self, position: int) -> dict[str, Any]:
        """The row at `position` of this reading of the stream (a fresh iteration starts at 0)."""
        with self._lock:
            if position == 0:  # a new reading: no earlier reading's draw is trained on now
                self._recent.clear()
                if self.on_bind is not None:  # until a trainer binds it
                    self.on_bind(self)
            if position < self._skip:
                return self.rows[0]
            if self._replay:
                env, task = self._replay.popleft()
            else:
                env = self.envs[0] if len(self.envs) == 1 else self._rng.choices(self.envs, self.weights)[0]
                task = self.curricula[env].draw()
            if (env, task) not in self.where:
                raise ConfigurationError(
                    f"{getattr(self.owners.get(env), 'name', env)}: its task sampler drew task {task!r}, which is not "
                    f"one of the {sum(e == env for e, _ in self.where)} tasks selected; draw() must return one of "
                    "those indices (or: resumed from a checkpoint of another selection).")
            self.drew = True
            if self._tracking:
                self._recent.append((position, env, task))
            return self.rows[self.where[(env, task)]]

    def trim(self, consumed: int | None) -> None:
        """Forget the draws before stream position `consumed` (unknown: keep the last `MAX_PENDING`)."""
        with self._lock:
            if consumed is None:
                consumed = self._recent[-1][0] + 1 - MAX_PENDING if self._recent else 0
            self._consumed = max(consumed, 0)
            while self._recent and self._recent[0][0] < consumed:
                self._recent.popleft()

    def reseed(self, seed: int) -> None:
        """Seed the mixture draw and the samplers made from a name (before the first draw; the trainer's seed)."""
        self._rng.seed(seed)
        for c in self.curricula.values():
            if c.draws == 0 and hasattr(c.sampler, "reseed"):
                c.sampler.reseed(seed)

    def state_dict(self) -> dict[str, Any]:
        """The curricula's and mixture's states, the draws trained on, and those read since (replayed on resume)."""
        with self._lock:
            return {"rng": rng_state(self._rng), "consumed": self._consumed,
                    "pending": [[env, task] for _, env, task in self._recent],
                    "curricula": {env or "": c.state_dict() for env, c in self.curricula.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from `state_dict()`'s output: a new reading of the stream skips and replays to where it stood."""
        set_rng_state(self._rng, state["rng"])
        for env, c in self.curricula.items():
            if (env or "") in state["curricula"]:
                c.load_state_dict(state["curricula"][env or ""])
        self._consumed = self._skip = int(state.get("consumed") or 0)
        self._replay = deque((None if env is None else str(env), int(task)) for env, task in state.get("pending", ()))
        self._recent.clear()


def _rebuild(rows: Dataset, where: Mapping[tuple[str | None, int], int], owners: Mapping[str | None, Any],
             samplers: Mapping[str | None, Any], mirrors: Mapping[str | None, str], weights: list[float],
             state: dict[str, Any]) -> DrawSource:
    """The copy in TRL's async worker: it draws on from `state`, feeding the samplers that came along."""
    for env, spec in owners.items():
        c = spec.curriculum = spec.curriculum or Curriculum(samplers[env], spec.runtime)
        c.sampler, c.mirror, c.writes_mirror = samplers[env], mirrors[env], True
        c.draws = int(state["curricula"][env or ""]["draws"])
        c.take()
    source = DrawSource(rows, where, owners, weights=weights)
    set_rng_state(source._rng, state["rng"])
    source._tracking = False
    return source


def sampled_stream(rows: Dataset, where: Mapping[tuple[str | None, int], int], owners: Mapping[str | None, Any],
                   tasks: Mapping[str | None, list[int]], *, weights: list[float] | None = None, seed: int = 0,
                   on_bind: Callable[[DrawSource], None] | None = None) -> TaskStream:
    """The endless `TaskStream` of `rows` drawn by the owners' curricula (see `DrawSource`), in one data shard so
    that every process reads the whole stream and draws what the others draw."""
    for env, spec in owners.items():
        bind = getattr(spec.curriculum.sampler, "bind", None)
        if callable(bind):
            bind(tasks[env])
    source = DrawSource(rows, where, owners, weights=weights, seed=seed, on_bind=on_bind)
    stream = IterableDataset.from_generator(_rows, features=rows.features, gen_kwargs={"source": source})
    stream.__class__ = TaskStream  # `from_generator` builds the plain class; the stream adds only the methods above
    stream.source = source
    return stream
