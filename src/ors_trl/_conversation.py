"""Conversations both ways: an ORS prompt into chat messages for the model, a rollout back into ORS messages.

Into the model: a `/messages` conversation keeps its roles (the system turn becomes the chat's
system message; tool calls and results map to the chat fields transformers' templates read:
`tool_calls`, `role: "tool"`, `reasoning_content`); `/prompt` blocks are one user turn. TRL's own
loop can only append text to the dataset's last user message, so there the whole conversation is
flattened to text with every word kept (`Prompt.flat`).

Back to the environment: a rollout's turns become the `[Message]` transcript `/score_group` judges,
using only the block types the server accepts (others are rendered as text, never dropped).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ._types import (
    Block,
    Message,
    ReasoningBlock,
    TextBlock,
    ToolCallBlock,
    ToolResultBlock,
    block_text,
    blocks_text,
)

__all__ = ["Prompt", "transcript"]


@dataclass(frozen=True)
class Prompt:
    """A task's prompt: the text of its system turns (None if none) and its other turns, roles kept."""

    system: str | None
    messages: tuple[Message, ...]

    @classmethod
    def from_blocks(cls, blocks: list[Block]) -> Prompt:
        """A `/prompt` answer: one user turn."""
        return cls(None, (Message("user", blocks),))

    @classmethod
    def from_messages(cls, messages: Iterable[Message]) -> Prompt:
        """A `/messages` answer: system turns apart, the rest in order."""
        messages = list(messages)
        system = [m.text for m in messages if m.role == "system"]
        return cls("\n\n".join(system) if system else None, tuple(m for m in messages if m.role != "system"))

    @property
    def text(self) -> str:
        """The non-system turns as text: a lone user turn verbatim, several with a `[role]` header each."""
        if len(self.messages) == 1 and self.messages[0].role == "user":
            return self.messages[0].text
        return "\n\n".join(f"[{m.role}]\n{m.text}" for m in self.messages)

    @property
    def flat(self) -> str:
        """Everything as one text (system turn first): what TRL's `reset()` can hand the model, every word kept."""
        return f"{self.system}\n\n{self.text}" if self.system else self.text

    def chat(self, base: Sequence[Mapping[str, Any]] = ()) -> list[dict[str, Any]]:
        """Chat messages for the model: `base` (the dataset row's prompt) with this prompt merged in.

        The system turn becomes (or joins) the system message; a first user turn joins the dataset's
        trailing user message, as TRL's `reset()` text does; later turns follow with their roles.
        """
        out = [dict(m) for m in base]
        if self.system:
            if out and out[0].get("role") == "system":
                out[0]["content"] = _join(out[0].get("content"), self.system)
            else:
                out.insert(0, {"role": "system", "content": self.system})
        turns = [chat for m in self.messages for chat in _chat(m)]
        if turns and turns[0]["role"] == "user" and out and out[-1].get("role") == "user":
            out[-1]["content"] = _append(out[-1].get("content", ""), turns.pop(0)["content"])
        return out + turns


def _join(first: Any, second: str) -> Any:
    return second if not first else _append(first, "\n\n" + second)


def _append(content: Any, text: str) -> Any:
    if isinstance(content, str):
        return content + text
    return [*content, {"type": "text", "text": text}]


def _chat(message: Message) -> list[dict[str, Any]]:
    """One ORS message as chat messages (a user turn's tool results become `tool` messages before its text)."""
    if message.role == "assistant":
        out: dict[str, Any] = {"role": "assistant",
                               "content": blocks_text([b for b in message.blocks if _plain(b)])}
        calls = [b for b in message.blocks if isinstance(b, ToolCallBlock)]
        if calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.input}}
                                 for c in calls]
        reasoning = [b.text for b in message.blocks if isinstance(b, ReasoningBlock)]
        if reasoning:
            out["reasoning_content"] = "\n".join(reasoning)
        return [out]
    tools = [{"role": "tool", "tool_call_id": b.tool_call_id,
              "content": ("[error] " if b.is_error else "") + blocks_text(b.blocks)}
             for b in message.blocks if isinstance(b, ToolResultBlock)]
    rest = [b for b in message.blocks if not isinstance(b, ToolResultBlock)]
    return tools + ([{"role": message.role, "content": blocks_text(rest)}] if rest or not tools else [])


def _plain(block: Block) -> bool:
    return not isinstance(block, ToolCallBlock | ReasoningBlock)


def transcript(prompt: Prompt | None, turns: Sequence[Mapping[str, Any]], final: str | None,
               block_types: Sequence[str] | None) -> list[Message]:
    """A rollout as the `[Message]` transcript `/score_group` judges: the prompt's turns, each model turn (text
    and tool calls), the tool results, and the final plain message. Block types the server does not accept
    (`block_types`, default text and image) are rendered as text blocks."""
    allowed = set(block_types or ("text", "image"))

    def keep(blocks: list[Block]) -> list[Block]:
        return [b if b.type in allowed else TextBlock(block_text(b)) for b in blocks]

    out: list[Message] = []
    if prompt is not None:
        if prompt.system:
            out.append(Message("system", [TextBlock(prompt.system)]))
        out += [Message(m.role, keep(list(m.blocks))) for m in prompt.messages]
    for turn in turns:
        calls = turn.get("tool_calls") or []
        blocks: list[Block] = [TextBlock(turn["assistant"])] if turn.get("assistant") else []
        blocks += [ToolCallBlock(str(c.get("id") or f"call_{turn.get('index', 0)}_{k}"), str(c.get("name")),
                                 c["arguments"] if isinstance(c.get("arguments"), dict) else {"raw": c.get("arguments")})
                   for k, c in enumerate(calls)]
        if blocks:
            out.append(Message("assistant", keep(blocks)))
        results: list[Block] = [
            ToolResultBlock(str(c.get("id") or f"call_{turn.get('index', 0)}_{k}"),
                            [TextBlock(str(c.get("output", "")))], is_error="error" in c)
            for k, c in enumerate(calls) if "output" in c
        ]
        if results:
            out.append(Message("user", keep(results)))
    if final:
        out.append(Message("assistant", [TextBlock(final)]))
    return out
