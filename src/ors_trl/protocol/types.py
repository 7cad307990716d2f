"""Plain data types for what an ORS server returns, parsed strictly where a wrong value would corrupt training (a
reward that is no finite number is a protocol error, not 0.0), leniently where nothing is lost (an unknown block is
kept); what a server sends is bounded (`MAX_*`): a twenty-byte answer must not cost gigabytes."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from . import images
from .errors import ImageError, ProtocolError
from .text import cut, json_size, show_name

__all__ = ["MAX_ENVIRONMENTS", "MAX_REWARD", "MAX_SPLITS", "MAX_TASK_COUNT", "MAX_TOOLS", "MAX_TOOLS_SIZE",
           "MAX_TOOL_SIZE", "Block", "GroupScore", "ImageBlock", "Message", "ReasoningBlock", "Split", "TerminalTool",
           "TextBlock", "ToolCallBlock", "ToolList", "ToolResult", "ToolResultBlock", "ToolSpec", "UnknownBlock",
           "block_json", "blocks_text", "check_answer_images", "image_blocks", "parse_blocks", "parse_flag",
           "parse_messages", "parse_reward", "quoted"]

#: How `quoted` masks secrets: set around each call of a client (`transport.masked`); outside one, nothing is masked.
MASK: ContextVar[Callable[[str], str] | None] = ContextVar("ors_trl_mask", default=None)
#: The largest task count `/num_tasks` may claim (2**53: the last integer every JSON reader holds exactly).
MAX_TASK_COUNT = 2**53
#: Tools one `/tools` or `/task_tools` answer may list: each is bound as a method and rendered into every prompt.
MAX_TOOLS = 4096
#: The size (characters of JSON) of one tool's name, description and input schema, and of a whole tool list.
MAX_TOOL_SIZE = 1 << 20
MAX_TOOLS_SIZE = 16 << 20
#: Splits `/splits` may list (inspect counts each) and environments `/list_environments` may.
MAX_SPLITS = 256
MAX_ENVIRONMENTS = 1024
#: The largest reward magnitude a server may send (2**53). TRL sums, squares and divides a group's rewards in
#: float32: past about 1e19 a square overflows to inf and the group's advantages become NaN.
MAX_REWARD = float(2**53)
_MAX_BLOCK_DEPTH = 16  # how deeply `tool_result` blocks may hold blocks (parsing and rendering recurse)


def quoted(value: Any, limit: int = 200) -> str:
    """`value` as an error message quotes it: its repr, secrets masked (before the cut), at most `limit` characters."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # an int past the digit limit, a structure nested too deeply
        return f"<{type(value).__name__}>"
    mask = MASK.get()
    return cut(mask(text) if mask is not None else text, limit, "")


@dataclass(frozen=True, slots=True)
class TextBlock:
    """A text block: `{"type": "text", "text": ..., "detail": ...}`.

    Attributes:
        text (`str`):
            The text.
        detail (`dict[str, Any]`, *optional*):
            The block's `detail` object as the server sent it, if any.
        type (`str`, *optional*, defaults to `"text"`):
            The block's type.
    """

    text: str
    detail: dict[str, Any] | None = None
    type: str = "text"


@dataclass(frozen=True, slots=True)
class ImageBlock:
    """An image block; what it is (`info()`) and its pixels (`image()`) are found once and remembered.

    Attributes:
        data (`str`):
            The image, base64-encoded, without a `data:` prefix.
        mime_type (`str`):
            Its MIME type (`"image/png"`, `"image/jpeg"`, ...).
        detail (`dict[str, Any]`, *optional*):
            The block's `detail` object as the server sent it, if any.
        type (`str`, *optional*, defaults to `"image"`):
            The block's type.
    """

    data: str
    mime_type: str
    detail: dict[str, Any] | None = None
    type: str = "image"
    _info: images.ImageInfo | None = field(default=None, compare=False, repr=False)
    _image: Any = field(default=None, compare=False, repr=False)

    def data_url(self) -> str:
        """The image as a `data:` URL, the form chat templates and OpenAI-style APIs accept."""
        return f"data:{self.mime_type};base64,{self.data}"

    def info(self) -> images.ImageInfo:
        """What the image is (hash, size, dimensions), or why a model will not be shown it (`error`)."""
        if self._info is None:
            object.__setattr__(self, "_info", images.check(self.data, self.mime_type))
        return self._info  # type: ignore[return-value]

    def _refuse(self, why: str) -> None:
        """Not shown after all (past its answer's bounds, pixels that do not decode): `info().error` says why."""
        object.__setattr__(self, "_info", dataclasses.replace(self.info(), error=why))

    def image(self) -> Any:
        """The pixels, an RGB `PIL.Image.Image`, decoded once; an `ImageError` where it cannot be shown."""
        if self._image is None:
            info = self.info()
            if info.error is not None:
                raise ImageError(f"image {info.sha256[:12]} cannot be shown: {info.error}")
            try:
                object.__setattr__(self, "_image", images.decode(images.as_bytes(self.data), info))
            except ImageError as exc:  # it checked out, yet its pixels do not decode
                self._refuse(str(exc))
                raise
        return self._image

    def __repr__(self) -> str:
        return f"ImageBlock(mime_type={self.mime_type!r}, data=<{len(self.data)} chars>)"


@dataclass(frozen=True, slots=True)
class ReasoningBlock:
    """A reasoning segment of an assistant turn (`/messages`, SDK >= 0.1.157).

    Attributes:
        text (`str`):
            The reasoning text.
        signature (`str`, *optional*):
            The provider's signature of the segment, if any.
        type (`str`, *optional*, defaults to `"reasoning"`):
            The block's type.
    """

    text: str
    signature: str | None = None
    type: str = "reasoning"


@dataclass(frozen=True, slots=True)
class ToolCallBlock:
    """A tool invocation inside an assistant turn (`/messages`).

    Attributes:
        id (`str`):
            The call's id, which a `ToolResultBlock`'s `tool_call_id` refers to.
        name (`str`):
            The tool called.
        input (`dict[str, Any]`):
            The call's arguments.
        type (`str`, *optional*, defaults to `"tool_call"`):
            The block's type.
    """

    id: str
    name: str
    input: dict[str, Any]
    type: str = "tool_call"


@dataclass(frozen=True, slots=True)
class ToolResultBlock:
    """A tool result inside a user turn, matched to a `ToolCallBlock` by `tool_call_id` (`/messages`).

    Attributes:
        tool_call_id (`str`):
            The `id` of the `ToolCallBlock` this answers.
        blocks (`list[Block]`):
            The result's blocks.
        is_error (`bool`, *optional*, defaults to `False`):
            Whether the tool failed.
        type (`str`, *optional*, defaults to `"tool_result"`):
            The block's type.
    """

    tool_call_id: str
    blocks: list[Block]
    is_error: bool = False
    type: str = "tool_result"


@dataclass(frozen=True, slots=True)
class UnknownBlock:
    """A block of a type this client does not know; kept as received.

    Attributes:
        type (`str`):
            The block's type.
        raw (`dict[str, Any]`, *optional*, defaults to `{}`):
            The block as received.
    """

    type: str
    raw: dict[str, Any] = field(default_factory=dict)


Block = TextBlock | ImageBlock | ReasoningBlock | ToolCallBlock | ToolResultBlock | UnknownBlock


def _block(raw: Any, i: int, where: str, depth: int) -> Block:
    if not isinstance(raw, dict):
        raise ProtocolError(f"{where}: block {i} is {type(raw).__name__}, not an object")
    kind = raw.get("type", "text" if "text" in raw else None)
    if kind in ("text", "reasoning"):
        text = raw.get("text")
        if not isinstance(text, str):
            raise ProtocolError(f"{where}: {kind} block {i} has no string 'text'")
        if kind == "reasoning":
            signature = raw.get("signature")
            return ReasoningBlock(text=text, signature=signature if isinstance(signature, str) else None)
        return TextBlock(text=text, detail=raw["detail"] if isinstance(raw.get("detail"), dict) else None)
    if kind == "image":
        data, mime = raw.get("data"), raw.get("mimeType", raw.get("mime_type"))
        if not isinstance(data, str) or not isinstance(mime, str):
            raise ProtocolError(f"{where}: image block {i} needs string 'data' and 'mimeType'")
        block = ImageBlock(data=data, mime_type=mime)
        return block if len(data) <= images.MAX_IMAGE_CHARS else ImageBlock("", mime, _info=block.info())
    if kind == "tool_call":
        arguments = raw.get("input") or {}
        if not isinstance(raw.get("name"), str) or not isinstance(arguments, dict):
            raise ProtocolError(f"{where}: tool_call block {i} needs a string 'name' and an object 'input'")
        return ToolCallBlock(id=str(raw.get("id") or f"call_{i}"), name=raw["name"], input=dict(arguments))
    if kind == "tool_result":
        if depth >= _MAX_BLOCK_DEPTH:
            raise ProtocolError(f"{where}: tool_result blocks nested more than {_MAX_BLOCK_DEPTH} deep")
        blocks = parse_blocks(raw.get("blocks"), where=f"{where} tool_result {i}", _depth=depth + 1)
        is_error = parse_flag(raw.get("is_error"), what=f"{where}: tool_result block {i} 'is_error'")
        return ToolResultBlock(tool_call_id=str(raw.get("tool_call_id") or ""), is_error=is_error, blocks=blocks)
    return UnknownBlock(type=str(kind), raw=raw)


def parse_blocks(value: Any, *, where: str, _depth: int = 0, _whole: bool = True) -> list[Block]:
    """A JSON list of blocks (a `ProtocolError` for shapes that cannot be), its images checked as one answer's."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ProtocolError(f"{where}: expected a list of blocks, got {type(value).__name__}")
    blocks = [_block(raw, i, where, _depth) for i, raw in enumerate(value)]
    if _depth == 0 and _whole:  # a conversation checks its messages together
        check_answer_images(blocks)
    return blocks


def image_blocks(blocks: Iterable[Block]) -> Iterator[ImageBlock]:
    for block in blocks:
        if isinstance(block, ImageBlock):
            yield block
        elif isinstance(block, ToolResultBlock):
            yield from image_blocks(block.blocks)


def check_answer_images(blocks: Iterable[Block]) -> None:
    """Check every image of one answer, and its bounds (`images.MAX_IMAGES`, `images.MAX_ANSWER_PIXELS` together):
    the images past either are not shown, each saying why."""
    count = pixels = 0
    for block in image_blocks(blocks):
        info = block.info()
        if info.error is not None:
            continue
        count, pixels = count + 1, pixels + info.pixels
        if count > images.MAX_IMAGES:
            block._refuse(f"the answer holds more than {images.MAX_IMAGES} images")
        elif pixels > images.MAX_ANSWER_PIXELS:
            block._refuse(f"the answer's images have more than {images.MAX_ANSWER_PIXELS} pixels together")


def block_text(block: Block) -> str:
    """The text a language model sees for one block: rich blocks rendered readably, nothing dropped."""
    if isinstance(block, TextBlock):
        return block.text
    if isinstance(block, ImageBlock):
        return f"[image: {block.mime_type}]"
    if isinstance(block, ReasoningBlock):
        return f"<think>{block.text}</think>"
    if isinstance(block, ToolCallBlock):
        try:
            arguments = json.dumps(block.input, ensure_ascii=False, default=str)
        except (ValueError, RecursionError):  # nested past what the encoder recurses through, a huge int
            arguments = "{...}"
        return f"[tool_call {block.name}] {arguments}"
    if isinstance(block, ToolResultBlock):
        header = "[tool_result (error)]" if block.is_error else "[tool_result]"
        return "\n".join([header, *(block_text(b) for b in block.blocks)])
    return f"[unsupported block: {block.type}]"


def blocks_text(blocks: list[Block]) -> str:
    return "\n".join(block_text(b) for b in blocks)


def block_json(block: Block) -> dict[str, Any]:
    """A block in its wire form (what `/score_group` candidates carry)."""
    if isinstance(block, UnknownBlock):
        return dict(block.raw)
    if isinstance(block, TextBlock):
        return {"type": "text", "text": block.text}
    if isinstance(block, ImageBlock):
        return {"type": "image", "data": block.data, "mimeType": block.mime_type}
    if isinstance(block, ReasoningBlock):
        return {"type": "reasoning", "text": block.text, **({"signature": block.signature} if block.signature else {})}
    if isinstance(block, ToolCallBlock):
        return {"type": "tool_call", "id": block.id, "name": block.name, "input": block.input}
    return {"type": "tool_result", "tool_call_id": block.tool_call_id, "is_error": block.is_error,
            "blocks": [block_json(b) for b in block.blocks]}


@dataclass(frozen=True, slots=True)
class Message:
    """One turn of a task conversation (`GET /{env}/messages`).

    Attributes:
        role (`str`):
            `"system"`, `"user"` or `"assistant"`.
        blocks (`list[Block]`):
            The turn's blocks.
    """

    role: str
    blocks: list[Block]

    @property
    def text(self) -> str:
        """The text a language model sees for the turn's blocks, joined with newlines."""
        return blocks_text(self.blocks)

    def to_json(self) -> dict[str, Any]:
        """The message in its wire form, `{"role": ..., "blocks": [...]}`."""
        return {"role": self.role, "blocks": [block_json(b) for b in self.blocks]}


def parse_messages(value: Any, *, where: str = "messages") -> list[Message]:
    """Parse `/messages` (`[{"role", "blocks"}]`); a role other than system/user/assistant is a protocol error."""
    if not isinstance(value, list):
        raise ProtocolError(f"{where}: expected a list of messages, got {type(value).__name__}")
    out = []
    for i, raw in enumerate(value):
        role = raw.get("role") if isinstance(raw, dict) else None
        if role not in ("system", "user", "assistant"):
            raise ProtocolError(f"{where}: message {i} has no role system, user or assistant")
        out.append(Message(role=role, blocks=parse_blocks(raw.get("blocks"), where=f"{where}[{i}]", _whole=False)))
    check_answer_images(b for m in out for b in m.blocks)
    return out


@dataclass(frozen=True, slots=True)
class Split:
    """A task split, e.g. `Split("train", "train")`.

    Attributes:
        name (`str`):
            The split's name, as tasks are asked for by.
        type (`str`):
            Its kind (`"train"`, `"validation"`, `"test"`, ...; the name where the server gives none).
    """

    name: str
    type: str


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A tool as the environment advertises it: name, description, JSON Schema of its input.

    Attributes:
        name (`str`):
            The tool's name.
        description (`str`, *optional*, defaults to `""`):
            What the tool says about itself.
        input_schema (`dict[str, Any]`, *optional*):
            The JSON Schema of its input, if it has one.
    """

    name: str
    description: str = ""
    input_schema: dict[str, Any] | None = None

    @classmethod
    def from_json(cls, raw: Any) -> ToolSpec:
        """A tool spec from its wire form; a `ProtocolError` for one without a string `name` or an object schema.

        Args:
            raw (`Any`):
                The decoded JSON: `{"name", "description"?, "input_schema"?}`.
        """
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
            raise ProtocolError(f"tool spec must be an object with a string 'name', got {quoted(raw)}")
        schema = raw.get("input_schema")
        if schema is not None and not isinstance(schema, dict):
            raise ProtocolError(f"tool {show_name(raw['name'])}: input_schema must be an object or null")
        desc = raw.get("description")
        return cls(name=raw["name"], description=desc if isinstance(desc, str) else "", input_schema=schema)

    def to_json(self) -> dict[str, Any]:
        """The spec in its wire form, `{"name", "description", "input_schema"}`."""
        return {"name": self.name, "description": self.description, "input_schema": self.input_schema}


@dataclass(frozen=True, slots=True)
class TerminalTool:
    """An environment's `@terminal` tool: hidden from the model, called with its final plain message.

    Attributes:
        name (`str`):
            The remote tool name.
        arg (`str`, *optional*):
            The argument the message is passed as (`None`: the tool takes none).
        description (`str`, *optional*, defaults to `""`):
            What the tool says about itself.
    """

    name: str
    arg: str | None = None
    description: str = ""

    def arguments(self, message: str) -> dict[str, Any]:
        """The wire arguments for a final message: `{arg: message}`, or `{}`.

        Args:
            message (`str`):
                The model's final plain message.
        """
        return {} if self.arg is None else {self.arg: message}


@dataclass(frozen=True, slots=True)
class ToolList:
    """The answer of `/tools` or `/task_tools`; a field an older server does not send means "not supported".

    Attributes:
        tools (`list[ToolSpec]`):
            The tools the model is shown.
        terminal_tool (`TerminalTool`, *optional*):
            The environment's `@terminal` tool, hidden from the model, if it has one.
        supports_score_group (`bool`, *optional*, defaults to `False`):
            Whether the environment scores GRPO groups (`/score_group`).
        message_block_types (`tuple[str, ...]`, *optional*):
            The block types `/messages` may carry; `None` when the server has no `/messages`.
    """

    tools: list[ToolSpec]
    terminal_tool: TerminalTool | None = None
    supports_score_group: bool = False
    message_block_types: tuple[str, ...] | None = None

    @classmethod
    def from_json(cls, raw: Any, *, where: str) -> ToolList:
        """A tool list from its wire form; a `ProtocolError` for one that is not, or past the bounds (`MAX_TOOL*`).

        Args:
            raw (`Any`):
                The decoded JSON: `{"tools": [...], ...}`, or a bare list of tools.
            where (`str`):
                The route it came from, named in errors.
        """
        if isinstance(raw, list):  # tolerate servers answering a bare list
            raw = {"tools": raw}
        if not isinstance(raw, dict) or not isinstance(raw.get("tools"), list):
            raise ProtocolError(f"{where}: expected {{'tools': [...]}}")
        if len(raw["tools"]) > MAX_TOOLS:
            raise ProtocolError(f"{where}: the server lists {len(raw['tools'])} tools, more than the {MAX_TOOLS} a "
                                "model can be given (each is bound, and rendered into every prompt)")
        total = 0
        for tool in raw["tools"]:
            size = json_size(tool, MAX_TOOL_SIZE)
            total += size
            if size > MAX_TOOL_SIZE or total > MAX_TOOLS_SIZE:
                name = quoted(tool.get("name") if isinstance(tool, dict) else tool, 100)
                raise ProtocolError(f"{where}: tool {name} is larger than {MAX_TOOL_SIZE >> 20} MiB of JSON" if
                                    size > MAX_TOOL_SIZE else f"{where}: the tools are larger than "
                                    f"{MAX_TOOLS_SIZE >> 20} MiB of JSON together")
        terminal = raw.get("terminal_tool")
        if terminal is not None and not (isinstance(terminal, dict) and isinstance(terminal.get("name"), str)
                                         and isinstance(terminal.get("arg"), str | None)):
            raise ProtocolError(f"{where}: terminal_tool must be an object with a string 'name', got {quoted(terminal)}")
        kinds = raw.get("message_block_types")
        return cls(
            tools=[ToolSpec.from_json(t) for t in raw["tools"]],
            terminal_tool=None if terminal is None else TerminalTool(
                terminal["name"], terminal.get("arg"), str(terminal.get("description") or "")),
            supports_score_group=raw.get("supports_score_group") is True,
            message_block_types=tuple(str(k) for k in kinds) if isinstance(kinds, list) else None,
        )

    def names(self) -> list[str]:
        """The tools' names, in order."""
        return [t.name for t in self.tools]


def parse_reward(value: Any, *, what: str) -> float | None:
    """A reward as sent by the server: None, or a JSON number of magnitude at most `MAX_REWARD`. Anything else (a
    numeric string, a boolean, NaN) is a `ProtocolError`: a guessed reward would corrupt a whole group's advantages,
    where an error scores the rollout None, counted."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        kind = "a string" if isinstance(value, str) else "non-numeric"
        raise ProtocolError(f"{what} returned {kind} reward {quoted(value, 100)} (a reward is a JSON number or null)")
    try:
        reward = float(value)
    except OverflowError:  # an integer too large for a float
        raise ProtocolError(f"{what} returned a non-numeric reward {quoted(value, 100)}") from None
    if not math.isfinite(reward):
        raise ProtocolError(f"{what} returned a non-finite reward {quoted(value, 100)}")
    if abs(reward) > MAX_REWARD:
        raise ProtocolError(f"{what} returned a reward of {reward:.3g}, past the ±{MAX_REWARD:.3g} a reward may be "
                            "(TRL computes advantages in float32, where it would overflow into NaN)")
    return reward


def parse_flag(value: Any, *, what: str) -> bool:
    """A boolean a server sends (`finished`, `is_error`): JSON `true` or `false`, missing or null read as false.
    Anything else (`"false"`, `0`) is a `ProtocolError`: guessing would end or continue episodes on a server's typo."""
    if value is None or isinstance(value, bool):
        return value is True
    raise ProtocolError(f"{what} is {quoted(value, 100)}, not a JSON boolean (true or false)")


def _metadata(value: Any) -> dict[str, Any] | None:
    return value if value is None or isinstance(value, dict) else {"value": value}


@dataclass(frozen=True, slots=True)
class ToolResult:
    """What a successful tool call returned.

    Attributes:
        blocks (`list[Block]`):
            The output blocks (text, images, unknown kinds kept as-is).
        reward (`float`, *optional*):
            The step reward, or `None` when this call was not scored.
        finished (`bool`, *optional*, defaults to `False`):
            `True` once the episode is over; later calls in the session are refused.
        metadata (`dict[str, Any]`, *optional*):
            The environment's free-form metadata for this call, or `None`.
        task_id (`str`, *optional*):
            The server's id for this call (used to resume a dropped stream).
    """

    blocks: list[Block]
    reward: float | None = None
    finished: bool = False
    metadata: dict[str, Any] | None = None
    task_id: str | None = None

    @property
    def text(self) -> str:
        """The text a language model sees for the output blocks, joined with newlines."""
        return blocks_text(self.blocks)

    @classmethod
    def from_output(cls, output: Any, *, tool: str, task_id: str | None = None) -> ToolResult:
        """A result from the `output` of a successful `/call` (metadata that is no object kept as `{"value": ...}`); a
        `ProtocolError` for a malformed output, block or reward.

        Args:
            output (`Any`):
                The decoded `output` object: `{"blocks", "reward"?, "finished"?, "metadata"?}`.
            tool (`str`):
                The tool called, named in errors.
            task_id (`str`, *optional*):
                The server's id for the call.
        """
        if not isinstance(output, dict):
            raise ProtocolError(f"tool {show_name(tool)}: 'output' must be an object")
        return cls(
            blocks=parse_blocks(output.get("blocks"), where=f"tool {show_name(tool)} output"),
            reward=parse_reward(output.get("reward"), what=f"tool {show_name(tool)}"),
            finished=parse_flag(output.get("finished"), what=f"tool {show_name(tool)}: 'finished'"),
            metadata=_metadata(output.get("metadata")),
            task_id=task_id,
        )


@dataclass(frozen=True, slots=True)
class GroupScore:
    """One candidate's comparative reward from `/score_group` (index-aligned with the candidates).

    Attributes:
        reward (`float`):
            The candidate's reward.
        metadata (`dict[str, Any]`, *optional*):
            The environment's free-form metadata for the candidate, or `None`.
    """

    reward: float
    metadata: dict[str, Any] | None = None

    @classmethod
    def parse_all(cls, body: Any, *, expected: int) -> list[GroupScore]:
        """The scores of a decoded `/score_group` result, in the candidates' order; a `ProtocolError` where it does
        not hold `expected` valid scores.

        Args:
            body (`Any`):
                The decoded result.
            expected (`int`):
                How many scores it must hold: one per candidate.
        """
        scores = body.get("scores") if isinstance(body, dict) else None
        if not isinstance(scores, list) or len(scores) != expected:
            raise ProtocolError(f"score_group: expected {{'scores': [...]}} with {expected} entries, got "
                                f"{quoted(body)}")
        out = []
        for score in scores:
            reward = parse_reward(score.get("reward") if isinstance(score, dict) else score, what="score_group")
            if reward is None:
                raise ProtocolError("score_group: a score has no reward")
            out.append(cls(reward, _metadata(score.get("metadata")) if isinstance(score, dict) else None))
        return out
