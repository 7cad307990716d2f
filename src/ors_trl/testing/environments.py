"""Reference ORS environments used by the tests, the benchmarks and the demo.

Each class is hosted by the reference server (``openreward.environments.Server``); its key on the
wire is the lower-cased class name (``EchoEnvironment`` -> ``echoenvironment``). Everything is
deterministic, so a test can compute what the server must answer.

=========================  ==========================================================================
``echo``                   ``EchoEnvironment``: call ``echo`` with the target word (TRL's guide env).
``tasktools``              ``TaskToolsEnvironment``: task-specific tools advertised per task.
``image``                  ``ImageEnvironment``: image blocks in the prompt and in tool output.
``long``                   ``LongOutputEnvironment``: one tool output of 20,000+ characters.
``schema``                 ``SchemaEnvironment``: rich pydantic input schemas, echoed back verbatim.
``sparse``                 ``SparseEnvironment``: only ``submit`` is scored; ``calculator`` is not.
``slow``                   ``SlowEnvironment``: configurable setup delay and tool latency, 256 tasks.
``mixed``                  ``MixedEnvironment``: task fields of mixed types/shapes and reserved names.
``hostile``                ``HostileEnvironment``: tool/parameter names and descriptions that break binders.
``demo``                   ``DemoEnvironment``: the task ``ors-trl demo`` trains on (``ors_trl.demo._task``).
=========================  ==========================================================================

The module also keeps process-global counters (tool invocations per ``env/tool``, setups and
teardowns), read by the launcher's ``GET /_test/stats`` so a test can prove a tool ran exactly once.
This module imports ``openreward``; ``ors_trl.testing`` itself does not.
"""

import ast
import asyncio
import base64
import enum
import json
import operator
import os
import random
import struct
import threading
import zlib
from collections import Counter
from typing import Any, Literal

from openreward.environments import (
    Environment,
    ImageBlock,
    JSONObject,
    ListToolsOutput,
    Split,
    TextBlock,
    ToolOutput,
    ToolSpec,
    tool,
)
from pydantic import BaseModel, Field

__all__ = [
    "ENVIRONMENTS",
    "SETUP_DELAY_ENV",
    "SSE_CHUNK_SIZE",
    "STEPS_ENV",
    "TOOL_LATENCY_ENV",
    "Color",
    "DemoEnvironment",
    "EchoEnvironment",
    "HostileEnvironment",
    "ImageEnvironment",
    "LongOutputEnvironment",
    "MixedEnvironment",
    "SchemaEnvironment",
    "SlowEnvironment",
    "SparseEnvironment",
    "TaskToolsEnvironment",
    "counters",
    "long_text",
    "png_bytes",
    "reset_counters",
    "resolve_environments",
]

# --------------------------------------------------------------------------------------------------
# Counters
# --------------------------------------------------------------------------------------------------

_lock = threading.Lock()
_tool_calls: Counter[str] = Counter()
_setups: Counter[str] = Counter()
_teardowns: Counter[str] = Counter()
# Work in progress, the most ever in progress at once, and finished runs, per "env/what" (SlowEnvironment):
# lets tests prove that sessions were set up, or tool calls ran, concurrently, without timing anything.
_in_flight: Counter[str] = Counter()
_peak: Counter[str] = Counter()
_done: Counter[str] = Counter()


def _bump(counter: Counter[str], key: str) -> None:
    with _lock:
        counter[key] += 1


class _tracked:
    """Context manager counting one piece of work in progress under ``key``."""

    def __init__(self, key: str) -> None:
        self.key = key

    def __enter__(self) -> None:
        with _lock:
            _in_flight[self.key] += 1
            _peak[self.key] = max(_peak[self.key], _in_flight[self.key])

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        with _lock:
            _in_flight[self.key] -= 1
            if exc_type is None:
                _done[self.key] += 1


def counters() -> dict[str, Any]:
    """Snapshot of the process-global counters (what ``/_test/stats`` reports)."""
    with _lock:
        return {
            "tool_calls": dict(_tool_calls),
            "setups": sum(_setups.values()),
            "teardowns": sum(_teardowns.values()),
            "setups_by_env": dict(_setups),
            "teardowns_by_env": dict(_teardowns),
            "in_flight": dict(_in_flight),
            "peak_in_flight": dict(_peak),
            "done": dict(_done),
        }


def reset_counters() -> None:
    """Zero every counter (for in-process use; the launcher never calls it)."""
    with _lock:
        for counter in (_in_flight, _peak, _done):
            counter.clear()
        _tool_calls.clear()
        _setups.clear()
        _teardowns.clear()


class _FixtureEnvironment(Environment):
    """Base class: train/test splits, counted setup/teardown and tool calls."""

    @classmethod
    def list_splits(cls) -> list[Split | str]:
        return [Split(name="train", type="train"), Split(name="test", type="test")]

    @classmethod
    def key(cls) -> str:
        """The environment's key on the wire (the lower-cased class name)."""
        return cls.name().lower()

    async def setup(self) -> None:
        _bump(_setups, self.key())

    async def teardown(self) -> None:
        _bump(_teardowns, self.key())

    def _count(self, tool_name: str) -> None:
        _bump(_tool_calls, f"{self.key()}/{tool_name}")


def _text(text: str) -> TextBlock:
    return TextBlock(text=text)


# --------------------------------------------------------------------------------------------------
# 1. Echo
# --------------------------------------------------------------------------------------------------

_ECHO_TRAIN_WORDS = [
    "hello", "world", "trl", "openreward", "spec", "factory", "delta", "gradient",
    "policy", "reward", "rollout", "token", "sample", "banana", "quartz", "lantern",
]  # fmt: skip
_ECHO_TEST_WORDS = ["orbit", "meadow", "cipher", "pebble", "violet", "harbor", "zephyr", "nimbus"]


class EchoInput(BaseModel):
    text: str = Field(description="The text to echo back. It must equal the target exactly.")


class EchoEnvironment(_FixtureEnvironment):
    """Echo the target word back: reward 1.0 and finished on an exact match (TRL's guide env)."""

    @classmethod
    def list_tasks(cls, split: str) -> list[JSONObject]:
        words = _ECHO_TRAIN_WORDS if split == "train" else _ECHO_TEST_WORDS
        return [{"id": f"echo-{i}", "target": word} for i, word in enumerate(words)]

    async def get_prompt(self) -> list[TextBlock]:
        target = self.task_spec["target"]
        return [_text(f'Call the `echo` tool with exactly this text: "{target}". Do not add anything else.')]

    @tool
    async def echo(self, params: EchoInput) -> ToolOutput:
        """Echo the given text back; reward 1.0 when it equals the target."""
        self._count("echo")
        target = str(self.task_spec["target"])
        match = params.text == target
        return ToolOutput(
            blocks=[_text(params.text)],
            reward=1.0 if match else 0.0,
            finished=match,
            metadata={"target_length": len(target)},
        )


# --------------------------------------------------------------------------------------------------
# 2. Task-specific tools
# --------------------------------------------------------------------------------------------------


class DoorInput(BaseModel):
    code: str = Field(description="The four-digit code written on the note.", pattern=r"^\d{4}$")


class WindowInput(BaseModel):
    side: Literal["left", "right"] = Field(description="Which window to open.")


_ROOM_LAYOUTS: list[list[str]] = [["open_door"], ["open_window"], ["open_door", "open_window"]]


def _room_task(i: int, prefix: str) -> JSONObject:
    return {
        "id": f"{prefix}-{i}",
        "tools": list(_ROOM_LAYOUTS[i % 3]),
        "code": f"{(1234 + 1111 * i) % 10000:04d}",
        "side": "left" if i % 2 == 0 else "right",
    }


class TaskToolsEnvironment(_FixtureEnvironment):
    """Escape a room. ``look`` is shared; ``open_door``/``open_window`` are advertised per task.

    Task ``i`` advertises ``open_door`` (i % 3 == 0), ``open_window`` (i % 3 == 1) or both
    (i % 3 == 2), only through ``GET /{env}/task_tools``. A correct call of an advertised tool gives
    reward 1.0 and ends the episode; calling a tool the task did not advertise gives 0.0.
    """

    @classmethod
    def list_tasks(cls, split: str) -> list[JSONObject]:
        if split == "train":
            return [_room_task(i, "room") for i in range(6)]
        return [_room_task(i, "room-test") for i in range(3)]

    def list_task_tools(self) -> ListToolsOutput:
        models: dict[str, type[BaseModel]] = {"open_door": DoorInput, "open_window": WindowInput}
        specs = []
        for name in self.task_spec["tools"]:
            doc = (getattr(type(self), name).__doc__ or "").strip()
            specs.append(ToolSpec(name=name, description=doc, input_schema=models[name].model_json_schema()))
        return ListToolsOutput(tools=specs)

    async def get_prompt(self) -> list[TextBlock]:
        spec = self.task_spec
        return [
            _text(
                "You are locked in a room. A note on the table reads "
                f'"door code {spec["code"]}"; the {spec["side"]} window looks loose. '
                "Use the tools you have to get out."
            )
        ]

    @tool
    async def look(self) -> ToolOutput:
        """Look around the room."""
        self._count("look")
        exits = " and ".join(name.removeprefix("open_") for name in self.task_spec["tools"])
        return ToolOutput(blocks=[_text(f"You see a way out: {exits}.")], reward=None)

    def _escape(self, name: str, ok: bool, detail: str) -> ToolOutput:
        if name not in self.task_spec["tools"]:
            return ToolOutput(blocks=[_text(f"There is nothing to {name.replace('_', ' ')} here.")], reward=0.0)
        return ToolOutput(blocks=[_text(detail)], reward=1.0 if ok else 0.0, finished=ok)

    @tool(shared=False)
    async def open_door(self, params: DoorInput) -> ToolOutput:
        """Open the door with a four-digit code."""
        self._count("open_door")
        ok = params.code == self.task_spec["code"]
        return self._escape("open_door", ok, "The door swings open." if ok else "Wrong code.")

    @tool(shared=False)
    async def open_window(self, params: WindowInput) -> ToolOutput:
        """Open one of the windows."""
        self._count("open_window")
        ok = params.side == self.task_spec["side"]
        return self._escape("open_window", ok, "You climb out." if ok else "That window is stuck.")


# --------------------------------------------------------------------------------------------------
# 3. Images
# --------------------------------------------------------------------------------------------------

_COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 180, 60),
    "blue": (40, 70, 220),
    "yellow": (240, 210, 30),
}


def png_bytes(width: int, height: int, rgb: tuple[int, int, int]) -> bytes:
    """A valid solid-colour 8-bit RGB PNG, built with zlib/struct only (no PIL)."""

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    row = b"\x00" + bytes(rgb) * width  # filter type 0, then the pixels
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(row * height))
        + chunk(b"IEND", b"")
    )


def _png_block(color: str, size: int) -> ImageBlock:
    data = base64.b64encode(png_bytes(size, size, _COLORS[color])).decode("ascii")
    return ImageBlock(data=data, mimeType="image/png")


class SnapshotInput(BaseModel):
    color: Literal["red", "green", "blue", "yellow"] = Field(description="The colour you saw in the image.")
    size: int = Field(8, ge=1, le=64, description="Side length in pixels of the snapshot to return.")


class ImageEnvironment(_FixtureEnvironment):
    """Name the colour of the prompt's image; ``snapshot`` answers with an image of that colour."""

    @classmethod
    def list_tasks(cls, split: str) -> list[JSONObject]:
        names = list(_COLORS)
        count, offset = (8, 0) if split == "train" else (4, 1)
        return [{"id": f"image-{split}-{i}", "color": names[(i + offset) % 4], "size": 4 + i} for i in range(count)]

    async def get_prompt(self) -> list[TextBlock | ImageBlock]:
        spec = self.task_spec
        return [
            _text("What colour is this square? Call `snapshot` with the colour."),
            _png_block(spec["color"], int(spec["size"])),
        ]

    @tool
    async def snapshot(self, params: SnapshotInput) -> ToolOutput:
        """Take a snapshot in the given colour; reward 1.0 when it matches the prompt's image."""
        self._count("snapshot")
        correct = params.color == self.task_spec["color"]
        return ToolOutput(
            blocks=[
                _png_block(params.color, params.size),
                _text(f"A {params.size}x{params.size} {params.color} square."),
            ],
            reward=1.0 if correct else 0.0,
            finished=correct,
            metadata={
                "image": {"width": params.size, "height": params.size, "mime_type": "image/png"},
                "guess": {"color": params.color, "rgb": list(_COLORS[params.color]), "correct": correct},
                "tags": ["snapshot", params.color],
            },
        )


# --------------------------------------------------------------------------------------------------
# 4. Long output
# --------------------------------------------------------------------------------------------------

#: The reference server slices the ``/call`` result JSON into SSE events of this many characters.
SSE_CHUNK_SIZE = 4096
# The result JSON before the first text block's text: {"ok":true,"output":{"blocks":[{"text":"
_JSON_TEXT_OFFSET = len('{"ok":true,"output":{"blocks":[{"text":"')

_LONG_WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "lorem", "ipsum", "reward", "token", "space"]
_LONG_PIECES = [
    "    ",  # a run of spaces
    " " * 9,
    "\n    indented line",  # lines starting with spaces
    "\n\tTabbed\tcolumns\t",
    "\n        \n",  # a line of spaces only
    "trailing spaces   \n",
    "héllo wörld ",
    "naïve café ",
    "日本語のテキスト ",
    "Ελληνικά ",
    "emoji 🎉🚀 ",
    "“curly quotes” — dash ",
    "line\u2028separator ",  # not an SSE line break; str.splitlines() would split here
    "next\x85line ",  # ditto (NEL)
    '"quoted" and back\\slash ',
    '{"json": [1, 2, {"a": null}]} ',
    "\ndata: not-an-sse-field\n",  # SSE-looking text inside the payload
    "\nevent: end\n",
    "\n: ping - 2024-01-01\n",
    "\r\ncrlf\r",
]


def _json_width(text: str) -> int:
    return len(json.dumps(text, ensure_ascii=False)) - 2


def long_text(size: int = 20_000, seed: int = 0) -> str:
    """The exact text ``LongOutputEnvironment.dump(size, seed)`` returns: ``size`` characters.

    It mixes runs of spaces, lines starting with spaces, tabs, CR/LF, non-ASCII (including U+2028
    and U+0085, which are not SSE line breaks) and SSE-looking lines. It is laid out so that, once
    the server JSON-encodes the tool result and cuts it into ``SSE_CHUNK_SIZE`` slices, every slice
    boundary inside the text falls right before a run of one to four spaces: a client that strips
    more than the one space the SSE spec allows after ``data:`` corrupts the result.
    """
    if size < 0:
        raise ValueError("size must be >= 0")
    rng = random.Random(seed)
    out: list[str] = []
    length = 0  # characters of text so far
    pos = _JSON_TEXT_OFFSET  # JSON position of the next character
    boundary = SSE_CHUNK_SIZE
    run = 0
    while length < size:
        if rng.random() < 0.55:
            piece = rng.choice(_LONG_WORDS) + rng.choice([" ", "  ", ", ", ". "])
        else:
            piece = rng.choice(_LONG_PIECES)
        width = _json_width(piece)
        if pos + width <= boundary:
            out.append(piece)
            length += len(piece)
            pos += width
            continue
        # The piece would straddle a slice boundary: pad with one-wide characters up to it, then
        # start the next slice with spaces.
        filler = "x" * (boundary - pos)
        spaces = " " * (1 + run % 4)
        run += 1
        out.append(filler + spaces)
        length += len(filler) + len(spaces)
        pos = boundary + len(spaces)
        boundary += SSE_CHUNK_SIZE
    return "".join(out)[:size]


class DumpInput(BaseModel):
    size: int = Field(20_000, ge=0, le=2_000_000, description="Number of characters to return.")
    seed: int = Field(0, description="Seed that selects the text.")


class LongOutputEnvironment(_FixtureEnvironment):
    """One tool, ``dump``, whose single text block is ``long_text(size, seed)``."""

    @classmethod
    def list_tasks(cls, split: str) -> list[JSONObject]:
        count = 4 if split == "train" else 2
        base = 0 if split == "train" else 100
        return [{"id": f"long-{base + i}", "size": 20_000 + 5_000 * i, "seed": base + i} for i in range(count)]

    async def get_prompt(self) -> list[TextBlock]:
        spec = self.task_spec
        return [_text(f"Call `dump` with size={spec['size']} and seed={spec['seed']}.")]

    @tool
    async def dump(self, params: DumpInput) -> ToolOutput:
        """Return a long text block (``size`` characters, chosen by ``seed``)."""
        self._count("dump")
        return ToolOutput(
            blocks=[_text(long_text(params.size, params.seed))],
            metadata={"size": params.size, "seed": params.seed},
        )


# --------------------------------------------------------------------------------------------------
# 5. Schemas
# --------------------------------------------------------------------------------------------------


class Color(enum.StrEnum):
    """A colour, as an ``enum.Enum`` (pydantic emits it as a ``$defs`` entry with ``enum``)."""

    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class Point(BaseModel):
    x: float = Field(description="Horizontal coordinate.")
    y: float = Field(description="Vertical coordinate.")


class LineItem(BaseModel):
    sku: str = Field(pattern=r"^[A-Z]{3}-\d{3}$", description="Stock keeping unit such as ABC-123.")
    quantity: int = Field(1, ge=1, le=99, description="How many to order.")
    note: str | None = Field(None, description="Optional note for this line.")


class OrderInput(BaseModel):
    customer: str = Field(min_length=2, max_length=40, description="Customer name.")
    items: list[LineItem] = Field(min_length=1, description="The lines of the order.")
    pickup: Point = Field(description="Where to collect the order.")
    dropoff: Point | None = Field(None, description="Where to deliver it; omit to collect in person.")
    priority: Literal["low", "normal", "high"] = Field("normal", description="Handling priority.")
    wrapping: Color = Field(Color.RED, description="Colour of the wrapping paper.")
    discount: float = Field(0.0, ge=0.0, le=0.5, description="Fractional discount.")
    weight_kg: float = Field(gt=0, description="Total weight in kilograms.")
    counts: dict[str, int] = Field(default_factory=dict, description="Free-form counters.")
    pair: tuple[int, str] = Field((1, "one"), description="A number and its name.")
    reference: int | str = Field(description="An order number or a reference string.")
    gift: bool = False


class PlotInput(BaseModel):
    points: list[Point] = Field(min_length=1, description="Points to plot, in order.")
    origin: Point | None = None
    label: str | None = Field(None, max_length=20, description="Optional title.")
    style: Literal["line", "scatter"] = "line"
    scale: int = Field(1, ge=1, le=10)


class ModeInput(BaseModel):
    mode: Color = Field(description="The colour mode to switch to.")
    level: int = Field(ge=0, le=10, description="Intensity.")
    verbose: bool | None = None


class SchemaEnvironment(_FixtureEnvironment):
    """Tools with rich input schemas; each echoes its validated input back as JSON text.

    ``status`` takes no arguments and reports the task spec and the secrets the session received.
    """

    _TOOLS = ("place_order", "plot", "set_mode", "status")

    @classmethod
    def list_tasks(cls, split: str) -> list[JSONObject]:
        count = 8 if split == "train" else 4
        return [{"id": f"schema-{split}-{i}", "tool": cls._TOOLS[i % 4]} for i in range(count)]

    def __init__(self, task_spec: JSONObject = {}, secrets: dict[str, str] = {}) -> None:  # noqa: B006
        super().__init__(task_spec, secrets)
        self.secrets = dict(secrets)

    async def get_prompt(self) -> list[TextBlock]:
        return [_text(f"Call the `{self.task_spec['tool']}` tool with arguments that satisfy its schema.")]

    def _echo(self, name: str, params: BaseModel) -> ToolOutput:
        self._count(name)
        return ToolOutput(
            blocks=[_text(params.model_dump_json())],
            metadata={"tool": name, "received": params.model_dump(mode="json")},
        )

    @tool
    async def place_order(self, params: OrderInput) -> ToolOutput:
        """Place an order; echoes the validated order back."""
        return self._echo("place_order", params)

    @tool
    async def plot(self, params: PlotInput) -> ToolOutput:
        """Plot points; echoes the validated input back."""
        return self._echo("plot", params)

    @tool
    async def set_mode(self, params: ModeInput) -> ToolOutput:
        """Switch the colour mode; echoes the validated input back."""
        return self._echo("set_mode", params)

    @tool
    async def status(self) -> ToolOutput:
        """Report the task and the secrets this session received (takes no arguments)."""
        self._count("status")
        body = {"task": dict(self.task_spec), "secrets": self.secrets}
        return ToolOutput(blocks=[_text(json.dumps(body, sort_keys=True))], metadata=body)


# --------------------------------------------------------------------------------------------------
# 6. Sparse reward
# --------------------------------------------------------------------------------------------------

_BIN_OPS: dict[type[ast.operator], Any] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


def _evaluate(node: ast.AST) -> float | int:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN_OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 1_000_000):
            raise ValueError("exponent too large")
        return _BIN_OPS[type(node.op)](left, right)
    raise ValueError(f"unsupported expression element: {type(node).__name__}")


class CalculatorInput(BaseModel):
    expression: str = Field(max_length=200, description="Arithmetic expression, e.g. '3 + 4 * 2'.")


class SubmitInput(BaseModel):
    answer: int = Field(description="Your final answer.")


class SparseEnvironment(_FixtureEnvironment):
    """Small additions. ``calculator`` is unscored (reward None); only ``submit`` is scored.

    ``calculator`` raises on an invalid expression, so the server streams ``event: error``.
    """

    @classmethod
    def list_tasks(cls, split: str) -> list[JSONObject]:
        count, salt = (32, 0) if split == "train" else (8, 11)
        return [
            {"id": f"add-{split}-{i}", "a": (7 * i + 3 + salt) % 20, "b": (5 * i + 1 + salt) % 15}
            for i in range(count)
        ]

    async def get_prompt(self) -> list[TextBlock]:
        a, b = self.task_spec["a"], self.task_spec["b"]
        return [_text(f"What is {a} + {b}? You may use `calculator`; then call `submit` with the answer.")]

    @tool(concurrent=True)
    async def calculator(self, params: CalculatorInput) -> ToolOutput:
        """Evaluate an arithmetic expression (+ - * / // % **). Not scored."""
        self._count("calculator")
        try:
            value = _evaluate(ast.parse(params.expression, mode="eval"))
        except (SyntaxError, ZeroDivisionError) as exc:
            raise ValueError(f"cannot evaluate {params.expression!r}: {exc}") from exc
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        return ToolOutput(blocks=[_text(str(value))], reward=None)

    @tool(exclusive=True)
    async def submit(self, params: SubmitInput) -> ToolOutput:
        """Submit the final answer; ends the episode with reward 1.0 if correct, else 0.0."""
        self._count("submit")
        expected = int(self.task_spec["a"]) + int(self.task_spec["b"])
        correct = params.answer == expected
        return ToolOutput(
            blocks=[_text("Correct." if correct else "Incorrect.")],
            reward=1.0 if correct else 0.0,
            finished=True,
            metadata={"correct": correct},
        )


# --------------------------------------------------------------------------------------------------
# 7. Slow
# --------------------------------------------------------------------------------------------------

#: Seconds ``SlowEnvironment.setup()`` sleeps, read when this module is imported (server start).
SETUP_DELAY_ENV = "ORS_TEST_SETUP_DELAY"
#: Seconds each ``SlowEnvironment.work`` call sleeps, read when this module is imported.
TOOL_LATENCY_ENV = "ORS_TEST_TOOL_LATENCY"
#: Steps per ``SlowEnvironment`` task (``work`` finishes on step ``steps - 1``), read at import; default 3.
STEPS_ENV = "ORS_TEST_STEPS"


def _env_seconds(name: str) -> float:
    raw = os.environ.get(name, "").strip()
    return float(raw) if raw else 0.0


class WorkInput(BaseModel):
    step: int = Field(ge=0, description="Step number, starting at 0.")


class SleepInput(BaseModel):
    seconds: float = Field(ge=0, le=600, description="How long to sleep.")


class SlowEnvironment(_FixtureEnvironment):
    """Latency on demand: ``setup()`` and ``work`` sleep for configurable times; 256 train tasks.

    ``work(step)`` finishes the episode with reward 1.0 on the task's last step (``steps - 1``) and
    returns reward None before it. ``sleep(seconds)`` sleeps as long as asked (long calls, keepalive)
    and is concurrent: it never grants reward. ``work`` grants reward, so it stays serialised per
    session (the SDK's rule); sessions still run in parallel.
    """

    setup_delay: float = _env_seconds(SETUP_DELAY_ENV)
    tool_latency: float = _env_seconds(TOOL_LATENCY_ENV)
    steps: int = max(1, int(os.environ.get(STEPS_ENV, "").strip() or 3))

    @classmethod
    def list_tasks(cls, split: str) -> list[JSONObject]:
        count = 256 if split == "train" else 64
        return [{"id": f"slow-{split}-{i}", "steps": cls.steps} for i in range(count)]

    async def setup(self) -> None:
        await super().setup()
        with _tracked(f"{self.key()}/setup"):
            if self.setup_delay > 0:
                await asyncio.sleep(self.setup_delay)

    async def get_prompt(self) -> list[TextBlock]:
        steps = int(self.task_spec["steps"])
        return [_text(f"Call `work` with step=0, then 1, and so on up to step={steps - 1}.")]

    @tool
    async def work(self, params: WorkInput) -> ToolOutput:
        """Do one step of work (takes the configured tool latency)."""
        self._count("work")
        with _tracked(f"{self.key()}/work"):
            if self.tool_latency > 0:
                await asyncio.sleep(self.tool_latency)
        last = params.step >= int(self.task_spec["steps"]) - 1
        return ToolOutput(
            blocks=[_text(f"step {params.step} done")],
            reward=1.0 if last else None,
            finished=last,
            metadata={"step": params.step, "latency_s": self.tool_latency},
        )

    @tool(concurrent=True)
    async def sleep(self, params: SleepInput) -> ToolOutput:
        """Sleep for the given number of seconds, then return."""
        self._count("sleep")
        with _tracked(f"{self.key()}/sleep"):
            await asyncio.sleep(params.seconds)
        return ToolOutput(blocks=[_text(f"slept {params.seconds:g}s")], reward=None)


# --------------------------------------------------------------------------------------------------
# 8. Heterogeneous task fields
# --------------------------------------------------------------------------------------------------


class AnswerInput(BaseModel):
    value: str = Field(description="Your answer.")


class MixedEnvironment(_FixtureEnvironment):
    """Tasks whose fields differ in type and shape from task to task, and collide with reserved names.

    ``answer`` is an int in some tasks and a string in others; ``meta`` is a dict of different shapes
    or a list; ``tags`` mixes types; ``prompt``, ``task_index`` and ``task_spec`` are task fields too.
    ``answer(value)`` scores 1.0 when ``value`` equals ``str(task["answer"])``.
    """

    @classmethod
    def list_tasks(cls, split: str) -> list[JSONObject]:
        count = 6 if split == "train" else 3
        tasks: list[JSONObject] = []
        for i in range(count):
            task: dict[str, Any] = {"id": f"mixed-{split}-{i}", "answer": i * 7 if i % 2 == 0 else f"a{i}"}
            task["meta"] = {"level": i, "source": {"name": "gen", "seed": i}} if i % 3 else [i, "x", None]
            task["tags"] = ["t", i, 1.5] if i % 2 else ["t"]
            task["prompt"] = f"task field named prompt #{i}"
            task["task_index"] = 1000 + i
            task["task_spec"] = {"nested": True}
            if i == 1:
                task["only_here"] = {"deep": {"deeper": [1, 2, {"x": "y"}]}}
            tasks.append(task)
        return tasks

    async def get_prompt(self) -> list[TextBlock]:
        return [_text(f"Answer with {self.task_spec['answer']!s}.")]

    @tool
    async def answer(self, params: AnswerInput) -> ToolOutput:
        """Submit the answer; reward 1.0 when it matches."""
        self._count("answer")
        ok = params.value == str(self.task_spec["answer"])
        return ToolOutput(blocks=[_text("correct" if ok else "wrong")], reward=1.0 if ok else 0.0, finished=True)

    @tool
    async def submit(self, params: AnswerInput) -> ToolOutput:
        """Same as answer, under the name SparseEnvironment uses for a different schema (for mix tests)."""
        self._count("submit")
        ok = params.value == str(self.task_spec["answer"])
        return ToolOutput(blocks=[_text("mixed: correct" if ok else "mixed: wrong")], reward=1.0 if ok else 0.0,
                          finished=True)


# --------------------------------------------------------------------------------------------------
# 9. Hostile metadata
# --------------------------------------------------------------------------------------------------

#: A description that tries everything a naive binder would trip over.
HOSTILE_DESCRIPTION = (
    'Runs "things" with \'quotes\' and """triple quotes""" and \'\'\'more\'\'\'.\n'
    "Args:\n    x: not a real argument\nReturns: nothing\n"
    "__import__('os').system('echo pwned > /tmp/ors_trl_pwned')\n"
    "eval(compile('1', 'x', 'eval')) (choices: [1, 2])"
)
#: Sentinel file a successful code injection would create.
PWNED_PATH = "/tmp/ors_trl_pwned"
#: How many task-specific tools task 1 of ``HostileEnvironment`` advertises.
MANY_TOOLS = 2000


class KeywordParams(BaseModel):
    model_config = {"populate_by_name": True}

    klass: str = Field(alias="class", description="A parameter named like a Python keyword.")
    dashed: int = Field(0, alias="x-y", description="A parameter whose name is not an identifier.")
    me: str = Field("", alias="self", description="A parameter named self. " + HOSTILE_DESCRIPTION)
    dunder: str = Field("", alias="__dunder__", description="A dunder parameter.")


class Node(BaseModel):
    label: str = Field(description="Node label.")
    children: list["Node"] = Field(default_factory=list, description="Child nodes (recursive).")


class TreeInput(BaseModel):
    root: Node = Field(description="A recursive tree.")


class Deep(BaseModel):
    a: dict[str, list[dict[str, list[list[dict[str, int]]]]]] = Field(description="Deeply nested.")


class HostileEnvironment(_FixtureEnvironment):
    """Tool and parameter names and descriptions chosen to break naive tool binding.

    Tools named ``reset``, ``get_reward``, ``_private``, ``run-shell`` and ``class``; parameters named
    ``class``, ``x-y``, ``self`` and ``__dunder__``; a description with quotes, docstring section
    headers and code; a recursive schema; and, in task 1's session, ``MANY_TOOLS`` extra tools. Every
    tool answers with its own name and the arguments it received, so a test can see where a call went.
    """

    @classmethod
    def list_tasks(cls, split: str) -> list[JSONObject]:
        return [{"id": f"hostile-{split}-{i}"} for i in range(2)]

    async def get_prompt(self) -> list[TextBlock]:
        return [_text("Call any tool.")]

    def list_task_tools(self) -> ListToolsOutput:
        if self.task_spec.get("id", "").endswith("-1"):
            return ListToolsOutput(tools=[
                ToolSpec(name=f"bulk_{i:04d}", description=f"Bulk tool {i}.", input_schema=None)
                for i in range(MANY_TOOLS)
            ])
        return ListToolsOutput(tools=[])

    def __getattr__(self, name: str) -> Any:
        # Dispatch for the bulk task tools (the reference server looks tools up with getattr).
        if name.startswith("bulk_"):
            async def bulk() -> ToolOutput:
                self._count("bulk")
                return ToolOutput(blocks=[_text(name)], reward=None)

            bulk.__annotations__ = {"return": ToolOutput}
            bulk._env_tool = True  # type: ignore[attr-defined]
            return bulk
        raise AttributeError(name)

    def _reply(self, name: str, params: BaseModel | None, reward: float | None = None) -> ToolOutput:
        self._count(name)
        received = params.model_dump(by_alias=True) if params is not None else {}
        return ToolOutput(blocks=[_text(json.dumps({"tool": name, "received": received}, sort_keys=True))],
                          reward=reward)

    @tool
    async def reset(self, params: AnswerInput) -> ToolOutput:
        """A tool that happens to be called reset."""
        return self._reply("reset", params, reward=0.25)

    @tool
    async def get_reward(self) -> ToolOutput:
        """A tool that happens to be called get_reward; its reward is negative."""
        return self._reply("get_reward", None, reward=-1.0)

    @tool
    async def _private(self) -> ToolOutput:
        """A tool whose name starts with an underscore."""
        return self._reply("_private", None)

    @tool
    async def keywords(self, params: KeywordParams) -> ToolOutput:
        """Parameters with hostile names."""
        return self._reply("keywords", params)

    @tool
    async def tree(self, params: TreeInput) -> ToolOutput:
        """A recursive input schema."""
        return self._reply("tree", params)

    @tool
    async def deep(self, params: Deep) -> ToolOutput:
        """A deeply nested input schema."""
        return self._reply("deep", params)


async def _run_shell(self: HostileEnvironment, params: AnswerInput) -> ToolOutput:
    return self._reply("run-shell", params)


async def _class_tool(self: HostileEnvironment) -> ToolOutput:
    return self._reply("class", None)


_run_shell.__doc__ = HOSTILE_DESCRIPTION
_class_tool.__doc__ = "A tool named like a Python keyword."
# Names that cannot be written as methods; the reference server finds tools with dir()/getattr().
setattr(HostileEnvironment, "run-shell", tool(_run_shell))
setattr(HostileEnvironment, "class", tool(_class_tool))


# --------------------------------------------------------------------------------------------------
# 10. The demo environment
# --------------------------------------------------------------------------------------------------


class DemoEchoInput(BaseModel):
    text: str = Field(description="The word to echo.")


class DemoEnvironment(_FixtureEnvironment):
    """The environment `ors-trl demo` trains against: the task logic of `ors_trl.demo._task`, served over ORS.

    Splits: ``train`` (the training tasks) and ``test`` (held-out phrasings). One tool, ``echo(text)``,
    scored by ``_task.score``: reward 1.0 and finished on the rewarded word, 0.0 otherwise.
    """

    @classmethod
    def list_tasks(cls, split: str) -> list[JSONObject]:
        from ors_trl.demo import _task

        return _task.train_tasks() if split == "train" else _task.heldout_tasks()

    async def get_prompt(self) -> list[TextBlock]:
        from ors_trl.demo import _task

        return [_text(_task.prompt(dict(self.task_spec)))]

    @tool
    async def echo(self, params: DemoEchoInput) -> ToolOutput:
        """Echo a word back to the environment."""
        from ors_trl.demo import _task

        self._count("echo")
        reward, finished, reply = _task.score(dict(self.task_spec), {"text": params.text})
        return ToolOutput(blocks=[_text(reply)], reward=reward, finished=finished)


# --------------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------------

#: Short name -> class, in the launcher's default order (the first is the server's default env).
ENVIRONMENTS: dict[str, type[Environment]] = {
    "echo": EchoEnvironment,
    "tasktools": TaskToolsEnvironment,
    "image": ImageEnvironment,
    "long": LongOutputEnvironment,
    "schema": SchemaEnvironment,
    "sparse": SparseEnvironment,
    "slow": SlowEnvironment,
    "mixed": MixedEnvironment,
    "hostile": HostileEnvironment,
    "demo": DemoEnvironment,
}


def resolve_environments(names: str | list[str] | tuple[str, ...] = "all") -> list[type[Environment]]:
    """Map ``"all"`` or short names / wire keys (``"echo"``, ``"echoenvironment"``) to classes, in order."""
    if isinstance(names, str):
        names = [n for n in (part.strip() for part in names.split(",")) if n]
    if not names or list(names) == ["all"]:
        return list(ENVIRONMENTS.values())
    by_key = {cls.name().lower(): cls for cls in ENVIRONMENTS.values()}
    chosen: list[type[Environment]] = []
    for name in names:
        cls = ENVIRONMENTS.get(name.lower()) or by_key.get(name.lower())
        if cls is None:
            known = ", ".join([*ENVIRONMENTS, "all"])
            raise ValueError(f"unknown environment {name!r}; known: {known}")
        if cls not in chosen:
            chosen.append(cls)
    return chosen
