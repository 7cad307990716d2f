"""Choosing tasks as training goes: the seeded samplers (their state goes into checkpoints), and the `Curriculum` that
feeds one environment's sampler its episodes' rewards, a group per task (`AdaptiveSampler` draws where they differ).
"""

from __future__ import annotations

import functools
import json
import math
import os
import random
import re
import secrets
import tempfile
import threading
import time
from collections import defaultdict, deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ..core.episode import TRAINING_SOURCES
from ..protocol.errors import ConfigurationError
from ..protocol.files import write_atomic
from .selection import is_int

__all__ = ["AdaptiveSampler", "Curriculum", "TaskSampler", "UniformSampler", "make_sampler", "mirror_path",
           "rng_state", "set_rng_state", "uniform_draws"]

_EQUAL = 1e-9  # rewards closer than this are equal (a group with no spread has no advantage)
#: AdaptiveSampler's pools: "fresh" (never drawn), "unscored", "mixed", and the all-equal ones by whether the
#: task's groups ever disagreed (`was_`), by side, and by level (all-equal groups in a row, 1 to `LEVELS`).
LEVELS = 5
PRIOR_GROUPS = 5  # how many groups the prior share of an all-equal pool is worth
SPREAD = "was_"
LAPSED = f"{SPREAD}unsolved"  # its groups once disagreed, now all fail: weighs `lapsed_weight`, nothing measured
FLAT_POOLS = tuple(f"{was}{side}{level}" for was in ("", SPREAD) for side in ("solved", "unsolved")
                   for level in range(1, LEVELS + 1))
POOLS = ("fresh", "unscored", "mixed", *FLAT_POOLS)


@runtime_checkable
class TaskSampler(Protocol):
    """What `OpenRewardSpec(task_sampling=...)` takes in place of `"uniform"` or `"adaptive"`: `draw()` and
    `update(task, rewards)`. Optional: `bind(tasks)` (the selected tasks, before the first draw), `reseed(seed)` (the
    trainer's, before the first draw), `state_dict()` and `load_state_dict(state)` (JSON-able, kept in checkpoints),
    `metrics()` (logged as `curriculum/<env>/<name>`).
    """

    def draw(self) -> int:
        """The next task: one of the spec's selected task indices."""
        ...

    def update(self, task: int, rewards: Sequence[float | None]) -> None:
        """Learn from one group of a task (the uniform sampler ignores it).

        Args:
            task (`int`):
                The task the group ran.
            rewards (`Sequence[float | None]`):
                Its rollouts' rewards, `None` for one the environment never scored.
        """
        ...


class _Pool(dict[int, int]):
    """A set with O(1) add, remove and uniform choice: each item maps to its position in `order`."""

    def __init__(self) -> None:
        super().__init__()
        self.order: list[int] = []

    def add(self, item: int) -> None:
        if item not in self:
            self[item] = len(self.order)
            self.order.append(item)

    def discard(self, item: int) -> None:
        pos = self.pop(item, None)
        if pos is not None:
            last = self.order.pop()
            if pos < len(self.order):
                self.order[pos] = last
                self[last] = pos

    def choice(self, rng: random.Random) -> int:
        return self.order[rng.randrange(len(self.order))]


def rng_state(rng: random.Random) -> list[Any]:
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def set_rng_state(rng: random.Random, state: Sequence[Any]) -> None:
    version, internal, gauss = state
    rng.setstate((version, tuple(internal), gauss))


def uniform_draws(tasks: Sequence[int], count: int, rng: random.Random) -> list[int]:
    """`count` of `tasks`, each once per pass, in a seeded order per pass: every uniform choice of tasks."""
    out: list[int] = []
    while tasks and len(out) < count:
        out += rng.sample(tasks, min(len(tasks), count - len(out)))
    return out


class _Sampler(TaskSampler):
    """What the built-in samplers share: the bound tasks, a seeded generator, and their state for checkpoints."""

    kind = ""

    def __init__(self, tasks: Sequence[int] | None, seed: int) -> None:
        self.seed, self._rng = seed, random.Random(seed)
        self._tasks: dict[int, None] = {}  # in order, with O(1) membership
        if tasks is not None:
            self.bind(tasks)

    def bind(self, tasks: Sequence[int]) -> None:
        """Draw from these tasks (a spec binds its selection), keeping what is known of them.

        Args:
            tasks (`Sequence[int]`):
                The task indices.
        """
        chosen = dict.fromkeys(tasks)
        if not chosen:
            raise ConfigurationError("a task sampler needs at least one task")
        if not all(map(is_int, chosen)):
            raise ConfigurationError("task indices must be ints")
        self._tasks = chosen
        self._restart()

    def reseed(self, seed: int) -> None:
        """Seed the draws again (a spec does, with the trainer's seed).

        Args:
            seed (`int`):
                The new seed.
        """
        self.seed = seed
        self._rng.seed(seed)
        self._restart()

    def draw(self) -> int:
        """The next task: one of the bound tasks."""
        if not self._tasks:
            raise ConfigurationError(f"{type(self).__name__} has no tasks: pass tasks= or give it to a spec")
        return self._draw()

    def state_dict(self) -> dict[str, Any]:
        """What the sampler knows, and the generator's state (JSON-able: checkpoints keep it)."""
        return {"kind": self.kind, "rng": rng_state(self._rng), **self._state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()`'s output.

        Args:
            state (`dict[str, Any]`):
                What `state_dict()` returned.
        """
        set_rng_state(self._rng, state["rng"])
        self._load(state)

    def _restart(self) -> None: ...
    def _draw(self) -> int: ...
    def _state(self) -> dict[str, Any]: ...
    def _load(self, state: dict[str, Any]) -> None: ...


class UniformSampler(_Sampler):
    """Every task once per pass, in a seeded random order; a new order each pass (feedback is ignored).

    Args:
        tasks (`Sequence[int]`, *optional*):
            The task indices to draw from; a spec binds its selection when not given.
        seed (`int`, *optional*, defaults to `0`):
            Seed of the order.
    """

    kind = "uniform"

    def __init__(self, tasks: Sequence[int] | None = None, *, seed: int = 0) -> None:
        self._order: list[int] = []
        self._pos = 0
        super().__init__(tasks, seed)

    def _restart(self) -> None:
        self._order, self._pos = [], 0

    def _draw(self) -> int:
        if self._pos >= len(self._order):
            self._order, self._pos = uniform_draws(list(self._tasks), len(self._tasks), self._rng), 0
        self._pos += 1
        return self._order[self._pos - 1]

    def _state(self) -> dict[str, Any]:
        return {"order": self._order, "pos": self._pos}

    def _load(self, state: dict[str, Any]) -> None:
        self._order, self._pos = [int(t) for t in state["order"]], int(state["pos"])


class AdaptiveSampler(_Sampler):
    """Draw tasks where groups disagree: unseen tasks first, all-equal tasks down-weighted but re-probed.

    A task not scored yet, or whose last groups (`window` of them pooled) disagree, weighs 1. One whose last k
    groups were all equal, to one value, is `solved` or `unsolved` at level k (1 to 5) and weighs the share of such
    tasks whose next group changed, measured from a prior (`suspect_weight` at k = 1, `flat_weight` at 2, halved per
    level) and floored at `flat_weight / 8`: one unlucky group does not starve a task a policy solves sometimes,
    while always- and never-solved tasks sink within a few re-probes. A task whose groups once disagreed weighs
    `lapsed_weight` while it fails, and keeps a record apart once solved. A reward of `None` is no failure.

    Args:
        tasks (`Sequence[int]`, *optional*):
            The task indices to draw from; a spec binds its selection when not given.
        seed (`int`, *optional*, defaults to `0`):
            Seed of the draws (every process of a run draws the same tasks).
        flat_weight (`float`, *optional*, defaults to `0.05`):
            The prior weight of a task whose last two groups were all equal (relative to 1). A third each of always-,
            never- and sometimes-solved tasks leaves about a fifth of the groups zero-spread (prime-rl's 0.2: 0.4).
        suspect_weight (`float`, *optional*, defaults to `0.2`):
            The prior weight of a task with one all-equal group.
        lapsed_weight (`float`, *optional*, defaults to `1.0`):
            The weight of a task whose groups once disagreed and whose last groups all failed.
        window (`int`, *optional*, defaults to `3`):
            How many of a task's last groups decide its pool.
        success_threshold (`float`, *optional*, defaults to `1.0`):
            The reward at or above which an all-equal task counts as solved (and a rollout as a success).
    """

    kind = "adaptive"

    def __init__(self, tasks: Sequence[int] | None = None, *, seed: int = 0, flat_weight: float = 0.05,
                 suspect_weight: float = 0.2, lapsed_weight: float = 1.0, window: int = 3,
                 success_threshold: float = 1.0) -> None:
        for name, value in (("flat_weight", flat_weight), ("suspect_weight", suspect_weight),
                            ("lapsed_weight", lapsed_weight)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
                raise ConfigurationError(f"{name} must be a number in (0, 1], got {value!r}")
        if not is_int(window, 1):
            raise ConfigurationError(f"window must be an int >= 1, got {window!r}")
        self.window, self.success_threshold = window, float(success_threshold)
        self.flat_weight, self.suspect_weight = float(flat_weight), float(suspect_weight)
        self.lapsed_weight = float(lapsed_weight)
        self._history: dict[int, deque[list[float]]] = {}
        self._streak: dict[int, int] = {}  # all-equal groups in a row (to one value), the last one included
        # per pool of all-equal tasks whose weight is measured: how their next group went, [changed, confirmed]
        self._next: dict[str, list[int]] = {name: [0, 0] for name in FLAT_POOLS if not name.startswith(LAPSED)}
        self._spread: set[int] = set()  # tasks whose groups ever disagreed
        self._drawn: dict[int, int] = defaultdict(int)
        self._pools: dict[str, _Pool] = {}
        self._order: dict[str, list[int]] | None = None  # the pools' order a loaded state had
        super().__init__(tasks, seed)

    def _restart(self) -> None:
        """Sort the tasks into their pools (in a loaded state's order: a draw picks by position)."""
        self._pools = {name: _Pool() for name in POOLS}
        for name, tasks in (self._order or {}).items():
            for task in tasks:
                if task in self._tasks and self._pool_of(task) == name:
                    self._pools[name].add(task)
        for task in self._tasks:
            if not any(task in pool for pool in self._pools.values()):
                self._pools[self._pool_of(task)].add(task)

    def _pool_of(self, task: int) -> str:
        groups = self._history.get(task)
        if not groups:
            return "unscored" if self._drawn.get(task) else "fresh"
        streak, side = self._streak.get(task, 0), "solved" if groups[-1][0] >= self.success_threshold else "unsolved"
        was = SPREAD if task in self._spread else ""
        if streak >= 2:
            return f"{was}{side}{min(streak, LEVELS)}"
        pooled = [r for group in groups for r in group]
        return "mixed" if streak == 0 or max(pooled) - min(pooled) > _EQUAL else f"{was}{side}1"

    def _weight(self, pool: str) -> float:
        """A pool's weight per task (see the class)."""
        if pool in ("mixed", "unscored"):
            return 1.0
        if pool.startswith(LAPSED):
            return self.lapsed_weight
        level, spread = int(pool[-1]), pool.startswith(SPREAD)
        prior = self.suspect_weight if level == 1 or spread else self.flat_weight / 2 ** (level - 2)
        changed, confirmed = self._next[pool]
        floor = self.flat_weight if spread else self.flat_weight / 8
        return max(floor, (changed + PRIOR_GROUPS * prior) / (changed + confirmed + PRIOR_GROUPS))

    def _move(self, task: int) -> None:
        for pool in self._pools.values():
            pool.discard(task)
        self._pools[self._pool_of(task)].add(task)

    def _draw(self) -> int:
        pools = self._pools
        if pools["fresh"]:
            task = pools["fresh"].choice(self._rng)
        else:
            drawn = [name for name, pool in pools.items() if pool and name != "fresh"]
            weights = [len(pools[name]) * self._weight(name) for name in drawn]
            task = pools[self._rng.choices(drawn, weights)[0]].choice(self._rng)
        self._drawn[task] += 1
        if task in pools["fresh"]:
            self._move(task)
        return task

    def update(self, task: int, rewards: Sequence[float | None]) -> None:
        """Take one group's rewards: the task's pool follows its last `window` groups.

        Args:
            task (`int`):
                The task the group ran (ignored when it is not one of the sampler's).
            rewards (`Sequence[float | None]`):
                Its rollouts' rewards; `None` is left out, and a group with no score changes nothing.
        """
        scored = [float(r) for r in rewards if r is not None and math.isfinite(r)]
        if not scored or task not in self._tasks:
            return
        history = self._history.setdefault(task, deque(maxlen=self.window))
        was = self._pool_of(task)
        flat = max(scored) - min(scored) <= _EQUAL
        same = flat and bool(history) and self._streak.get(task, 0) > 0 and abs(history[-1][0] - scored[0]) <= _EQUAL
        self._streak[task] = self._streak.get(task, 0) + 1 if same else int(flat)
        history.append(scored)
        if not flat:
            self._spread.add(task)
        if was in self._next:  # an all-equal task's next group: did it change, or confirm?
            self._next[was][1 if self._streak[task] > int(was[-1]) else 0] += 1
        self._move(task)

    def pool_sizes(self) -> dict[str, int]:
        """Tasks per pool: `unseen` (never scored), `mixed`, `solved`, `unsolved`."""
        sizes = dict.fromkeys(("unseen", "mixed", "solved", "unsolved"), 0)
        for name, pool in self._pools.items():
            kind = "unseen" if name in ("fresh", "unscored") else name.removeprefix(SPREAD).rstrip("0123456789")
            sizes[kind] += len(pool)
        return sizes

    def pass_rate(self, task: int) -> float | None:
        """The share of a task's recent rewards at or above `success_threshold` (None when it was never scored).

        Args:
            task (`int`):
                The task.
        """
        pooled = [r for group in self._history.get(task, ()) for r in group]
        return sum(r >= self.success_threshold for r in pooled) / len(pooled) if pooled else None

    def metrics(self) -> dict[str, float]:
        """The pool sizes (logged as `curriculum/<env>/<pool>`)."""
        return {k: float(v) for k, v in self.pool_sizes().items()}

    def _state(self) -> dict[str, Any]:
        return {"history": {str(t): [list(g) for g in groups] for t, groups in self._history.items()},
                "drawn": {str(t): n for t, n in self._drawn.items()},
                "streak": {str(t): n for t, n in self._streak.items()}, "next": self._next,
                "spread": sorted(self._spread),
                "pools": {name: list(pool.order) for name, pool in self._pools.items()}}

    def _load(self, state: dict[str, Any]) -> None:
        self._history = {int(t): deque(([float(r) for r in g] for g in groups), maxlen=self.window)
                         for t, groups in state["history"].items()}
        self._drawn = defaultdict(int, {int(t): int(n) for t, n in state["drawn"].items()})
        self._streak = {int(t): int(n) for t, n in state.get("streak", {}).items()}
        self._next = {name: [int(n) for n in state.get("next", {}).get(name, (0, 0))] for name in self._next}
        self._spread = {int(t) for t in state.get("spread", ())}
        self._order = {name: [int(t) for t in tasks] for name, tasks in state.get("pools", {}).items()}
        if self._tasks:
            self._restart()


def make_sampler(task_sampling: Any, *, seed: int = 0, success_threshold: float = 1.0) -> Any:
    """The sampler `task_sampling=` names (None for `"uniform"`: TRL's own dataset and order), or the object given."""
    if task_sampling == "uniform":
        return None
    if task_sampling == "adaptive":
        return AdaptiveSampler(seed=seed, success_threshold=success_threshold)
    if isinstance(task_sampling, str) or not isinstance(task_sampling, TaskSampler):
        raise ConfigurationError(
            f"task_sampling must be 'uniform', 'adaptive' or an object with draw() and update(task, rewards) "
            f"methods, got {task_sampling!r}")
    return task_sampling


class Curriculum:
    """One environment's sampler, and what its training episodes told it since the last update; `draw()` applies that
    first unless `synced` (several processes: `ors_trl.trl.callbacks` applies what all observed at each step's end).
    `mirror`: a file the copy in TRL's async rollout worker writes its state and metrics to (each `MIRROR_EVERY` s)."""

    MIRROR_EVERY = 1.0

    def __init__(self, sampler: Any, runtime: Any) -> None:
        self.sampler, self.runtime = sampler, runtime
        self.synced = False
        self.mirror: str | None = None
        self.writes_mirror = False  # a copy in TRL's async worker writes; the trainer's process reads
        self.draws = 0
        self._mirrored = 0.0
        self._lock = threading.Lock()
        self._observed: list[tuple[int, float | None]] = []
        self._window: dict[str, float] = defaultdict(float)
        runtime.listeners.append(self.observe)

    @property
    def name(self) -> str:
        """The environment's name, as it reports (a mix renames its environments)."""
        return self.runtime.name

    def observe(self, episode: Any) -> None:
        """Note a counted episode's outcome when a training source played it (applied at the next update)."""
        if episode.source in TRAINING_SOURCES and episode.task.index is not None:
            with self._lock:
                self._observed.append((episode.task.index, episode.reward))

    def take(self) -> list[tuple[int, float | None]]:
        """What was observed since the last call (this process's part, for gathering)."""
        with self._lock:
            out, self._observed = self._observed, []
        return out

    def apply(self, observed: Sequence[tuple[int, float | None]]) -> None:
        """Hand the sampler one group per task of `observed`, and count what the groups were like."""
        groups: dict[int, list[float | None]] = defaultdict(list)
        for task, reward in observed:
            groups[int(task)].append(reward)
        w, threshold = self._window, self.runtime.metrics.success_threshold
        for task, rewards in sorted(groups.items()):  # the order episodes ended in must not change the draws
            self.sampler.update(task, rewards)
            scored = [r for r in rewards if r is not None]
            if scored:
                w["groups"] += 1
                w["zero_std_groups"] += max(scored) - min(scored) <= _EQUAL
                w["successes"] += sum(r >= threshold for r in scored)
                w["scored"] += len(scored)
        if self.writes_mirror and groups and time.monotonic() - self._mirrored >= self.MIRROR_EVERY:
            self.write_mirror()

    def draw(self) -> int:
        """The next task (after applying what was observed, unless the run syncs at step ends)."""
        if not self.synced:
            self.apply(self.take())
        task = self.sampler.draw()
        self.draws += 1
        self._window["draws"] += 1
        return task

    def metrics(self) -> dict[str, float]:
        """`curriculum/<env>/...` since the last call: the sampler's own, the draws, and the groups applied."""
        w, self._window = self._window, defaultdict(float)
        own = getattr(self.sampler, "metrics", None)
        out = {**(own() if callable(own) else {}), "draws": w["draws"], "groups": w["groups"]}
        if w["groups"]:
            out |= {"zero_std_fraction": w["zero_std_groups"] / w["groups"], "pass_rate": w["successes"] / w["scored"]}
        return {f"curriculum/{self.name}/{k}": float(v) for k, v in out.items()}

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state (when it has one) and the number of draws."""
        state = self.sampler.state_dict() if hasattr(self.sampler, "state_dict") else None
        return {"sampler": state, "draws": self.draws}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()`'s output (what was observed and not yet applied is dropped)."""
        if state.get("sampler") is not None and hasattr(self.sampler, "load_state_dict"):
            self.sampler.load_state_dict(state["sampler"])
        self.draws = int(state.get("draws") or 0)
        self.take()

    def write_mirror(self) -> None:
        """Write the state and the pending metrics to `mirror` (replaced whole, so a reader never sees half)."""
        assert self.mirror is not None
        self._mirrored = time.monotonic()
        doc = {"state": self.state_dict(), "metrics": self.metrics(), "at": time.time()}
        write_atomic(Path(self.mirror), json.dumps(doc).encode())

    def read_mirror(self) -> dict[str, Any] | None:
        """What the async worker's copy last wrote (None before it wrote anything)."""
        try:
            text = Path(self.mirror).read_text(encoding="utf-8") if self.mirror else ""
        except OSError:
            return None
        return json.loads(text) if text else None


@functools.cache
def _mirror_dir() -> tempfile.TemporaryDirectory[str]:
    return tempfile.TemporaryDirectory(prefix="ors-trl-sampling-")  # removed at exit (its finalizer)


def mirror_path(name: str) -> str:
    """A new file path for a curriculum's mirror, in a private folder of this process (removed at exit)."""
    stem = re.sub(r"[^0-9A-Za-z_.-]+", "_", name)[:48]
    return os.path.join(_mirror_dir().name, f"{stem}-{secrets.token_hex(6)}.json")
