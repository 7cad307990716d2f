"""Task sampling's trainer side: the callback that feeds a task stream's samplers (`ors_trl.tasks.stream`) each
step's groups, logs what they do and keeps their state in checkpoints, and the stream's first-read hook that
attaches it to the trainer reading the stream. Imported only with a task stream, so `import ors_trl` needs no
transformers.
"""

from __future__ import annotations

import logging
import math
import weakref
from typing import Any

from transformers import TrainerCallback

from ..tasks.stream import DrawSource
from . import backend as _trl

__all__ = ["STATE_KEY", "TaskSamplingCallback", "attach_task_sampling", "stream_callbacks"]

logger = logging.getLogger("ors_trl")

#: Where the sampling state lives in a checkpoint's `trainer_state.json` (`stateful_callbacks`).
STATE_KEY = "ors_trl.task_sampling"


def consumed(args: Any, global_step: int) -> int | None:
    """How many draws the trainer's first `global_step` optimizer steps read: TRL reads `generation_batch_size /
    num_generations` draws at a time and each of them `num_iterations * steps_per_generation` times over, one
    generation batch per micro-step (`repeat_iterable_dataset`). None for arguments that are not GRPO's."""
    try:
        per_read = args.generation_batch_size // args.num_generations
        repeat = args.num_iterations * args.steps_per_generation
        return math.ceil(global_step * args.gradient_accumulation_steps / repeat) * per_read
    except (AttributeError, TypeError, ZeroDivisionError):
        return None


class TaskSamplingCallback(TrainerCallback):
    """Feed a task stream's samplers each step's groups, log what they do, and keep their state in checkpoints.

    Attached by the stream at its first read (or passed in `spec.callbacks`, which TRL's async trainer needs: there
    the stream is read in the rollout worker, whose samplers report through a file). At each step's end the
    groups every process observed are gathered, so every process updates its samplers alike and draws the same
    tasks; `curriculum/<env>/...` goes to the step's logs; at a checkpoint the state goes to `trainer_state.json`
    (`stateful_callbacks["ors_trl.task_sampling"]`), from which a resumed run restores it.
    """

    def __init__(self, source: DrawSource) -> None:
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
        self.source.on_bind = None
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
        _trl.Backend.of(trainer).add_step_metrics(metrics)
        if source.drew:
            source.trim(consumed(args, state.global_step))
        if control.should_save:
            saved = source.state_dict()
            saved["curricula"].update(states)
            state.stateful_callbacks[STATE_KEY] = saved


def attach_task_sampling(source: DrawSource) -> None:
    """A task stream's first read (its `on_bind`): have the trainer reading it, found up the stack, update and
    checkpoint its samplers."""
    trainer = _trl.training_trainer()
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


def stream_callbacks(dataset: Any) -> list[TrainerCallback]:
    """The `TaskSamplingCallback` a task stream needs (none for a map-style dataset)."""
    source = getattr(dataset, "source", None)
    return [TaskSamplingCallback(source)] if isinstance(source, DrawSource) else []
