"""A `transformers.TrainerCallback` that keeps session lifetimes tied to the training loop.

Rollouts are complete by the end of a training step (GRPO generates and scores inside the step),
so every adapter's session is released then instead of idling on the server until the next
batch; at the end of training every session is closed and the close is waited for. Imported only
when `spec.callbacks` is used, so the core package does not need transformers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import TrainerCallback

__all__ = ["SessionCleanupCallback"]


class SessionCleanupCallback(TrainerCallback):
    """Release sessions at each step's end (in the background) and close them all at the end of training.

    Args:
        runtimes: the environment runtimes (one per spec) whose adapters' sessions to manage.
        close_each_step: release sessions at every step end (default) rather than only at the end.
    """

    def __init__(self, runtimes: Sequence[Any], *, close_each_step: bool = True) -> None:
        self.runtimes = list(runtimes)
        self.close_each_step = close_each_step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.close_each_step:
            for runtime in self.runtimes:
                runtime.release_all()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        for runtime in self.runtimes:
            runtime.close_all()

