"""The dataset a spec (or mix) with `task_sampling` other than "uniform" gives TRL: an endless stream of task rows,
each drawn by a sampler when TRL reads it.

TRL 1.16 trains on a `datasets.IterableDataset` (with `max_steps`) and repeats each row it reads `num_generations`
times itself (`trl.trainer.utils.repeat_iterable_dataset`), so a row is drawn at most a generation batch or two
before its group runs, and the sampler has seen the rewards of every group before. Two things are arranged for it:

- TRL shuffles an iterable train set through a 1,000-row buffer (`shuffle_dataset=True`): that would draw 1,000
  tasks before any reward came back, and adaptive draws would look uniform. The stream's `shuffle` keeps it as it
  is (the sampler draws at random itself).
- Resuming from a checkpoint, the trainer reads and drops the rows of the steps already trained. The source knows
  how many draws those steps consumed and which were drawn but not yet trained on when the checkpoint was taken:
  it answers the dropped reads with a filler row (no draw), then replays the pending draws, then draws on, so a
  resumed run continues the very draws of an uninterrupted one.

The first read finds the trainer up the stack (`ors_trl.trl.backend.training_trainer`) and hands it to `on_bind`, which
attaches a `TaskSamplingCallback`: it restores a checkpoint's state and updates the samplers at each step's end.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from datasets import Dataset, IterableDataset
from transformers import TrainerCallback

from ..protocol.errors import ConfigurationError
from ..trl import backend as _trl
from .sampling import Curriculum, mirror_path, rng_state, set_rng_state

__all__ = ["STATE_KEY", "DrawSource", "TaskSamplingCallback", "TaskStream", "sampled_stream", "stream_callbacks"]

logger = logging.getLogger("ors_trl")

#: Draws kept for a resume when the trainer's batching is not GRPO's (the position trained on is then unknown).
MAX_PENDING = 4096
#: Where the sampling state lives in a checkpoint's `trainer_state.json` (`stateful_callbacks`).
STATE_KEY = "ors_trl.task_sampling"


class NotMapStyleError(ConfigurationError, TypeError):
    """A task stream was asked for its length or a row by index (a consumer that needs a map-style dataset)."""


class TaskStream(IterableDataset):
    """The `train_dataset` of a spec or mix with `task_sampling` other than "uniform": rows drawn as they are read.

    It has no length and no indexing: a consumer that needs them (an older TRL, a custom trainer) gets a
    `ConfigurationError` (also a `TypeError`) that says so. TRL's buffered `shuffle` leaves it as it is.
    """

    def shuffle(self, *args: Any, **kwargs: Any) -> TaskStream:
        """The stream itself: the sampler draws at random, and a shuffle buffer would draw far ahead of rewards."""
        return self

    def __len__(self) -> int:
        raise NotMapStyleError(
            "task_sampling= gives an IterableDataset whose rows are drawn as training goes: it has no length or "
            "indexing. Train with TRL >= 1.16's GRPOTrainer (or AsyncGRPOTrainer) and GRPOConfig(max_steps=N), or use "
            "task_sampling='uniform' for a trainer that needs a map-style Dataset.")

    def __getitem__(self, key: Any) -> Any:
        return len(self)


def _rows(source: DrawSource) -> Iterator[dict[str, Any]]:
    position = 0
    while True:
        yield source.row(position)
        position += 1


class DrawSource:
    """Draws the stream's rows: an environment by weight (a mix), then a task by that environment's curriculum.

    Args:
        rows (`datasets.Dataset`):
            One row per (environment, task), as the uniform dataset would have them.
        where (`Mapping[tuple[str | None, int], int]`):
            The row of each (environment, task).
        owners (`Mapping[str | None, OpenRewardSpec]`):
            The spec of each environment (the key `None` for a lone spec), whose runtime holds its curriculum.
        weights (`list[float]`, *optional*):
            The environments' mixture weights (default: their numbers of tasks).
        seed (`int`, *optional*, defaults to `0`):
            Seed of the environment draws (re-seeded with the trainer's seed at the first read).
    """

    def __init__(self, rows: Dataset, where: Mapping[tuple[str | None, int], int], owners: Mapping[str | None, Any],
                 *, weights: list[float] | None = None, seed: int = 0) -> None:
        self.rows, self.where, self.owners = rows, dict(where), dict(owners)
        self.envs = list(self.owners)
        counts = [sum(1 for env, _ in self.where if env == name) for name in self.envs]
        self.weights = weights if weights is not None else [float(c) for c in counts]
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.bound = False
        #: Called at the first read with the trainer reading (or None): `ors_trl.trl.callbacks.attach_task_sampling`.
        self.on_bind: Callable[[DrawSource, Any], None] | None = None
        self.drew = False  # this process has read the stream (TRL's async trainer reads it in its worker only)
        self._tracking = True
        self._skip = 0  # reads to answer with a filler (the steps a resumed trainer drops)
        self._replay: deque[tuple[str | None, int]] = deque()  # drawn before the checkpoint, not yet trained on
        self._recent: deque[tuple[int, str | None, int]] = deque()  # (position, env, task) drawn since `consumed`
        self._consumed = 0

    @property
    def curricula(self) -> dict[str | None, Curriculum]:
        """Each environment's curriculum (on its spec's runtime, where its episodes report)."""
        return {env: spec.runtime.curriculum for env, spec in self.owners.items()}

    def __reduce__(self) -> tuple[Any, ...]:
        """A copy for TRL's async rollout worker: it draws on from this state, and its curricula write what they
        learn to mirror files this process reads (`TaskSamplingCallback`)."""
        mirrors = {}
        for env, c in self.curricula.items():
            c.mirror = c.mirror or mirror_path(c.name)
            mirrors[env] = c.mirror
        samplers = {env: c.sampler for env, c in self.curricula.items()}
        return (_rebuild, (self.rows, self.where, self.owners, samplers, mirrors, self.weights, self.state_dict()))

    def row(self, position: int) -> dict[str, Any]:
        """The row at `position` of this reading of the stream (a fresh iteration starts at 0)."""
        with self._lock:
            if not self.bound:
                self.bound = True
                if self.on_bind is not None:
                    self.on_bind(self, _trl.training_trainer())
            if position < self._skip:
                return self.rows[0]
            if self._replay:
                env, task = self._replay.popleft()
            else:
                env = self.envs[0] if len(self.envs) == 1 else self._rng.choices(self.envs, self.weights)[0]
                task = self.curricula[env].draw()
            self.drew = True
            if self._tracking:
                self._recent.append((position, env, task))
            return self.rows[self.where[(env, task)]]

    def consumed(self, args: Any, global_step: int) -> int | None:
        """How many draws the trainer's first `global_step` optimizer steps read: TRL reads `generation_batch_size /
        num_generations` draws at a time and each of them `num_iterations * steps_per_generation` times over, one
        generation batch per micro-step (`repeat_iterable_dataset`). None for arguments that are not GRPO's."""
        try:
            per_read = args.generation_batch_size // args.num_generations
            repeat = args.num_iterations * args.steps_per_generation
            return math.ceil(global_step * args.gradient_accumulation_steps / repeat) * per_read
        except (AttributeError, TypeError, ZeroDivisionError):
            return None

    def trim(self, consumed: int | None) -> None:
        """Forget the draws before stream position `consumed` (trained on: no resume replays them); when it is not
        known, keep the last `MAX_PENDING` only."""
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
        """The curricula's and the mixture draw's states, where the stream stands (the draws trained on), and
        the draws read since (to replay after a resume)."""
        with self._lock:
            return {"rng": rng_state(self._rng), "consumed": self._consumed,
                    "pending": [[env, task] for _, env, task in self._recent],
                    "curricula": {_key(env): c.state_dict() for env, c in self.curricula.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from `state_dict()`'s output: a new reading of the stream skips and replays to where it stood."""
        set_rng_state(self._rng, state["rng"])
        for env, c in self.curricula.items():
            if _key(env) in state["curricula"]:
                c.load_state_dict(state["curricula"][_key(env)])
        self._consumed = int(state.get("consumed") or 0)
        self._skip = int(state.get("consumed") or 0)
        self._replay = deque((None if env is None else str(env), int(task)) for env, task in state.get("pending", ()))
        self._recent.clear()


def _rebuild(rows: Dataset, where: Mapping[tuple[str | None, int], int], owners: Mapping[str | None, Any],
             samplers: Mapping[str | None, Any], mirrors: Mapping[str | None, str], weights: list[float],
             state: dict[str, Any]) -> DrawSource:
    for env, spec in owners.items():  # each spec's copy (one per process) reports to the sampler that came along
        c = Curriculum(samplers[env], name=spec.runtime.name, success_threshold=spec.runtime.metrics.success_threshold)
        c.mirror, c.writes_mirror, c.draws = mirrors[env], True, int(state["curricula"][_key(env)]["draws"])
        spec.runtime.curriculum = c
    source = DrawSource(rows, where, owners, weights=weights)
    set_rng_state(source._rng, state["rng"])
    # A copy (TRL's async worker, which restarts its dataset) has no trainer: it draws on from the state, and its
    # curricula update as rewards come.
    source.bound, source._tracking = True, False
    return source


def _key(env: str | None) -> str:
    return "" if env is None else env


def sampled_stream(rows: Dataset, where: Mapping[tuple[str | None, int], int], owners: Mapping[str | None, Any],
                   tasks: Mapping[str | None, list[int]], *, weights: list[float] | None = None,
                   seed: int = 0) -> TaskStream:
    """The endless `TaskStream` of `rows` drawn by the owners' curricula (each bound to its tasks first): one data
    shard, so that every process of a run reads the whole stream and draws what the others draw."""
    for env, spec in owners.items():
        bind = getattr(spec.runtime.curriculum.sampler, "bind", None)
        if callable(bind):
            bind(tasks[env])
    source = DrawSource(rows, where, owners, weights=weights, seed=seed)
    source.on_bind = attach_task_sampling
    stream = IterableDataset.from_generator(_rows, features=rows.features, gen_kwargs={"source": source})
    stream.__class__ = TaskStream  # `from_generator` builds the plain class; the stream adds only the methods above
    stream.source = source
    return stream


def stream_callbacks(dataset: Any) -> list[TrainerCallback]:
    """The `TaskSamplingCallback` a task stream needs (none for a map-style dataset)."""
    source = getattr(dataset, "source", None)
    return [TaskSamplingCallback(source)] if isinstance(source, DrawSource) else []


class TaskSamplingCallback(TrainerCallback):
    """Feed a task stream's samplers each step's groups, log what they do, and keep their state in checkpoints.

    Attached by the stream at its first read (or passed in `spec.callbacks`, which TRL's async trainer needs: there
    the stream is read in the rollout worker, whose samplers report through a file). At each step's end the
    groups every process observed are gathered, so every process updates its samplers alike and draws the same
    tasks; `curriculum/<env>/...` goes to the step's logs; at a checkpoint the state goes to `trainer_state.json`
    (`stateful_callbacks["ors_trl.task_sampling"]`), from which a resumed run restores it.

    Args:
        source (`DrawSource`):
            The stream's source (`ors_trl.tasks.stream`).
    """

    def __init__(self, source: Any) -> None:
        self.source = source
        self._trainer: Any = None
        self._seen: dict[str, float] = {}  # the async worker's mirror writes already logged, by curriculum

    @property
    def trainer(self) -> Any:
        return self._trainer() if self._trainer is not None else None

    def bind(self, trainer: Any) -> None:
        """Update the samplers from `trainer`'s steps: alike on every process, from its checkpoint if resumed."""
        if self.trainer is trainer:
            return
        self._trainer = weakref.ref(trainer)
        self.source.bound = True
        processes = getattr(getattr(trainer, "accelerator", None), "num_processes", 1)
        for curriculum in self.source.curricula.values():
            curriculum.synced = processes > 1
        saved = (getattr(trainer.state, "stateful_callbacks", None) or {}).get(STATE_KEY)
        if saved and trainer.state.global_step > 0:
            self.source.load_state_dict(saved)
        else:
            self.source.reseed(trainer.args.seed)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = _trl.calling_trainer()
        if trainer is not None:
            self.bind(trainer)

    def _mirrored(self) -> tuple[dict[str, float], dict[str, Any]]:
        """What the async worker's copies wrote since the last look: their metrics, and their state."""
        metrics: dict[str, float] = {}
        states: dict[str, Any] = {}
        for env, curriculum in self.source.curricula.items():
            doc = curriculum.read_mirror()
            if doc is None:
                continue
            states["" if env is None else env] = doc["state"]
            if doc["at"] != self._seen.get(curriculum.name):
                self._seen[curriculum.name] = doc["at"]
                metrics.update(doc["metrics"])
        return metrics, states

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer, source = self.trainer, self.source
        if trainer is None:
            return
        observed = {env: c.take() for env, c in source.curricula.items()}
        if getattr(trainer.accelerator, "num_processes", 1) > 1:
            from accelerate.utils import gather_object

            gathered = gather_object([observed])
            observed = {env: [o for part in gathered for o in part[env]] for env in source.curricula}
        metrics: dict[str, float] = {}
        for env, curriculum in source.curricula.items():
            curriculum.apply(observed[env])
            metrics.update(curriculum.metrics())
        mirrored, states = self._mirrored() if not source.drew else ({}, {})
        metrics.update(mirrored)
        _trl.Backend.of(trainer).add_step_metrics(metrics)
        if source.drew:
            source.trim(source.consumed(args, state.global_step))
        if control.should_save:
            saved = source.state_dict()
            saved["curricula"].update(states)
            state.stateful_callbacks[STATE_KEY] = saved


def attach_task_sampling(source: Any, trainer: Any) -> None:
    """A task stream's first read: have `trainer` (found reading it, or None) update and checkpoint its samplers."""
    if trainer is None:
        logger.warning("task sampling: no trainer was found reading the dataset, so the samplers learn from rewards "
                       "as they come but are neither saved with checkpoints nor logged; "
                       "pass callbacks=spec.callbacks.")
        return
    for cb in trainer.callback_handler.callbacks:
        if isinstance(cb, TaskSamplingCallback) and cb.source is source:
            break
    else:
        cb = TaskSamplingCallback(source)
        trainer.add_callback(cb)
    cb.bind(trainer)
