"""Policies: what `evaluate` asks for the model's next turn.

A policy is a generator (`ors_trl.core.rollout.Generator`, as `LocalPolicy` is) or a `Policy` (`await respond(messages,
tools) -> Reply`, driven through `Responder`): `LocalPolicy`, `OpenAIPolicy` and `RandomPolicy` are built in. Its
`tool_markup` says what a tool call looks like in its text: a reply without calls holding it is counted `unparsed`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from ..core.episode import Reply
from ..core.rollout import Batcher, Conversation
from ..protocol.errors import ConfigurationError, ContextLengthExceeded, ORSError, PolicyError, checked_keywords
from ..protocol.target import check_header_value
from ..protocol.transport import RetryPolicy, Timeouts, Transport
from ..trl.backend import Rendering, image_inputs
from ..trl.tokens import TokenGenerator, Tokens

__all__ = ["TOOL_MARKUPS", "LocalPolicy", "OpenAIPolicy", "Policy", "PolicyReply", "RandomPolicy", "Responder",
           "as_generator", "describe_policy", "markup_pattern", "random_arguments", "resolve_policy"]

#: The reply type of the `Policy` protocol: `ors_trl.core.episode.Reply` itself.
PolicyReply = Reply

logger = logging.getLogger("ors_trl.eval")
#: The texts that open (or, for gpt-oss, address or end) a tool call in the major open-weight chat templates: what the
#: tool-call parsers of vLLM and SGLang look for. A server run without the model's parser returns them as content.
TOOL_MARKUPS: dict[str, str] = {
    "<tool_call>": "Qwen 2.5 / 3, QwQ, Hermes 2 Pro / 3, GLM-4.5, Granite 3.1",
    "<tool_calls>": "Jamba, MiniMax-M1, Hunyuan-A13B",
    "<minimax:tool_call>": "MiniMax-M2",
    "<|tool_call|>": "Granite 3.0, Phi-4-mini",
    "<|python_tag|>": "Llama 3.1 / 3.2 / 3.3",
    "[TOOL_CALLS]": "Mistral, Mixtral, Ministral, Magistral, Devstral",
    "<\uff5ctool\u2581calls\u2581begin\uff5c>": "DeepSeek V3 / R1 / V3.1",
    "<|tool_calls_section_begin|>": "Kimi K2",
    "<|action_start|><|plugin|>": "InternLM 2 / 2.5",
    "to=functions.": "gpt-oss (harmony: a message to a function)",
    "<|call|>": "gpt-oss (harmony: the end of a call)",
}
#: A JSON call on a line of its own, `{"name": "...", "parameters": ...}`: Llama 3.x's JSON tool calling (vLLM's
#: `llama3_json`), and Hermes' body without its tags (`"arguments"`).
_JSON_CALL = r'^[ \t]*\{\s*"name"\s*:\s*"[^"\n]*"\s*,\s*"(?:parameters|arguments)"\s*:'


def markup_pattern(texts: str | Sequence[str] | None = None) -> re.Pattern[str] | None:
    """What a tool call looks like in a reply's text: any of `texts` (literal), or by default any of `TOOL_MARKUPS`
    and a JSON call on a line of its own; None for no text (`()`: look for nothing)."""
    if texts is None:
        return re.compile("|".join([*map(re.escape, TOOL_MARKUPS), _JSON_CALL]), re.MULTILINE)
    given = [texts] if isinstance(texts, str) else list(texts)
    if not all(isinstance(t, str) and t.strip() for t in given):
        raise ConfigurationError(f"tool_markup must be texts that open a tool call (not blank), got {given!r}")
    return re.compile("|".join(map(re.escape, given))) if given else None


@runtime_checkable
class Policy(Protocol):
    """What `evaluate` drives: the assistant's reply to the conversation and tool schemas. It may also have
    `tool_markup` (a text or pattern: a tool call in its text) and `description` (its name in records and reports).

    A reply calls tools (`tool_calls`: `{"name": ..., "arguments": {...}}` each; the episode goes on with their
    results) or answers in plain text (`content`; the episode ends, graded by the environment's terminal tool if it has
    one). For example, a policy that echoes the word its prompt quotes:

        class Echo:
            async def respond(self, messages, tools):
                if any(m["role"] == "tool" for m in messages):
                    return PolicyReply("Done.")
                word = messages[-1]["content"].split('"')[1]
                return PolicyReply("", [{"name": "echo", "arguments": {"text": word}}])

        report = OpenRewardSpec(url, split="test").evaluate(Echo())
    """

    async def respond(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> Reply:
        """The assistant's next turn.

        Args:
            messages (`list[dict[str, Any]]`):
                Chat messages (system, user, assistant with `tool_calls`, tool); image content as content parts.
            tools (`list[dict[str, Any]]`):
                The tools' JSON schemas, as training renders them.

        Raises:
            PolicyError: no reply could be produced (`ContextLengthExceeded` when the conversation no longer fits).
        """


def openai_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A chat message as OpenAI's chat API takes it: image parts as `image_url` parts (`data:` URLs), calls'
    arguments as JSON text; the harness server answers in the same shape."""
    out = {k: v for k, v in message.items() if k in ("role", "content", "tool_call_id")}
    if message.get("reasoning_content"):
        out["reasoning_content"] = message["reasoning_content"]
    if isinstance(content := message.get("content"), list):
        from ..protocol.images import data_url

        out["content"] = [p if p.get("type") != "image" else {"type": "image_url", "image_url": {
            "url": p["image"] if isinstance(p["image"], str) else data_url(p["image"])}} for p in content]
    if calls := message.get("tool_calls"):
        out["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
            "name": (f := c["function"])["name"],
            "arguments": a if isinstance(a := f["arguments"], str) else json.dumps(a, ensure_ascii=False)}} for c in calls]
    return out


class OpenAIPolicy:
    """A model behind any OpenAI-compatible `/chat/completions` endpoint (vLLM, SGLang, TGI, OpenAI...).

    Args:
        base_url (`str`):
            The API root, e.g. `"http://127.0.0.1:8001/v1"`.
        model (`str`):
            The model name the endpoint serves.
        api_key (`str`, *optional*):
            Sent as `Authorization: Bearer ...` (default: `OPENAI_API_KEY`); never logged, masked as `***` in errors.
        temperature (`float`, *optional*):
            Sampling temperature, sent with every request when set.
        max_tokens (`int`, *optional*):
            Token limit of one reply, sent with every request when set.
        seed (`int`, *optional*):
            Sampling seed, sent with every request when set.
        extra_body (`dict[str, Any]`, *optional*):
            More fields merged into every request body.
        timeout (`float`, *optional*, defaults to `300.0`):
            Seconds allowed for one request.
        max_attempts (`int`, *optional*, defaults to `4`):
            Tries per request for connection errors and 429/5xx answers (backoff as `RetryPolicy`).
        include_return_schema (`bool`, *optional*, defaults to `False`):
            Also send the `"return"` entry `get_json_schema` adds to each function (not in OpenAI's function schema).
        tool_images (`str`, *optional*, defaults to `"tool"`):
            Where a tool output's images go: `"tool"`, in the tool message (vLLM; as in training); `"user"`, in a user
            message after the turn's tool messages (APIs without images in tool messages).
        tool_markup (`str` or `Sequence[str]`, *optional*):
            The text(s) opening a tool call the server did not parse (counted `unparsed`); default: `TOOL_MARKUPS` and
            a JSON call on its own line; `()`: none.
    """

    @checked_keywords
    def __init__(self, base_url: str, model: str, *, api_key: str | None = None, temperature: float | None = None,
                 max_tokens: int | None = None, seed: int | None = None, extra_body: dict[str, Any] | None = None,
                 timeout: float = 300.0, max_attempts: int = 4, include_return_schema: bool = False,
                 tool_images: str = "tool", tool_markup: str | Sequence[str] | None = None) -> None:
        self.tool_markup = markup_pattern(tool_markup)
        if tool_images not in ("tool", "user"):
            raise ConfigurationError(f'tool_images must be "tool" or "user", got {tool_images!r}')
        self.tool_images = tool_images
        if not isinstance(base_url, str) or "://" not in base_url:
            raise ConfigurationError(f"base_url must be an http(s) URL like 'http://127.0.0.1:8001/v1', got "
                                     f"{base_url!r}")
        if not model:
            raise ConfigurationError("OpenAIPolicy needs the served model's name (model=...)")
        self.base_url, self.model, self.include_return_schema = base_url.rstrip("/"), model, include_return_schema
        sampling = {"temperature": temperature, "max_tokens": max_tokens, "seed": seed}
        self.body = {"model": model, **{k: v for k, v in sampling.items() if v is not None}, **(extra_body or {})}
        api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        if api_key:
            check_header_value(api_key, "the API key")
        self._transport = Transport.for_url(  # the one HTTP stack: its retries, cap, decoder and masking
            self.base_url, error=PolicyError, secrets=[api_key] if api_key else [],
            headers={"Authorization": f"Bearer {api_key}"} if api_key else None,
            timeouts=Timeouts(connect=None, request=timeout),
            retry=RetryPolicy(max_attempts=max(1, int(max_attempts)), backoff_initial=0.5))

    def __repr__(self) -> str:  # never shows the key
        return f"OpenAIPolicy({self.base_url!r}, {self.model!r})"

    description = property(lambda self: f"{self.model} @ {self.base_url}",
                           doc='The policy\'s name in records and reports: `"{model} @ {base_url}"`.')

    def _messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The conversation in OpenAI's shape; with `tool_images="user"`, a turn's tool images move to a user message
        after its tool messages."""
        out: list[dict[str, Any]] = []
        moved: list[dict[str, Any]] = []
        for message in map(openai_message, messages):
            if moved and message["role"] != "tool":
                out.append({"role": "user", "content": moved})
                moved = []
            if message["role"] == "assistant":
                message["content"] = message.get("content") or ""
            elif message["role"] == "tool" and self.tool_images == "user" and isinstance(message["content"], list):
                moved += [p for p in message["content"] if p["type"] == "image_url"]
                message["content"] = "".join(p.get("text", "") for p in message["content"])
            out.append(message)
        if moved:
            out.append({"role": "user", "content": moved})
        return out

    async def respond(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> Reply:
        """The next turn, asked of the endpoint (retried under `max_attempts`); a `PolicyError` when the endpoint
        answers an error or no chat completion, or cannot be reached.

        Args:
            messages (`list[dict[str, Any]]`):
                The conversation so far (see `Policy.respond`).
            tools (`list[dict[str, Any]]`):
                The tools' JSON schemas.
        """
        body: dict[str, Any] = {"model": self.model, "messages": self._messages(messages)}
        if tools:
            body["tools"] = [{"type": "function", "function": {k: v for k, v in schema.get("function", schema).items()
                                                               if k != "return" or self.include_return_schema}}
                             for schema in tools]
        body = await self._transport.post_json("/chat/completions", {**body, **self.body})
        try:
            choice = body["choices"][0]
            message = choice["message"]
            calls = message.get("tool_calls") or []  # not a list of objects: not a call silently dropped
            if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
                raise TypeError
        except (KeyError, IndexError, TypeError, AttributeError):
            raise PolicyError("the endpoint's answer is not a chat completion: "
                              + self._transport.decoder.quote(json.dumps(body, default=str).encode(), 300)) from None
        usage = body.get("usage") if isinstance(body.get("usage"), dict) else None
        reasoning = message.get("reasoning_content")
        content = message.get("content") or ""  # content parts (Mistral's): their text
        if isinstance(content, list):
            content = "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
        return Reply(content if isinstance(content, str) else json.dumps(content), calls, usage=usage,
                     truncated=choice.get("finish_reason") == "length",
                     reasoning=reasoning if isinstance(reasoning, str) and reasoning else None)

    async def aclose(self) -> None:
        """Close the HTTP connections; the policy stays usable (a later request opens new ones)."""
        await self._transport.aclose()


class LocalPolicy(TokenGenerator):
    """A local transformers causal LM (or vision-language model and processor), its ids built as GRPO builds them
    (`ors_trl.trl.tokens`) with the chat template `GRPOTrainer` trains tools with. Waiting turns are batched
    (`Batcher`) into one `generate` call on a worker thread; replies parse with TRL's `parse_response`.

    Args:
        model (`Any`):
            A model object with `generate` (e.g. `AutoModelForCausalLM`, `AutoModelForImageTextToText`).
        tokenizer (`Any`):
            Its tokenizer, with a chat template; for a vision-language model, its processor.
        temperature (`float`, *optional*, defaults to `0.0`):
            0: greedy; otherwise sampled with `top_p`.
        max_new_tokens (`int`, *optional*, defaults to `256`):
            Tokens generated per turn (capped by the model's context).
        top_p (`float`, *optional*, defaults to `1.0`):
            Nucleus sampling's probability mass, when sampling.
        seed (`int`, *optional*, defaults to `0`):
            Seeds torch's generator once, when generation starts (`None`: not seeded).
        max_batch_size (`int`, *optional*, defaults to `64`):
            At most this many requests per `generate` call.
        batch_wait (`float`, *optional*):
            How long requests are gathered for one `generate` call, at most (`None`: automatic, see `Batcher`).
        name (`str`, *optional*):
            The policy's name in records (default: the model's path).
        chat_template (`str`, *optional*):
            Render with this template; default: the one `GRPOTrainer` trains tools with (else the tokenizer's, logged).
        join_turns (`bool`, *optional*, defaults to `True`):
            Build a later turn's ids as GRPO does; `False` re-renders each turn (can differ from the trained ids).
            Turned off, logged, where TRL cannot build a tool turn with the template.
    """

    @checked_keywords
    def __init__(self, model: Any, tokenizer: Any, *, temperature: float = 0.0, max_new_tokens: int = 256,
                 top_p: float = 1.0, seed: int | None = 0, max_batch_size: int = 64, batch_wait: float | None = None,
                 name: str | None = None, chat_template: str | None = None, join_turns: bool = True) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ConfigurationError("the tokenizer has no chat template; LocalPolicy needs one to render tools")
        if chat_template is not None:
            rendering = Rendering(tokenizer, chat_template=chat_template)
        else:
            try:  # the template GRPOTrainer trains tools with (TRL's training variant of a template it knows)
                rendering = Rendering.for_training(tokenizer)
            except Exception as exc:  # a template TRL has no training variant of, or no TRL
                logger.warning("LocalPolicy renders with the tokenizer's own chat template: the one GRPOTrainer "
                               "trains tools with could not be determined (%s: %s).", type(exc).__name__, exc)
                rendering = Rendering(tokenizer)
        if rendering.parse_error is not None:
            logger.warning("cannot parse tool calls from this model's replies (%s): no response template for its chat "
                           "template; replies are decoded as plain text, so every episode ends after one turn.",
                           rendering.parse_error)
        super().__init__(rendering, Batcher(batch_wait, max_batch=max(1, int(max_batch_size))))
        self.model, self.tokenizer = model, tokenizer
        self.max_new_tokens, self.seed = int(max_new_tokens), seed
        self.sampling: dict[str, Any] = {"do_sample": False} if not temperature > 0 else {  # `generate`'s arguments
            "do_sample": True, "temperature": float(temperature), "top_p": top_p, "top_k": 0}
        config = getattr(model, "config", None)
        self.name = name or getattr(config, "_name_or_path", None) or type(model).__name__
        self.rerender = not join_turns
        limit = getattr(config.get_text_config() if hasattr(config, "get_text_config") else config,
                        "max_position_embeddings", None)
        self.context = limit if isinstance(limit, int) and limit > 0 else None  # the model's context, in tokens
        self._abort, self._lock, self._seeded = threading.Event(), threading.Lock(), False
        self._worker: threading.Thread | None = None

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], *, device: str | None = None, **kwargs: Any) -> LocalPolicy:
        """Load a model and tokenizer from a local directory, never the Hub (with a `preprocessor_config.json`: a
        vision-language model and its processor); a `ConfigurationError` when it holds none, or without torch.

        Args:
            path (`str` or `os.PathLike`):
                The model's directory.
            device (`str`, *optional*):
                Where the model runs (default: `"cuda"` when available, else `"cpu"`).
            **kwargs:
                `LocalPolicy`'s other arguments (`name` defaults to `path`).
        """
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise ConfigurationError(f"{path!r} is not a local model directory. To evaluate a served model, pass "
                                     "OpenAIPolicy(base_url, model) (CLI: --base-url URL --model NAME).")
        try:
            import torch
            import transformers
        except ImportError as exc:
            raise ConfigurationError(f"evaluating a local model needs torch and transformers ({exc}); pip install "
                                     "'ors-trl[trl]'") from None
        vision = os.path.isfile(os.path.join(path, "preprocessor_config.json"))
        loaders = ((transformers.AutoProcessor, transformers.AutoModelForImageTextToText) if vision else
                   (transformers.AutoTokenizer, transformers.AutoModelForCausalLM))
        try:
            tokenizer = loaders[0].from_pretrained(path, local_files_only=True)
            model = loaders[1].from_pretrained(path, local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigurationError(f"cannot load a model and tokenizer from {path!r}: {exc}") from exc
        model.to(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
        model.eval()
        return cls(model, tokenizer, name=kwargs.pop("name", path), **kwargs)

    def __repr__(self) -> str:
        return f"LocalPolicy({self.name!r})"

    description = property(lambda self: str(self.name), doc="The policy's name in records and reports (`name`).")
    tool_markup = property(lambda self: self.rendering.tool_markup,
                           doc="The text that opens a tool call in the chat template's replies.")
    join_turns = property(lambda self: not self.rerender,
                          doc="Whether a later turn's ids are built as GRPO builds them (see `join_turns=`).")
    batch_sizes = property(lambda self: self.batcher.batch_sizes, doc="Requests per `generate` call so far.")

    def start(self, conversation: Conversation) -> None:
        """An episode begins (see `TokenGenerator.start`); the generation worker starts if it is not running.

        Args:
            conversation (`Conversation`):
                The episode's conversation.
        """
        super().start(conversation)
        with self._lock:
            if self._worker is None:
                self._abort.clear()
                self._worker = threading.Thread(target=self._pump, name="ors-trl-local-policy", daemon=True)
                self._worker.start()

    async def respond(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> Reply:
        """The next turn to a conversation given whole (so rendered whole), batched with the other episodes' turns;
        a `PolicyError` when generation or rendering fails (`ContextLengthExceeded`: the context is full).

        Args:
            messages (`list[dict[str, Any]]`):
                The conversation so far (see `Policy.respond`).
            tools (`list[dict[str, Any]]`):
                The tools' JSON schemas.
        """
        conversation = Conversation(None, list(messages), list(tools) or None)  # type: ignore[arg-type]
        self.start(conversation)
        try:
            return await self.reply(conversation)
        finally:
            self.finish(conversation)

    async def aclose(self) -> None:
        """Stop generating (an ongoing `generate` call is aborted) and fail the replies still waited for; the next
        evaluation starts from the same seed."""
        self._abort.set()
        self.batcher.wake()
        worker = self._worker
        if worker is not None:
            await asyncio.to_thread(worker.join, 60)
        self._seeded = False

    def _idle(self) -> bool:
        return self._abort.is_set() or self.batcher.members <= 0

    def _pump(self) -> None:
        """Generate for the waiting episodes until none is left (started again by the next one)."""
        while True:
            batch = self.batcher.take(stop=self._idle)
            if not batch:
                with self._lock:  # `start` counts its episode before it looks for a worker: none is stranded
                    if self._idle():
                        self._worker = None
                        self._renders.clear()  # no episode left: what was rendered for them is not kept
                        return
                continue
            try:
                self._answer(batch)
            except Exception as exc:  # never leave an episode waiting for a reply that cannot come
                error = exc if isinstance(exc, PolicyError) else PolicyError(
                    f"generation failed: {type(exc).__name__}: {exc}")
                self.batcher.give(batch, [error] * len(batch))

    def _extend(self, conversation: Conversation) -> None:
        try:
            super()._extend(conversation)
        except (PolicyError, ORSError):
            raise
        except Exception as exc:
            if conversation.state is None or self.rerender:
                raise PolicyError(f"the chat template failed: {type(exc).__name__}: {exc}") from None
            logger.warning("%s renders every conversation whole from now on (join_turns=False): TRL cannot build a "
                           "turn after tool calls with this chat template (%s: %s).", self.name, type(exc).__name__,
                           exc)
            self.rerender = True
            super()._extend(conversation)

    def _refuse_images(self, what: str) -> None:
        if not self.rendering.takes_images:
            raise PolicyError("the conversation holds an image, and this model's tokenizer takes none: evaluate a "
                              "vision-language model with its processor, or pass OpenRewardSpec(..., "
                              'images="placeholder")')

    def _clip(self, tokens: Tokens, ids: list[int], logprobs: list[float] | None
             ) -> tuple[list[int], list[float] | None, str | None]:
        limit = self.context  # generation stops at the context: a reply that reached it is cut by it
        return ids, logprobs, "context_length" if limit is not None and len(tokens.ids) + len(ids) >= limit else None

    def _fits(self, tokens: Tokens, suffix: list[int]) -> None:
        if self.context is not None and len(tokens.ids) + len(suffix) >= self.context:
            raise ContextLengthExceeded(f"the conversation ({len(tokens.ids) + len(suffix)} tokens) fills the "
                                        f"model's context ({self.context})")

    def _generate_ids(self, tokens: list[Tokens]) -> list[tuple[list[int], list[float] | None]]:
        if not tokens:
            return []
        import torch
        from transformers import StoppingCriteriaList

        tok, limit = self.rendering.tokenizer, self.context
        width = max(len(t.ids) for t in tokens)
        max_new = self.max_new_tokens if limit is None else max(1, min(self.max_new_tokens, limit - width))
        eos_id = tok.eos_token_id
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else eos_id
        device = getattr(self.model, "device", "cpu")
        input_ids = torch.tensor([[pad_id] * (width - len(t.ids)) + t.ids for t in tokens], dtype=torch.long)  # left
        attention = torch.tensor([[0] * (width - len(t.ids)) + [1] * len(t.ids) for t in tokens], dtype=torch.long)
        extra: dict[str, Any] = {}
        if any(t.images for t in tokens):
            fields = image_inputs(self.rendering.processing_class, input_ids.tolist(), [t.images for t in tokens],
                                  self.rendering.image_token_id)
            extra = {k: torch.as_tensor(v).to(device) for k, v in fields.items()}
        if self.seed is not None and not self._seeded:
            torch.manual_seed(self.seed)
            self._seeded = True
        abort = self._abort

        def stop(input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            return torch.full((input_ids.shape[0],), abort.is_set(), dtype=torch.bool, device=input_ids.device)

        with torch.no_grad():
            out = self.model.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                                      max_new_tokens=max_new, eos_token_id=eos_id, pad_token_id=pad_id,
                                      stopping_criteria=StoppingCriteriaList([stop]), **extra, **self.sampling)
        if abort.is_set():
            raise PolicyError("generation aborted")
        results = []
        for row in range(len(tokens)):
            ids = out[row, width:].tolist()
            if eos_id is not None and eos_id in ids:
                ids = ids[: ids.index(eos_id) + 1]
            else:
                while ids and ids[-1] == pad_id:
                    ids.pop()
            results.append((ids, None))
        return results


class RandomPolicy:
    """No model, to try an environment end to end (`ors-trl eval --policy random`): each turn calls a random tool
    offered with arguments drawn from its schema (`random_arguments`; the environment's own checks may still fail it),
    or (by `answer_probability`, or with no tools) answers `answer`. A reply depends on `seed`, the conversation and
    how often it was seen before (so `--repeats` differ), not on the order episodes run in.

    Args:
        seed (`int`, *optional*, defaults to `0`):
            Seeds every choice.
        answer_probability (`float`, *optional*, defaults to `0.2`):
            The chance of a plain-text answer on a turn that offers tools.
        answer (`str`, *optional*, defaults to `"I am done."`):
            The plain-text answer.
    """

    tool_markup = None  # its calls are structured: no text to search for missed ones

    def __init__(self, seed: int = 0, *, answer_probability: float = 0.2, answer: str = "I am done.") -> None:
        if not 0.0 <= answer_probability <= 1.0:
            raise ConfigurationError(f"answer_probability must lie in [0, 1], got {answer_probability!r}")
        self.seed, self.answer_probability, self.answer = seed, answer_probability, answer
        self._seen: Counter[str] = Counter()

    def __repr__(self) -> str:
        return f"RandomPolicy(seed={self.seed})"

    description = property(lambda self: f"random (seed {self.seed})",
                           doc='The policy\'s name in records and reports: `"random (seed N)"`.')

    async def respond(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> Reply:
        """A random tool call, or the plain-text answer (see the class).

        Args:
            messages (`list[dict[str, Any]]`):
                The conversation so far (see `Policy.respond`).
            tools (`list[dict[str, Any]]`):
                The tools' JSON schemas, as the model is shown them.
        """
        key = _conversation_key(messages)
        self._seen[key] += 1
        rng = random.Random(f"{self.seed}:{self._seen[key]}:{key}")
        functions = [t.get("function", t) for t in tools if isinstance(t, dict)]
        functions = [f for f in functions if isinstance(f, dict) and isinstance(f.get("name"), str)]
        if not functions or rng.random() < self.answer_probability:
            return Reply(self.answer)
        function = rng.choice(functions)
        return Reply("", [{"name": function["name"], "arguments": random_arguments(function.get("parameters"), rng)}])


def _conversation_key(messages: list[dict[str, Any]]) -> str:
    """A digest of what a conversation says (roles, text, images' pixels, tool calls; not call ids)."""
    def part(p: dict[str, Any]) -> Any:
        image = p.get("image")
        if image is None or isinstance(image, str):
            return p.get("text", image)
        pixels = image.tobytes() if hasattr(image, "tobytes") else repr(getattr(image, "size", None)).encode()
        return hashlib.sha256(pixels).hexdigest()

    def text(content: Any) -> Any:
        return content if not isinstance(content, list) else [part(p) for p in content if isinstance(p, dict)]

    def call(c: dict[str, Any]) -> Any:
        return [c.get("function", c).get("name"), c.get("function", c).get("arguments")]

    said = [[m.get("role"), text(m.get("content")), [call(c) for c in m.get("tool_calls") or [] if isinstance(c, dict)]]
            for m in messages]
    return hashlib.sha256(json.dumps(said, sort_keys=True, default=str).encode()).hexdigest()


_WORDS = ("alpha", "river", "stone", "cloud", "hello", "piano", "seven", "green")
_MAX_VALUE_DEPTH = 8
_MAX_TEXT = 10_000  # the longest string drawn (a hostile minLength asks for more: the call may then fail)


def random_arguments(schema: Any, rng: random.Random | None = None) -> dict[str, Any]:
    """Arguments drawn at random for a tool's parameters `schema` (a JSON Schema object; anything else: `{}`): every
    required property and about half the others, values of their `type` within `enum`/`const`, `minimum`/`maximum`
    (and the exclusive ones), `minLength`/`maxLength`, `minItems`/`maxItems`, `prefixItems`, `anyOf`/`oneOf` (a non-null
    arm), `allOf` and local `$ref`s; small where unbounded. A `pattern` or `format` is not followed."""
    value = _random_value(schema if isinstance(schema, dict) else {}, rng or random.Random(0), schema, 0)
    return value if isinstance(value, dict) else {}


def _resolve(root: Any, ref: str) -> Any:
    """A local `$ref` (`#/$defs/Name`) in `root`; None where it does not resolve."""
    node = root
    for part in ref.removeprefix("#").split("/")[1:] if ref.startswith("#") else [None]:
        if not isinstance(node, dict) or part is None:
            return None
        node = node.get(part.replace("~1", "/").replace("~0", "~"))
    return node if isinstance(node, dict) else None


def _bound(schema: dict[str, Any], low: str, high: str) -> tuple[Any, Any]:
    """A number keyword pair's values (a bool, another non-number or one past 1e15: unset)."""
    def num(key: str) -> Any:
        value = schema.get(key)
        ok = isinstance(value, int | float) and not isinstance(value, bool) and abs(value) < 1e15  # finite, exact
        return value if ok else None

    return num(low), num(high)


def _random_value(schema: Any, rng: random.Random, root: Any, depth: int) -> Any:
    if not isinstance(schema, dict):
        return rng.choice(_WORDS) if schema is not False else None
    for _ in range(_MAX_VALUE_DEPTH):  # $ref and allOf wrappers, merged (bounded: a reference cycle stops)
        ref, every = schema.get("$ref"), schema.get("allOf")
        if isinstance(ref, str):
            schema = {**(_resolve(root, ref) or {}), **{k: v for k, v in schema.items() if k != "$ref"}}
        elif isinstance(every, list):
            merged = {k: v for k, v in schema.items() if k != "allOf"}
            for arm in every:
                merged.update(arm if isinstance(arm, dict) else {})
            schema = merged
        else:
            break
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return rng.choice(schema["enum"])
    arms = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(arms, list) and arms and depth < _MAX_VALUE_DEPTH:
        real = [a for a in arms if not (isinstance(a, dict) and a.get("type") == "null")] or arms
        rest = {k: v for k, v in schema.items() if k not in ("anyOf", "oneOf")}
        return _random_value({**rest, **(a if isinstance(a := rng.choice(real), dict) else {})}, rng, root, depth + 1)
    kinds = schema.get("type")
    kinds = [k for k in (kinds if isinstance(kinds, list) else [kinds]) if isinstance(k, str)]
    kind = rng.choice([k for k in kinds if k != "null"] or kinds or [
        "object" if "properties" in schema else "array" if "items" in schema or "prefixItems" in schema else "string"])
    if kind == "null":
        return None
    if kind == "boolean":
        return rng.random() < 0.5
    if kind in ("integer", "number"):
        low, high = _bound(schema, "minimum", "maximum")
        above, below = _bound(schema, "exclusiveMinimum", "exclusiveMaximum")
        step = 1 if kind == "integer" else 1e-3
        low = max([b for b in (low, None if above is None else above + step) if b is not None], default=None)
        high = min([b for b in (high, None if below is None else below - step) if b is not None], default=None)
        # unbounded: small and positive (a count, a size: what an unwritten `>= 1` most often asks)
        if low is None:
            low = (step if kind == "number" else 1) if high is None or high >= 1 else 0 if high >= 0 else high - 9
        high = high if high is not None and high >= low else low + 9
        if kind == "integer":
            low, high = int(-(-low // 1)), int(high // 1)
            return rng.randint(low, max(low, high))
        return round(rng.uniform(low, high), 3) if high - low > 2e-3 else low
    if kind == "string":
        low, high = _bound(schema, "minLength", "maxLength")
        word, low = rng.choice(_WORDS), min(max(0, int(low or 0)), _MAX_TEXT)
        text = word * (1 + low // len(word))
        return text[:max(low, len(word)) if high is None else max(0, min(max(low, len(word)), int(high)))]
    if depth >= _MAX_VALUE_DEPTH:
        return [] if kind == "array" else {}
    if kind == "array":
        low, high = _bound(schema, "minItems", "maxItems")
        prefix = schema.get("prefixItems") if isinstance(schema.get("prefixItems"), list) else []
        out = [_random_value(p, rng, root, depth + 1) for p in prefix]
        items = schema.get("items")
        if items is not False and not (prefix and items is None):
            low = max(int(low or 0), len(out), 0 if prefix else 1)
            count = min(rng.randint(low, low + 2), int(high) if high is not None else low + 2)
            out += [_random_value(items if isinstance(items, dict) else {}, rng, root, depth + 1)
                    for _ in range(max(0, count - len(out)))]
        return out
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = [k for k in schema.get("required") or [] if isinstance(k, str)]
    keys = [k for k in properties if k in required or rng.random() < 0.5]
    keys += [k for k in required if k not in properties]
    return {k: _random_value(properties.get(k, {}), rng, root, depth + 1) for k in keys}


def resolve_policy(policy: Any, options: Any) -> Any:
    """The policy object for a local model directory or a `(model, tokenizer)` pair (loaded with the generation
    settings of `options`, an `EvalOptions`), or a `Policy`."""
    local_kwargs: dict[str, Any] = {"temperature": options.temperature, "seed": options.seed}
    if options.max_new_tokens is not None:
        local_kwargs["max_new_tokens"] = options.max_new_tokens
    if isinstance(policy, str | os.PathLike):
        return LocalPolicy.from_pretrained(policy, device=options.device, **local_kwargs)
    if isinstance(policy, tuple) and len(policy) == 2:
        return LocalPolicy(policy[0], policy[1], **local_kwargs)
    if callable(getattr(policy, "respond", None)):
        return policy
    raise ConfigurationError(f"cannot evaluate {type(policy).__name__}: pass a local model directory, a (model, "
                             "tokenizer) pair, an OpenAIPolicy, or an object with `async respond(messages, tools) -> "
                             "PolicyReply`.")


@dataclass
class Responder:
    """A `Policy` (`respond(messages, tools)`) as a generator (`ors_trl.core.rollout`); what it raises, other than an
    ors-trl error, is the policy's failure (`PolicyError`)."""

    policy: Any

    async def reply(self, conversation: Conversation) -> Reply:
        started = time.monotonic()
        try:
            reply = await self.policy.respond(conversation.messages, conversation.tools or [])
        except ORSError:
            raise
        except Exception as exc:
            raise PolicyError(f"{type(exc).__name__}: {exc}") from exc
        if not isinstance(reply, Reply):
            raise PolicyError(f"respond() returned {type(reply).__name__}, not a Reply (PolicyReply)")
        if reply.seconds is None:
            reply.seconds = round(time.monotonic() - started, 4)
        return reply


def as_generator(policy: Any) -> Any:
    """`policy` as a generator: itself when it is one (`LocalPolicy`), else its `respond` (`Responder`)."""
    return policy if callable(getattr(policy, "reply", None)) else Responder(policy)


def describe_policy(policy: Any) -> str:
    """A policy's name for records and reports."""
    return str(getattr(policy, "description", None) or repr(policy))
