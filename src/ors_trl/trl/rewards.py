"""The reward functions a spec hands `GRPOTrainer`: the environment's outcome reward and its group score.

Picklable module-level functions (TRL's async trainer) for every path: with `environment_factory` they settle the
batch's episodes from its adapters and transcripts, with `rollout_func` they read the engine's columns, in TRL's async
worker they take the episodes `get_reward` settled. Environment metrics go to TRL's `log_metric`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

from ..core.episode import EnvironmentRuntime, Episode, drop_failed_groups, runtimes, score_groups
from ..protocol.errors import ConfigurationError
from ..protocol.loop import get_loop
from . import backend as _trl
from .adapter import READS_EPISODES, OpenRewardEnvironment, settle_all, take_ended
from .credit import require as require_credit

__all__ = ["group_reward", "outcome_reward", "reward_function"]

logger = logging.getLogger("ors_trl")


def _episodes(environments: Sequence[Any] | None, kwargs: dict[str, Any], column: str) -> list[Episode | None] | None:
    """Where the batch's episodes are, by what TRL passed: the adapters (`environment_factory`, settled here), the
    transcripts of TRL's async worker (episodes its `get_reward` hook handed over), or None: the engine's columns."""
    if environments is not None:
        settle_all(list(environments), kwargs.get("completions"), kwargs.get("completion_ids"))
        episodes = [env.episode if isinstance(env, OpenRewardEnvironment) else None for env in environments]
        drop_failed_groups([ep for ep in episodes if ep is not None])
        return episodes
    completions = kwargs.get("completions")
    if column not in kwargs and _trl.in_async_worker() and isinstance(completions, list):
        return [take_ended(messages) for messages in completions]
    return None


def _flush(rts: Sequence[EnvironmentRuntime], log_metric: Any) -> None:
    """Hand the environments' metrics since the last flush to `log_metric` (TRL's async worker has none: the window
    starts again anyway, so that they do not pile up)."""
    if not callable(log_metric) and not _trl.in_async_worker():
        return
    for metrics in {id(rt.metrics): rt.metrics for rt in rts}.values():
        for name, value in metrics.flush().items():
            if callable(log_metric):
                log_metric(name, value)


def _column(kwargs: dict[str, Any], name: str, func: str) -> list[Any]:
    values = kwargs.get(name)
    if values is None:
        raise ConfigurationError(f"{func} needs `environments` (environment_factory) or the `{name}` column "
                                 "(spec.rollout_func); pass one of them to GRPOTrainer.")
    return [None if v is None or (isinstance(v, float) and v != v) else float(v) for v in values]


def outcome_reward(environments: Sequence[Any] | None = None, *, unscored_reward: float | None = None,
                   **kwargs: Any) -> list[float | None]:
    """The outcome reward: each rollout's last non-None reward (0.0 and negative ones are scores), None when nothing
    was scored. A terminal tool grades here, on the final plain message (a rollout cut off before one scores None).

    Args:
        environments (`Sequence[OpenRewardEnvironment]`, *optional*):
            The batch's adapters, which TRL passes with `environment_factory`; without them (`rollout_func`), the
            rewards are read from the `ors_reward` column.
        unscored_reward (`float`, *optional*):
            Replaces `None` (`OpenRewardSpec(unscored_reward=)`), e.g. 0.0 so that not calling a tool is no escape
            from negative advantages; the metrics still count such rollouts as ungraded. A rollout a failure voided
            (`Episode.voided`) stays None: infrastructure failure is no score.
        **kwargs:
            What TRL passes reward functions: `completions`, the dataset's columns (`ors_reward`, `ors_env` with
            `rollout_func`), `log_metric`, which receives the environment metrics of the batch.

    Raises:
        ConfigurationError: neither `environments` nor the `ors_reward` column was passed.
    """
    episodes = _episodes(environments, kwargs, "ors_reward")
    if episodes is None:
        rewards = _column(kwargs, "ors_reward", "outcome_reward")
        voided = kwargs.get("ors_voided") or [False] * len(rewards)
        rts = runtimes(kwargs.get("ors_env") or [])
    else:
        for ep in episodes:
            if ep is not None:
                ep.account()
        rewards = [ep.reward if ep is not None else getattr(env, "reward", None)
                   for env, ep in zip(environments or [None] * len(episodes), episodes, strict=True)]
        rts = [ep.env for ep in episodes if ep is not None]
        voided = [ep is not None and ep.voided for ep in episodes]
    require_credit(rts)
    _flush(rts, kwargs.get("log_metric"))
    return [trained_reward(r, v, unscored_reward) for r, v in zip(rewards, voided, strict=True)]


def trained_reward(reward: float | None, voided: bool, unscored: float | None) -> float | None:
    """What a rollout is trained on: its reward, else `unscored` where the model left it unscored; a rollout a failure
    voided stays None (infrastructure failure is no score)."""
    return unscored if reward is None and not voided else reward


def group_reward(environments: Sequence[Any] | None = None, **kwargs: Any) -> list[float | None]:
    """The comparative reward of each rollout within its GRPO group (the batch's rollouts of one task): one
    `/score_group` call per group, all at once; None for a group whose scoring failed (`env/<name>/group_failures`)."""
    episodes = _episodes(environments, kwargs, "ors_group_reward")
    if episodes is None:
        return _column(kwargs, "ors_group_reward", "group_reward")
    scored = [ep for ep in episodes if ep is not None and ep.group_reward is None]
    for ep in scored:
        if not ep.env.supports_score_group:
            raise ConfigurationError(f"{ep.env.name} does not support score_group (its /tools does not say "
                                     "supports_score_group); remove its group reward function.")
    if scored:
        get_loop().run(score_groups(scored))
    _flush([ep.env for ep in scored], kwargs.get("log_metric"))
    return [ep.group_reward if ep is not None else None for ep in episodes]


for _reader in (outcome_reward, group_reward):
    setattr(_reader, READS_EPISODES, True)


def reward_function(func: Callable[..., list[float | None]], unscored_reward: float | None = None
                    ) -> Callable[..., list[float | None]]:
    """`func` itself, or bound to an `unscored_reward` (a picklable partial that keeps `func`'s name for TRL)."""
    if unscored_reward is None:
        for name in _TRL_LOGGERS:  # TRL may now warn of rollouts nothing scored: we say it once, and what to do
            logging.getLogger(name).addFilter(_unscored)  # once: a logger keeps a filter only once
        return func
    bound = functools.partial(func, unscored_reward=unscored_reward)
    functools.update_wrapper(bound, func)
    return bound


#: The trainers' loggers that warn of a rollout no reward function scored, quoting its whole prompt and completion,
#: at every step: `All reward functions returned None for the following kwargs: ...`.
_TRL_LOGGERS = ("trl.trainer.grpo_trainer", "trl.trainer.rloo_trainer")


@functools.cache
def _say_unscored() -> None:
    logger.warning("ors-trl: a rollout got no reward from the environment (no tool call, or cut off before the final "
                   "answer), so TRL trains nothing on it (advantage 0); pass unscored_reward=0.0 to OpenRewardSpec / "
                   "OpenRewardMix to score such rollouts 0.0 instead (said once; TRL's warning for each is silenced)")


def _unscored(record: logging.LogRecord) -> bool:
    """TRL's warning of an unscored rollout, as one line of ours, once per process, pointing at `unscored_reward=`."""
    if "All reward functions returned None" not in str(record.msg)[:80]:  # after accelerate's "[RANK 0] "
        return True
    _say_unscored()
    return False
