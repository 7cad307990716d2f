"""Play ORS episodes with an agent harness that owns its loop (design decision 16): `Harness`. `Harness.play` has
`ors_trl.core.rollout.play`'s signature, so the engine and evaluation drive harness episodes as their own (same
records, metrics and rewards); the loopback server is `ors_trl.harness.server`, the rows `ors_trl.harness.rows`."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import os
import pickle
import signal
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..core.episode import Episode, Rules, ToolCall
from ..core.rollout import Batcher, Conversation, StopEpisode, play_task
from ..protocol.errors import ConfigurationError, PolicyError
from ..protocol.loop import get_loop
from ..trl.backend import Played, error_text, harness_worker
from ..trl.engine import episode_for
from ..trl.rewards import trained_reward
from ..trl.tokens import TokenGenerator, fidelity
from .rows import build_rows
from .server import HarnessServer, ModelCall, _text

__all__ = ["Endpoint", "Harness", "HarnessConversation"]

logger = logging.getLogger("ors_trl.harness")

#: The most of a command harness's standard output kept (its final answer).
_MAX_OUTPUT = 1 << 20


@dataclass(frozen=True)
class Endpoint:
    """What a harness gets for one episode.

    Attributes:
        base_url (`str`):
            The OpenAI-compatible model endpoint (`http://127.0.0.1:<port>/v1`).
        api_key (`str`):
            The episode's key for it (its calls are this episode's model calls).
        mcp_url (`str`):
            The episode's MCP endpoint (Streamable HTTP, JSON responses).
        mcp_token (`str`):
            Its bearer token (`Authorization: Bearer <mcp_token>`).
        messages (`list[dict]`):
            The episode's prompt as chat messages (a system message first, where it has one).
        tools (`list[dict]`):
            The episode's tool schemas (also listed over MCP).
    """

    base_url: str
    api_key: str
    mcp_url: str
    mcp_token: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]

    def __repr__(self) -> str:  # never the key
        return f"Endpoint({self.base_url!r}, mcp={self.mcp_url!r})"

    @property
    def prompt(self) -> str:
        """The prompt's last user message, as text."""
        users = [m for m in self.messages if m.get("role") == "user"]
        return _text(users[-1].get("content")) if users else ""

    @property
    def system(self) -> str | None:
        """The prompt's system message, if any."""
        return next((str(m.get("content")) for m in self.messages if m.get("role") == "system"), None)

    def environ(self) -> dict[str, str]:
        """The environment variables a command harness gets: `OPENAI_BASE_URL`, `OPENAI_API_KEY`, `ORS_MCP_URL`,
        `ORS_MCP_TOKEN`, `ORS_PROMPT` (the last user message) and `ORS_MESSAGES` (the prompt messages, JSON)."""
        return {"OPENAI_BASE_URL": self.base_url, "OPENAI_API_KEY": self.api_key, "ORS_MCP_URL": self.mcp_url,
                "ORS_MCP_TOKEN": self.mcp_token, "ORS_PROMPT": self.prompt,
                "ORS_MESSAGES": json.dumps(self.messages, default=str)}


class HarnessConversation(Conversation):
    """A harness episode as the drivers see it: `state` is the training row holding the final model call (the
    engine trains on it), `rows` every row, `calls` every model call in order."""

    __slots__ = ("calls", "rows")

    def __init__(self, episode: Episode) -> None:
        super().__init__(episode)
        self.calls: list[ModelCall] = []
        self.rows: list[Any] = []


class _InEnvironment(NamedTuple):
    """The environment runs the agent: the tool call that starts it (`Harness.in_environment`)."""

    tool: str
    arguments: dict[str, Any]


Agent = Callable[[Endpoint], Awaitable[str | None]] | Sequence[str] | _InEnvironment


class Harness:
    """An agent harness that plays ORS episodes (see the module docstring).

    Args:
        agent (`async (Endpoint) -> str | None`, or a command line):
            A coroutine function returning the final answer (`None`: the last plain reply), or a command
            (`["python", "agent.py"]`) run per episode with `Endpoint.environ()`, its standard output the final answer.
        train_call (`(ModelCall) -> bool`, *optional*):
            Which model calls train (default: all); leave out a harness's auxiliary calls (titles, summaries).
        score (`(Episode, list[ModelCall]) -> float | None`, *optional*):
            The episode's reward (default: the environment's, which the record keeps as `env_reward`).
        timeout (`float`, *optional*):
            Seconds an episode may take (with the driver's own deadline); past it the episode ends scored `None`.
        env (`Mapping[str, str]`, *optional*):
            More environment variables for a command harness (for `in_environment`: more `env_overrides`).
        server (`HarnessServer`, *optional*):
            The endpoints' server (default: `HarnessServer()`, loopback on a free port).
    """

    def __init__(self, agent: Agent, *, train_call: Callable[[ModelCall], bool] | None = None,
                 score: Callable[[Episode, list[ModelCall]], float | None] | None = None,
                 timeout: float | None = None, env: Mapping[str, str] | None = None,
                 server: HarnessServer | None = None) -> None:
        if not callable(agent) and not isinstance(agent, _InEnvironment) and (
                isinstance(agent, str) or not agent or not all(isinstance(a, str) for a in agent)):
            raise ConfigurationError("a harness is a coroutine function or a command line as a list of strings "
                                     f"(e.g. ['python', 'agent.py']), got {agent!r}")
        self.agent, self.train_call, self.score, self.timeout = agent, train_call, score, timeout
        self.env = dict(env or {})
        self.server = server or HarnessServer()

    @classmethod
    def in_environment(cls, tool: str = "run_agent", arguments: Mapping[str, Any] | None = None,
                       **options: Any) -> Harness:
        """A harness for an environment that runs the agent itself, in its sandbox: each episode's session opens
        with `env_overrides` `OPENAI_BASE_URL` and `OPENAI_API_KEY` naming the episode's model endpoint, then one
        call of `tool` with `arguments` runs the agent; its calls become the rows, the environment's reward the
        episode's. The environment must reach the endpoint (`HarnessServer`'s `host` and `public_url`).

        Args:
            tool (`str`, *optional*, defaults to `"run_agent"`):
                The environment's tool that runs its agent to the end.
            arguments (`Mapping[str, Any]`, *optional*):
                Its arguments (no secrets: the record keeps them).
            **options:
                `Harness`'s keyword arguments (`train_call`, `score`, `timeout`, `env`, `server`).
        """
        if not isinstance(tool, str) or not tool or not isinstance(arguments or {}, Mapping):
            raise ConfigurationError(f"in_environment needs a tool name and a mapping of arguments, got {tool!r}, "
                                     f"{arguments!r}")
        return cls(_InEnvironment(tool, dict(arguments or {})), **options)

    def __repr__(self) -> str:
        if isinstance(self.agent, _InEnvironment):
            return f"Harness.in_environment({self.agent.tool!r})"
        return f"Harness({getattr(self.agent, '__qualname__', self.agent)!r})"

    def rollout_worker(self, spec: Any, **kwargs: Any) -> Any:
        """A rollout worker with every rollout played by this harness: give it to `AsyncGRPOTrainer(rollout_worker=...)`
        (with `train_dataset=spec.train_dataset`). It runs in TRL's spawned rollout process, so the harness (its agent,
        `train_call`, `score`) must pickle: module-level functions. Its model calls generate on TRL's vLLM server; the
        reward is the episode's (`unscored_reward` applies), logged as `rewards/outcome_reward`.

        Args:
            spec (`OpenRewardSpec` or `OpenRewardMix`):
                The spec whose environments and dataset the trainer uses.
            **kwargs:
                TRL's rollout loop arguments that differ from the trainer's (e.g. `queue_maxsize=args.queue_maxsize`).
        """
        _ = spec.rollout_func  # the tools are discovered here, once: they travel with the spec
        mix = hasattr(spec, "specs")
        play = _AsyncPlay(self, dict(spec.specs) if mix else {None: spec},
                          spec.unscored_reward if mix else spec._unscored_reward)
        try:
            pickle.dumps(play)
        except Exception as exc:
            raise ConfigurationError(f"this harness cannot travel to TRL's rollout process, which takes it by pickle "
                                     f"({type(exc).__name__}: {exc}): make its agent, train_call and score "
                                     "module-level functions, or give a command line.") from None
        return harness_worker(play, **kwargs)

    def rollout_func(self, spec: Any) -> Any:
        """`spec.rollout_func` with every episode played by this harness: give it to `GRPOTrainer(rollout_func=...)`.

        Args:
            spec (`OpenRewardSpec` or `OpenRewardMix`):
                The spec whose environments, dataset and reward functions the trainer uses.
        """
        engine = copy.copy(spec.rollout_func)  # the spec's own engine stays ors-trl's loop
        engine.info, engine.player = dict(engine.info), self.play
        return engine

    async def aclose(self) -> None:
        """Stop the loopback server (a later episode starts it again)."""
        await self.server.aclose()

    async def play(self, episode: Episode, generator: Any, *, base: Sequence[Mapping[str, Any]] = (),
                   flatten: bool = False, timeout: float | None = None) -> HarnessConversation:
        """Play `episode` with the harness and `generator` (as `ors_trl.core.rollout.play`); a failing harness fails
        its episode (scored `None`), never the batch.

        Args:
            episode (`Episode`):
                The episode (opened here).
            generator (`Any`):
                What answers the harness's model calls (a token generator's ids become the training rows).
            base (`Sequence[Mapping]`, *optional*):
                The dataset row's prompt messages the episode's prompt joins.
            flatten (`bool`, *optional*, defaults to `False`):
                Unused: a harness renders its own prompt.
            timeout (`float`, *optional*):
                Seconds the episode may take (with the harness's own `timeout`, the smaller wins).
        """
        conversation = HarnessConversation(episode)
        url = await self.server.start()
        start, finish = getattr(generator, "start", None), getattr(generator, "finish", None)
        if start is not None:  # first: a start that raises leaves no live seat (token) behind
            start(conversation)
        seat = self.server.seat(episode, generator)  # before the session: its env_overrides may name it
        limits = [t for t in (timeout, self.timeout) if t is not None]
        deadline = asyncio.timeout(min(limits) if limits else None)
        try:
            async with deadline:
                inside = isinstance(self.agent, _InEnvironment)
                if await episode.open({**self.env, "OPENAI_BASE_URL": f"{url}/v1", "OPENAI_API_KEY": seat.token}
                                      if inside else None):
                    assert episode.prompt is not None
                    endpoint = Endpoint(f"{url}/v1", seat.token, f"{url}/mcp", seat.token, episode.prompt.chat(base),
                                        episode.toolset.schemas if episode.toolset is not None else [])
                    try:
                        final = await self._run(episode, endpoint)
                    except asyncio.CancelledError:  # a deadline (it raises TimeoutError only outside this block)
                        raise
                    except Exception as exc:
                        logger.warning("%s: the harness failed on task %s: %s", episode.env.name, episode.task.key,
                                       exc)
                        episode.fail(exc if isinstance(exc, PolicyError) else
                                     PolicyError(f"the harness failed: {type(exc).__name__}: {exc}"))
                    else:
                        last = seat.calls[-1].reply if seat.calls else None
                        if final is None and last is not None and not last.tool_calls:
                            final = last.content
                        await episode.conclude(final)
        except TimeoutError:
            if not deadline.expired():
                raise
            episode.time_out(min(limits))
        finally:
            self.server.revoke(seat)
            if finish is not None:
                finish(conversation)
        self._finish(conversation, seat.calls)
        return conversation

    def _finish(self, conversation: HarnessConversation, calls: list[ModelCall]) -> None:
        """The episode's rows, the row to train (the one holding the last trained call), the score hook."""
        episode = conversation.episode
        conversation.calls, conversation.rows = calls, build_rows(calls, self.train_call)
        trained = [c for c in calls if c.row is not None]
        conversation.state = conversation.rows[trained[-1].row] if trained else None  # type: ignore[index]
        if calls:
            conversation.messages = [*calls[-1].messages]
        episode.info["harness"] = {"model_calls": len(calls), "trained_calls": len(trained),
                                   "rows": len(conversation.rows), "joined_calls": sum(c.joined for c in calls)}
        if self.score is not None:
            episode.info["env_reward"] = episode.reward
            episode.reward = self.score(episode, calls)

    async def _run(self, episode: Episode, endpoint: Endpoint) -> str | None:
        """The agent's final answer: the environment's agent run (one call of its tool), the coroutine's, or the
        command's standard output."""
        if isinstance(self.agent, _InEnvironment):
            outcome = await episode.call(ToolCall(*self.agent))
            if outcome.error is not None:
                raise PolicyError(f"the environment's agent run ({self.agent.tool}) failed: {outcome.error}")
            return None
        if callable(self.agent):
            final = await self.agent(endpoint)
            return None if final is None else str(final)
        process = await asyncio.create_subprocess_exec(  # a process group of its own, to stop with what it started
            *self.agent, env={**os.environ, **self.env, **endpoint.environ()}, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)
        out = err = None
        try:  # its output read as it comes, only the tails used kept (an agent may log its whole trajectory)
            out, err = await asyncio.gather(_tail(process.stdout, _MAX_OUTPUT), _tail(process.stderr, 2000))
            await process.wait()
        finally:
            if out is None or process.returncode is None:  # cancelled (a deadline): the agent and its children stop
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                await process.wait()

        def shown(data: bytes) -> str:  # its output, without the episode's key (an agent may print its environment)
            return data.decode("utf-8", "replace").replace(endpoint.api_key, "***").strip()

        if process.returncode:
            raise PolicyError(f"the harness command exited with status {process.returncode}: {shown(err)}")
        return shown(out) or None


async def _tail(stream: Any, limit: int) -> bytes:
    """The last `limit` bytes of what `stream` gives until its end, read as it comes."""
    kept = bytearray()
    while chunk := await stream.read(1 << 16):
        kept += chunk
        del kept[:-limit]
    return bytes(kept)


class _TurnGenerator(TokenGenerator):
    """TRL's async worker's generation (`backend.harness_worker`'s `turn`) as a token generator: one request per call."""

    def __init__(self, turn: Any) -> None:
        super().__init__(turn.rendering, Batcher())
        self.turn = turn

    async def reply(self, conversation: Conversation) -> Any:
        self._extend(conversation)
        started = time.monotonic()
        ids, logprobs = await self.turn(conversation.state.ids)
        if not ids:  # no room left in the model's context (`backend.bound_async_context`)
            raise StopEpisode("context_length", "the prompt fills the model's context")
        return self._parse(conversation, list(ids), list(logprobs), time.monotonic() - started)

    def _refuse_images(self, what: str) -> None:
        raise ConfigurationError(f"{what} holds an image, and TRL's async worker sends vLLM token ids alone; pass "
                                 "OpenRewardSpec(..., images=\"placeholder\") to show the model a text marker instead.")


class _AsyncPlay:
    """One rollout of TRL's async worker: the row's episode, played by the harness on ors-trl's loop."""

    def __init__(self, harness: Harness, specs: dict[str | None, Any], unscored: float | None) -> None:
        self.harness, self.specs, self.unscored = harness, specs, unscored

    async def __call__(self, prompt: list[dict[str, Any]], turn: Any) -> Played:
        return await asyncio.wrap_future(get_loop().submit(self._play(prompt, turn)))

    async def _play(self, prompt: list[dict[str, Any]], turn: Any) -> Played:
        environments = {name: spec.runtime for name, spec in self.specs.items()}
        episode, base = episode_for(environments, prompt, Rules(error_text=error_text,
                                                                 tool_markup=turn.rendering.tool_markup), "trl")
        attempts: list[Episode] = []
        try:
            episode, conversation = await play_task(episode, _TurnGenerator(turn), attempts=attempts,
                                                    player=self.harness.play, base=base,
                                                    timeout=episode.env.options["episode_timeout"])
            episode.tokens = fidelity(conversation)
        finally:
            await (attempts[-1] if attempts else episode).close()
        calls = conversation.calls
        rows = [(r.ids, [0] * len(r.prompt_ids) + r.mask, [0.0] * len(r.prompt_ids) + (r.logprobs or [0.0] * len(r.mask)))
                for r in conversation.rows]
        messages = [*calls[-1].messages[len(calls[0].messages):],
                    {"role": "assistant", "content": calls[-1].reply.content or ""}] if calls else []
        return Played(messages, [i for c in calls if c.row is not None for i in c.completion_ids or ()], rows,
                      episode.tool_calls, episode.tool_failures,
                      trained_reward(episode.reward, episode.voided, self.unscored), len(calls))

    def metrics(self) -> dict[str, float]:
        """The environments' `env/...` metrics since the last call (a new window starts)."""
        windows = {id(spec.runtime.metrics): spec.runtime.metrics for spec in self.specs.values()}  # a mix shares one
        return {k: v for metrics in windows.values() for k, v in metrics.flush().items()}

    def close(self) -> None:
        """The worker stops: the loopback server, then every episode and session of the environments."""
        get_loop().run(self.harness.aclose(), timeout=60)
        for spec in self.specs.values():
            spec.runtime.close_all()
