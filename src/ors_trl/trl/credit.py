"""Per-turn credit (`OpenRewardSpec(credit="turn")`; why: docs/guides/long-horizons.md): the tokens of model turn t
train on `(A_episode + A_turn(t)) / 2`, TRL's advantage for the rollout and `A_turn(t) = (R_t - b_t) / s`: `R_t` the
turn's return (`Episode.turn_returns`), `b_t` the mean `R_t` of the group's rollouts that reached turn t, `s` the std
of the group's `R_t - b_t` over its turns (TRL's `scale_rewards`: "batch" over the batch's, "none" 1). A rollout
without turn returns keeps TRL's advantage; tool-result tokens get 0. Turns are the runs of generated tokens
(`completion_mask * tool_mask` = 1) matched in order to `Episode.turns`, applied behind the TRL seam
(`backend.patch_grpo`) on GRPOTrainer's generate-and-score batch, whose loss takes advantages of shape (B, T).
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from typing import Any

from ..core.episode import EnvironmentRuntime, Episode
from ..protocol.errors import ConfigurationError
from . import backend as _trl

__all__ = ["group_turn_advantages", "install", "require", "turn_spans"]

_NEEDS = ("credit='turn' needs GRPOTrainer (or a subclass that keeps its generate-and-score step), a verified "
          "TRL, and the episodes of spec.rollout_func or environment_factory with reward_funcs=spec.reward_funcs")


def install() -> None:
    """Make GRPOTrainer apply per-turn credit to the batches whose environments ask for it (idempotent)."""
    _trl.patch_grpo(apply)


def require(runtimes: Sequence[EnvironmentRuntime]) -> None:
    """Raise `ConfigurationError` when an environment of the batch asks `credit="turn"` and the scoring running now
    cannot give it (TRL's async trainer, a trainer that scores its own way, an unverified TRL)."""
    if any(rt.options["credit"] == "turn" for rt in runtimes) and not _trl.scoring_hooked():
        raise ConfigurationError(f"{_NEEDS}; this trainer gives no per-turn token boundaries. Use credit='episode' "
                                 "here.")


def returns_of(ep: Episode) -> list[float] | None:
    """The per-turn returns credit trains `ep`'s turns on (`Episode.turn_returns`); the benchmark's control
    replaces this to shuffle them."""
    return ep.turn_returns()


def turn_spans(mask: Sequence[int]) -> list[tuple[int, int]]:
    """The `[start, end)` spans of consecutive 1s in a completion's trained-token mask: the model's replies."""
    spans, start = [], 0
    for bit, run in itertools.groupby(mask, key=bool):
        end = start + len(list(run))
        if bit:
            spans.append((start, end))
        start = end
    return spans


def _std(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0  # TRL's (unbiased) std


def group_turn_advantages(returns: Sequence[list[float] | None], group: int, scale: str = "group"
                          ) -> list[list[float] | None]:
    """Per rollout, per turn, `A_turn(t)` (see the module): rollouts in GRPO groups of `group` consecutive ones;
    None where a rollout has no returns. `scale`: TRL's `scale_rewards`."""
    residuals: list[list[float] | None] = [None] * len(returns)
    for g in range(0, len(returns), group):
        rows = [i for i in range(g, min(g + group, len(returns))) if returns[i] is not None]
        for t in range(max((len(returns[i] or ()) for i in rows), default=0)):
            at = [i for i in rows if len(returns[i] or ()) > t]
            base = sum(returns[i][t] for i in at) / len(at)  # type: ignore[index]
            for i in at:
                residuals[i] = (residuals[i] or []) + [returns[i][t] - base]  # type: ignore[index]
    scales: list[float] = [1.0] * len(returns)
    if scale == "batch":
        scales = [_std([r for row in residuals for r in row or ()])] * len(returns)
    elif scale != "none":
        for g in range(0, len(returns), group):
            s = _std([r for row in residuals[g:g + group] for r in row or ()])
            scales[g:g + group] = [s] * len(scales[g:g + group])
    return [None if row is None else [r / (s + 1e-4) if scale != "none" else r for r in row]
            for row, s in zip(residuals, scales, strict=True)]


def apply(trainer: Any, batch: dict[str, Any]) -> None:
    """The `patch_grpo` hook: turn `batch["advantages"]` (B,) into per-token advantages (B, T) where an episode of
    the batch asks `credit="turn"`; a batch that asks none is left as TRL made it."""
    backend = _trl.Backend.of(trainer)
    episodes = backend.batch_episodes
    local = [ep if isinstance(ep, Episode) and ep.env.options["credit"] == "turn" else None for ep in episodes or ()]
    wanted = any(ep is not None for ep in local)
    if backend.processes == 1 and not wanted:
        return
    if wanted:
        advantages, mask = batch.get("advantages"), batch.get("tool_mask")
        if mask is None or advantages is None or advantages.dim() != 1 or len(local) != advantages.shape[0]:
            raise ConfigurationError(f"{_NEEDS}: this step's batch has no tool mask or no per-rollout advantages to "
                                     "split into turns.")
        if any(ep is not None and not ep.over for ep in local):
            raise ConfigurationError(f"{_NEEDS}: an episode of this batch was not settled by the reward functions.")
    rows, start = backend.gather_objects([returns_of(ep) if ep is not None else None for ep in local])
    if not wanted:  # another process's batch wanted it: the gather above was collective
        return
    size, scale = backend.grouping()
    turn = group_turn_advantages(rows, size, scale)[start:start + len(local)]
    trained = (batch["completion_mask"] * mask).tolist()
    out = advantages.unsqueeze(1).repeat(1, batch["completion_ids"].shape[1])
    unmatched = 0
    for i, (ep, mine) in enumerate(zip(local, turn, strict=True)):
        if ep is None or mine is None:
            continue
        out[i] = 0.0
        spans = turn_spans(trained[i])
        unmatched += len(spans) > len(mine)
        episode = float(advantages[i])
        for k, (a, b) in enumerate(spans):
            out[i, a:b] = (episode + mine[k]) / 2 if k < len(mine) else episode
    batch["advantages"] = out.to(advantages.dtype)
    scored = [t for t in turn if t is not None]
    backend.add_step_metrics({"credit/turns": sum(map(len, scored)) / max(1, len(scored)),
                              "credit/unmatched": float(unmatched)})
