"""One construction of a rollout's token ids (design decision 14) and the generator built on it: the prompt rendered
once with the tools, each reply's ids as generated, each turn's tool results as TRL's tool suffix (masked out of the
loss). The engine trains on these ids and `LocalPolicy` is evaluated on the same: they agree by construction."""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core.conversation import images_of
from ..core.episode import Reply
from ..core.records import token_fidelity
from ..core.rollout import Batcher, Conversation
from .backend import Rendering

__all__ = ["TokenGenerator", "Tokens", "fidelity"]

logger = logging.getLogger("ors_trl")


@dataclass(slots=True, eq=False)
class Tokens:
    """One rollout's ids: `prompt_ids`, `completion_ids` with their `mask` (1: generated, 0: tool result) and `logprobs`
    (None once a generation gave none), `images`, `shown` (messages in the ids); `earlier`, `masked`: tokens earlier
    renders generated and how many of them a later render changed (see `fidelity`)."""

    prompt_ids: list[int]
    images: list[Any]
    shown: int
    earlier: int = 0
    masked: int = 0
    completion_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] | None = field(default_factory=list)

    @property
    def ids(self) -> list[int]:
        """Everything so far: the next generation's input."""
        return self.prompt_ids + self.completion_ids

    def add(self, ids: Sequence[int], logprobs: Sequence[float] | None = None, *, generated: bool = True) -> None:
        """Append generated ids (with their logprobs) or, `generated=False`, a tool suffix."""
        self.completion_ids += ids
        self.mask += [int(generated)] * len(ids)
        if self.logprobs is not None and (logprobs is not None or not generated):
            self.logprobs += list(logprobs) if generated and logprobs is not None else [0.0] * len(ids)
        else:
            self.logprobs = None


def fidelity(conversation: Conversation) -> dict[str, Any] | None:
    """An episode's token fidelity (`Episode.tokens`; `core.records.token_fidelity`), None where its generator built
    no ids."""
    tokens: Tokens | None = conversation.state
    if tokens is None:
        return None
    rows = len(getattr(conversation, "rows", None) or [tokens])
    return token_fidelity(tokens.earlier + sum(tokens.mask), tokens.masked, rows)


def _drift(old: Tokens, prompt: list[int]) -> int:
    """How many generated tokens of `old` a fresh render of the conversation (`prompt`) does not keep as they were."""
    ids, n = old.ids, len(old.prompt_ids)
    same = next((k for k, (a, b) in enumerate(zip(ids, prompt, strict=False)) if a != b), min(len(ids), len(prompt)))
    return sum(old.mask[max(same - n, 0):])


class TokenGenerator:
    """A batched generator of token ids (`Tokens`): a kind provides `_generate_ids` and may override `_fits`, `_clip`,
    `_refuse_images` and `rerender`. Rendering and parsing run on the pump's thread (`_answer`), not the event loop."""

    rerender = False
    #: Renders kept for equal inputs (a group's rollouts share them), oldest dropped first.
    max_renders = 512

    def __init__(self, rendering: Rendering, batcher: Batcher) -> None:
        self.rendering, self.batcher = rendering, batcher
        self._renders: OrderedDict[str, list[int]] = OrderedDict()
        self._warned = False
        self._order: dict[int, int] = {}  # each playing conversation's place in a batch's rows

    def start(self, conversation: Conversation) -> None:
        """An episode begins (`play` calls it): one more that may ask, which batches wait for.

        Args:
            conversation (`Conversation`):
                The episode's conversation.
        """
        self._order[id(conversation)] = self.batcher.enter()

    def finish(self, conversation: Conversation) -> None:
        """The episode ended (`play` calls it): batches no longer wait for it.

        Args:
            conversation (`Conversation`):
                The episode's conversation.
        """
        self._order.pop(id(conversation), None)
        self.batcher.leave()

    async def reply(self, conversation: Conversation) -> Reply:
        """The model's next reply, generated in a batch with the other episodes waiting for theirs.

        Args:
            conversation (`Conversation`):
                The episode's conversation; its ids are built (or extended) as GRPO builds them.
        """
        return await self.batcher.ask(conversation, self._order.get(id(conversation), 0))

    def _answer(self, batch: Sequence[Any]) -> None:
        """Generate for a batch (`Batcher.take`); answer each request with its `Reply` or the exception ending it."""
        results: list[Any] = [None] * len(batch)
        live = []
        for i, request in enumerate(batch):
            try:
                self._extend(request.item)
                live.append(i)
            except Exception as exc:  # a stop, a budget, an image the model cannot take: that episode's alone
                results[i] = exc
        started = time.monotonic()
        outs = self._generate_ids([batch[i].item.state for i in live])
        seconds = time.monotonic() - started
        for i, (ids, logprobs) in zip(live, outs, strict=True):
            results[i] = self._parse(batch[i].item, ids, logprobs, seconds)
        self.batcher.give(batch, results, seconds)

    def _extend(self, conversation: Conversation) -> None:
        """Bring the ids up to date: the prompt rendered the first time, else the tool results as TRL's tool suffix."""
        tokens: Tokens | None = conversation.state
        messages = conversation.messages
        if tokens is None or self.rerender:
            images = images_of(messages)
            if images:
                self._refuse_images(f"The prompt of task {conversation.episode.task.key}")
            prompt = self._prompt_ids(messages, conversation.tools)
            conversation.state = Tokens(prompt, images, len(messages))
            if tokens is not None:  # re-rendered: what it changed of the generated tokens is no longer what was trained
                conversation.state.earlier = tokens.earlier + sum(tokens.mask)
                conversation.state.masked = tokens.masked + _drift(tokens, prompt)
                if conversation.state.masked and not self._warned:  # said once: the history differs from training's
                    self._warned = True
                    logger.warning("re-rendering the conversation changed %d generated token(s) of episode %s's "
                                   "history (a chat template that rewrites earlier turns, e.g. drops reasoning): the "
                                   "model now sees a history training never builds; records carry it as tokens.masked",
                                   conversation.state.masked,
                                   conversation.episode.task.key if conversation.episode is not None else "?")
            self._fits(conversation.state, [])
            return
        shown = [m for m in messages[tokens.shown:] if m.get("role") == "tool"]
        tokens.shown = len(messages)
        trl_shaped = [{"role": "tool", "name": m["name"], "content": m["content"]} for m in shown]  # as TRL appends
        suffix = self._render(["tools", trl_shaped], lambda: self.rendering.tool_suffix_ids(trl_shaped))
        self._fits(tokens, suffix)
        images = images_of(shown)
        if images:
            self._refuse_images(f"The output of a {conversation.episode.env.name} tool")
        tokens.add(suffix, generated=False)
        tokens.images += images

    def _parse(self, conversation: Conversation, ids: list[int], logprobs: list[float] | None,
              seconds: float) -> Reply:
        """A completion as the reply TRL parses it to; its ids join the conversation's."""
        tokens: Tokens = conversation.state
        prefix = tokens.ids
        ids, logprobs, cut = self._clip(tokens, ids, logprobs)  # cut: None, or the limit that cut the reply
        tokens.add(ids, logprobs)
        eos = self.rendering.eos_token_ids
        parsed = self.rendering.parse(ids, prefix, conversation.tools)
        content = parsed.get("content")
        return Reply(content if isinstance(content, str) else None, parsed.get("tool_calls") or (),
                     truncated=bool(cut) or (bool(eos) and (not ids or ids[-1] not in eos)), limit=cut or "length",
                     raw=self.rendering.tokenizer.decode(ids, skip_special_tokens=False) if ids else None,
                     seconds=round(seconds, 4))

    def _prompt_ids(self, messages: list[dict[str, Any]], tools: Any) -> list[int]:
        return self._render(["prompt", messages, tools], lambda: self.rendering.prompt_ids(messages, tools))

    def _render(self, key: list[Any], render: Any) -> list[int]:
        """Tokens from `render()`, computed once for equal inputs (tokenizing dominates the pump)."""
        text = json.dumps(key, sort_keys=True, default=repr)
        if text not in self._renders:
            self._renders[text] = render()
        self._renders.move_to_end(text)
        while len(self._renders) > self.max_renders:
            self._renders.popitem(last=False)
        return list(self._renders[text])

    def _generate_ids(self, tokens: list[Tokens]) -> list[tuple[list[int], list[float] | None]]:
        """One completion per rollout's ids (with its logprobs, or None)."""
        raise NotImplementedError

    def _fits(self, tokens: Tokens, suffix: list[int]) -> None:
        """Raise `StopEpisode` (or `ContextLengthExceeded`) when the tool suffix (`[]`: after the prompt) may not go."""

    def _clip(self, tokens: Tokens, ids: list[int], logprobs: list[float] | None
             ) -> tuple[list[int], list[float] | None, str | None]:
        """A reply kept within a budget: its ids, logprobs and the limit that cut them, or None."""
        return ids, logprobs, None

    def _refuse_images(self, what: str) -> None:
        """Raise when the model cannot take the images `what` holds."""
