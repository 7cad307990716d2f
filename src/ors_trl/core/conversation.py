"""Conversations both ways: an ORS prompt into chat messages for the model, a rollout back into ORS messages.

Into the model: `/messages` keep their roles (system, `tool_calls`, `role: "tool"`, `reasoning_content`), `/prompt`
blocks are one user turn, and TRL's own loop gets it all flattened, every word kept (`Prompt.flat`). An image block
becomes an image part (`{"type": "image", "image": <RGB PIL image>}`), or its placeholder text where it cannot be
shown. Back: a rollout becomes the `[Message]` transcript `/score_group` judges (unaccepted block types as text).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..protocol import images as _images
from ..protocol.errors import ImageError
from ..protocol.types import (
    Block,
    ImageBlock,
    Message,
    ReasoningBlock,
    TextBlock,
    ToolCallBlock,
    ToolResultBlock,
    block_text,
    blocks_text,
)

__all__ = ["Prompt", "assistant_message", "content", "images_of", "transcript"]

#: What `content` gives a model: a text, or content parts (`{"type": "text"|"image", ...}`) where an image is shown.
Content = str | list[dict[str, Any]]


def _pieces(blocks: Sequence[Block], images: bool, view: bool = False) -> list[str | dict[str, Any]]:
    """`blocks` as pieces of text and image parts (separated as `blocks_text` separates them), as `content` says."""
    out: list[str | dict[str, Any]] = []
    for i, block in enumerate(blocks):
        if i:
            out.append("\n")
        if not images or not isinstance(block, ImageBlock):
            out.append(block_text(block))
            continue
        try:
            image = None if view and block.info().error is None else block.image()
        except ImageError:
            out.append(_images.placeholder(block.info()))
        else:
            out.append(block_text(block) if image is None else {"type": "image", "image": image})
    return out


def _merge(pieces: Iterable[str | dict[str, Any]]) -> Content:
    """Pieces as one text, or, when an image part is among them, as content parts (adjacent text joined)."""
    pieces = list(pieces)
    if all(isinstance(p, str) for p in pieces):
        return "".join(pieces)  # type: ignore[arg-type]
    out: list[dict[str, Any]] = []
    for piece in pieces:
        if isinstance(piece, dict):
            out.append(piece)
        elif piece and out and out[-1]["type"] == "text":
            out[-1] = {"type": "text", "text": out[-1]["text"] + piece}
        elif piece:
            out.append({"type": "text", "text": piece})
    return out


def content(blocks: Sequence[Block], *, images: bool = True, view: bool = False, prefix: str = "") -> Content:
    """What a model reads for `blocks`: their text, or with `images` and an image that can be shown, content parts
    (else its placeholder or `[image: ...]` marker); `view`: the text a record keeps (an image as its marker)."""
    return _merge([prefix, *_pieces(blocks, images, view)])


def assistant_message(reply: Any, ids: Sequence[str]) -> dict[str, Any]:
    """A reply (`Reply`) as the chat message that follows it in the conversation, its calls under `ids`."""
    calls = [call.chat(i) for call, i in zip(reply.tool_calls, ids, strict=True)]
    return _assistant(reply.content or "", calls, getattr(reply, "reasoning", None))


def _assistant(text: str, calls: list[dict[str, Any]], reasoning: str | None) -> dict[str, Any]:
    """The one shape of an assistant chat message: an endpoint's reasoning stays in the history, as training keeps it."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message


def images_of(messages: Iterable[Mapping[str, Any]]) -> list[Any]:
    """The images of chat messages' image parts, in order (the order of their image tokens once rendered)."""
    return [part["image"] for m in messages if isinstance(m.get("content"), list) for part in m["content"]
            if isinstance(part, Mapping) and part.get("type") == "image" and "image" in part]


@dataclass(frozen=True)
class Prompt:
    """A task's prompt: the text of its system turns (None if none) and its other turns, roles kept; `images`: whether
    its images reach the model as image parts (`content`, `chat`), the environment's choice (`images=` of a spec)."""

    system: str | None
    messages: tuple[Message, ...]
    images: bool = True

    @classmethod
    def from_blocks(cls, blocks: list[Block], *, images: bool = True) -> Prompt:
        """A `/prompt` answer: one user turn."""
        return cls(None, (Message("user", blocks),), images)

    @classmethod
    def from_messages(cls, messages: Iterable[Message], *, images: bool = True) -> Prompt:
        """A `/messages` answer: system turns apart, the rest in order."""
        messages = list(messages)
        system = [m.text for m in messages if m.role == "system"]
        return cls("\n\n".join(system) if system else None, tuple(m for m in messages if m.role != "system"), images)

    def _turns(self, images: bool) -> list[str | dict[str, Any]]:
        if len(self.messages) == 1 and self.messages[0].role == "user":
            return _pieces(self.messages[0].blocks, images)
        out: list[str | dict[str, Any]] = []
        for i, m in enumerate(self.messages):
            out += ["\n\n" if i else "", f"[{m.role}]\n", *_pieces(m.blocks, images)]
        return out

    @property
    def text(self) -> str:
        """The non-system turns as text: a lone user turn verbatim, several with a `[role]` header each."""
        return _merge(self._turns(False))  # type: ignore[return-value]

    @property
    def flat(self) -> str:
        """Everything as one text (system turn first): what TRL's `reset()` can hand the model, every word kept."""
        return self.content(images=False)  # type: ignore[return-value]

    def content(self, *, images: bool | None = None) -> Content:
        """`flat`, with its images as image parts (`images`, default the prompt's own)."""
        return _merge([*((self.system, "\n\n") if self.system else ()), *self._turns(self.images if images is None
                                                                                     else images)])

    def chat(self, base: Sequence[Mapping[str, Any]] = (), *, images: bool | None = None) -> list[dict[str, Any]]:
        """Chat messages: `base` (the dataset row's prompt) with this prompt merged in: the system turn joins the
        system message, a first user turn the trailing user message (as TRL's `reset()` does), later turns follow;
        `images` (default the prompt's own): image parts (`content`)."""
        out = [dict(m) for m in base]
        if self.system:
            if out and out[0].get("role") == "system":
                first = out[0].get("content")
                out[0]["content"] = _append(first, "\n\n" + self.system) if first else self.system
            else:
                out.insert(0, {"role": "system", "content": self.system})
        turns = [chat for m in self.messages for chat in _chat(m, self.images if images is None else images)]
        if turns and turns[0]["role"] == "user" and out and out[-1].get("role") == "user":
            out[-1]["content"] = _append(out[-1].get("content", ""), turns.pop(0)["content"])
        return out + turns


def _append(content: Any, more: Content) -> Any:
    """Content with more after it (parts as TRL's `reset()` joins them: a text becomes one text part)."""
    if isinstance(content, str) and isinstance(more, str):
        return content + more
    return [*_as_parts(content), *_as_parts(more)]


def _as_parts(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else [{"type": "text", "text": value}]


def _chat(message: Message, images: bool) -> list[dict[str, Any]]:
    """One ORS message as chat messages (a user turn's tool results become `tool` messages before its text)."""
    if message.role == "assistant":
        text = blocks_text([b for b in message.blocks if not isinstance(b, ToolCallBlock | ReasoningBlock)])
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
                 for b in message.blocks if isinstance(b, ToolCallBlock)]
        return [_assistant(text, calls, "\n".join(b.text for b in message.blocks if isinstance(b, ReasoningBlock)))]
    tools = [{"role": "tool", "tool_call_id": b.tool_call_id,
              "content": content(b.blocks, images=images, prefix="[error] " if b.is_error else "")}
             for b in message.blocks if isinstance(b, ToolResultBlock)]
    rest = [b for b in message.blocks if not isinstance(b, ToolResultBlock)]
    return tools + ([{"role": message.role, "content": content(rest, images=images)}] if rest or not tools else [])


def transcript(prompt: Prompt | None, turns: Sequence[Mapping[str, Any]], final: str | None,
               block_types: Sequence[str] | None) -> list[Message]:
    """A rollout as the `[Message]` transcript `/score_group` judges (prompt, model turns, tool results, final
    message); block types not in `block_types` (default text and image) become text blocks."""
    allowed = set(block_types or ("text", "image"))

    def keep(blocks: list[Block]) -> list[Block]:
        return [b if b.type in allowed and not (isinstance(b, ImageBlock) and b.info().error) else
                TextBlock(block_text(b)) for b in blocks]

    out: list[Message] = []
    if prompt is not None:
        if prompt.system:
            out.append(Message("system", [TextBlock(prompt.system)]))
        out += [Message(m.role, keep(list(m.blocks))) for m in prompt.messages]
    for turn in turns:
        calls = turn.get("tool_calls") or []
        ids = [str(c.get("id") or f"call_{turn.get('index', 0)}_{k}") for k, c in enumerate(calls)]
        blocks: list[Block] = [TextBlock(turn["assistant"])] if turn.get("assistant") else []
        blocks += [ToolCallBlock(i, str(c.get("name")), c["arguments"] if isinstance(c.get("arguments"), dict)
                                 else {"raw": c.get("arguments")}) for i, c in zip(ids, calls, strict=True)]
        if blocks:
            out.append(Message("assistant", keep(blocks)))
        results: list[Block] = [ToolResultBlock(i, [TextBlock(str(c.get("output", "")))], is_error="error" in c)
                                for i, c in zip(ids, calls, strict=True) if "output" in c]
        if results:
            out.append(Message("user", keep(results)))
    if final and not (out and out[-1].role == "assistant" and out[-1].text == final):  # not the last reply again
        out.append(Message("assistant", [TextBlock(final)]))
    return out
