"""Evaluate a policy against an ORS environment through the same client and tool binding as training.

    report = OpenRewardSpec("http://127.0.0.1:8000", split="test").evaluate("./my-checkpoint", num_tasks=32)
    report = spec.evaluate(OpenAIPolicy("http://127.0.0.1:8001/v1", "my-model"), output="episodes.jsonl")
    print(report.mean_reward, report.coverage)

An episode: open a session for the task, read its prompt, then alternate policy turns and tool calls
until the policy answers without a tool call, a tool result says `finished`, or `max_turns` replies
were made. The model sees the tools exactly as TRL shows them in training (the JSON schemas
`transformers.utils.get_json_schema` renders from the functions `ors_trl._binding.bind_tools` builds),
and its calls are routed through those same functions to the remote tool names. A failed tool call is
recorded (`kind`, `reason`) and the model gets the error as the tool result, in TRL's own form
(`{'error': '...'}`). The episode's reward is its last non-None reward (the outcome convention);
an episode the environment never scored has reward None and does not count in `mean_reward`.

Policies work at the message level: `await policy.respond(messages, tools) -> PolicyReply`, where
`messages` are chat messages (`user`, `assistant` with `tool_calls`, `tool`) and `tools` the tool
schemas. Two are built in: `LocalPolicy` (a transformers model, generation batched across the
episodes waiting for a turn) and `OpenAIPolicy` (any OpenAI-compatible chat-completions endpoint).

Every finished episode is appended to `output` as one JSON line and flushed at once, so an
interrupted evaluation loses at most its running episodes; `resume=True` reads the file back and
runs only the episodes it lacks (identified by split, task index and repeat index). Every session
is closed, also on errors and on Ctrl-C.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ._binding import DEFAULT_RESERVED, BindingResult, bind_tools
from ._exceptions import ConfigurationError, ORSError, ToolError
from ._spec import check_in_range, check_selection
from ._types import ToolSpec, blocks_text

__all__ = [
    "EvalReport",
    "LocalPolicy",
    "OpenAIPolicy",
    "Policy",
    "PolicyError",
    "PolicyReply",
    "evaluate",
    "load_episodes",
]

logger = logging.getLogger("ors_trl.eval")

RECORD_VERSION = 1
#: End reasons of an episode, as recorded in `end_reason`.
END_REASONS = ("no_tool_calls", "finished", "max_turns", "context_length", "error")
_CLEANUP_WAIT_S = 30.0


# ---------------------------------------------------------------------------------------------------------
# Policies


class PolicyError(Exception):
    """The policy could not produce a reply (HTTP error from an endpoint, generation failure)."""

    kind = "policy"


class ContextLengthExceeded(PolicyError):
    """The conversation no longer fits the model's context: the episode ends (`end_reason="context_length"`)."""

    kind = "context_length"


@dataclass
class PolicyReply:
    """One assistant turn.

    Attributes:
        content: the assistant's text ("" if none).
        tool_calls: `[{"id": str, "name": str, "arguments": dict | str}]`; `arguments` is the raw text when the
            model's arguments were not a JSON object.
        raw: the raw completion text, when the policy has one (local models), for the episode record.
        usage: token counts reported by an endpoint, if any.
    """

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    raw: str | None = None
    usage: dict[str, Any] | None = None


@runtime_checkable
class Policy(Protocol):
    """What `evaluate` drives: given the conversation and the tool schemas, return the assistant's reply."""

    async def respond(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> PolicyReply: ...


def _call_id(turn: int, k: int) -> str:
    return f"call_{turn}_{k}"


def _parse_arguments(value: Any) -> dict[str, Any] | str:
    if isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            parsed = json.loads(value) if value.strip() else {}
        except ValueError:
            return value
        return parsed if isinstance(parsed, dict) else value
    return json.dumps(value, default=str)


class OpenAIPolicy:
    """A model behind any OpenAI-compatible `/chat/completions` endpoint (vLLM, SGLang, TGI, OpenAI...).

    Args:
        base_url: the API root, e.g. `"http://127.0.0.1:8001/v1"` (requests go to `{base_url}/chat/completions`).
        model: the model name the endpoint serves.
        api_key: sent as `Authorization: Bearer ...`; defaults to `OPENAI_API_KEY`. Never logged or recorded.
        temperature, max_tokens, seed: sampling options sent with every request (None = not sent).
        extra_body: more fields merged into every request body.
        timeout: seconds allowed for one request.
        max_attempts: tries per request for connection errors and 429/5xx answers.
        include_return_schema: also send the `"return"` entry `get_json_schema` adds to each function (not part
            of OpenAI's function schema, so left out by default; the model-facing names, descriptions and
            parameters are exactly the bound functions' schemas either way).
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        temperature: float | None = None,
        max_tokens: int | None = None,
        seed: int | None = None,
        extra_body: dict[str, Any] | None = None,
        timeout: float = 300.0,
        max_attempts: int = 4,
        include_return_schema: bool = False,
    ) -> None:
        if not isinstance(base_url, str) or "://" not in base_url:
            raise ConfigurationError(
                f"base_url must be an http(s) URL like 'http://127.0.0.1:8001/v1', got {base_url!r}"
            )
        if not model:
            raise ConfigurationError("OpenAIPolicy needs the served model's name (model=...)")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self._api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.seed = seed
        self.extra_body = dict(extra_body or {})
        self.timeout = timeout
        self.max_attempts = max(1, int(max_attempts))
        self.include_return_schema = include_return_schema
        self._http: Any = None
        self.requests = 0

    def __repr__(self) -> str:  # never shows the key
        return f"OpenAIPolicy({self.base_url!r}, {self.model!r})"

    @property
    def description(self) -> str:
        return f"{self.model} @ {self.base_url}"

    def _tools(self, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for schema in tools:
            function = dict(schema.get("function", schema))
            if not self.include_return_schema:
                function.pop("return", None)
            out.append({"type": "function", "function": function})
        return out

    @staticmethod
    def _messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for message in messages:
            role = message["role"]
            if role == "assistant":
                item: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
                calls = message.get("tool_calls") or []
                if calls:
                    item["tool_calls"] = [
                        {
                            "id": call["id"],
                            "type": "function",
                            "function": {
                                "name": call["function"]["name"],
                                "arguments": call["function"]["arguments"]
                                if isinstance(call["function"]["arguments"], str)
                                else json.dumps(call["function"]["arguments"], ensure_ascii=False),
                            },
                        }
                        for call in calls
                    ]
                out.append(item)
            elif role == "tool":
                out.append({"role": "tool", "tool_call_id": message["tool_call_id"], "content": message["content"]})
            else:
                out.append({"role": role, "content": message["content"]})
        return out

    async def _session(self) -> Any:
        import aiohttp

        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout), trust_env=False)
        return self._http

    async def respond(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> PolicyReply:
        import aiohttp

        body: dict[str, Any] = {"model": self.model, "messages": self._messages(messages)}
        if tools:
            body["tools"] = self._tools(tools)
        for key, value in (("temperature", self.temperature), ("max_tokens", self.max_tokens), ("seed", self.seed)):
            if value is not None:
                body[key] = value
        body.update(self.extra_body)
        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        url = f"{self.base_url}/chat/completions"
        http = await self._session()
        last = ""
        for attempt in range(1, self.max_attempts + 1):
            self.requests += 1
            try:
                async with http.post(url, json=body, headers=headers) as resp:
                    text = await resp.text()
                    if resp.status == 200:
                        return self._parse(text)
                    last = f"HTTP {resp.status} from {url}: {text[:300]}"
                    if resp.status != 429 and resp.status < 500:
                        raise PolicyError(last)
            except (aiohttp.ClientError, TimeoutError) as exc:
                last = f"{type(exc).__name__} calling {url}: {exc}"
            if attempt < self.max_attempts:
                await asyncio.sleep(min(0.5 * 2 ** (attempt - 1), 8.0))
        raise PolicyError(last)

    @staticmethod
    def _parse(text: str) -> PolicyReply:
        try:
            body = json.loads(text)
            message = body["choices"][0]["message"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise PolicyError(f"the endpoint's answer is not a chat completion: {text[:300]}") from None
        calls = []
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            calls.append({
                "id": call.get("id") or None,
                "name": function.get("name") or "",
                "arguments": _parse_arguments(function.get("arguments")),
            })
        usage = body.get("usage") if isinstance(body.get("usage"), dict) else None
        return PolicyReply(content=message.get("content") or "", tool_calls=calls, usage=usage)

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None


@dataclass
class _Pending:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    future: asyncio.Future[PolicyReply]


class LocalPolicy:
    """A local transformers causal LM, prompted with its tokenizer's chat template (tools included).

    Episodes waiting for a turn are batched: the first request waits up to `batch_wait` seconds for the other
    running episodes (or until `max_batch_size` are waiting), then one left-padded `generate` call answers all
    of them, in a worker thread so that tool calls and keepalives go on meanwhile. Replies are parsed with
    TRL's `parse_response` (the tokenizer's `response_template`, set with `add_response_schema` when missing),
    as `GRPOTrainer` does.

    Args:
        model: a model object with `generate` (e.g. `AutoModelForCausalLM`).
        tokenizer: its tokenizer, with a chat template.
        temperature: 0 = greedy; otherwise sampled with `top_p`.
        max_new_tokens: tokens generated per turn (capped by the model's context).
        seed: seeds torch's generator once, when generation starts.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        temperature: float = 0.0,
        max_new_tokens: int = 256,
        top_p: float = 1.0,
        seed: int | None = 0,
        max_batch_size: int = 64,
        batch_wait: float = 0.05,
        name: str | None = None,
    ) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ConfigurationError("the tokenizer has no chat template; LocalPolicy needs one to render tools")
        self.model = model
        self.tokenizer = tokenizer
        self.temperature = float(temperature)
        self.max_new_tokens = int(max_new_tokens)
        self.top_p = top_p
        self.seed = seed
        self.max_batch_size = max(1, int(max_batch_size))
        self.batch_wait = batch_wait
        self.name = name or getattr(getattr(model, "config", None), "_name_or_path", None) or type(model).__name__
        self.batch_sizes: list[int] = []
        self._parse_mode = self._prepare_parser()
        self._queue: list[_Pending] = []
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task[None] | None = None
        self._active: Callable[[], int] = lambda: 1
        self._abort = threading.Event()
        self._seeded = False

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], *, device: str | None = None, **kwargs: Any) -> LocalPolicy:
        """Load a model and tokenizer from a local directory (never from the Hub)."""
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise ConfigurationError(f"{path!r} is not a local model directory")
        try:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError as exc:
            raise ConfigurationError(
                f"evaluating a local model needs torch and transformers ({exc}); pip install 'ors-trl[trl]'"
            ) from None
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigurationError(f"cannot load a model and tokenizer from {path!r}: {exc}") from exc
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        model.to(device)
        model.eval()
        return cls(model, tokenizer, name=kwargs.pop("name", path), **kwargs)

    def __repr__(self) -> str:
        return f"LocalPolicy({self.name!r})"

    @property
    def description(self) -> str:
        return str(self.name)

    def _prepare_parser(self) -> str:
        tok = self.tokenizer
        if getattr(tok, "response_template", None) is None and getattr(tok, "response_schema", None) is None:
            try:
                from trl.chat_template_utils import add_response_schema

                add_response_schema(tok)
            except Exception as exc:  # unknown template, or trl missing
                logger.warning(
                    "cannot parse tool calls from this model's replies (%s): no response template for its chat "
                    "template; replies are decoded as plain text, so every episode ends after one turn.", exc
                )
                return "text"
        return "parse"

    # -- the Policy protocol ---------------------------------------------------------------------------------

    def _set_active_counter(self, active: Callable[[], int]) -> None:
        self._active = active

    async def respond(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> PolicyReply:
        loop = asyncio.get_running_loop()
        if self._wakeup is None:
            self._wakeup = asyncio.Event()
        if self._worker is None or self._worker.done():
            self._abort.clear()
            self._worker = loop.create_task(self._work())
        pending = _Pending(messages, tools, loop.create_future())
        self._queue.append(pending)
        self._wakeup.set()
        try:
            return await pending.future
        finally:
            if pending in self._queue:
                self._queue.remove(pending)

    async def _work(self) -> None:
        try:
            await self._work_loop()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # never leave an episode waiting for a reply that cannot come
            for p in self._queue:
                if not p.future.done():
                    p.future.set_exception(PolicyError(f"the generation worker failed: {type(exc).__name__}: {exc}"))
            self._queue.clear()
            raise

    async def _work_loop(self) -> None:
        assert self._wakeup is not None
        loop = asyncio.get_running_loop()
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            if not self._queue:
                continue
            # Give the other running episodes a moment to ask too, so they share one generate call.
            deadline = loop.time() + self.batch_wait
            while len(self._queue) < min(self._active(), self.max_batch_size) and loop.time() < deadline:
                self._wakeup.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, deadline - loop.time())):
                        await self._wakeup.wait()
            batch = [p for p in self._queue[: self.max_batch_size] if not p.future.done()]
            del self._queue[: self.max_batch_size]
            if not batch:
                continue
            self.batch_sizes.append(len(batch))
            try:
                replies = await loop.run_in_executor(None, self._generate, [(p.messages, p.tools) for p in batch])
            except Exception as exc:
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(exc if isinstance(exc, PolicyError) else PolicyError(
                            f"generation failed: {type(exc).__name__}: {exc}"))
                continue
            for p, reply in zip(batch, replies, strict=True):
                if p.future.done():
                    continue
                if isinstance(reply, BaseException):
                    p.future.set_exception(reply)
                else:
                    p.future.set_result(reply)
            if self._queue:
                self._wakeup.set()

    async def aclose(self) -> None:
        self._abort.set()
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(BaseException):
                await self._worker
            self._worker = None
        for p in self._queue:
            if not p.future.done():
                p.future.cancel()
        self._queue.clear()
        self._wakeup = None
        self._seeded = False  # the next evaluation starts from the same seed

    # -- generation (worker thread) --------------------------------------------------------------------------

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[int]:
        out = self.tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return list(out["input_ids"])

    def _context_limit(self) -> int | None:
        config = getattr(self.model, "config", None)
        limit = getattr(config, "max_position_embeddings", None)
        return limit if isinstance(limit, int) and limit > 0 else None

    def _generate(self, requests: list[tuple[list[dict[str, Any]], list[dict[str, Any]]]]) -> list[Any]:
        import torch

        tok = self.tokenizer
        limit = self._context_limit()
        prompts: list[list[int] | None] = []
        results: list[Any] = [None] * len(requests)
        for i, (messages, tools) in enumerate(requests):
            try:
                ids = self._render(messages, tools)
            except Exception as exc:  # one conversation the template cannot render fails alone
                results[i] = PolicyError(f"the chat template failed: {type(exc).__name__}: {exc}")
                prompts.append(None)
                continue
            if limit is not None and len(ids) >= limit:
                results[i] = ContextLengthExceeded(
                    f"the conversation ({len(ids)} tokens) fills the model's context ({limit})"
                )
                prompts.append(None)
            else:
                prompts.append(ids)
        live = [i for i, p in enumerate(prompts) if p is not None]
        if not live:
            return results
        width = max(len(prompts[i]) for i in live)  # type: ignore[arg-type]
        max_new = self.max_new_tokens if limit is None else max(1, min(self.max_new_tokens, limit - width))
        eos_id = tok.eos_token_id
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else eos_id
        device = getattr(self.model, "device", "cpu")
        input_ids = torch.full((len(live), width), pad_id, dtype=torch.long)
        attention = torch.zeros((len(live), width), dtype=torch.long)
        for row, i in enumerate(live):  # left padding
            p = prompts[i]
            assert p is not None
            input_ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
            attention[row, width - len(p):] = 1
        sampling: dict[str, Any] = (
            {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": 0}
            if self.temperature > 0 else {"do_sample": False}
        )
        if self.seed is not None and not self._seeded:
            torch.manual_seed(self.seed)
            self._seeded = True
        abort = self._abort

        def stop(input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            return torch.full((input_ids.shape[0],), abort.is_set(), dtype=torch.bool, device=input_ids.device)

        from transformers import StoppingCriteriaList

        with torch.no_grad():
            out = self.model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention.to(device),
                max_new_tokens=max_new,
                eos_token_id=eos_id,
                pad_token_id=pad_id,
                stopping_criteria=StoppingCriteriaList([stop]),
                **sampling,
            )
        if abort.is_set():
            raise PolicyError("generation aborted")
        for row, i in enumerate(live):
            ids = out[row, width:].tolist()
            if eos_id is not None and eos_id in ids:
                ids = ids[: ids.index(eos_id) + 1]
            else:
                while ids and ids[-1] == pad_id:
                    ids.pop()
            results[i] = self._parse(ids, prompts[i], requests[i][1])
        return results

    def _parse(self, ids: list[int], prefix: list[int] | None, tools: list[dict[str, Any]]) -> PolicyReply:
        raw = self.tokenizer.decode(ids, skip_special_tokens=False)
        if not ids:
            return PolicyReply(content="", raw=raw)
        if self._parse_mode == "parse":
            from trl.chat_template_utils import parse_response

            parsed = parse_response(self.tokenizer, ids, prefix=prefix, tools=tools or None)
        else:
            parsed = {"content": self.tokenizer.decode(ids, skip_special_tokens=True)}
        calls = []
        for call in parsed.get("tool_calls") or []:
            function = call.get("function") or {}
            calls.append({"id": None, "name": str(function.get("name") or ""),
                          "arguments": _parse_arguments(function.get("arguments"))})
        content = parsed.get("content")
        return PolicyReply(content=content if isinstance(content, str) else "", tool_calls=calls, raw=raw)


def resolve_policy(
    policy: Any,
    *,
    temperature: float = 0.0,
    max_new_tokens: int | None = None,
    seed: int | None = 0,
    device: str | None = None,
) -> tuple[Any, bool]:
    """Turn what the user passed into a policy object; returns `(policy, created_here)`.

    Accepts a local model directory, a `(model, tokenizer)` pair, or any object with `respond` (`OpenAIPolicy`).
    """
    local_kwargs: dict[str, Any] = {"temperature": temperature, "seed": seed}
    if max_new_tokens is not None:
        local_kwargs["max_new_tokens"] = max_new_tokens
    if isinstance(policy, str | os.PathLike):
        path = os.fspath(policy)
        if not os.path.isdir(path):
            raise ConfigurationError(
                f"policy {path!r} is not a local model directory. To evaluate a served model, pass "
                "OpenAIPolicy(base_url, model) (CLI: --base-url URL --model NAME)."
            )
        return LocalPolicy.from_pretrained(path, device=device, **local_kwargs), True
    if isinstance(policy, tuple) and len(policy) == 2:
        return LocalPolicy(policy[0], policy[1], **local_kwargs), True
    if callable(getattr(policy, "respond", None)):
        return policy, False
    raise ConfigurationError(
        f"cannot evaluate {type(policy).__name__}: pass a local model directory, a (model, tokenizer) pair, "
        "an OpenAIPolicy, or an object with `async respond(messages, tools) -> PolicyReply`."
    )


def _describe(policy: Any) -> str:
    return str(getattr(policy, "description", None) or repr(policy))


# ---------------------------------------------------------------------------------------------------------
# Tools: the same binding as training


class _Router:
    """Stands in for the adapter: the bound (async) tool functions hand it the remote name and wire arguments."""

    async def _acall_tool(self, name: str, arguments: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return name, arguments


@dataclass
class _Toolset:
    binding: BindingResult
    schemas: list[dict[str, Any]]
    by_name: dict[str, Any]

    @classmethod
    def build(cls, specs: Sequence[ToolSpec]) -> _Toolset:
        try:
            from transformers.utils import get_json_schema
        except ImportError:
            raise ConfigurationError(
                "evaluation needs transformers to render the tool schemas exactly as training does: "
                "pip install 'ors-trl[trl]'"
            ) from None

        binding = bind_tools([s.to_json() for s in specs], reserved=DEFAULT_RESERVED | {"reset"}, asynchronous=True,
                             module=__name__, qualname_prefix="OpenRewardEnvironment")
        schemas, by_name = [], {}
        for bound in binding.tools.values():
            schemas.append(get_json_schema(bound.function))
            by_name[bound.name] = bound
        return cls(binding, schemas, by_name)

    async def route(self, name: str, arguments: Any) -> tuple[str, dict[str, Any]]:
        """The remote tool name and wire arguments for a model's call; raises `_CallError` when it cannot be made."""
        bound = self.by_name.get(name)
        if bound is None:
            raise _CallError("unknown_tool", f"Tool {name} not found.")
        if not isinstance(arguments, dict):
            raise _CallError("invalid_arguments",
                             f"Tool {name}: the arguments are not a JSON object: {str(arguments)[:200]}")
        try:
            return await bound.function(_Router(), **arguments)
        except TypeError as exc:
            raise _CallError("invalid_arguments", str(exc)) from None


class _CallError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _tool_error_content(message: str) -> str:
    # Exactly what GRPOTrainer sends the model when a tool raises.
    return str({"error": message})


# ---------------------------------------------------------------------------------------------------------
# Records and the report


EpisodeKey = tuple[str, int, int]


def _key(record: dict[str, Any]) -> EpisodeKey | None:
    try:
        return (str(record["split"]), int(record["task_index"]), int(record.get("repeat", 0)))
    except (KeyError, TypeError, ValueError):
        return None


def load_episodes(path: str | os.PathLike[str]) -> dict[EpisodeKey, dict[str, Any]]:
    """Read an episodes file: `{(split, task_index, repeat): record}`, the last record of each key winning.

    Lines that are not complete JSON objects (an interrupted write) are skipped with a warning.
    """
    out: dict[EpisodeKey, dict[str, Any]] = {}
    p = Path(path)
    if not p.exists():
        return out
    bad = 0
    with p.open("r", encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                bad += 1
                continue
            key = _key(record) if isinstance(record, dict) else None
            if key is None:
                bad += 1
                continue
            out[key] = record
    if bad:
        logger.warning("%s: skipped %d unreadable line(s) (an interrupted write?)", p, bad)
    return out


class _Writer:
    """Appends one JSON line per episode and flushes it at once."""

    def __init__(self, path: Path, *, truncate: bool) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        needs_newline = False
        if not truncate and path.exists() and path.stat().st_size > 0:
            with path.open("rb") as fh:
                fh.seek(-1, os.SEEK_END)
                needs_newline = fh.read(1) != b"\n"
        self._fh = path.open("w" if truncate else "a", encoding="utf-8")
        if needs_newline:  # a line cut short by an interruption must not swallow the next record
            self._fh.write("\n")
            self._fh.flush()
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, ensure_ascii=False, default=str) + "\n"
        with self._lock:
            self._fh.write(line)
            self._fh.flush()

    def close(self) -> None:
        with self._lock:
            self._fh.close()


@dataclass
class EvalReport:
    """What an evaluation measured.

    Attributes:
        target, environment, split, policy: what was evaluated.
        num_episodes: episodes in the report (run now plus those resumed from `output`).
        num_scored: episodes the environment gave a reward (a non-None one).
        mean_reward: mean episode reward over the scored episodes; None if none was scored.
        coverage: grading coverage, `num_scored / num_episodes`.
        finished_rate: fraction of episodes a tool result marked finished.
        tool_calls_per_episode, tool_failures_per_episode: mean tool calls / failed tool calls per episode.
        turns_per_episode: mean policy replies per episode.
        num_errors: episodes that ended in an environment or policy error (`end_reason == "error"`).
        end_reasons: episodes per end reason (`no_tool_calls`, `finished`, `max_turns`, `context_length`, `error`).
        num_resumed: episodes read back from `output` rather than run.
        seconds: wall time of this run.
        output: the episodes file, if any.
        episodes: every episode record (the dicts written to `output`), in task order.
    """

    target: str
    environment: str | None
    split: str
    policy: str
    num_episodes: int
    num_scored: int
    mean_reward: float | None
    coverage: float
    finished_rate: float
    tool_calls_per_episode: float
    tool_failures_per_episode: float
    turns_per_episode: float
    num_errors: int
    end_reasons: dict[str, int]
    num_resumed: int
    seconds: float
    output: str | None = None
    episodes: list[dict[str, Any]] = field(default_factory=list, repr=False)

    @classmethod
    def from_episodes(cls, episodes: list[dict[str, Any]], **info: Any) -> EvalReport:
        n = len(episodes)
        rewards = [e["reward"] for e in episodes if e.get("reward") is not None]

        def mean(values: list[float]) -> float:
            return sum(values) / n if n else 0.0

        return cls(
            num_episodes=n,
            num_scored=len(rewards),
            mean_reward=sum(rewards) / len(rewards) if rewards else None,
            coverage=len(rewards) / n if n else 0.0,
            finished_rate=mean([1.0 if e.get("finished") else 0.0 for e in episodes]),
            tool_calls_per_episode=mean([float(e.get("tool_calls", 0)) for e in episodes]),
            tool_failures_per_episode=mean([float(e.get("tool_failures", 0)) for e in episodes]),
            turns_per_episode=mean([float(len(e.get("turns") or [])) for e in episodes]),
            num_errors=sum(1 for e in episodes if e.get("end_reason") == "error"),
            end_reasons=dict(Counter(str(e.get("end_reason")) for e in episodes)),
            episodes=episodes,
            **info,
        )

    def to_dict(self, *, episodes: bool = False) -> dict[str, Any]:
        """The report as JSON-able data (without the episode records unless `episodes=True`)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "episodes"}
        out["end_reasons"] = dict(self.end_reasons)
        if episodes:
            out["episodes"] = list(self.episodes)
        return out

    def summary(self) -> str:
        """A few readable lines."""
        reward = "n/a (no episode was scored)" if self.mean_reward is None else f"{self.mean_reward:.4f}"
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.end_reasons.items())) or "-"
        lines = [
            f"Evaluated {self.num_episodes} episode(s) of {self.environment or self.target} "
            f"(split {self.split!r}) with {self.policy}",
            f"  mean reward           {reward}" + (f"  (over {self.num_scored} scored)" if self.num_scored else ""),
            f"  grading coverage      {self.coverage:.3f}",
            f"  finished rate         {self.finished_rate:.3f}",
            f"  tool calls / episode  {self.tool_calls_per_episode:.2f}",
            f"  tool failures / ep.   {self.tool_failures_per_episode:.2f}",
            f"  turns / episode       {self.turns_per_episode:.2f}",
            f"  errors                {self.num_errors}",
            f"  end reasons           {reasons}",
            f"  time                  {self.seconds:.1f} s",
        ]
        if self.num_resumed:
            lines.append(f"  resumed               {self.num_resumed} episode(s) from {self.output}")
        if self.output:
            lines.append(f"Episodes: {self.output}")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# The engine


def _error(kind: str, exc: BaseException | str, reason: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": kind, "message": str(exc)}
    if reason:
        out["reason"] = reason
    return out


class _Evaluation:
    def __init__(self, spec: Any, policy: Any, *, environment: str | None, toolset: _Toolset | None,
                 max_turns: int, writer: _Writer | None, bar: Any, policy_name: str) -> None:
        self.spec = spec
        self.client = spec.client
        self.split = spec.split
        self.policy = policy
        self.environment = environment
        self.toolset = toolset
        self.max_turns = max_turns
        self.writer = writer
        self.bar = bar
        self.policy_name = policy_name
        self.max_output_chars = getattr(getattr(spec, "_runtime", None), "max_output_chars", None)
        self.active = 0
        self.done: list[dict[str, Any]] = []
        self._toolsets: dict[str, _Toolset] = {}

    async def _episode_toolset(self, session: Any) -> _Toolset:
        if self.toolset is not None:
            return self.toolset
        specs = (await session.tools()).tools
        key = json.dumps([s.to_json() for s in specs], sort_keys=True, default=str)
        toolset = self._toolsets.get(key)
        if toolset is None:
            toolset = self._toolsets[key] = _Toolset.build(specs)
        return toolset

    async def run_one(self, gate: asyncio.Semaphore, key: EpisodeKey) -> dict[str, Any]:
        async with gate:
            self.active += 1
            try:
                record = await self._episode(key)
            finally:
                self.active -= 1
        if self.writer is not None:
            self.writer.write(record)
        self.done.append(record)
        if self.bar is not None:
            scored = [r["reward"] for r in self.done if r.get("reward") is not None]
            if scored:
                self.bar.set_postfix(reward=f"{sum(scored) / len(scored):.3f}", refresh=False)
            self.bar.update(1)
        return record

    async def _episode(self, key: EpisodeKey) -> dict[str, Any]:
        from ._adapter import truncate_output

        split, index, repeat = key
        started = time.monotonic()
        record: dict[str, Any] = {
            "version": RECORD_VERSION,
            "environment": self.environment,
            "target": self.spec.target,
            "split": split,
            "task_index": index,
            "repeat": repeat,
            "policy": self.policy_name,
            "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "prompt": None,
            "turns": [],
            "rewards": [],
            "reward": None,
            "finished": False,
            "end_reason": None,
            "tool_calls": 0,
            "tool_failures": 0,
            "error": None,
            "timings": {},
        }
        timings = record["timings"]
        session = None
        generation_s = tools_s = 0.0
        try:
            session = await self.client.open_session(split=split, index=index)
            timings["open"] = round(time.monotonic() - started, 4)
            t = time.monotonic()
            prompt = blocks_text(await session.prompt())
            timings["prompt"] = round(time.monotonic() - t, 4)
            record["prompt"] = prompt
            toolset = await self._episode_toolset(session)
            messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
            end = "max_turns"
            for turn_index in range(self.max_turns):
                t = time.monotonic()
                try:
                    reply = await self.policy.respond(messages, toolset.schemas)
                except ContextLengthExceeded as exc:
                    end = "context_length"
                    record["stop_detail"] = str(exc)
                    break
                except (PolicyError, ORSError):
                    raise
                except Exception as exc:
                    raise PolicyError(f"{type(exc).__name__}: {exc}") from exc
                gen = time.monotonic() - t
                generation_s += gen
                calls = [dict(c, id=c.get("id") or _call_id(turn_index, k)) for k, c in enumerate(reply.tool_calls)]
                turn: dict[str, Any] = {"index": turn_index, "assistant": reply.content, "tool_calls": [],
                                        "generation_seconds": round(gen, 4)}
                if reply.raw is not None:
                    turn["raw"] = reply.raw
                if reply.usage:
                    turn["usage"] = reply.usage
                record["turns"].append(turn)
                messages.append({
                    "role": "assistant",
                    "content": reply.content,
                    **({"tool_calls": [{"id": c["id"], "type": "function",
                                        "function": {"name": c["name"], "arguments": c["arguments"]}}
                                       for c in calls]} if calls else {}),
                })
                if not calls:
                    end = "no_tool_calls"
                    break
                finished = False
                for call in calls:
                    entry: dict[str, Any] = {"id": call["id"], "name": call["name"], "arguments": call["arguments"]}
                    turn["tool_calls"].append(entry)
                    if finished:  # the episode is over; the server would refuse the rest
                        entry["skipped"] = "the episode finished before this call"
                        continue
                    record["tool_calls"] += 1
                    t = time.monotonic()
                    content, fatal = await self._call(session, toolset, call, entry, record)
                    elapsed = time.monotonic() - t
                    tools_s += elapsed
                    entry["seconds"] = round(elapsed, 4)
                    if isinstance(content, str):
                        content = truncate_output(content, self.max_output_chars)
                    entry["output"] = content
                    messages.append({"role": "tool", "tool_call_id": call["id"], "name": call["name"],
                                     "content": content})
                    if fatal is not None:
                        raise fatal
                    if entry.get("finished"):
                        finished = True
                if finished:
                    end = "finished"
                    break
            record["end_reason"] = end
        except ORSError as exc:
            record["end_reason"] = "error"
            record["error"] = _error(exc.kind, exc, getattr(exc, "reason", None))
        except PolicyError as exc:
            record["end_reason"] = "error"
            record["error"] = _error(exc.kind, exc)
        except Exception as exc:  # a bug or an unexpected failure: recorded, not fatal for the other episodes
            logger.warning("episode %s/%d/%d failed unexpectedly: %s", split, index, repeat, exc, exc_info=True)
            record["end_reason"] = "error"
            record["error"] = _error("internal", f"{type(exc).__name__}: {exc}")
        finally:
            if session is not None:
                await session.close()
        record["finished"] = any(c.get("finished") for turn in record["turns"] for c in turn.get("tool_calls", []))
        timings["generation"] = round(generation_s, 4)
        timings["tools"] = round(tools_s, 4)
        timings["total"] = round(time.monotonic() - started, 4)
        return record

    async def _call(self, session: Any, toolset: _Toolset, call: dict[str, Any], entry: dict[str, Any],
                    record: dict[str, Any]) -> tuple[str, ORSError | None]:
        """Run one tool call; fills `entry`, returns the text for the model and an error that ends the episode."""
        try:
            remote, wire = await toolset.route(call["name"], call["arguments"])
        except _CallError as exc:
            record["tool_failures"] += 1
            record["rewards"].append(None)
            entry["error"] = _error(exc.kind, exc)
            return _tool_error_content(str(exc)), None
        entry["remote_name"] = remote
        if wire != call["arguments"]:
            entry["remote_arguments"] = wire
        try:
            result = await session.call(remote, wire)
        except ORSError as exc:
            record["tool_failures"] += 1
            record["rewards"].append(None)
            entry["error"] = _error(exc.kind, exc, getattr(exc, "reason", None))
            # A refused or failed tool is the model's problem; anything else (session gone, network) ends the episode.
            return _tool_error_content(str(exc)), None if isinstance(exc, ToolError) else exc
        record["rewards"].append(result.reward)
        if result.reward is not None:
            record["reward"] = result.reward
        entry["reward"] = result.reward
        entry["finished"] = result.finished
        entry["metadata"] = result.metadata
        return result.text or "(no output)", None


def _select(total: int, split: str, num_tasks: int | None, indices: Sequence[int] | None) -> list[int]:
    if indices is not None:
        check_in_range(indices, total, split)
        return list(dict.fromkeys(indices))
    n = total if num_tasks is None else min(num_tasks, total)
    return list(range(n))


def evaluate(
    spec: Any,
    policy: Any,
    *,
    num_tasks: int | None = None,
    indices: Sequence[int] | None = None,
    repeats: int = 1,
    concurrency: int = 8,
    max_turns: int = 10,
    output: str | os.PathLike[str] | None = None,
    resume: bool = False,
    overwrite: bool = False,
    per_task_tools: bool = False,
    temperature: float = 0.0,
    max_new_tokens: int | None = None,
    seed: int | None = 0,
    device: str | None = None,
    progress: bool = True,
) -> EvalReport:
    """Run `policy` over tasks of `spec` (an `OpenRewardSpec` or a target string) and score it.

    Args:
        spec: the environment, as an `OpenRewardSpec` (its split, env_name, secrets, timeouts apply) or a target.
        policy: a local model directory, a `(model, tokenizer)` pair, an `OpenAIPolicy`, or any object with
            `async respond(messages, tools) -> PolicyReply`.
        num_tasks: the first `num_tasks` tasks of the split; `indices`: exactly these. Default: the spec's own
            selection (`num_tasks=` / `indices=` it was built with), else the whole split.
        repeats: episodes per task (told apart by their repeat index).
        concurrency: episodes (and so sessions) running at once.
        max_turns: policy replies allowed per episode.
        output: JSON-lines file receiving every finished episode at once (append + flush).
        resume: read `output` back and run only the episodes it lacks (episodes that ended in an error are rerun).
        overwrite: replace an existing non-empty `output` (without `resume`, an existing file is an error).
        per_task_tools: bind each episode's own tool list (`/task_tools` of its session) instead of the spec's
            tools, i.e. what training binds (shared plus the probed task-specific tools).
        temperature, max_new_tokens, seed, device: generation options for a policy given as a path or pair.
        progress: show a progress bar on stderr.

    Returns:
        An `EvalReport`; `report.episodes` holds every record.
    """
    from ._loop import get_loop

    if isinstance(spec, str):
        from ._spec import OpenRewardSpec

        spec = OpenRewardSpec(spec)
    indices = check_selection(num_tasks, indices)
    if num_tasks is None and indices is None:
        indices = getattr(spec, "_indices", None)
        num_tasks = getattr(spec, "_num_tasks", None)
    for name, value, low in (("repeats", repeats, 1), ("concurrency", concurrency, 1), ("max_turns", max_turns, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigurationError(f"{name} must be an int >= {low}, got {value!r}")
    out_path = Path(output) if output is not None else None
    if resume and out_path is None:
        raise ConfigurationError("resume=True needs output= (the episodes file to continue)")
    if out_path is not None and not resume and not overwrite and out_path.exists() and out_path.stat().st_size > 0:
        raise ConfigurationError(
            f"{out_path} already exists; pass resume=True to continue it or overwrite=True to replace it"
        )

    started = time.monotonic()
    bg = get_loop()
    client = spec.client
    environment = bg.run(client.environment())
    total = bg.run(client.num_tasks(spec.split))
    selected = _select(total, spec.split, num_tasks, indices)
    keys: list[EpisodeKey] = [(spec.split, i, r) for i in selected for r in range(repeats)]
    toolset = None if per_task_tools else _Toolset.build(spec.tool_specs)

    previous: dict[EpisodeKey, dict[str, Any]] = load_episodes(out_path) if resume and out_path else {}
    if previous:
        others = {r.get("environment") for r in previous.values()} - {environment}
        if others:
            logger.warning("%s holds episodes of other environments (%s); they are not reused",
                           out_path, ", ".join(map(str, others)))
    wanted = set(keys)
    kept = {k: r for k, r in previous.items()
            if k in wanted and r.get("end_reason") != "error" and r.get("environment") == environment}
    todo = [k for k in keys if k not in kept]

    policy_obj, _ = resolve_policy(policy, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed,
                                   device=device)
    policy_name = _describe(policy_obj)
    writer = _Writer(out_path, truncate=not resume) if out_path is not None else None
    bar = None
    if progress and todo:
        import sys

        from tqdm.auto import tqdm

        bar = tqdm(total=len(keys), initial=len(kept), desc=f"eval {environment or spec.name}", unit="ep",
                   file=sys.stderr, dynamic_ncols=True)
    evaluation = _Evaluation(spec, policy_obj, environment=environment, toolset=toolset, max_turns=max_turns,
                             writer=writer, bar=bar, policy_name=policy_name)
    if hasattr(policy_obj, "_set_active_counter"):
        policy_obj._set_active_counter(lambda: evaluation.active)
    finished_event = threading.Event()

    async def run_all() -> None:
        gate = asyncio.Semaphore(concurrency)
        tasks = [asyncio.ensure_future(evaluation.run_one(gate, k)) for k in todo]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # every session closed before we return
            aclose = getattr(policy_obj, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
            finished_event.set()

    fut = bg.submit(run_all())
    try:
        fut.result()
    except BaseException:
        fut.cancel()  # Ctrl-C: cancel the running episodes, then wait (bounded) until their sessions are closed
        finished_event.wait(_CLEANUP_WAIT_S)
        raise
    finally:
        if bar is not None:
            bar.close()
        if writer is not None:
            writer.close()

    by_key = dict(kept)
    by_key.update({_key(r): r for r in evaluation.done})  # type: ignore[misc]
    episodes = [by_key[k] for k in keys if k in by_key]
    return EvalReport.from_episodes(
        episodes,
        target=spec.target,
        environment=environment,
        split=spec.split,
        policy=policy_name,
        num_resumed=len(kept),
        seconds=round(time.monotonic() - started, 3),
        output=os.fspath(out_path) if out_path is not None else None,
    )

