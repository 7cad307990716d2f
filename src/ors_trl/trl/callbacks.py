"""The `transformers.TrainerCallback`s ors-trl gives a trainer: session cleanup, evaluation during training and task
sampling. Imported only when one is used, so `import ors_trl` needs no transformers."""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Sequence
from typing import Any

from transformers import TrainerCallback

from ..core.metrics import stats_metrics
from ..core.stats import by_task
from ..tasks.stream import DrawSource
from . import backend as _trl

__all__ = ["STATE_KEY", "EvalCallback", "SessionCleanupCallback", "TaskSamplingCallback", "attach_session_cleanup",
           "attach_task_sampling", "stream_callbacks"]

logger = logging.getLogger("ors_trl")

#: Where the sampling state lives in a checkpoint's `trainer_state.json` (`stateful_callbacks`).
STATE_KEY = "ors_trl.task_sampling"


class SessionCleanupCallback(TrainerCallback):
    """Release the sessions of `runtimes` (one per spec) at each step's end, in the background (GRPO generates and
    scores inside the step, so none is needed after it), and close them all at the end of training."""

    def __init__(self, runtimes: Sequence[Any]) -> None:
        self.runtimes = list(runtimes)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        for runtime in self.runtimes:
            runtime.release_all()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        for runtime in self.runtimes:
            runtime.close_all()


def attach_session_cleanup(trainer: Any, runtime: Any) -> None:
    """Give `trainer` a `SessionCleanupCallback` for `runtime`, unless one already covers it."""
    if not hasattr(trainer, "add_callback") or not runtime.bind(trainer):
        return
    callbacks = getattr(getattr(trainer, "callback_handler", None), "callbacks", [])
    if not any(isinstance(cb, SessionCleanupCallback) and runtime in cb.runtimes for cb in callbacks):
        trainer.add_callback(SessionCleanupCallback([runtime]))


class EvalCallback(TrainerCallback):
    """Evaluate held-out tasks with the model being trained, every `every` steps (and, `at_start`, at step 0).

    Built by `OpenRewardSpec.eval_callback` (which documents it): `repeats` episodes of every task through the held-out
    spec's engine (split across processes, `source: "eval"`), logged as `eval/<env>/...` and kept in `history`."""

    def __init__(self, spec: Any, prompts: Sequence[Any], *, every: int, repeats: int = 1,
                 at_start: bool = True) -> None:
        self.spec = spec  # holds the held-out environment's client
        self.runtime = spec.runtime
        self.engine = spec.rollout_func  # the held-out spec's own engine
        self.engine.source = "eval"
        self.prompts = [p for p in prompts for _ in range(repeats)]
        self.every, self.repeats, self.at_start = every, repeats, at_start
        self.history: list[dict[str, float]] = []
        self._missing = False

    def __repr__(self) -> str:
        return f"EvalCallback({self.runtime.name!r}, tasks={len(self.prompts) // self.repeats}, every={self.every})"

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.at_start:
            self._evaluate(state.global_step)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step % self.every == 0:
            self._evaluate(state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.runtime.close_all()

    def _evaluate(self, step: int) -> None:
        trainer = _trl.calling_trainer()
        if trainer is None:
            if not self._missing:
                self._missing = True
                logger.warning("EvalCallback: the trainer of this callback event cannot be found; no evaluation")
            return
        accelerator = trainer.accelerator
        self.engine.info = {"step": step, "policy": "the model in training"}
        self.engine(self.prompts[accelerator.process_index::accelerator.num_processes], trainer)
        rows = [(ep.task.key, ep.record()) for ep in self.engine.last_episodes]
        self.runtime.metrics.flush()  # its own window, apart from the training metrics: started again each time
        backend = _trl.Backend.of(trainer)
        rows, _ = backend.gather_objects(rows)
        stats, _, passed, interval = by_task(rows, self.runtime.metrics.success_threshold,
                                             lambda s, e: s.add_record(e, sessions=False))
        prefix = f"eval/{self.runtime.name}/"
        logs = {**stats_metrics(prefix, stats), **{f"{prefix}pass@{k}": v for k, v in passed.items()}}
        if interval is not None:
            logs[f"{prefix}pass@1_low"], logs[f"{prefix}pass@1_high"] = interval
        backend.log_outside_step(dict(logs))
        self.history.append({"step": step, **logs})


def consumed(args: Any, global_step: int) -> int | None:
    """How many draws the first `global_step` optimizer steps read (TRL's `repeat_iterable_dataset`: a read of
    `generation_batch_size / num_generations` serves `num_iterations * steps_per_generation` micro-steps), else None."""
    try:
        per_read = args.generation_batch_size // args.num_generations
        repeat = args.num_iterations * args.steps_per_generation
        return math.ceil(global_step * args.gradient_accumulation_steps / repeat) * per_read
    except (AttributeError, TypeError, ZeroDivisionError):
        return None


class TaskSamplingCallback(TrainerCallback):
    """Feed a task stream's samplers each step's groups from every process (all update alike), log `curriculum/<env>/...`
    and keep their state in checkpoints (`stateful_callbacks[STATE_KEY]`). Attached by the stream at its first read, or
    passed in `spec.callbacks` (TRL's async trainer: its rollout worker's samplers report through a file)."""

    def __init__(self, source: DrawSource) -> None:
        self.source = source
        self._trainer: Any = None
        self._seen: dict[str, float] = {}  # the async worker's mirror writes already logged, by curriculum

    trainer = property(lambda self: self._trainer() if self._trainer is not None else None)

    def bind(self, trainer: Any) -> None:
        """Update the samplers from `trainer`'s steps: alike on every process, from its checkpoint if resumed."""
        if self.trainer is trainer:
            return
        self._trainer = weakref.ref(trainer)
        self.source.on_bind = None
        for curriculum in self.source.curricula.values():
            curriculum.synced = _trl.Backend.of(trainer).processes > 1
        saved = (getattr(trainer.state, "stateful_callbacks", None) or {}).get(STATE_KEY)
        if saved and trainer.state.global_step > 0:
            self.source.load_state_dict(saved)
        else:
            self.source.reseed(trainer.args.seed)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = _trl.calling_trainer()
        if trainer is not None:
            self.bind(trainer)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Leave the stream to the next trainer that reads it (a second run on the same spec)."""
        self._trainer, self.source.on_bind = None, attach_task_sampling

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer, source = self.trainer, self.source
        if trainer is None:
            return
        backend = _trl.Backend.of(trainer)
        gathered, _ = backend.gather_objects([{env: c.take() for env, c in source.curricula.items()}])
        observed = {env: [o for part in gathered for o in part[env]] for env in source.curricula}
        metrics: dict[str, float] = {}
        states: dict[str, Any] = {}  # what the async worker's copies last wrote, when this process draws nothing
        for env, curriculum in source.curricula.items():
            curriculum.apply(observed[env])
            metrics.update(curriculum.metrics())
            doc = None if source.drew else curriculum.read_mirror()
            if doc is not None:
                states[env or ""] = doc["state"]
                if doc["at"] != self._seen.get(curriculum.name):  # its metrics are logged once
                    self._seen[curriculum.name] = doc["at"]
                    metrics.update(doc["metrics"])
        backend.add_step_metrics(metrics)
        if source.drew:
            source.trim(consumed(args, state.global_step))
        if control.should_save:
            saved = source.state_dict()
            saved["curricula"].update(states)
            state.stateful_callbacks[STATE_KEY] = saved


def attach_task_sampling(source: DrawSource) -> None:
    """A task stream reading's first read (`on_bind`, until it binds): the trainer reading it updates and
    checkpoints its samplers."""
    trainer = _trl.calling_trainer(hops=96)
    if trainer is None:
        logger.warning("task sampling: no trainer was found reading the dataset; until one reads it, the samplers "
                       "learn from rewards as they come but are neither saved with checkpoints nor logged; "
                       "pass callbacks=spec.callbacks.")
        return
    cb = next((c for c in trainer.callback_handler.callbacks
               if isinstance(c, TaskSamplingCallback) and c.source is source), None)
    if cb is None:
        cb = TaskSamplingCallback(source)
        trainer.add_callback(cb)
    cb.bind(trainer)


def stream_callbacks(dataset: Any) -> list[TrainerCallback]:
    """The `TaskSamplingCallback` a task stream needs (none for a map-style dataset)."""
    source = getattr(dataset, "source", None)
    return [TaskSamplingCallback(source)] if isinstance(source, DrawSource) else []
