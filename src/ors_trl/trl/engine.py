"""The rollout engine: `spec.rollout_func` for TRL's `rollout_func`, with no turn barriers.

TRL's own loop runs a batch turn by turn: every rollout waits for the slowest tool call of the
turn before anyone generates again. The engine lets each rollout advance on its own: its session
opens, it is rendered and generated for, its tool calls run (on the background loop, concurrently
with every other rollout's), it is generated for again, and so on, while generation batches
whatever rollouts are ready at that moment (by default waiting for others at most 0.05 s and at most
half of what a generation call has been taking: company is worth waiting for only when generating costs
more than the wait; `gather_window=` fixes the wait instead). A slow tool call delays only its own
rollout, so a step takes about as long as its slowest single rollout instead of the sum over turns of
each turn's slowest call.

Each rollout follows TRL's tool loop exactly (same chat template, tool-call parsing, tool-result
formatting, `max_completion_length` and `max_tool_calling_iterations` rules), so with greedy
decoding it produces the same completions, tool calls and rewards as the `environment_factory`
path. Under several processes every process makes the same number of generation calls with the
same number of prompts (a process without work joins with dummy prompts), as collective backends
(vLLM server mode, ZeRO-3, FSDP) require. A spec's `episode_timeout` closes an episode that runs over
and scores it None. Everything here that reads TRL's internals goes through `ors_trl.trl.backend`.

Images: a prompt's and the tool results' image parts are expanded into their image tokens by the
processor as the rollout is rendered, go to every generation call beside those ids with their pixel
fields (`_trl.generate`), and reach TRL's loss with the ids (`_trl.hand_images`); a processing class
that takes no images is a `ConfigurationError` at the first one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from ..core.conversation import images_of
from ..core.episode import Call, EnvironmentRuntime, Episode, Outcome, Reply, Task, score_groups
from ..protocol.budget import get_max_sessions
from ..protocol.errors import ConfigurationError
from ..protocol.loop import get_loop
from . import backend as _trl

__all__ = ["TASK_KEY", "GatherWindow", "RolloutEngine", "task_of"]

logger = logging.getLogger("ors_trl")

#: Key of the prompt message that carries a row's task identity (written by the specs' datasets).
TASK_KEY = "ors_task"
AUTO_GATHER_WINDOW = 0.05  # the automatic gather window's longest wait, in seconds


class GatherWindow:
    """The one micro-batching rule (the engine's generation batches, `LocalPolicy`'s): a request that is ready
    waits for the others that can still come, for at most `window` seconds; None (automatic): at most
    `AUTO_GATHER_WINDOW` and at most half of what a generation call has been taking, since company is worth
    waiting for only when generating costs more than the wait."""

    def __init__(self, window: float | None = None) -> None:
        if window is not None and not window >= 0:  # also refuses NaN
            raise ConfigurationError(f"the gather window must be >= 0 seconds or None (automatic), got {window!r}")
        self.window = window
        self._took: float | None = None  # moving average of a generation call's wall time

    @property
    def seconds(self) -> float:
        if self.window is not None:
            return self.window
        return AUTO_GATHER_WINDOW if self._took is None else min(AUTO_GATHER_WINDOW, self._took / 2)

    def left(self, waiting: int, coming: int, since: float) -> float:
        """Seconds the `waiting` requests (the first ready at `since`) should still wait while `coming` others may
        join; 0.0: generate now."""
        if not waiting or not coming:
            return 0.0
        return max(0.0, self.seconds - (time.monotonic() - since))

    def took(self, seconds: float) -> None:
        """A generation call took `seconds`."""
        self._took = seconds if self._took is None else 0.7 * self._took + 0.3 * seconds


def task_of(prompt: Sequence[Mapping[str, Any]]) -> Task:
    """The task a spec's dataset row put in its prompt's user message."""
    for message in reversed(prompt):
        raw = message.get(TASK_KEY) if isinstance(message, Mapping) else None
        if raw:
            ident = json.loads(raw) if isinstance(raw, str) else dict(raw)
            return Task(ident.get("split", "train"), ident.get("index"), ident.get("task_spec"), ident.get("env"))
    raise ConfigurationError(
        "This prompt carries no ORS task identity. The rollout engine needs the rows of spec.train_dataset "
        "(or mix.train_dataset), whose prompt messages carry it."
    )


class _Rollout:
    """One rollout's token-level state beside its episode."""

    def __init__(self, episode: Episode, base: list[dict[str, Any]], deadline: float | None) -> None:
        self.ep = episode
        self.base = base
        self.deadline = deadline
        self.prompt_ids: list[int] = []
        self.completion_ids: list[int] = []
        self.tool_mask: list[int] = []
        self.logprobs: list[float] | None = []
        self.completions: list[dict[str, Any]] = []
        self.images: list[Any] = []  # the images among its ids, in order (prompt, then tool results)
        self.request: list[int] | None = None  # waiting for generation from these ids
        self.future: concurrent.futures.Future[Any] | None = None  # network work in flight
        self.stage = "open"  # open -> generate <-> tools -> done ("end": a length cut being settled)
        self.waiting_since = 0.0

    @property
    def busy(self) -> bool:
        return self.stage in ("open", "tools", "end")


class RolloutEngine:
    """`rollout_func(prompts, trainer)`: every episode of a batch runs on its own, none waits for another.

    Args:
        environments: environment key (None for a single spec) -> its runtime (whose `episode_timeout` bounds
            each of its episodes: past it an episode is closed and scored None).
        gather_window: seconds generation waits for more rollouts to be ready before it runs for those that
            are. None (the default): at most `AUTO_GATHER_WINDOW` and at most half the recent duration of a
            generation call, so a cheap generator (an API, a small model) does not add a wait to every turn
            of the slowest rollout, while an expensive one still gets full batches.
        turn_barrier: wait for every rollout before each generation (TRL's turn-by-turn schedule), for comparison.
        source: the `source` of its episodes' records (`"eval"`: evaluation during training).

    `info` holds extra record fields for the episodes of the next calls (the evaluation's training `step`).

    Episodes of an environment whose spec has `score_groups=True` are also scored as GRPO groups with its
    `/score_group` (the `ors_group_reward` column `spec.group_reward_func` reads).
    """

    def __init__(self, environments: Mapping[str | None, EnvironmentRuntime], *, gather_window: float | None = None,
                 turn_barrier: bool = False, source: str = "engine") -> None:
        self.environments = dict(environments)
        self.source = source
        self.info: dict[str, Any] = {}
        self.gather = GatherWindow(gather_window)
        self.turn_barrier = turn_barrier
        self.last_episodes: list[Episode] = []
        self.generation_calls: list[int] = []  # prompts per generation call (this process), for inspection
        self._tokens: dict[str, list[int]] = {}
        self._rendering: tuple[weakref.ref[Any], _trl.Rendering] | None = None  # per trainer, held weakly
        _trl.install_image_handoff()

    def __repr__(self) -> str:
        return f"RolloutEngine({list(self.environments)})"

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        _trl.require_engine()
        if self._rendering is None or self._rendering[0]() is not trainer:
            self._rendering = (weakref.ref(trainer), _trl.Rendering.of(trainer))
        self._render_with = self._rendering[1]
        self._eos = _trl.eos_token_ids(trainer)
        self._tokens: dict[str, list[int]] = {}  # this call's renders: a group's rollouts share most of them
        for rt in self.environments.values():
            rt.attach_to(trainer)
        rules = _trl.rules(trainer)
        rollouts = [self._rollout(p, rules) for p in prompts]
        episodes = [r.ep for r in rollouts]
        groups: dict[tuple[int, str], list[Episode]] = {}  # GRPO groups: the rollouts of one task
        for ep in episodes:
            if ep.env.score_groups:
                groups.setdefault((id(ep.env), ep.task.key), []).append(ep)
        bg = get_loop()
        try:
            done: set[int] = set()
            for wave in self._waves(rollouts):
                try:
                    self._run(wave, trainer)
                    done.update(id(r.ep) for r in wave)
                    if groups:  # while their sessions are still open: every group now complete
                        complete = [k for k, g in groups.items() if all(id(e) in done for e in g)]
                        bg.run(score_groups([e for k in complete for e in groups.pop(k)]))
                finally:
                    bg.run(_close_sessions([r.ep for r in wave]))
        finally:
            self._tokens = {}
            for ep in episodes:
                ep.release()  # accounts the episode and writes its record
        self.last_episodes = episodes
        _trl.hand_images(trainer, [r.images for r in rollouts])
        return self._output(rollouts)

    def _rollout(self, prompt: Any, rules: Any) -> _Rollout:
        task = task_of(prompt)
        rt = self.environments.get(task.env)
        if rt is None:
            if len(self.environments) != 1 or task.env is not None:
                raise ConfigurationError(
                    f"prompt names environment {task.env!r}, which this engine does not know ({list(self.environments)})"
                )
            rt = next(iter(self.environments.values()))
        base = [{k: v for k, v in m.items() if k != TASK_KEY} for m in prompt]
        deadline = None if rt.episode_timeout is None else time.monotonic() + rt.episode_timeout
        return _Rollout(rt.episode(task, source=self.source, rules=rules, **self.info), base, deadline)

    def _waves(self, rollouts: list[_Rollout]) -> list[list[_Rollout]]:
        """Split the batch so that no wave opens more sessions than a session cap allows (queuing, not failing).

        Every process has the same batch size and caps, so all processes run the same number of waves.
        """
        caps = [rt.client.max_sessions for rt in self.environments.values()] + [get_max_sessions()]
        known = [c for c in caps if c is not None]
        size = max(min(known) if known else len(rollouts), 1)
        return [rollouts[i:i + size] for i in range(0, len(rollouts), size)]

    # -- the schedule ----------------------------------------------------------------------------

    def _run(self, rollouts: list[_Rollout], trainer: Any) -> None:
        for r in rollouts:
            r.future = r.ep.env.submit(r.ep.open())
        multi = trainer.accelerator.num_processes > 1
        self._fallback: tuple[list[int], list[Any]] | None = None
        while True:
            for r in rollouts:
                self._advance(r, trainer)
            waiting = [r for r in rollouts if r.stage == "generate"]
            busy = [r for r in rollouts if r.busy]
            done = not waiting and not busy
            now = time.monotonic()
            left = self.gather.left(len(waiting), len(busy), min((r.waiting_since for r in waiting), default=now))
            ready = bool(waiting) and (not busy or (not self.turn_barrier and left == 0.0))
            if ready or done:
                if not (self._anyone(trainer, not done) if multi else not done):
                    return
                self._generate_for(waiting, trainer)
                continue
            waits = [r.deadline - now for r in busy if r.deadline is not None]
            if waiting and not self.turn_barrier:
                waits.append(left)
            concurrent.futures.wait([r.future for r in busy if r.future is not None],
                                    timeout=max(min(waits), 0.0) if waits else None,
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def _advance(self, r: _Rollout, trainer: Any) -> None:
        """Move a rollout on once its network work is done (or its time is up)."""
        if r.busy and r.deadline is not None and time.monotonic() >= r.deadline:
            r.ep.time_out(r.ep.env.episode_timeout or 0.0)
            r.stage, r.future = "done", None
            return
        if not r.busy or r.future is None or not r.future.done():
            return
        result, r.future = r.future.result(), None
        if r.stage == "open":
            self._render(r, trainer, opened=bool(result))
        elif r.stage == "tools" and result is not None:
            self._after_tools(r, trainer, result)
        else:
            r.stage = "done"

    def _render(self, r: _Rollout, trainer: Any, *, opened: bool) -> None:
        ep = r.ep
        if opened and ep.prompt is not None:
            messages = ep.prompt.chat(r.base)
            r.images = images_of(messages)
            if r.images:
                _trl.check_images(trainer, f"The prompt of task {ep.task.key}")
        else:
            text = f"[The environment failed to start this task: {(ep.error or {}).get('message')}]"
            messages = [dict(m) for m in r.base]
            messages[-1]["content"] = messages[-1].get("content", "") + text
        tools = self._schemas(r)
        r.prompt_ids = self._memo(["prompt", messages, tools], lambda: self._render_with.prompt_ids(messages, tools))
        self._fallback = self._fallback or (r.prompt_ids, r.images)
        if not opened:  # nothing to generate for: one end-of-sequence token, scored None
            r.completion_ids, r.tool_mask, r.logprobs = [self._render_with.tokenizer.eos_token_id], [1], [0.0]
            r.stage = "done"
            return
        self._wait_for_generation(r, r.prompt_ids)

    def _schemas(self, r: _Rollout) -> list[Any] | None:
        toolset = r.ep.toolset
        return toolset.schemas if toolset is not None and toolset.by_name else None

    def _memo(self, key: list[Any], render: Any) -> list[int]:
        """Tokens from `render()`, computed once per call for equal inputs (tokenizing dominates the main thread)."""
        text = json.dumps(key, sort_keys=True, default=repr)
        if text not in self._tokens:
            self._tokens[text] = render()
        return list(self._tokens[text])

    def _wait_for_generation(self, r: _Rollout, ids: list[int]) -> None:
        r.request, r.stage, r.waiting_since = ids, "generate", time.monotonic()

    def _generate_for(self, waiting: list[_Rollout], trainer: Any) -> None:
        started = time.monotonic()
        ids, lps = self._generate(trainer, [(r.request or [], r.images) for r in waiting],
                                  fallback=self._fallback or ([], []))
        took = time.monotonic() - started
        self.gather.took(took)
        for r, new_ids, new_lp in zip(waiting, ids, lps, strict=True):
            prefix = r.request or []
            if r.completion_ids:  # a reply after tool results: TRL keeps the completion within its budget
                kept = _trl.clip_post_tool(new_ids, len(prefix) - len(r.prompt_ids), trainer.max_completion_length)
                cut, new_ids = len(kept) < len(new_ids), kept
                new_lp = new_lp[: len(new_ids)] if new_lp is not None else None
            else:
                cut = False
            tool_length = len(prefix) - len(r.prompt_ids) - len(r.completion_ids)
            r.tool_mask += [0] * tool_length + [1] * len(new_ids)
            if r.logprobs is not None and new_lp is not None:
                r.logprobs += [0.0] * tool_length + list(new_lp)
            else:
                r.logprobs = None
            r.completion_ids = prefix[len(r.prompt_ids):] + list(new_ids)
            r.request = None
            parsed = self._render_with.parse(new_ids, prefix, self._schemas(r))
            if parsed:
                r.completions.append(parsed)
            text = parsed.get("content")
            reply = Reply(text if isinstance(text, str) else None,
                          tuple(Call.from_chat(c) for c in parsed.get("tool_calls") or ()),
                          truncated=cut or (bool(self._eos) and (not new_ids or new_ids[-1] not in self._eos)),
                          extra={"generation_seconds": round(took, 4)})
            r.stage = "tools"
            r.future = r.ep.env.submit(r.ep.reply(reply))

    def _after_tools(self, r: _Rollout, trainer: Any, outcomes: list[Outcome]) -> None:
        calls = r.completions[-1].get("tool_calls") or []
        tool_messages = [_trl.tool_message(Call.from_chat(c).name, o.content) for c, o in zip(calls, outcomes, strict=True)]
        shown = images_of(tool_messages)
        if shown:
            _trl.check_images(trainer, f"The output of a {r.ep.env.name} tool")
        suffix = self._memo(["tools", tool_messages], lambda: self._render_with.tool_suffix_ids(tool_messages))
        pct = r.prompt_ids + r.completion_ids + suffix
        if _trl.overflows(len(pct) - len(r.prompt_ids), len(pct), trainer.max_completion_length,
                          _trl.max_model_len(trainer)):
            r.stage = "end"  # the tool results would overflow the completion budget: TRL rolls them back
            r.future = r.ep.env.submit(r.ep.end("length"))
            return
        r.completions += tool_messages
        r.images += shown
        self._wait_for_generation(r, pct)

    # -- generation across processes ---------------------------------------------------------------

    @staticmethod
    def _anyone(trainer: Any, local: bool) -> bool:
        """True if any process still has work (every process must then join the next generation call)."""
        accelerator = trainer.accelerator
        if accelerator.num_processes == 1:
            return local
        import torch

        flag = torch.tensor([1 if local else 0], device=accelerator.device)
        return bool(accelerator.gather(flag).max().item())

    def _generate(self, trainer: Any, requests: list[tuple[list[int], list[Any]]], *,
                  fallback: tuple[list[int], list[Any]]) -> tuple[list[list[int]], list[list[float] | None]]:
        """One completion per prompt (its ids and their images) through TRL's backend, padded to a common count
        across processes."""
        n = len(requests)
        accelerator = trainer.accelerator
        target = n
        if accelerator.num_processes > 1:
            import torch

            counts = accelerator.gather(torch.tensor([n], device=accelerator.device))
            target = int(counts.max().item())
        if target == 0:
            return [], []
        self.generation_calls.append(n)
        padded = list(requests) + [requests[0] if requests else fallback] * (target - n)
        completion_ids, logprobs = _trl.generate(trainer, [list(ids) for ids, _ in padded], [im for _, im in padded])
        completion_ids = [list(c) for c in completion_ids[:n]]
        lps: list[list[float] | None] = [list(lp) for lp in logprobs[:n]] if logprobs is not None else [None] * n
        return completion_ids, lps

    # -- results -----------------------------------------------------------------------------------

    @staticmethod
    def _output(rollouts: list[_Rollout]) -> dict[str, Any]:
        logprobs = [r.logprobs for r in rollouts]
        return {
            "prompt_ids": [r.prompt_ids for r in rollouts],
            "completion_ids": [r.completion_ids for r in rollouts],
            "logprobs": logprobs if all(lp is not None for lp in logprobs) else None,
            "env_mask": [r.tool_mask for r in rollouts],
            "ors_reward": [r.ep.reward for r in rollouts],
            "ors_group_reward": [r.ep.group_reward for r in rollouts],
            "ors_finished": [r.ep.finished for r in rollouts],
            "ors_tool_calls": [r.ep.tool_calls for r in rollouts],
            "ors_tool_failures": [r.ep.tool_failures for r in rollouts],
            "ors_env": [r.ep.env.key for r in rollouts],
        }


async def _close_sessions(episodes: list[Episode]) -> None:
    await asyncio.gather(*(ep.close_session() for ep in episodes), return_exceptions=True)
