"""The one seam to TRL's internals (elsewhere ors-trl uses TRL's public surface): given a trainer, `Backend.of(trainer)`;
before one is in hand, the functions here find it (or TRL's loop state) up the stack. Read, and why:
`_generate_and_score_completions`' batch and `_tool_call_loop`'s turn (a batch's sessions open and a turn's calls
start at once); `_generate_single_turn` and `_get_tool_suffix_ids` (the engine generates as TRL's loop does);
`_generate` (a `rollout_func`'s images reach the loss); `_metrics` and `Trainer.log` (callbacks log beside GRPO); the
async worker's `_generate_loop` (`get_reward` reads the finished rollout there). Verified for the TRL releases in
`VERIFIED`: on another the adapter falls back to TRL's public behaviour (correct, slower; one log line) and the engine
refuses to start, unless `ORS_TRL_TRUST_TRL=1`.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import importlib
import importlib.metadata
import itertools
import json
import logging
import multiprocessing
import os
import re
import sys
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType, ModuleType
from typing import Any

from ..core.episode import Reply, Rules
from ..core.records import token_fidelity
from ..protocol.errors import ConfigurationError, UsageError, require_extra
from ..tasks.selection import TRL_KEYWORDS

__all__ = ["TRL_KEYWORDS", "VERIFIED", "AsyncGRPO", "Backend", "FinishedRollout", "Played", "Rendering", "async_grpo",
           "bound_async_context", "calling_trainer", "error_text", "finished_rollout", "harness_worker",
           "in_async_worker", "patch_grpo", "replies_of", "resetting_batch", "rules", "scoring_hooked", "shown_error",
           "tool_markup", "tool_turn", "verified"]

logger = logging.getLogger("ors_trl")

#: TRL releases (major.minor) the fast paths were verified against (`requirements/constraints.txt` pins the tested
#: one). Verifying a release is running the tests against it and adding it here.
VERIFIED = ("1.16",)
TRUST_ENV = "ORS_TRL_TRUST_TRL"
#: What changes on a TRL that is not in `VERIFIED` (the log line and the engine's error say it).
_UNVERIFIED = ("TRL's environment_factory loop runs on TRL's public behaviour (one session open and one tool call at a "
               "time: correct, slower; pass callbacks=spec.callbacks so that sessions close at each step's end), and "
               "spec.rollout_func will not run")


def trl_version() -> str | None:
    try:
        return importlib.metadata.version("trl")
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def verified() -> bool:
    """True when the installed TRL is one the fast paths were verified against (or the user opted in); False without
    TRL (no trainer to read: nothing to warn about)."""
    version = trl_version()
    if version is None:
        return False
    if any(version == v or version.startswith(v + ".") for v in VERIFIED):
        return True
    trusted = os.environ.get(TRUST_ENV) == "1"
    if trusted:
        logger.warning("ors-trl: TRL %s is not a verified version (%s); %s=1 turns the fast paths on anyway.",
                       version, ", ".join(VERIFIED), TRUST_ENV)
    else:
        logger.warning("ors-trl: TRL %s is not a version ors-trl was verified against (%s): %s. Set %s=1 to try the "
                       "fast paths on it.", version, ", ".join(VERIFIED), _UNVERIFIED, TRUST_ENV)
    return trusted


def require_engine(what: str = "spec.rollout_func") -> None:
    """Fail early, and say why, when TRL is not installed (`MissingExtraError`) or the engine's TRL internals are not
    verified for the installed TRL."""
    require_extra("trl", what)
    if not verified():
        raise UsageError(f"spec.rollout_func drives TRL internals verified for TRL {', '.join(VERIFIED)} only, and "
                         f"TRL {trl_version()} is installed. Use environment_factory=spec.environment_factory (TRL's "
                         f"public API; with callbacks=spec.callbacks), or set {TRUST_ENV}=1 to try the engine anyway.")


def _frame_locals(skip: int, hops: int, function: str | None = None) -> dict[str, Any]:
    """The locals of the first of `hops` frames, walking up from `skip` frames above our caller, of TRL's `function`
    (None: of a trainer's method); `{}` if there is none."""
    try:
        frame: FrameType | None = sys._getframe(skip + 1)
    except ValueError:  # the stack is not that deep: not called from TRL's loop
        return {}
    for _ in range(hops):
        if frame is None:
            break
        this = frame.f_locals.get("self")
        a_trainer = hasattr(this, "add_callback") and hasattr(this, "callback_handler")
        if (frame.f_code.co_name == function) if function else a_trainer:
            return frame.f_locals
        frame = frame.f_back
    return {}


def calling_trainer(hops: int = 8) -> Any:
    """The trainer found up the stack within `hops` frames: the one whose callback event is running, or (`hops=96`)
    whose training loop is reading a dataset, from inside the read."""
    return _frame_locals(1, hops).get("self")


def resetting_batch(adapter: Any, skip: int = 2) -> tuple[Any, list[tuple[Any, Mapping[str, Any]]] | None]:
    """`(trainer, batch)` of the trainer calling `adapter.reset()` (`skip`: frames between our caller and TRL's loop):
    `batch` the (environment, row) pairs TRL is about to reset when `adapter` is the first of them (so that all their
    sessions start opening at once), else None. `(None, None)` when no trainer is found or TRL is unverified."""
    loc = _frame_locals(skip, 6) if verified() else {}
    trainer = loc.get("self")
    envs, inputs = getattr(trainer, "environments", None), loc.get("inputs")
    if (isinstance(envs, list) and isinstance(inputs, list) and len(envs) == len(inputs) > 1
            and envs[0] is adapter and all(isinstance(row, Mapping) for row in inputs)):
        return trainer, list(zip(envs, inputs, strict=True))
    return trainer, None


def tool_turn(adapter: Any, skip: int = 2, rest: bool = True
              ) -> tuple[object, list[tuple[Any, list[tuple[str, Any]], int]]] | None:
    """At a call TRL's tool loop makes on `adapter` (`skip`: frames between our caller and the loop): `(turn,
    [(environment, [(name, arguments), ...], made), ...])`, per rollout the calls of the turn not yet made, from
    `adapter`'s current call on (`rest=False`: `adapter`'s entry alone), and `made`, the calls the model made before
    them (those TRL failed itself included); `turn` identifies the turn (TRL builds a new `tool_calls` list each turn).
    None when the loop does not look as expected or TRL is unverified."""
    loc = _frame_locals(skip, 4, "_tool_call_loop") if verified() else {}
    trainer, idxs, calls = loc.get("self"), loc.get("idxs_with_tool"), loc.get("tool_calls")
    idx, current, completions = loc.get("idx"), loc.get("tool_call"), loc.get("completions")
    envs = getattr(trainer, "environments", None)
    if not (isinstance(idxs, list) and isinstance(calls, list) and len(idxs) == len(calls)
            and isinstance(idx, int) and 0 <= idx < len(idxs) and isinstance(envs, list)
            and isinstance(completions, list) and len(completions) == len(envs)
            and all(isinstance(i, int) and 0 <= i < len(envs) for i in idxs)
            and envs[idxs[idx]] is adapter and isinstance(calls[idx], list)):
        return None
    position = next((j for j, call in enumerate(calls[idx]) if call is current), None)
    if position is None:
        return None
    out = []
    for k in range(idx, len(idxs) if rest else idx + 1):
        first = position if k == idx else 0
        chain = []
        for call in (calls[k] if isinstance(calls[k], list) else [])[first:]:
            function = call.get("function") if isinstance(call, dict) and call.get("type") == "function" else None
            if not isinstance(function, dict):
                break
            chain.append((function.get("name"), function.get("arguments")))
        # made before: `first` of this reply, and those of its earlier replies (TRL's `completions` entry ends with it)
        completion = completions[idxs[k]]
        made = first + (sum(len(m.get("tool_calls") or []) for m in completion[:-1] if isinstance(m, dict)
                            and m.get("role") == "assistant") if isinstance(completion, list) else 0)
        out.append((envs[idxs[k]], chain, made))
    return calls, out


def eos_token_ids(trainer: Any, tokenizer: Any = None) -> set[int]:
    """The ids that end a completion for TRL: `trainer.eos_token_ids` and `tokenizer`'s (the trainer's) padding id."""
    tokenizer = tokenizer or (getattr(trainer, "_tokenizer", None) if verified() else None)
    pad = getattr(tokenizer, "pad_token_id", None)
    return set(getattr(trainer, "eos_token_ids", None) or []) | ({pad} if pad is not None else set())


@dataclass(frozen=True)
class AsyncGRPO:
    """Where the installed TRL keeps `AsyncGRPOTrainer`: its config class, its module, and its rollout worker's."""

    trainer: type
    config: type
    trainer_module: ModuleType
    worker_module: ModuleType


def async_grpo() -> AsyncGRPO | None:
    """TRL's `AsyncGRPOTrainer`: `trl.AsyncGRPOTrainer` (stable from TRL 1.18), else `trl.experimental.async_grpo`
    (which warns from 1.18: never imported where the stable one exists); None when TRL has neither."""
    import trl

    trainer = getattr(trl, "AsyncGRPOTrainer", None)
    if trainer is None:
        try:
            trainer = importlib.import_module("trl.experimental.async_grpo").AsyncGRPOTrainer
        except (ImportError, AttributeError):
            return None
    module = sys.modules[trainer.__module__]
    return AsyncGRPO(trainer, getattr(module, "AsyncGRPOConfig", None) or trl.AsyncGRPOConfig, module,
                     sys.modules[module.AsyncRolloutWorker.__module__])


def in_async_worker() -> bool:
    """True in the rollout process TRL's `AsyncGRPOTrainer` spawns (also while it unpickles its arguments)."""
    return multiprocessing.current_process().name == "grpo-rollout-worker-child"  # AsyncRolloutWorker names it so


@dataclass(frozen=True)
class FinishedRollout:
    """A rollout TRL's async worker has just finished, as its `_generate_loop` holds it when it asks `get_reward`;
    `messages` is the very list TRL later hands reward functions as that rollout's `completions` entry."""

    messages: list[Any]
    completion_ids: list[int]
    eos_token_ids: set[int]
    reward_funcs: list[Any]
    tokens: dict[str, Any] | None = None  # token fidelity of the rows TRL built (re-rendered each turn)


def finished_rollout(adapter: Any, skip: int = 2) -> FinishedRollout | None:
    """At TRL's async worker's `await environment.get_reward()` (`skip`: frames up to `_generate_loop`): the rollout
    `adapter` just finished, read off the loop's locals. None when the loop looks unexpected or TRL is unverified."""
    loc = _frame_locals(skip, 3, "_generate_loop") if verified() else {}
    worker, messages, ids = loc.get("self"), loc.get("completion"), loc.get("completion_ids")
    if loc.get("environment") is not adapter or not isinstance(messages, list) or not isinstance(ids, list):
        return None
    rows = loc.get("sequences")  # TRL re-renders each turn: a drift it realigns masks generated tokens, a fork splits
    trained = sum(sum(getattr(row, "completion_mask", ())) for row in rows) if isinstance(rows, list) else None
    tokens = None if trained is None else token_fidelity(len(ids), max(len(ids) - trained, 0), len(rows))
    return FinishedRollout(messages, ids, eos_token_ids(worker, getattr(worker, "tokenizer", None)),
                           list(getattr(worker, "reward_funcs", None) or []), tokens)


async def _context_of(loop: Any) -> int | None:
    """The context of the model TRL's rollout loop generates with: vLLM's `max_model_len` (asked once), else the
    tokenizer's `model_max_length` when it states a real one; None: unknown (no bound)."""
    if "_ors_context" not in loop.__dict__:
        limit = None
        try:  # through TRL's own HTTP session
            async with asyncio.timeout(30), loop.session.get(f"{loop.vllm_server_url}/v1/models") as response:
                models = (await response.json()).get("data") or []
            lengths = [m.get("max_model_len") for m in models if m.get("id") in (loop.model_name, None)] or \
                [m.get("max_model_len") for m in models]
            limit = next((n for n in lengths if isinstance(n, int) and n > 0), None)
        except Exception as exc:  # an older server, or none: fall back to the tokenizer's bound
            logger.warning("ors-trl: could not read the generation server's max_model_len (%s); the async worker's "
                           "rollouts are bounded by the tokenizer's model_max_length instead.", error_text(exc))
        stated = getattr(loop.tokenizer, "model_max_length", None)
        loop.__dict__["_ors_context"] = limit or (stated if isinstance(stated, int) and stated < 1 << 24 else None)
    return loop.__dict__["_ors_context"]


def bound_async_context(on_cut: Callable[[Any, str, str], None]) -> bool:
    """Bound the conversations of TRL's async rollout worker by the model's context (`_context_of`), which TRL does
    not: a turn whose prompt leaves no room generates nothing (an empty reply: TRL's loop ends), one with less room
    than `max_tokens` asks for what fits, instead of an over-long request that vLLM refuses and the worker dies of.
    `on_cut(environment, kind, detail)` tells the rollout's environment (read off `_generate_one`'s tools): `"prompt"`
    (its last results got no reply) or `"reply"` (the context cut the reply). Installed on the loop class once;
    False where TRL is unverified or its loop looks unexpected."""
    found = async_grpo() if verified() else None
    loop_class = getattr(found.worker_module, "_AsyncRolloutLoop", None) if found else None
    generate = getattr(loop_class, "_generate_one_turn", None)
    parse = getattr(found.worker_module, "parse_response", None) if found else None
    if generate is None or parse is None:
        return False
    if getattr(generate, "_ors_bounded", False):
        return True

    def parse_response(tokenizer: Any, ids: list[int], *args: Any, **kwargs: Any) -> dict[str, Any]:
        return {"role": "assistant", "content": ""} if not ids else parse(tokenizer, ids, *args, **kwargs)

    async def _generate_one_turn(self: Any, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
        tools = _frame_locals(1, 2, "_generate_one").get("tool_dict") or {}
        environment = next((t.__self__ for t in tools.values() if hasattr(t, "__self__")), None)
        limit = await _context_of(self)
        room = self.max_tokens if limit is None else limit - len(prompt_ids)
        if room < 1:
            on_cut(environment, "prompt", f"{len(prompt_ids)} tokens fill the model's context ({limit})")
            return [], []
        if room >= self.max_tokens:
            return await generate(self, prompt_ids)
        clamped = copy.copy(self)  # the same loop, asking for at most `room` tokens
        clamped.max_tokens = room
        ids, logprobs = await generate(clamped, prompt_ids)
        if len(ids) >= room and (not ids or ids[-1] not in set(self.eos_token_ids)):
            on_cut(environment, "reply", f"the reply reached the model's context ({limit} tokens)")
        return ids, logprobs

    _generate_one_turn._ors_bounded = True  # type: ignore[attr-defined]
    loop_class._generate_one_turn = _generate_one_turn
    found.worker_module.parse_response = parse_response  # no reply: an empty message (TRL's would fail on no ids)
    return True


def harness_worker(play: Any, **loop_kwargs: Any) -> Any:
    """A rollout worker for `AsyncGRPOTrainer(rollout_worker=...)` whose rollouts `play` plays (TRL's
    `HarnessRolloutWorker` pattern): per rollout, in TRL's spawned process, `await play(prompt, turn)` with the row's
    prompt messages and `turn`: `await turn(ids)` is one generation on TRL's vLLM (ids and logprobs), `turn.rendering`
    how to render for it. `play` (picklable) returns a `Played`; its `metrics()` (`env/...`) are logged once per scored
    group, its `close()` runs when the worker stops. The loop's other arguments are the trainer's (read off it at
    `start`); `loop_kwargs` (e.g. `queue_maxsize`) win."""
    return __getattr__("_HarnessWorker")(play, **loop_kwargs)


@dataclass
class Played:
    """One rollout as a harness worker hands it to TRL: its transcript, the ids it generated, its training rows
    `(ids, completion mask, logprobs)` (prompt included), tool calls and failures, reward and model calls."""

    messages: list[dict[str, Any]]
    completion_ids: list[int]
    rows: list[tuple[list[int], list[int], list[float]]]
    tool_calls: int
    tool_failures: int
    reward: float | None
    turns: int


class _Turn:
    """One generation on TRL's worker loop (its `_generate_one_turn`), awaitable from any event loop."""

    def __init__(self, loop: Any) -> None:
        self.loop, self.rendering = loop, loop._ors_rendering

    def __call__(self, ids: list[int]) -> Any:
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self.loop._generate_one_turn(list(ids)),
                                                                    self.loop._loop))


def __getattr__(name: str) -> Any:
    """The harness worker's classes, built on first use over TRL's (pickle finds them here in the spawned process)."""
    if name not in ("_HarnessWorker", "_HarnessLoop"):
        raise AttributeError(name)
    if name in globals():  # built already (`harness_worker` calls this directly): one class, or pickle refuses it
        return globals()[name]
    import time
    import uuid

    found = async_grpo() if verified() else None
    if found is None:
        raise UsageError(f"a harness rollout worker drives TRL internals verified for TRL {', '.join(VERIFIED)} "
                         f"only; TRL {trl_version()} is installed.")
    module = found.worker_module

    class _HarnessLoop(module._AsyncRolloutLoop):  # type: ignore[name-defined]
        _provides_rollout_reward = True

        def __init__(self, *, play: Any, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self._play = play
            self._ors_rendering = Rendering.for_training(self.tokenizer, chat_template_kwargs=self.chat_template_kwargs)
            self.reward_func_names.append("outcome_reward")
            bound_async_context(lambda *_: None)  # no room: an empty reply, which ends the harness's episode

        async def _generate_one(self, prompt: Any, tool_dict: Any, tools: Any, group_id: int = 0) -> Any:
            started = time.monotonic()
            out: Played = await self._play(prompt, _Turn(self))
            rid = uuid.uuid4().hex
            rows = [module.TrainingSequence(list(i), list(m), list(lp), rid) for i, m, lp in out.rows]
            tally = dict.fromkeys(("clean", "realign", "fork", "transitions", "drift_tokens", "drift_max"), 0.0)
            self._push_rollout_metrics(turns=out.turns, sequences=len(rows), completion_ids=out.completion_ids,
                                       tally=tally, loop_exhausted=False, duration_s=time.monotonic() - started)
            return out.messages, out.completion_ids, rows, out.tool_calls, out.tool_failures, out.reward

        async def _score_group(self, group: Any) -> Any:
            samples = await super()._score_group(group)
            self._push_metrics(self._play.metrics())  # one window per GRPO group (the trainer averages them)
            return samples

        async def _run_loops(self, stop_event: Any) -> None:
            try:
                await super()._run_loops(stop_event)
            finally:  # the episodes' sessions close as the worker stops
                await asyncio.to_thread(getattr(self._play, "close", lambda: None))

    class _HarnessWorker(module.AsyncRolloutWorker):  # type: ignore[name-defined]
        _loop_cls = _HarnessLoop

        def __init__(self, play: Any, **loop_kwargs: Any) -> None:
            super().__init__(**loop_kwargs)
            self._play = play

        def start(self) -> None:
            trainer = calling_trainer()
            if getattr(trainer, "rollout_worker", None) is not self:
                raise UsageError("a harness rollout worker starts with its trainer: pass it to "
                                 "AsyncGRPOTrainer(rollout_worker=...) and call trainer.train().")
            args = trainer.args
            names = ("num_generations", "max_inflight_tasks", "temperature", "top_p", "top_k", "min_p",
                     "repetition_penalty", "request_timeout", "chat_template_kwargs", "max_tool_calling_iterations",
                     "log_completions", "num_completions_to_print")
            self._loop_kwargs = {  # as AsyncGRPOTrainer builds its own worker's
                **{n: getattr(args, n) for n in names}, "dataset": trainer.train_dataset, "reward_funcs": [],
                "model_name": found.trainer_module.get_config_model_id(trainer.model.config),
                "lora_name": trainer._lora_name if getattr(trainer, "_lora_sync", False) else None,
                "processing_class": trainer.processing_class, "eos_token_ids": trainer.eos_token_ids,
                "vllm_server_url": args.vllm_server_base_url, "max_tokens": args.max_completion_length,
                "play": self._play, **self._loop_kwargs}
            super().start()

    for cls in (_HarnessLoop, _HarnessWorker):
        cls.__module__, cls.__qualname__ = __name__, cls.__name__
        globals()[cls.__name__] = cls
    return globals()[name]


def tool_masks() -> list[Any] | None:
    """In a reward function of TRL's own tool loop: each completion's tool mask (1: generated, 0: a tool result), read
    off `_generate_and_score_completions`; None elsewhere or when TRL is unverified."""
    masks = (_frame_locals(1, 16, "_generate_and_score_completions") if verified() else {}).get("tool_mask_list")
    return masks if isinstance(masks, list) else None


def error_text(exc: BaseException) -> str:
    """What TRL's tool loop shows the model for a failed call: `str({"error": str(exc)})`."""
    return str({"error": str(exc)})


def shown_error(content: str) -> str:
    """What TRL showed the model for a call it failed itself, `{'error': ...}` unwrapped (else `content` itself)."""
    wrapped = re.fullmatch(r"\{'error': (['\"])(.*)\1\}", content, re.S)
    return wrapped.group(2) if wrapped else content


def replies_of(messages: Sequence[Mapping[str, Any]], truncated: bool
               ) -> tuple[list[tuple[Reply, list[str]]], bool]:
    """TRL's transcript of one rollout (the messages after the prompt) read back for `Episode.replay`: each reply (an
    assistant message; `truncated`: the last was cut) with what TRL's loop showed the model after it (`shown_error`),
    and whether the transcript ends after tool results (the reply after them was cut to nothing: TRL's budget)."""
    at = [i for i, m in enumerate(messages) if m.get("role", "assistant") == "assistant"]
    replies = []
    for k, i in enumerate(at):
        content = messages[i].get("content")
        reply = Reply(None if content is None else content if isinstance(content, str)
                      else json.dumps(content, default=str), messages[i].get("tool_calls") or (),
                      truncated=truncated and k == len(at) - 1)
        shown = itertools.takewhile(lambda m: m.get("role") == "tool", messages[i + 1:])
        replies.append((reply, [shown_error(str(m.get("content"))) for m in shown]))
    return replies, bool(at) and at[-1] < len(messages) - 1


def rules(trainer: Any) -> Rules:
    """The turn rules of TRL's tool loop: `max_tool_calling_iterations` tool turns, then one more reply, whose calls
    are not run; failures read as TRL writes them. Without a trainer (outside TRL's loop): no turn limit."""
    iterations = getattr(trainer, "max_tool_calling_iterations", None)
    limit = iterations + 1 if isinstance(iterations, int) and iterations < sys.maxsize else None
    return Rules(max_replies=limit, error_text=error_text, tool_markup=tool_markup(getattr(trainer, "processing_class",
                                                                                            None)))


def training_info(trainer: Any) -> dict[str, Any]:
    """The run's metadata for training uploads (`RolloutUploader`'s `run_info`), from the trainer driving it."""
    info: dict[str, Any] = {"run_type": "train", "training_stage": "rl", "rl_algorithm": "grpo"}
    if (model := getattr(trainer, "model", None)) is not None:
        info["model_name"] = getattr(getattr(model, "config", None), "_name_or_path", None) or type(model).__name__
        if callable(getattr(model, "parameters", None)):
            info["model_params"] = sum(p.numel() for p in model.parameters())
    args = getattr(trainer, "args", None)
    info.update(batch_size=getattr(args, "per_device_train_batch_size", None), lr=getattr(args, "learning_rate", None),
                initial_step=getattr(getattr(trainer, "state", None), "global_step", None))
    return info


def _literal_start(pattern: str) -> str:
    """The text every match of a regular expression starts with (its leading literal characters)."""
    lead = re.match(r"(?:\\[^a-zA-Z0-9]|[^\\^$.|?*+()\[\]{}])*", pattern).group()  # type: ignore[union-attr]
    out = re.sub(r"\\(.)", r"\1", lead, flags=re.S)
    return out[:-1] if pattern[len(lead):len(lead) + 1] in ("?", "*", "{") else out  # the last one is optional


def tool_markup(processing_class: Any) -> str | None:
    """The text that opens a tool call in the replies TRL parses for this processing class (qwen3: `<tool_call>`),
    read off the response template `add_response_schema` set (or the legacy schema); None where there is none."""
    tok = getattr(processing_class, "tokenizer", processing_class)
    template = getattr(tok, "response_template", None)
    fields = template.get("fields") if isinstance(template, dict) else None
    call = fields.get("tool_calls") if isinstance(fields, dict) else None
    if isinstance(call, dict):
        opener = call.get("open") or _literal_start(str(call.get("open_pattern") or ""))
    else:
        schema = getattr(tok, "response_schema", None)
        props = schema.get("properties") if isinstance(schema, dict) else None
        call = props.get("tool_calls") if isinstance(props, dict) else None
        opener = _literal_start(str(call.get("x-regex-iterator") or "")) if isinstance(call, dict) else None
    return opener if isinstance(opener, str) and len(opener.strip()) > 1 else None


class Rendering:
    """How TRL turns a tool conversation into token ids, and a completion back into a message, for one processing
    class (a tokenizer, or a vision-language model's processor): the engine, `LocalPolicy` and the demo all render
    through it. Its response schema is set as `GRPOTrainer` sets it for tools; where TRL knows none for the template
    (`parse_error`), completions parse as plain text. The tool turn is TRL's own `_get_tool_suffix_ids`, called with
    the rendering as its `self` (it reads `processing_class`, `_tokenizer`, `_is_vlm`, `chat_template`,
    `chat_template_kwargs`).
    """

    def __init__(self, processing_class: Any, *, chat_template: str | None = None,
                 chat_template_kwargs: Mapping[str, Any] | None = None) -> None:
        self.processing_class = processing_class
        self.tokenizer = self._tokenizer = getattr(processing_class, "tokenizer", processing_class)
        self.takes_images = self._is_vlm = self._tokenizer is not processing_class  # a processor, not a tokenizer
        #: The id of the token a processor expands each image into (None for a tokenizer).
        self.image_token_id = getattr(processing_class, "image_token_id", None) if self._is_vlm else None
        self.parse_error: Exception | None = None
        if getattr(self._tokenizer, "response_template", None) is None and \
                getattr(self._tokenizer, "response_schema", None) is None:
            try:
                from trl.chat_template_utils import add_response_schema

                add_response_schema(processing_class)
            except Exception as exc:  # an unknown chat template, or no TRL
                self.parse_error = exc
        self.chat_template = chat_template
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    @classmethod
    def for_training(cls, processing_class: Any, **kwargs: Any) -> Rendering:
        """Rendered with the template `GRPOTrainer` trains tools with: the tokenizer's own if it is prefix-preserving,
        else TRL's training variant of it (`get_training_chat_template`)."""
        from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving

        rendering = cls(processing_class, **kwargs)  # sets the response schema the checks below need
        if rendering.parse_error is None and not is_chat_template_prefix_preserving(processing_class):
            rendering.chat_template = get_training_chat_template(processing_class)
        return rendering

    @classmethod
    def of(cls, trainer: Any) -> Rendering:
        """The rendering of `trainer`: its processing class, chat template (or the training one) and template kwargs.
        Raises `ConfigurationError` when TRL cannot parse tool calls for its chat template."""
        template = getattr(trainer, "chat_template", None)
        kwargs = {"chat_template_kwargs": getattr(trainer, "chat_template_kwargs", None)}
        rendering = (cls(trainer.processing_class, chat_template=template, **kwargs) if template is not None
                     else cls.for_training(trainer.processing_class, **kwargs))
        if rendering.parse_error is not None:
            raise ConfigurationError(f"TRL cannot parse tool calls with this model's chat template "
                                     f"({rendering.parse_error}); use one TRL knows (trl/chat_templates).")
        return rendering

    tool_markup = property(lambda self: tool_markup(self.processing_class),
                           doc="The text that opens a tool call in this template's replies (`tool_markup`).")
    eos_token_ids = property(lambda self: {t for t in (self._tokenizer.eos_token_id, self._tokenizer.pad_token_id)
                                           if t is not None}, doc="The ids that end a completion (EOS and padding).")

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[Any] | None) -> list[int]:
        """Prompt ids for `messages` with `tools`, as `GRPOTrainer` renders them (images expanded into tokens)."""
        if self._is_vlm:
            from trl.data_utils import prepare_multimodal_messages

            messages = prepare_multimodal_messages(messages)
        tokenized = self.processing_class.apply_chat_template(
            conversation=[messages], tools=tools or None, chat_template=self.chat_template,
            add_generation_prompt=True, tokenize=True, return_dict=True, **self.chat_template_kwargs)
        return list(tokenized["input_ids"][0])

    def tool_suffix_ids(self, tool_messages: list[dict[str, Any]]) -> list[int]:
        """The tokens TRL's loop appends after a turn's tool calls: the tool results and the next assistant header."""
        from trl import GRPOTrainer

        return list(GRPOTrainer._get_tool_suffix_ids(self, tool_messages))  # type: ignore[arg-type]

    def parse(self, ids: list[int], prefix: list[int] | None, tools: list[Any] | None) -> dict[str, Any]:
        """A completion as the assistant message TRL parses it to (`{}` for no tokens)."""
        if not ids:
            return {}
        if self.parse_error is not None:
            return {"role": "assistant", "content": self._tokenizer.decode(ids, skip_special_tokens=True)}
        from trl.chat_template_utils import parse_response

        return parse_response(self._tokenizer, ids, prefix=prefix, tools=tools)


def image_inputs(processing_class: Any, prompt_ids: list[list[int]], images: list[list[Any]],
                 image_token_id: int | None) -> dict[str, Any]:
    """What a vision-language model takes beside `prompt_ids` (whose image tokens are expanded already) for the images
    of each prompt, in order: the processor's pixel fields and the per-token type ids (1 on an image token), as TRL's
    tool loop builds them (`mm_token_type_ids` for a model with `image_grid_thw`, else `token_type_ids`)."""
    flat = [image for row in images for image in row or ()]
    fields = dict(processing_class.image_processor(images=flat, return_tensors="pt")) if flat else {}
    types = [[int(t == image_token_id) for t in ids] for ids in prompt_ids]
    fields["mm_token_type_ids" if "image_grid_thw" in fields else "token_type_ids"] = types
    return fields


_HANDOFF = "_ors_images"
_BACKEND = "_ors_backend"


def _no_tool() -> None:
    """A stand-in tool: see `patch_grpo`."""


_HOOKS: list[Callable[[Any, dict[str, Any]], None]] = []
_scoring = threading.local()  # how deep this thread is in a patched `_generate_and_score_completions`


def patch_grpo(hook: Callable[[Any, dict[str, Any]], None] | None = None) -> bool:
    """Patch `GRPOTrainer` once (on the class: a `rollout_func` runs inside `_generate`, too late to wrap the instance)
    so that its `_generate` takes the images a `rollout_func` hands it (`Backend.hand_images`) into its loss as it
    takes its own tool loop's (returned beside the ids, the step counting as one with tools: only then does TRL build
    their pixel fields), and its `_generate_and_score_completions` runs each `hook(trainer, batch)` on the batch it
    returns (the tensors GRPO trains on: `advantages`, `completion_mask`, `tool_mask`, ...) before TRL splits it for
    the loss (a subclass that overrides it without calling it runs none: `scoring_hooked` says so). A trainer handed
    nothing runs as before. False, and nothing installed, on an unverified TRL."""
    if not verified():
        return False
    from trl import GRPOTrainer

    generate_, score = GRPOTrainer._generate, GRPOTrainer._generate_and_score_completions
    if not getattr(generate_, _HANDOFF, False):

        @functools.wraps(generate_)
        def _generate(self: Any, prompts: list[Any]) -> Any:
            out = generate_(self, prompts)
            images = self.__dict__.pop(_HANDOFF, None)
            if images is None:
                return out
            self.tools = self.tools or [_no_tool]  # put back when the step's scoring ends (below)
            return (*out[:-2], images, images)

        @functools.wraps(score)
        def _generate_and_score_completions(self: Any, inputs: Any) -> Any:
            tools, _scoring.depth = self.tools, getattr(_scoring, "depth", 0) + 1
            try:
                out = score(self, inputs)
            finally:
                _scoring.depth -= 1
                self.tools = tools
            for run in _HOOKS:
                run(self, out)
            return out

        setattr(_generate, _HANDOFF, True)
        GRPOTrainer._generate = _generate
        GRPOTrainer._generate_and_score_completions = _generate_and_score_completions
    if hook is not None and hook not in _HOOKS:
        _HOOKS.append(hook)
    return True


def scoring_hooked() -> bool:
    """True inside a `_generate_and_score_completions` whose batch the `patch_grpo` hooks will see (its reward
    functions run there)."""
    return getattr(_scoring, "depth", 0) > 0


class Backend:
    """TRL's private surface for one trainer (held weakly), built once and kept on it (`Backend.of`): its rendering
    and turn rules, its context length, generation padded across processes, the image hand-off and its logs."""

    def __init__(self, trainer: Any) -> None:
        try:
            self._trainer: Callable[[], Any] = weakref.ref(trainer)
        except TypeError:  # a stand-in trainer (tests): held as it is
            self._trainer = lambda: trainer

    @classmethod
    def of(cls, trainer: Any) -> Backend:
        if _BACKEND not in vars(trainer):
            vars(trainer)[_BACKEND] = cls(trainer)
        return vars(trainer)[_BACKEND]

    trainer = property(lambda self: self._trainer())

    @functools.cached_property
    def rendering(self) -> Rendering:
        return Rendering.of(self.trainer)

    @property
    def max_model_len(self) -> int:
        """The longest sequence the generation backend accepts (TRL's own bound in its tool loop)."""
        trainer = self.trainer
        if getattr(trainer, "use_vllm", False) and getattr(trainer, "vllm_mode", None) == "colocate":
            return trainer.vllm_generation.llm.llm_engine.model_config.max_model_len
        config = trainer.model.config
        config = getattr(config, "text_config", None) or config
        return getattr(config, "max_position_embeddings", 1 << 30)

    def refuse_images(self, what: str) -> None:
        """Raise a `ConfigurationError` when the trainer's processing class is a tokenizer, which takes no images."""
        trainer = self.trainer
        vlm = getattr(trainer, "_is_vlm", None)
        if not (vlm if isinstance(vlm, bool) else
                getattr(getattr(trainer, "processing_class", None), "image_processor", None) is not None):
            raise ConfigurationError(
                f"{what} holds an image, and this trainer's processing class "
                f"({type(getattr(trainer, 'processing_class', None)).__name__}) is a tokenizer, which takes no "
                "images. Train a vision-language model with its processor (GRPOTrainer(model=..., processing_class="
                "AutoProcessor.from_pretrained(...))), or pass OpenRewardSpec(..., images=\"placeholder\") to show "
                "the model the text [image: <media type>] in its place.")

    processes = property(lambda self: getattr(getattr(self.trainer, "accelerator", None), "num_processes", 1))

    def most(self, n: int) -> int:
        """The largest `n` over the processes (each of them must call this, together: a process with work left, and
        every process must then join the next generation call, shows in a positive answer)."""
        if self.processes == 1:
            return n
        import torch

        accelerator = self.trainer.accelerator
        return int(accelerator.gather(torch.tensor([n], device=accelerator.device)).max().item())

    def generate(self, requests: Sequence[tuple[list[int], list[Any]]], fallback: tuple[list[int], list[Any]]
                 ) -> list[tuple[list[int], list[float] | None]]:
        """One completion per prompt (its ids and their images) through TRL's generation backend (transformers,
        vLLM server or colocate), padded to a common count across processes (collective backends need every
        process in every call: a process with fewer prompts repeats one, or `fallback`)."""
        n, trainer = len(requests), self.trainer
        target = self.most(n)
        if target == 0:
            return []
        padded = list(requests) + [requests[0] if requests else fallback] * (target - n)
        prompt_ids, images = [list(p) for p, _ in padded], [row or None for _, row in padded]
        fields: dict[str, Any] = {}
        if any(images) and getattr(trainer, "use_transformers_continuous_batching", False):
            raise ConfigurationError("TRL's continuous-batching generation takes no images; generate with "
                                     "transformers' generate (the default) or vLLM for an environment that shows "
                                     "images.")
        if any(images) and not getattr(trainer, "use_vllm", False):
            processing_class = trainer.processing_class
            token = getattr(trainer, "_image_pad_token_id", None) or getattr(processing_class, "image_token_id", None)
            fields = image_inputs(processing_class, prompt_ids, images, token)
        ids, logprobs = trainer._generate_single_turn(prompt_ids, images if any(images) else None, fields,
                                                      num_generations=1)
        return [(list(ids[i]), list(logprobs[i]) if logprobs is not None else None) for i in range(n)]

    # -- the batch a step trains on (per-turn credit) -----------------------------------------------

    @property
    def batch_episodes(self) -> list[Any] | None:
        """The episodes of the batch the trainer just generated, in its rows' order: the `rollout_func`'s
        (`last_episodes`) or the `environment_factory` adapters' (`episode`); None when neither is there."""
        trainer = self.trainer
        engine = getattr(getattr(trainer, "rollout_func", None), "last_episodes", None)
        if getattr(trainer, "rollout_func", None) is not None:
            return list(engine) if isinstance(engine, list) else None
        envs = getattr(trainer, "environments", None)
        return [getattr(env, "episode", None) for env in envs] if isinstance(envs, list) and envs else None

    def grouping(self) -> tuple[int, str]:
        """The GRPO group size of the current mode and TRL's `scale_rewards` ("group", "batch" or "none")."""
        trainer = self.trainer
        size = trainer.num_generations if trainer.model.training else trainer.num_generations_eval
        return int(size), str(getattr(trainer, "scale_rewards", "group"))

    def gather_objects(self, local: list[Any]) -> tuple[list[Any], int]:
        """Every process's `local` items, concatenated in process order, and where this process's start (every
        process must call this, together)."""
        if self.processes == 1:
            return list(local), 0
        from accelerate.utils import gather_object

        return list(gather_object(local)), self.trainer.accelerator.process_index * len(local)

    # -- the image hand-off and logs -----------------------------------------------------------------

    def hand_images(self, images: list[list[Any]]) -> None:
        """Hand TRL the images of a `rollout_func`'s rollouts (each one's, in the order of its image tokens) for the
        loss of this step (`patch_grpo`); nothing when there are none."""
        if not any(images):
            return
        trainer = self.trainer
        if not getattr(getattr(type(trainer), "_generate", None), _HANDOFF, False):
            raise ConfigurationError(f"{type(trainer).__name__} does not hand a rollout_func's images to its loss (its "
                                     "_generate is not GRPOTrainer's, or TRL is not a verified version); use "
                                     "environment_factory=spec.environment_factory for an environment that shows "
                                     "images.")
        trainer.__dict__[_HANDOFF] = [row or None for row in images]

    def add_step_metrics(self, metrics: Mapping[str, float]) -> None:
        """Log `metrics` with the current step's own (GRPO's per-step metric store, averaged and logged at the next
        logging step); on a trainer without that store, or an unverified TRL, as an entry of their own."""
        store = getattr(self.trainer, "_metrics", None)
        if verified() and isinstance(store, dict) and isinstance(store.get("train"), dict):
            for name, value in metrics.items():
                store["train"].setdefault(name, []).append(value)
        elif metrics:
            self.log_outside_step(dict(metrics))

    def log_outside_step(self, logs: dict[str, float]) -> None:
        """Log `logs` to the trainer's `log_history` and its `on_log` callbacks from a callback event: with
        `Trainer.log`, as `GRPOTrainer.log` would fold in (and clear) the metrics its current step collected."""
        from transformers import Trainer

        Trainer.log(self.trainer, logs)
