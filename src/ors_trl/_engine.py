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
(vLLM server mode, ZeRO-3, FSDP) require. `episode_timeout` closes an episode that runs over and
scores it None. Everything here that reads TRL's internals goes through `ors_trl._trl`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from . import _trl
from ._budget import get_max_sessions
from ._episode import EnvironmentRuntime, Episode, Outcome, Task, score_groups
from ._exceptions import ConfigurationError, ToolRefusedError
from ._loop import get_loop

__all__ = ["TASK_KEY", "RolloutEngine", "task_of"]

logger = logging.getLogger("ors_trl")

#: Key of the prompt message that carries a row's task identity (written by the specs' datasets).
TASK_KEY = "ors_task"
AUTO_GATHER_WINDOW = 0.05  # the automatic gather window's longest wait, in seconds


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
        self.request: list[int] | None = None  # waiting for generation from these ids
        self.future: concurrent.futures.Future[Any] | None = None  # network work in flight
        self.stage = "open"  # open -> generate <-> tools -> end -> done
        self.iteration = 0
        self.waiting_since = 0.0

    @property
    def busy(self) -> bool:
        return self.stage in ("open", "tools", "end")


class RolloutEngine:
    """`rollout_func(prompts, trainer)`: every episode of a batch runs on its own, none waits for another.

    Args:
        environments: environment key (None for a single spec) -> its runtime.
        episode_timeout: wall-clock seconds one episode may take (None: no limit); it is then closed and
            scored None.
        gather_window: seconds generation waits for more rollouts to be ready before it runs for those that
            are. None (the default): at most `AUTO_GATHER_WINDOW` and at most half the recent duration of a
            generation call, so a cheap generator (an API, a small model) does not add a wait to every turn
            of the slowest rollout, while an expensive one still gets full batches.
        turn_barrier: wait for every rollout before each generation (TRL's turn-by-turn schedule), for comparison.

    Episodes of an environment whose spec has `score_groups=True` are also scored as GRPO groups with its
    `/score_group` (the `ors_group_reward` column `spec.group_reward_func` reads).
    """

    def __init__(self, environments: Mapping[str | None, EnvironmentRuntime], *, episode_timeout: float | None = None,
                 gather_window: float | None = None, turn_barrier: bool = False) -> None:
        if episode_timeout is not None and episode_timeout <= 0:
            raise ConfigurationError("episode_timeout must be positive or None")
        self.environments = dict(environments)
        self.episode_timeout = episode_timeout
        self.gather_window = gather_window
        self.turn_barrier = turn_barrier
        self.last_episodes: list[Episode] = []
        self.generation_calls: list[int] = []  # prompts per generation call (this process), for inspection
        self._tokens: dict[str, list[int]] = {}
        self._generation_s: float | None = None  # moving average of a generation call's wall time

    def __repr__(self) -> str:
        return f"RolloutEngine({list(self.environments)})"

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        _trl.require_engine()
        self._tok = _trl.prepare(trainer)
        self._eos = _trl.eos_token_ids(trainer)
        self._tokens: dict[str, list[int]] = {}  # this call's renders: a group's rollouts share most of them
        for rt in self.environments.values():
            rt.attach_to(trainer)
        rollouts = [self._rollout(p) for p in prompts]
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
        return self._output(rollouts)

    def _rollout(self, prompt: Any) -> _Rollout:
        task = task_of(prompt)
        rt = self.environments.get(task.env)
        if rt is None:
            if len(self.environments) != 1 or task.env is not None:
                raise ConfigurationError(
                    f"prompt names environment {task.env!r}, which this engine does not know ({list(self.environments)})"
                )
            rt = next(iter(self.environments.values()))
        base = [{k: v for k, v in m.items() if k != TASK_KEY} for m in prompt]
        deadline = None if self.episode_timeout is None else time.monotonic() + self.episode_timeout
        return _Rollout(rt.episode(task, source="engine"), base, deadline)

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
        self._fallback: list[int] | None = None
        while True:
            for r in rollouts:
                self._advance(r, trainer)
            waiting = [r for r in rollouts if r.stage == "generate"]
            busy = [r for r in rollouts if r.busy]
            done = not waiting and not busy
            now = time.monotonic()
            first = min((r.waiting_since for r in waiting), default=now)
            window = self._window()
            ready = bool(waiting) and (not busy or (not self.turn_barrier and now - first >= window))
            if ready or done:
                if not (self._anyone(trainer, not done) if multi else not done):
                    return
                self._generate_for(waiting, trainer)
                continue
            waits = [r.deadline - now for r in busy if r.deadline is not None]
            if waiting and not self.turn_barrier:
                waits.append(window - (now - first))
            concurrent.futures.wait([r.future for r in busy if r.future is not None],
                                    timeout=max(min(waits), 0.0) if waits else None,
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def _window(self) -> float:
        """How long a ready rollout waits for company: `gather_window`, else the automatic rule."""
        if self.gather_window is not None:
            return self.gather_window
        if self._generation_s is None:
            return AUTO_GATHER_WINDOW
        return min(AUTO_GATHER_WINDOW, self._generation_s / 2)

    def _advance(self, r: _Rollout, trainer: Any) -> None:
        """Move a rollout on once its network work is done (or its time is up)."""
        if r.busy and r.deadline is not None and time.monotonic() >= r.deadline and r.stage != "end":
            r.ep.timed_out = True
            r.ep.fail(TimeoutError(f"the episode exceeded episode_timeout={self.episode_timeout}s"), reason="timeout")
            logger.warning("%s: episode for task %s exceeded episode_timeout=%ss; closing it, scored None",
                           r.ep.env.name, r.ep.task.key, self.episode_timeout)
            r.stage, r.future = "done", None
            return
        if not r.busy or r.future is None or not r.future.done():
            return
        result, r.future = r.future.result(), None
        if r.stage == "open":
            self._render(r, trainer, opened=bool(result))
        elif r.stage == "tools":
            self._after_tools(r, trainer, result)
        elif r.stage == "end":
            r.stage = "done"

    def _render(self, r: _Rollout, trainer: Any, *, opened: bool) -> None:
        ep = r.ep
        if opened and ep.prompt is not None:
            messages = ep.prompt.chat(r.base)
        else:
            text = f"[The environment failed to start this task: {(ep.error or {}).get('message')}]"
            messages = [dict(m) for m in r.base]
            messages[-1]["content"] = messages[-1].get("content", "") + text
        tools = self._schemas(r)
        r.prompt_ids = self._memo(["prompt", messages, tools], lambda: _trl.render(trainer, messages, tools))
        self._fallback = self._fallback or r.prompt_ids
        if not opened:  # nothing to generate for: one end-of-sequence token, scored None
            r.completion_ids, r.tool_mask, r.logprobs = [self._tok.eos_token_id], [1], [0.0]
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
        from trl.chat_template_utils import parse_response

        started = time.monotonic()
        ids, lps = self._generate(trainer, [r.request or [] for r in waiting], fallback=self._fallback or [])
        took = time.monotonic() - started
        self._generation_s = took if self._generation_s is None else 0.7 * self._generation_s + 0.3 * took
        for r in waiting:
            r.ep.timings["generation"] += took
        max_len = trainer.max_completion_length
        for r, new_ids, new_lp in zip(waiting, ids, lps, strict=True):
            prefix = r.request or []
            first = not r.completion_ids
            if not first:  # keep the completion within max_completion_length, as TRL cuts post-tool text
                excess = len(prefix) - len(r.prompt_ids) + len(new_ids) - max_len
                if excess > 0:
                    new_ids = new_ids[: len(new_ids) - excess]
                    new_lp = new_lp[: len(new_ids)] if new_lp is not None else None
            tool_length = len(prefix) - len(r.prompt_ids) - len(r.completion_ids)
            r.tool_mask += [0] * tool_length + [1] * len(new_ids)
            if r.logprobs is not None and new_lp is not None:
                r.logprobs += [0.0] * tool_length + list(new_lp)
            else:
                r.logprobs = None
            r.completion_ids = prefix[len(r.prompt_ids):] + list(new_ids)
            r.request = None
            parsed = parse_response(self._tok, new_ids, prefix=prefix, tools=self._schemas(r)) if new_ids else {}
            if parsed:
                r.completions.append(parsed)
            text = parsed.get("content") if parsed else None
            r.ep.begin_turn(text if isinstance(text, str) else None)
            calls = (parsed.get("tool_calls") or None) if parsed else None
            truncated = bool(new_ids) and bool(self._eos) and new_ids[-1] not in self._eos
            if calls and r.iteration < trainer.max_tool_calling_iterations:
                r.stage = "tools"
                r.future = r.ep.env.submit(_run_calls(r.ep, calls))
            elif calls:
                self._end(r, None, "max_turns")
            else:
                self._end(r, None if truncated or not parsed else text or "", "length" if truncated else "no_tool_calls")

    def _after_tools(self, r: _Rollout, trainer: Any, results: list[tuple[str, Outcome]]) -> None:
        tool_messages = [{"role": "tool", "name": name, "content": outcome.content} for name, outcome in results]
        r.completions += tool_messages
        r.iteration += 1
        if r.ep.timed_out:
            r.stage = "done"
            return
        suffix = self._memo(["tools", tool_messages], lambda: _trl.tool_suffix_ids(trainer, tool_messages))
        pct = r.prompt_ids + r.completion_ids + suffix
        if len(pct) - len(r.prompt_ids) > trainer.max_completion_length or len(pct) >= _trl.max_model_len(trainer):
            # The tool results would overflow the completion budget: roll them back and end the episode.
            del r.completions[len(r.completions) - len(tool_messages):]
            self._end(r, None, "length")
            return
        self._wait_for_generation(r, pct)

    def _end(self, r: _Rollout, message: str | None, reason: str) -> None:
        r.stage = "end"
        r.future = r.ep.env.submit(r.ep.end(message, reason=reason))

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

    def _generate(self, trainer: Any, prompt_ids: list[list[int]], *, fallback: list[int]
                  ) -> tuple[list[list[int]], list[list[float] | None]]:
        """One completion per prompt through TRL's backend, padded to a common count across processes."""
        n = len(prompt_ids)
        accelerator = trainer.accelerator
        target = n
        if accelerator.num_processes > 1:
            import torch

            counts = accelerator.gather(torch.tensor([n], device=accelerator.device))
            target = int(counts.max().item())
        if target == 0:
            return [], []
        self.generation_calls.append(n)
        padded = list(prompt_ids) + [list(prompt_ids[0] if prompt_ids else fallback)] * (target - n)
        completion_ids, logprobs = _trl.generate(trainer, padded)
        completion_ids = [list(c) for c in completion_ids[:n]]
        lps: list[list[float] | None] = [list(lp) for lp in logprobs[:n]] if logprobs is not None else [None] * n
        return completion_ids, lps

    # -- results -----------------------------------------------------------------------------------

    @staticmethod
    def _output(rollouts: list[_Rollout]) -> dict[str, Any]:
        logprobs = [r.logprobs for r in rollouts]
        out = {
            "prompt_ids": [r.prompt_ids for r in rollouts],
            "completion_ids": [r.completion_ids for r in rollouts],
            "logprobs": logprobs if all(lp is not None for lp in logprobs) else None,
            "env_mask": [r.tool_mask for r in rollouts],
            "ors_reward": [None if r.ep.timed_out else r.ep.reward for r in rollouts],
            "ors_group_reward": [r.ep.group_reward for r in rollouts],
            "ors_finished": [r.ep.finished for r in rollouts],
            "ors_tool_calls": [r.ep.tool_calls for r in rollouts],
            "ors_tool_failures": [r.ep.tool_failures for r in rollouts],
            "ors_env": [r.ep.env.key for r in rollouts],
        }
        return out


async def _run_calls(ep: Episode, calls: list[dict[str, Any]]) -> list[tuple[str, Outcome]]:
    """One rollout's calls of a turn, in order on its session, formatted as TRL's loop formats them."""
    out = []
    for call in calls:
        if call.get("type") != "function":
            name = call.get("name", "unknown")
            refusal = ToolRefusedError(f"Unsupported tool call type: {call.get('type')}", tool=name)
            out.append((name, await ep.call(name, None, rejected=refusal)))
            continue
        function = call.get("function") or {}
        name = function.get("name", "unknown")
        out.append((name, await ep.call(name, function.get("arguments") or {})))
    return out


async def _close_sessions(episodes: list[Episode]) -> None:
    await asyncio.gather(*(ep.close_session() for ep in episodes), return_exceptions=True)
