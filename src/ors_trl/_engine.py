"""The concurrent rollout engine: `spec.rollout_func` for TRL's `rollout_func` extension point.

TRL's own loop opens one session per rollout one after another and runs each rollout's tool
calls one rollout at a time. The engine runs the whole multi-turn episode itself, for every
rollout of the batch at once:

1. all sessions of the batch open concurrently (bounded by the client's `max_sessions`);
2. generation is batched across the rollouts that are still active, through TRL's own backends
   (`trainer._generate_single_turn`: transformers, vLLM server or colocate);
3. every tool call of a turn, across all rollouts, runs concurrently (bounded by
   `max_concurrent_tool_calls`);
4. it returns what TRL needs (prompt ids, completion ids, logprobs, an `env_mask` that keeps
   environment tokens out of the loss) plus each rollout's reward in the `ors_reward` column
   that `spec.reward_funcs` reads.

It follows TRL's own tool loop turn for turn (same chat template, same tool-call parsing, same
tool-result formatting, same `max_completion_length` and `max_tool_calling_iterations` rules), so
with greedy decoding it produces the same completions, tool calls and rewards as the
`environment_factory` path. Under several processes every generation call is made by every
process the same number of times (idle processes generate a dummy prompt), as collective
backends (vLLM server mode, ZeRO-3, FSDP) require.

A per-episode wall-clock limit (`episode_timeout`) closes an episode that runs over and scores it
None, so one straggler does not hold the step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._adapter import EnvironmentRuntime, episode_finished_error, truncate_output
from ._budget import get_max_sessions
from ._client import AsyncSession
from ._exceptions import ConfigurationError, ORSError

__all__ = ["TASK_KEY", "EngineEnvironment", "RolloutEngine", "task_identity"]

logger = logging.getLogger("ors_trl")

#: Key of the prompt message that carries a row's task identity (written by the specs' datasets).
TASK_KEY = "ors_task"


@dataclass
class EngineEnvironment:
    """What the engine needs about one environment: its runtime and its bound adapter class."""

    runtime: EnvironmentRuntime
    adapter_cls: type
    remote_names: dict[str, str]  # attribute -> remote tool name
    display_names: dict[str, str]  # attribute -> name the model sees
    _tools: list[Any] | None = None

    def tools(self) -> list[Any]:
        """The bound tool methods, exactly as TRL would collect them from an adapter instance."""
        if self._tools is None:
            instance = self.adapter_cls()
            self._tools = [getattr(instance, attr) for attr in sorted(self.remote_names)]
        return self._tools

    def remote_by_display(self) -> dict[str, str]:
        return {self.display_names[a]: a for a in self.remote_names}


class _Capture:
    """Stands in for an adapter so a bound tool function maps model arguments to wire arguments."""

    def _call_tool(self, name: str, arguments: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return name, arguments

    async def _acall_tool(self, name: str, arguments: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return name, arguments


@dataclass
class _Episode:
    index: int
    env_key: str | None
    env: EngineEnvironment
    task_index: int | None
    task_spec: dict[str, Any] | None
    prompt_messages: list[dict[str, Any]]
    started: float = field(default_factory=time.monotonic)
    session: AsyncSession | None = None
    prompt_text: str = ""
    error: str | None = None
    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    tool_mask: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    completions: list[dict[str, Any]] = field(default_factory=list)
    pending_calls: list[dict[str, Any]] | None = None
    reward: float | None = None
    rewards: list[float | None] = field(default_factory=list)
    finished: bool = False
    tool_calls: int = 0
    tool_failures: int = 0
    timed_out: bool = False
    over: bool = False
    trace: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.session is not None and not self.timed_out


def task_identity(prompt: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The task identity a spec's dataset put in the prompt's user message."""
    for message in reversed(prompt):
        raw = message.get(TASK_KEY) if isinstance(message, Mapping) else None
        if raw:
            return json.loads(raw) if isinstance(raw, str) else dict(raw)
    raise ConfigurationError(
        "This prompt carries no ORS task identity. The rollout engine needs the rows of spec.train_dataset "
        "(or mix.train_dataset), whose prompt messages carry it."
    )


class RolloutEngine:
    """Callable `rollout_func(prompts, trainer)` running every episode of a batch concurrently.

    Args:
        environments: environment key (None for a single spec) -> `EngineEnvironment`.
        max_concurrent_tool_calls: bound on tool calls in flight at once across the batch.
        episode_timeout: wall-clock seconds an episode may take (None: no limit).
    """

    def __init__(self, environments: Mapping[str | None, EngineEnvironment], *,
                 max_concurrent_tool_calls: int = 64, episode_timeout: float | None = None) -> None:
        if max_concurrent_tool_calls < 1:
            raise ConfigurationError("max_concurrent_tool_calls must be at least 1")
        if episode_timeout is not None and episode_timeout <= 0:
            raise ConfigurationError("episode_timeout must be positive or None")
        self.environments = dict(environments)
        self.max_concurrent_tool_calls = max_concurrent_tool_calls
        self.episode_timeout = episode_timeout
        self._prepared_for: int | None = None
        self.last_episodes: list[_Episode] = []

    # -- trainer plumbing ------------------------------------------------------------------------

    def _prepare(self, trainer: Any) -> None:
        """Once per trainer: response parsing and the (prefix-preserving) chat template TRL would use with tools."""
        if self._prepared_for == id(trainer):
            return
        from trl.chat_template_utils import (
            add_response_schema,
            get_training_chat_template,
            is_chat_template_prefix_preserving,
        )

        tok = trainer._tokenizer
        if getattr(tok, "response_template", None) is None and getattr(tok, "response_schema", None) is None:
            add_response_schema(trainer.processing_class)
        if getattr(trainer, "chat_template", None) is None and not is_chat_template_prefix_preserving(
            trainer.processing_class
        ):
            trainer.chat_template = get_training_chat_template(trainer.processing_class)
        self._prepared_for = id(trainer)

    def _env_for(self, key: str | None) -> EngineEnvironment:
        if key in self.environments:
            return self.environments[key]
        if len(self.environments) == 1 and key is None:
            return next(iter(self.environments.values()))
        raise ConfigurationError(
            f"prompt names environment {key!r}, which this engine does not know ({list(self.environments)})"
        )

    # -- the rollout function ----------------------------------------------------------------------

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        self._prepare(trainer)
        for env in self.environments.values():
            env.runtime.attach_to(trainer)
        episodes = [self._episode(i, p) for i, p in enumerate(prompts)]
        bg = next(iter(self.environments.values())).runtime.bg
        for wave in self._waves(episodes):
            bg.run(self._open_all(wave))
            try:
                self._run_turns(wave, trainer)
            finally:
                bg.run(self._finish_all(wave))
        self.last_episodes = episodes
        self._log_metrics(trainer)
        return self._output(episodes, trainer)

    def _waves(self, episodes: list[_Episode]) -> list[list[_Episode]]:
        """Split the batch so no wave opens more sessions than a session cap allows (queuing, not failing).

        Every process has the same batch size and caps, so all processes run the same number of waves.
        """
        caps = [env.runtime.client.max_sessions for env in self.environments.values()]
        caps.append(get_max_sessions())
        known = [c for c in caps if c is not None]
        size = min(known) if known else len(episodes)
        size = max(size, 1)
        return [episodes[i:i + size] for i in range(0, len(episodes), size)]

    def _episode(self, i: int, prompt: Any) -> _Episode:
        ident = task_identity(prompt)
        key = ident.get("env")
        env = self._env_for(key)
        messages = [dict(m) for m in prompt]
        for m in messages:
            m.pop(TASK_KEY, None)
        return _Episode(index=i, env_key=key, env=env, task_index=ident.get("index"),
                        task_spec=ident.get("task_spec"), prompt_messages=messages)

    async def _open_all(self, episodes: list[_Episode]) -> None:
        async def open_one(ep: _Episode) -> None:
            rt = ep.env.runtime
            key = rt.task_key(ep.task_index, ep.task_spec)
            ep.started = time.monotonic()
            try:
                ep.session, ep.prompt_text = await rt.open(key, ep.task_index, ep.task_spec)
            except ORSError as exc:
                ep.error = str(exc)
                logger.warning("%s: could not open a session for task %s: %s", rt.name, key, exc)

        await asyncio.gather(*(open_one(ep) for ep in episodes))

    async def _finish_all(self, episodes: list[_Episode]) -> None:
        async def finish(ep: _Episode) -> None:
            if ep.session is not None:
                await ep.session.close()
            rt = ep.env.runtime
            rt.metrics.record_episode(rt.name, reward=ep.reward, finished=ep.finished, calls=ep.tool_calls,
                                      timed_out=ep.timed_out)
            if rt.recorder is not None:
                rt.recorder.write(self._record(ep))

        await asyncio.gather(*(finish(ep) for ep in episodes), return_exceptions=True)

    # -- turns -----------------------------------------------------------------------------------

    def _render_prompt(self, ep: _Episode, trainer: Any) -> list[int]:
        messages = [dict(m) for m in ep.prompt_messages]
        text = ep.prompt_text if ep.error is None else f"[The environment failed to start this task: {ep.error}]"
        last = messages[-1]
        content = last.get("content", "")
        last["content"] = content + text if isinstance(content, str) else [*content, {"type": "text", "text": text}]
        ep.prompt_messages = messages
        tokenized = trainer.processing_class.apply_chat_template(
            conversation=[messages],
            tools=ep.env.tools() or None,
            chat_template=trainer.chat_template,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            **trainer.chat_template_kwargs,
        )
        return list(tokenized["input_ids"][0])

    def _run_turns(self, episodes: list[_Episode], trainer: Any) -> None:
        from trl.chat_template_utils import parse_response

        tok = trainer._tokenizer
        for ep in episodes:
            ep.prompt_ids = self._render_prompt(ep, trainer)
        first = [ep for ep in episodes if ep.ok]
        ids, lps = self._generate(trainer, [ep.prompt_ids for ep in first], fallback=episodes[0].prompt_ids)
        for ep, c_ids, lp in zip(first, ids, lps, strict=True):
            ep.completion_ids = list(c_ids)
            ep.tool_mask = [1] * len(c_ids)
            ep.logprobs = list(lp) if lp is not None else None
            ep.completions = [parse_response(tok, ep.completion_ids, prefix=ep.prompt_ids, tools=ep.env.tools())]
            ep.pending_calls = ep.completions[0].get("tool_calls") or None
        for ep in episodes:
            if not ep.ok:
                ep.completion_ids = [tok.eos_token_id]
                ep.tool_mask = [1]
                ep.logprobs = [0.0]

        max_iterations = trainer.max_tool_calling_iterations
        max_len = trainer.max_completion_length
        max_model_len = self._max_model_len(trainer)
        bg = episodes[0].env.runtime.bg
        iteration = 0
        while True:
            active = [ep for ep in episodes if ep.ok and ep.pending_calls and iteration < max_iterations]
            if not self._anyone(trainer, bool(active)):
                break
            bg.run(self._run_tools(active))
            active = [ep for ep in active if ep.ok]  # timed-out episodes stop here
            pcts = []
            kept = []
            for ep in active:
                tool_messages = []
                for message in reversed(ep.completions):
                    if message.get("role") != "tool":
                        break
                    tool_messages.insert(0, message)
                pct = ep.prompt_ids + ep.completion_ids + list(trainer._get_tool_suffix_ids(tool_messages))
                if len(pct) - len(ep.prompt_ids) > max_len or len(pct) >= max_model_len:
                    # The tool results would overflow the completion budget: roll them back, end the episode.
                    del ep.completions[len(ep.completions) - len(tool_messages):]
                    ep.pending_calls = None
                    continue
                pcts.append(pct)
                kept.append(ep)
            post_ids, post_lps = self._generate(trainer, pcts, fallback=episodes[0].prompt_ids)
            for ep, pct, p_ids, p_lp in zip(kept, pcts, post_ids, post_lps, strict=True):
                p_ids = list(p_ids)
                p_lp = list(p_lp) if p_lp is not None else None
                excess = len(pct) - len(ep.prompt_ids) + len(p_ids) - max_len
                if excess > 0:
                    p_ids = p_ids[: len(p_ids) - excess]
                    if p_lp is not None:
                        p_lp = p_lp[: len(p_ids)]
                tool_length = len(pct) - len(ep.prompt_ids) - len(ep.completion_ids)
                ep.tool_mask += [0] * tool_length + [1] * len(p_ids)
                if ep.logprobs is not None and p_lp is not None:
                    ep.logprobs += [0.0] * tool_length + p_lp
                else:
                    ep.logprobs = None
                ep.completion_ids = pct[len(ep.prompt_ids):] + p_ids
                parsed = parse_response(tok, p_ids, prefix=pct, tools=ep.env.tools()) if p_ids else {}
                if parsed:
                    ep.completions.append(parsed)
                ep.pending_calls = parsed.get("tool_calls") or None if parsed else None
            iteration += 1

    @staticmethod
    def _max_model_len(trainer: Any) -> int:
        if getattr(trainer, "use_vllm", False) and getattr(trainer, "vllm_mode", None) == "colocate":
            return trainer.vllm_generation.llm.llm_engine.model_config.max_model_len
        config = trainer.model.config
        config = getattr(config, "text_config", None) or config
        return getattr(config, "max_position_embeddings", 1 << 30)

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
        """Generate one completion per prompt through TRL's backend, padding to a common count across processes."""
        n = len(prompt_ids)
        accelerator = trainer.accelerator
        target = n
        if accelerator.num_processes > 1:
            import torch

            counts = accelerator.gather(torch.tensor([n], device=accelerator.device))
            target = int(counts.max().item())
        if target == 0:
            return [], []
        padded = list(prompt_ids) + [list(prompt_ids[0] if prompt_ids else fallback)] * (target - n)
        completion_ids, logprobs = trainer._generate_single_turn(padded, None, {}, num_generations=1)
        completion_ids = [list(c) for c in completion_ids[:n]]
        lps: list[list[float] | None] = [list(lp) for lp in logprobs[:n]] if logprobs is not None else [None] * n
        return completion_ids, lps

    # -- tools -----------------------------------------------------------------------------------

    async def _run_tools(self, active: list[_Episode]) -> None:
        gate = asyncio.Semaphore(self.max_concurrent_tool_calls)

        async def run_episode(ep: _Episode) -> None:
            calls = ep.pending_calls or []
            remaining = None
            if self.episode_timeout is not None:
                remaining = self.episode_timeout - (time.monotonic() - ep.started)
            results: list[tuple[str, Any]] = []
            try:
                async with asyncio.timeout(remaining):
                    for call in calls:
                        results.append(await self._one_call(ep, call, gate))
            except TimeoutError:
                ep.timed_out = True
                logger.warning("%s: episode for task %s exceeded episode_timeout=%ss; closing it, scored None",
                               ep.env.runtime.name, ep.task_index, self.episode_timeout)
                ep.reward = None
                return
            for name, content in results:
                message = {"role": "tool", "name": name, "content": content}
                ep.completions.append(message)

        await asyncio.gather(*(run_episode(ep) for ep in active))

    async def _one_call(self, ep: _Episode, call: Mapping[str, Any], gate: asyncio.Semaphore) -> tuple[str, Any]:
        """One tool call, formatted exactly as TRL's loop formats results (`str(result)` or `{"error": ...}`)."""
        rt = ep.env.runtime
        ep.tool_calls += 1
        if call.get("type") != "function":
            ep.tool_failures += 1
            name = call.get("name", "unknown")
            return name, str({"error": f"Unsupported tool call type: {call.get('type')}"})
        function = call.get("function") or {}
        name = function.get("name", "unknown")
        arguments = function.get("arguments") or {}
        by_display = ep.env.remote_by_display()
        started = time.monotonic()
        if name not in by_display:
            ep.tool_failures += 1
            ep.rewards.append(None)
            rt.metrics.record_call(rt.name, 0.0, "refused")
            ep.trace.append({"tool": name, "arguments": arguments, "error": f"Tool {name} not found."})
            return name, str({"error": f"Tool {name} not found."})
        attr = by_display[name]
        fn = ep.env.adapter_cls.__dict__[attr]
        try:
            captured = fn(_Capture(), **arguments) if isinstance(arguments, dict) else fn(_Capture(), arguments)
            if asyncio.iscoroutine(captured):
                captured = await captured
            remote, wire_args = captured
        except TypeError as exc:
            ep.tool_failures += 1
            ep.rewards.append(None)
            rt.metrics.record_call(rt.name, 0.0, "refused")
            ep.trace.append({"tool": name, "arguments": arguments, "error": str(exc)})
            return name, str({"error": str(exc)})
        assert ep.session is not None
        try:
            if ep.over:
                raise episode_finished_error(remote)
            async with gate:
                result = await ep.session.call(remote, wire_args)
        except ORSError as exc:
            elapsed = time.monotonic() - started
            ep.tool_failures += 1
            ep.rewards.append(None)
            rt.metrics.record_call(rt.name, elapsed, exc.kind)
            ep.trace.append({"tool": name, "arguments": wire_args, "error": str(exc), "error_kind": exc.kind,
                             "seconds": elapsed})
            return name, str({"error": str(exc)})
        elapsed = time.monotonic() - started
        ep.rewards.append(result.reward)
        if result.reward is not None:
            ep.reward = result.reward
        ep.finished = ep.finished or result.finished
        if result.finished and not ep.over:
            ep.over = True  # servers refuse every later call: release the session now
            await ep.session.close()
        text = truncate_output(result.text, rt.max_output_chars) or "(no output)"
        rt.metrics.record_call(rt.name, elapsed)
        ep.trace.append({"tool": name, "arguments": wire_args, "output": text, "reward": result.reward,
                         "finished": result.finished, "metadata": result.metadata, "seconds": elapsed})
        return name, text

    # -- results ---------------------------------------------------------------------------------

    def _record(self, ep: _Episode) -> dict[str, Any]:
        return {
            "environment": ep.env.runtime.name,
            "task_index": ep.task_index,
            "task_spec": ep.task_spec,
            "prompt": ep.prompt_text,
            "calls": ep.trace,
            "reward": ep.reward,
            "finished": ep.finished,
            "error": ep.error,
            "timed_out": ep.timed_out,
            "seconds": time.monotonic() - ep.started,
        }

    def _log_metrics(self, trainer: Any) -> None:
        """Environment metrics go through the trainer's own `log_metric` (gathered across processes)."""
        log_metric = getattr(trainer, "_log_metric", None)
        if not callable(log_metric):
            return
        seen: set[int] = set()
        for env in self.environments.values():
            metrics = env.runtime.metrics
            if id(metrics) in seen:
                continue
            seen.add(id(metrics))
            for name, value in metrics.flush().items():
                log_metric(name, value)

    @staticmethod
    def _output(episodes: list[_Episode], trainer: Any) -> dict[str, Any]:
        logprobs = [ep.logprobs for ep in episodes]
        return {
            "prompt_ids": [ep.prompt_ids for ep in episodes],
            "completion_ids": [ep.completion_ids for ep in episodes],
            "logprobs": logprobs if all(lp is not None for lp in logprobs) else None,
            "env_mask": [ep.tool_mask for ep in episodes],
            "ors_reward": [None if ep.timed_out else ep.reward for ep in episodes],
            "ors_finished": [ep.finished for ep in episodes],
            "ors_tool_calls": [ep.tool_calls for ep in episodes],
            "ors_tool_failures": [ep.tool_failures for ep in episodes],
        }

