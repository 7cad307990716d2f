"""`EvalCallback`: evaluation during training, a `transformers.TrainerCallback` (`spec.eval_callback(...)`).

It evaluates held-out tasks every N steps with the model being trained, through the rollout engine and so through
the trainer's own generation (a vLLM run evaluates on vLLM, with the step's weights), under TRL's turn rules; it
logs `eval/<env>/pass@k` and the episode metrics to `log_history`, and its episodes go to the training's episode
log with `source: "eval"` and their `step`. Imported only when the callback is built (it needs transformers).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from transformers import TrainerCallback

from ..core.metrics import EpisodeStats, stats_metrics, tool_health
from ..core.stats import pass_over_tasks
from . import backend as _trl
from .engine import RolloutEngine

__all__ = ["EvalCallback"]

logger = logging.getLogger("ors_trl")


class EvalCallback(TrainerCallback):
    """Evaluate held-out tasks with the model being trained, every `every` steps (and before the first step).

    Build it with `OpenRewardSpec.eval_callback`. Each evaluation runs `repeats` episodes of every held-out task
    through the rollout engine (split across processes), logs `eval/<env>/pass@k` for k = 1..`repeats`,
    `eval/<env>/pass@1_low` / `pass@1_high` (a 95% interval over tasks) and the episode metrics
    (`eval/<env>/reward_mean`, `no_tool_call_fraction`, ...) to the trainer's `log_history`, and keeps them in
    `history`.

    Args:
        spec (`OpenRewardSpec`):
            The held-out tasks' spec (its runtime writes to the training's episode log).
        prompts (`list`):
            One dataset prompt per held-out task (`spec.dataset_rows(...)["prompt"]`).
        every (`int`):
            Evaluate when the global step is a multiple of it.
        repeats (`int`, *optional*, defaults to `1`):
            Episodes per task and evaluation (pass@k up to it).
        at_start (`bool`, *optional*, defaults to `True`):
            Also evaluate before the first step (step 0: the curve's starting point).
    """

    def __init__(self, spec: Any, prompts: Sequence[Any], *, every: int, repeats: int = 1,
                 at_start: bool = True) -> None:
        self.spec = spec  # holds the held-out environment's client
        self.runtime = spec.runtime
        self.engine = RolloutEngine({None: self.runtime}, gather_window=spec.gather_window, source="eval")
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
        rows = [(ep.task.key, ep.reward, ep.finished, ep.tool_calls, ep.tool_failures, len(ep.turns), ep.unscored,
                 *tool_health(ep.turns), ep.prompt is not None) for ep in self.engine.last_episodes]
        self.runtime.metrics.flush()  # its own window, apart from the training metrics: started again each time
        if accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            rows = gather_object(rows)
        logs = self.metrics(rows)
        _trl.Backend.of(trainer).log_outside_step(dict(logs))
        self.history.append({"step": step, **logs})

    def metrics(self, rows: Sequence[tuple[Any, ...]]) -> dict[str, float]:
        """The logged metrics of one evaluation's episodes (`(task, reward, finished, calls, failures, turns,
        unscored, unparsed, malformed, opened)` each)."""
        stats = EpisodeStats(self.runtime.metrics.success_threshold)
        tasks: dict[str, EpisodeStats] = {}  # the one definition of success, per task too
        for task, reward, finished, calls, failures, turns, unscored, unparsed, malformed, opened in rows:
            episode = dict(reward=reward, finished=finished, tool_calls=calls, tool_failures=failures, turns=turns,
                           unscored=unscored, unparsed_turns=unparsed, malformed_calls=malformed, opened=opened)
            stats.add(**episode)
            tasks.setdefault(task, EpisodeStats(stats.success_threshold)).add(**episode)
        prefix = f"eval/{self.runtime.name}/"
        out = stats_metrics(prefix, stats)
        passed, interval = pass_over_tasks(tasks.values())
        out.update({f"{prefix}pass@{k}": v for k, v in passed.items()})
        if interval is not None:
            out[f"{prefix}pass@1_low"], out[f"{prefix}pass@1_high"] = interval
        return out
