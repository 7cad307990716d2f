"""The rollout engine: `spec.rollout_func` for TRL's `rollout_func`, with no turn barriers.

Each episode plays on its own (`ors_trl.core.rollout.play`, on the background loop) while the training thread generates
for the rollouts that are ready (one `Batcher`), following TRL's tool loop exactly (`ors_trl.trl.tokens`): greedy
decoding gives `environment_factory`'s completions and rewards. Under several processes all make the same generation
calls with as many prompts (padded), as collective backends (vLLM server mode, ZeRO-3, FSDP) require.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from collections.abc import Mapping, Sequence
from typing import Any

from ..core.episode import EnvironmentRuntime, Episode, Task, drop_failed_groups, score_groups
from ..core.rollout import Batcher, Conversation, StopEpisode, play, play_task
from ..protocol.budget import get_max_sessions
from ..protocol.errors import ConfigurationError
from ..protocol.loop import get_loop
from .backend import Backend, patch_grpo, require_engine, rules
from .credit import install as install_credit
from .tokens import TokenGenerator, Tokens, fidelity

__all__ = ["TASK_KEY", "RolloutEngine", "episode_for", "task_of"]

#: Key of the prompt message that carries a row's task identity (written by the specs' datasets).
TASK_KEY = "ors_task"


def task_of(prompt: Sequence[Mapping[str, Any]]) -> Task:
    """The task a spec's dataset row put in its prompt's user message."""
    for message in reversed(prompt):
        raw = message.get(TASK_KEY) if isinstance(message, Mapping) else None
        if raw:
            ident = json.loads(raw) if isinstance(raw, str) else dict(raw)
            return Task(ident.get("split", "train"), ident.get("index"), ident.get("task_spec"), ident.get("env"))
    raise ConfigurationError("This prompt carries no ORS task identity. The rollout engine needs the rows of "
                             "spec.train_dataset (or mix.train_dataset), whose prompt messages carry it.")


def episode_for(environments: Mapping[str | None, EnvironmentRuntime], prompt: Any, rules: Any, source: str,
                **info: Any) -> tuple[Episode, list[dict[str, Any]]]:
    """The (unopened) episode of a dataset row's prompt in its environment, and the prompt without the task key."""
    task = task_of(prompt)
    rt = environments.get(task.env)
    if rt is None:
        if len(environments) != 1 or task.env is not None:
            raise ConfigurationError(f"prompt names environment {task.env!r}, which this engine does not know "
                                     f"({list(environments)})")
        rt = next(iter(environments.values()))
    base = [{k: v for k, v in m.items() if k != TASK_KEY} for m in prompt]
    return rt.episode(task, source=source, rules=rules, **info), base


class _TrainerGenerator(TokenGenerator):
    """The trainer's generation backend as a generator, under TRL's budgets."""

    def __init__(self, backend: Backend, batcher: Batcher) -> None:
        super().__init__(backend.rendering, batcher)
        self.backend = backend
        self.fallback: tuple[list[int], list[Any]] | None = None  # a prompt to pad with, once one was rendered

    def _generate_ids(self, tokens: list[Tokens]) -> list[tuple[list[int], list[float] | None]]:
        self.fallback = self.fallback or next(((t.prompt_ids, t.images) for t in tokens), None)
        nothing = ([self.rendering.tokenizer.eos_token_id], [])  # a process that has rendered no prompt pads with it
        return self.backend.generate([(t.ids, t.images) for t in tokens], self.fallback or nothing)

    def _fits(self, tokens: Tokens, suffix: list[int]) -> None:
        """Stop before the context fills (`context_length`) or tool results pass the completion budget (`length`)."""
        total = len(tokens.ids) + len(suffix)
        if total >= self.backend.max_model_len:
            raise StopEpisode("context_length", f"{total} tokens would fill the model's context "
                                                f"({self.backend.max_model_len})")
        if suffix and total - len(tokens.prompt_ids) > self.backend.trainer.max_completion_length:
            raise StopEpisode("length")

    def _clip(self, tokens: Tokens, ids: list[int], logprobs: list[float] | None
             ) -> tuple[list[int], list[float] | None, str | None]:
        """A reply cut to the completion budget after tool results (TRL cuts only those) and to the context."""
        context = self.backend.max_model_len - len(tokens.ids)
        budget = self.backend.trainer.max_completion_length - len(tokens.completion_ids) if tokens.completion_ids \
            else len(ids)
        if len(ids) <= min(context, budget):
            return ids, logprobs, None
        kept = ids[: max(min(context, budget), 0)]
        return kept, logprobs[: len(kept)] if logprobs is not None else None, \
            "context_length" if context < budget else "length"

    def _refuse_images(self, what: str) -> None:
        self.backend.refuse_images(what)


class RolloutEngine:
    """`rollout_func(prompts, trainer)`: every episode of a batch runs on its own, none waits for another.

    `environments`: environment key (None for a single spec) -> its runtime; `gather_window`: seconds generation
    waits for more ready rollouts (None: automatic, see `Batcher`); `turn_barrier`: TRL's turn-by-turn schedule, for
    comparison. `source` and `info` go to the next calls' records. A spec with `score_groups=True` also scores GRPO
    groups (the `ors_group_reward` column)."""

    def __init__(self, environments: Mapping[str | None, EnvironmentRuntime], *, gather_window: float | None = None,
                 turn_barrier: bool = False) -> None:
        Batcher(gather_window)  # checks the window now
        self.environments = dict(environments)
        self.source, self.gather_window, self.turn_barrier = "engine", gather_window, turn_barrier
        self.player: Any = play  # what plays an episode: `play`, or a harness's (`ors_trl.harness.Harness.play`)
        self.info: dict[str, Any] = {}
        self.last_episodes: list[Episode] = []
        self.generation_calls: list[int] = []  # prompts per generation call (this process), for inspection
        patch_grpo()
        if any(rt.options["credit"] == "turn" for rt in self.environments.values()):
            install_credit()

    def __repr__(self) -> str:
        return f"RolloutEngine({list(self.environments)})"

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        require_engine()
        from .callbacks import attach_session_cleanup

        backend = Backend.of(trainer)
        for rt in self.environments.values():
            attach_session_cleanup(trainer, rt)
        generator = _TrainerGenerator(backend, Batcher(self.gather_window, barrier=self.turn_barrier))
        turn_rules = rules(trainer)
        rollouts = [episode_for(self.environments, p, turn_rules, self.source, **self.info) for p in prompts]
        episodes = [ep for ep, _ in rollouts]  # each rollout's last attempt once played (a replay replaces it)
        conversations: list[Conversation | None] = [None] * len(rollouts)
        groups: dict[tuple[int, str], list[int]] = {}  # GRPO groups to score: the rollouts of one task
        for i, ep in enumerate(episodes):
            if ep.env.options["score_groups"]:
                groups.setdefault((id(ep.env), ep.task.key), []).append(i)

        async def play_wave(wave: list[int]) -> None:
            """Play a wave's rollouts (`episode_retries`), score its complete GRPO groups while their sessions are
            open, close its sessions, also on errors (the first error, in wave order, raised once all have ended)."""
            attempts: dict[int, list[Episode]] = {i: [] for i in wave}

            async def one(i: int) -> None:
                episodes[i], conversations[i] = await play_task(
                    rollouts[i][0], generator, attempts=attempts[i], player=self.player, base=rollouts[i][1],
                    timeout=rollouts[i][0].env.options["episode_timeout"])
                episodes[i].tokens = fidelity(conversations[i])

            try:
                errors = [p for p in await asyncio.gather(*map(one, wave), return_exceptions=True)
                          if isinstance(p, BaseException)]
                if errors:
                    raise errors[0]
                complete = [key for key, group in groups.items() if all(conversations[i] is not None for i in group)]
                await score_groups([episodes[i] for key in complete for i in groups.pop(key)])
            finally:
                for i in wave:
                    episodes[i] = attempts[i][-1] if attempts[i] else episodes[i]
                await _close_sessions([episodes[i] for i in wave])

        try:
            for wave in self._waves(list(range(len(rollouts))), backend):
                future = get_loop().submit(play_wave(wave))
                future.add_done_callback(lambda _: generator.batcher.wake())
                try:
                    self._pump(generator, future)
                    future.result()
                finally:
                    if not future.done():  # the pump failed: stop the wave, its sessions close all the same
                        future.cancel()
                        get_loop().run(_close_sessions([episodes[i] for i in wave]))
            drop_failed_groups(episodes)
        finally:
            for ep in episodes:
                ep.release()  # accounts the episode and writes its record
        self.last_episodes = episodes
        tokens = [self._tokens(generator, c, ep, base) for c, ep, (_, base) in zip(conversations, episodes, rollouts,
                                                                                 strict=True)]
        backend.hand_images([t.images for t in tokens])
        logprobs = [t.logprobs for t in tokens]
        return {
            "prompt_ids": [t.prompt_ids for t in tokens],
            "completion_ids": [t.completion_ids for t in tokens],
            "logprobs": logprobs if all(lp is not None for lp in logprobs) else None,
            "env_mask": [t.mask for t in tokens],
            **{f"ors_{k}": [getattr(ep, k) for ep in episodes]
               for k in ("reward", "group_reward", "finished", "tool_calls", "tool_failures", "voided")},
            "ors_env": [ep.env.key for ep in episodes],
        }

    def _waves(self, rollouts: list[Any], backend: Backend) -> list[list[Any]]:
        """Split the batch so that no wave opens more sessions than a cap allows; as many waves on every process (one
        with fewer rollouts, or none, still joins the others' generation calls in its empty waves)."""
        caps = [rt.client.max_sessions for rt in self.environments.values()] + [get_max_sessions()]
        size = max(min((c for c in caps if c is not None), default=len(rollouts)), 1)
        return [rollouts[i * size:(i + 1) * size] for i in range(backend.most(-(-len(rollouts) // size)))]

    def _pump(self, generator: _TrainerGenerator, wave: concurrent.futures.Future[Any]) -> None:
        """Generate on the training thread for the ready rollouts until the wave ends (under several processes: until
        none has work; a process without any joins every call with padding)."""
        batcher, backend = generator.batcher, generator.backend
        while True:
            batch = batcher.take(stop=wave.done)
            if not backend.most(len(batch)):
                return
            self.generation_calls.append(len(batch))
            generator._answer(batch)

    def _tokens(self, generator: _TrainerGenerator, conversation: Conversation | None, ep: Episode,
                base: list[dict[str, Any]]) -> Tokens:
        """The rollout's ids; for one that never rendered, the dataset prompt saying why; one EOS token where nothing
        was generated (the prompt filled the context, or it never got that far): TRL cannot parse an empty completion."""
        tokens = conversation.state if conversation is not None else None
        if tokens is None:
            messages = [dict(m) for m in base]
            if ep.error is not None:
                messages[-1]["content"] = messages[-1].get("content", "") + \
                    f"[The environment failed to start this task: {ep.error.get('message')}]"
            tools = ep.toolset.schemas if ep.toolset is not None and ep.toolset.by_name else None
            tokens = Tokens(generator._prompt_ids(messages, tools), [], len(messages))
        if not tokens.completion_ids:
            tokens.add([generator.rendering.tokenizer.eos_token_id], [0.0])
        return tokens


async def _close_sessions(episodes: list[Episode]) -> None:
    await asyncio.gather(*(ep.close_session() for ep in episodes), return_exceptions=True)
