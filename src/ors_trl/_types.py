"""Plain data types for what an ORS server returns: blocks, tool specs, tool results, splits.

Parsing is strict where a wrong value would corrupt training (a reward that is not a finite
number is a protocol error, not a silent 0.0) and lenient where nothing is lost (an unknown
block type is kept, with a placeholder in the text view).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ._exceptions import ProtocolError

__all__ = [
    "Block",
    "ImageBlock",
    "Split",
    "TextBlock",
    "ToolList",
    "ToolResult",
    "ToolSpec",
    "UnknownBlock",
    "blocks_text",
    "parse_blocks",
]


@dataclass(frozen=True, slots=True)
class TextBlock:
    """A text block: `{"type": "text", "text": ..., "detail": ...}`."""

    text: str
    detail: dict[str, Any] | None = None
    type: str = "text"


@dataclass(frozen=True, slots=True)
class ImageBlock:
    """An image block; `data` is base64 without a `data:` prefix."""

    data: str
    mime_type: str
    detail: dict[str, Any] | None = None
    type: str = "image"

    def data_url(self) -> str:
        """The image as a `data:` URL, the form chat templates and OpenAI-style APIs accept."""
        return f"data:{self.mime_type};base64,{self.data}"

    def __repr__(self) -> str:  # base64 payloads are long; keep reprs readable
        return f"ImageBlock(mime_type={self.mime_type!r}, data=<{len(self.data)} chars>)"


@dataclass(frozen=True, slots=True)
class UnknownBlock:
    """A block of a type this client does not know; kept as received."""

    type: str
    raw: dict[str, Any] = field(default_factory=dict)


Block = TextBlock | ImageBlock | UnknownBlock


def parse_blocks(value: Any, *, where: str) -> list[Block]:
    """Parse a JSON list of blocks, raising `ProtocolError` for shapes that cannot be blocks."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ProtocolError(f"{where}: expected a list of blocks, got {type(value).__name__}")
    out: list[Block] = []
    for i, raw in enumerate(value):
        if not isinstance(raw, dict):
            raise ProtocolError(f"{where}: block {i} is {type(raw).__name__}, not an object")
        btype = raw.get("type", "text" if "text" in raw else None)
        detail = raw.get("detail") if isinstance(raw.get("detail"), dict) else None
        if btype == "text":
            text = raw.get("text")
            if not isinstance(text, str):
                raise ProtocolError(f"{where}: text block {i} has no string 'text'")
            out.append(TextBlock(text=text, detail=detail))
        elif btype == "image":
            data = raw.get("data")
            mime = raw.get("mimeType", raw.get("mime_type"))
            if not isinstance(data, str) or not isinstance(mime, str):
                raise ProtocolError(f"{where}: image block {i} needs string 'data' and 'mimeType'")
            out.append(ImageBlock(data=data, mime_type=mime, detail=detail))
        else:
            out.append(UnknownBlock(type=str(btype), raw=raw))
    return out


def blocks_text(blocks: list[Block]) -> str:
    """The text a language model sees for a list of blocks.

    Text blocks are joined with newlines; an image becomes `[image: image/png]` and an unknown
    block `[unsupported block: TYPE]`, so the model is told something was there.
    """
    parts: list[str] = []
    for b in blocks:
        if isinstance(b, TextBlock):
            parts.append(b.text)
        elif isinstance(b, ImageBlock):
            parts.append(f"[image: {b.mime_type}]")
        else:
            parts.append(f"[unsupported block: {b.type}]")
    return "\n".join(parts)


@dataclass(frozen=True, slots=True)
class Split:
    """A task split, e.g. `Split("train", "train")`."""

    name: str
    type: str


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A tool as the environment advertises it: name, description, JSON Schema of its input."""

    name: str
    description: str = ""
    input_schema: dict[str, Any] | None = None

    @classmethod
    def from_json(cls, raw: Any) -> ToolSpec:
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
            raise ProtocolError(f"tool spec must be an object with a string 'name', got {raw!r:.200}")
        schema = raw.get("input_schema")
        if schema is not None and not isinstance(schema, dict):
            raise ProtocolError(f"tool {raw['name']!r}: input_schema must be an object or null")
        desc = raw.get("description")
        return cls(name=raw["name"], description=desc if isinstance(desc, str) else "", input_schema=schema)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "input_schema": self.input_schema}


@dataclass(frozen=True, slots=True)
class ToolList:
    """The answer of `/tools` or `/task_tools`."""

    tools: list[ToolSpec]
    terminal_tool: dict[str, Any] | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, raw: Any, *, where: str) -> ToolList:
        if isinstance(raw, list):  # tolerate servers answering a bare list
            raw = {"tools": raw}
        if not isinstance(raw, dict) or not isinstance(raw.get("tools"), list):
            raise ProtocolError(f"{where}: expected {{'tools': [...]}}")
        terminal = raw.get("terminal_tool")
        return cls(
            tools=[ToolSpec.from_json(t) for t in raw["tools"]],
            terminal_tool=terminal if isinstance(terminal, dict) else None,
            raw=raw,
        )

    def names(self) -> list[str]:
        return [t.name for t in self.tools]


def _parse_reward(value: Any, *, tool: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ProtocolError(f"tool {tool!r} returned a non-numeric reward {value!r:.100}")
    try:
        reward = float(value)
    except ValueError:
        raise ProtocolError(f"tool {tool!r} returned a non-numeric reward {value!r:.100}") from None
    if not math.isfinite(reward):
        raise ProtocolError(f"tool {tool!r} returned a non-finite reward {value!r}")
    return reward


@dataclass(frozen=True, slots=True)
class ToolResult:
    """What a successful tool call returned.

    Attributes:
        blocks: the output blocks (text, images, unknown kinds kept as-is).
        reward: the step reward, or None when this call was not scored.
        finished: True once the episode is over; later calls in the session are refused.
        metadata: the environment's free-form metadata for this call, or None.
        task_id: the server's id for this call (used to resume a dropped stream).
    """

    blocks: list[Block]
    reward: float | None = None
    finished: bool = False
    metadata: dict[str, Any] | None = None
    task_id: str | None = None

    @property
    def text(self) -> str:
        return blocks_text(self.blocks)

    @classmethod
    def from_output(cls, output: Any, *, tool: str, task_id: str | None = None) -> ToolResult:
        if not isinstance(output, dict):
            raise ProtocolError(f"tool {tool!r}: 'output' must be an object")
        metadata = output.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            metadata = {"value": metadata}
        return cls(
            blocks=parse_blocks(output.get("blocks"), where=f"tool {tool!r} output"),
            reward=_parse_reward(output.get("reward"), tool=tool),
            finished=bool(output.get("finished", False)),
            metadata=metadata,
            task_id=task_id,
        )
