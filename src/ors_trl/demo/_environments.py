"""The environments of the demo and `ors-trl serve-echo` (`ENVIRONMENTS`): `echo` (TRL's guide task), `demo` and
`look` (`_task`'s tasks), `card` (the word only in an image; needs Pillow), `corridor` (long-horizon: ~30 calls with
per-call progress). Each counts its setups, teardowns and tool calls (`ors_trl.testing.counters`)."""

from __future__ import annotations

import base64
import importlib.util
import io
import os
import random

from openreward.environments import (
    Environment,
    ImageBlock,
    JSONObject,
    Message,
    Split,
    TextBlock,
    ToolOutput,
    terminal,
    tool,
)
from pydantic import BaseModel, Field

from ors_trl.testing import counters

from . import _task

__all__ = ["CARD_SAMPLE", "CARD_SIZE", "CARD_SYSTEM", "CARD_WORDS", "ENVIRONMENTS", "CardEnvironment",
           "CorridorEnvironment", "CountedEnvironment", "DemoEnvironment", "EchoEnvironment", "LookEnvironment",
           "card_png"]


class CountedEnvironment(Environment):
    """Base class: train/test splits, and setups, teardowns and tool calls counted for `/_test/stats`."""

    @classmethod
    def list_splits(cls) -> list[Split | str]:
        return [Split(name="train", type="train"), Split(name="test", type="test")]

    @classmethod
    def key(cls) -> str:
        """The environment's key on the wire (the lower-cased class name)."""
        return cls.name().lower()

    async def setup(self) -> None:
        counters.count(self.key(), "setups")

    async def teardown(self) -> None:
        counters.count(self.key(), "teardowns")

    def _count(self, tool_name: str) -> None:
        counters.count(f"{self.key()}/{tool_name}")

    @classmethod
    def unavailable(cls) -> str | None:
        """Why the environment cannot be served here (a package it needs is missing), or None."""
        return None


def _text(text: str) -> TextBlock:
    return TextBlock(text=text)


_ECHO_TRAIN_WORDS = ["hello", "world", "trl", "openreward", "spec", "factory", "delta", "gradient", "policy", "reward",
                     "rollout", "token", "sample", "banana", "quartz", "lantern"]
_ECHO_TEST_WORDS = ["orbit", "meadow", "cipher", "pebble", "violet", "harbor", "zephyr", "nimbus"]


class EchoInput(BaseModel):
    text: str = Field(description="The text to echo back. It must equal the target exactly.")


class EchoEnvironment(CountedEnvironment):
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
        return ToolOutput(blocks=[_text(params.text)], reward=1.0 if match else 0.0, finished=match,
                          metadata={"target_length": len(target)})


class DemoEchoInput(BaseModel):
    text: str = Field(description="The word to echo.")


class DemoEnvironment(CountedEnvironment):
    """`ors-trl demo --task echo`'s environment: `_task`'s echo tasks (`test`: held-out phrasings) and its `score`."""

    @classmethod
    def list_tasks(cls, split: str) -> list[JSONObject]:
        return _task.train_tasks() if split == "train" else _task.heldout_tasks()

    async def get_prompt(self) -> list[TextBlock]:
        return [_text(_task.prompt(dict(self.task_spec)))]

    @tool
    async def echo(self, params: DemoEchoInput) -> ToolOutput:
        """Echo a word back to the environment."""
        self._count("echo")
        reward, finished, reply = _task.score(dict(self.task_spec), {"text": params.text})
        return ToolOutput(blocks=[_text(reply)], reward=reward, finished=finished)


class LookAnswer(BaseModel):
    answer: str = Field(description=_task.ANSWER_DESCRIPTION)


class LookEnvironment(CountedEnvironment):
    """`ors-trl demo`'s environment: `_task`'s look tasks (splits `train`, `test`, `blind` and the pools), the
    conversation as `/messages`; `look()` is an ordinary, unscored tool, `answer` the `@terminal` tool that grades the
    model's final plain message (`_task.grade`) and finishes the episode."""

    @classmethod
    def list_splits(cls) -> list[Split | str]:
        return [*super().list_splits(), Split(name="blind", type="test"),
                *(Split(name=pool, type="train") for pool in _task.POOLS)]

    @classmethod
    def list_tasks(cls, split: str) -> list[JSONObject]:
        return _task.look_tasks(split) if split in _task.LOOK_SPLITS else []

    async def get_messages(self) -> list[Message]:
        messages = _task.look_messages(dict(self.task_spec))
        return [Message(role=m["role"], blocks=[_text(m["content"])]) for m in messages]

    @tool
    async def look(self) -> ToolOutput:
        """Look under the cup and see the hidden word."""
        self._count(_task.LOOK_TOOL)
        return ToolOutput(blocks=[_text(str(self.task_spec["reply"]))], reward=None, finished=False)

    @terminal
    @tool
    async def answer(self, params: LookAnswer) -> ToolOutput:
        """Grade the model's final message."""
        self._count(_task.ANSWER_TOOL)
        reward, reply, metadata = _task.grade(dict(self.task_spec), params.answer)
        return ToolOutput(blocks=[_text(reply)], reward=reward, finished=True, metadata=metadata)


#: CardEnvironment's words (task i shows CARD_WORDS[i]), its system turn, the sample card's word, a card's size.
CARD_WORDS = ["cat", "sun", "map", "key"]
CARD_SYSTEM = "Read the word on the card: call `look`, then `say` the word you read."
CARD_SAMPLE = "demo"
CARD_SIZE = (56, 28)
_NEEDS_PILLOW = ("the card environment draws its cards with Pillow, which is not installed: "
                 "pip install 'ors-trl[vision]'")


def card_png(word: str, size: tuple[int, int] = CARD_SIZE) -> bytes:
    """A card with `word` written on it, drawn with Pillow (black on white, Pillow's default font), as PNG bytes."""
    try:
        from PIL import Image, ImageDraw
    except ImportError:
        raise ImportError(_NEEDS_PILLOW) from None

    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).text((4, 8), word, fill="black")
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def card_block(word: str) -> ImageBlock:
    """`card_png(word)` as an ORS image block."""
    return ImageBlock(data=base64.b64encode(card_png(word)).decode("ascii"), mimeType="image/png")


class CardWord(BaseModel):
    text: str = Field(description="The word you read on your card.")


class CardEnvironment(CountedEnvironment):
    """The word is only in an image: a conversation (`/messages`: the rules as a system turn, a user turn with a
    sample card; split `test`: no sample, a text-only prompt), `look()` answers with the task's card,
    `say(text)` gives 1.0 and finishes for the card's word, 0.0 (and goes on) otherwise. Needs Pillow."""

    @classmethod
    def unavailable(cls) -> str | None:
        return _NEEDS_PILLOW if importlib.util.find_spec("PIL") is None else None

    @classmethod
    def list_tasks(cls, split: str) -> list[JSONObject]:
        return [{"id": f"card-{split}-{i}", "word": word, "sample": split == "train"}
                for i, word in enumerate(CARD_WORDS)]

    async def get_messages(self) -> list[Message]:
        sample = [_text("A sample card:"), card_block(CARD_SAMPLE)] if self.task_spec["sample"] else []
        return [Message(role="system", blocks=[_text(CARD_SYSTEM)]),
                Message(role="user", blocks=[*sample, _text("Now read yours.")])]

    @tool
    async def look(self) -> ToolOutput:
        """Look at your card."""
        self._count("look")
        return ToolOutput(blocks=[_text("Your card:"), card_block(self.task_spec["word"])], reward=None)

    @tool
    async def say(self, params: CardWord) -> ToolOutput:
        """Say the word on your card."""
        self._count("say")
        right = params.text == self.task_spec["word"]
        return ToolOutput(blocks=[_text("right" if right else "wrong")], reward=1.0 if right else 0.0, finished=right)


_DOOR_WORDS = ["amber", "birch", "cedar", "dune", "ember", "fjord", "grove", "heron", "iris", "jade", "kelp", "lilac",
               "maple", "nectar", "opal", "pine", "quill", "reed", "sage", "thyme"]
#: Sandbox death on demand (for tests of failures mid-episode): `"CALL:EVERY"` makes the session of every EVERY-th
#: setup die at its CALL-th tool call (the tool raises, as a dead sandbox's would); unset: no death.
CORRIDOR_DEATH_ENV = "ORS_CORRIDOR_DEATH"
#: Shorter corridors (for a tiny model, `benchmarks/bench_credit.py`): `"ROOMS"` or `"ROOMS:WORDS"`, the rooms of every
#: task and how many of the door words are used; unset: 30 rooms, every word.
CORRIDOR_SIZE_ENV = "ORS_CORRIDOR_SIZE"


def _corridor_size() -> tuple[int, int]:
    rooms, _, words = os.environ.get(CORRIDOR_SIZE_ENV, "").partition(":")
    return int(rooms or 30), int(words or len(_DOOR_WORDS))


class DoorInput(BaseModel):
    word: str = Field(description="The word written on the door in front of you.")


class CorridorEnvironment(CountedEnvironment):
    """A long-horizon task: a corridor of rooms (30 by default, the task's `rooms`). Each door opens with the word
    written on it, which the last result (or the prompt) shows: 0.1 per room passed, 1.0 and finished at the exit,
    0.0 for a wrong word (the door stays shut). `ORS_CORRIDOR_DEATH` kills sandboxes mid-episode on demand."""

    setups = 0  # in this server process: which session a death knob picks

    @classmethod
    def list_tasks(cls, split: str) -> list[JSONObject]:
        rooms, words = _corridor_size()
        return [{"id": f"corridor-{split}-{i}", "rooms": rooms, "words": words,
                 "seed": i + (0 if split == "train" else 10_000)}
                for i in range(64 if split == "train" else 16)]

    async def setup(self) -> None:
        await super().setup()
        type(self).setups += 1
        call, _, every = os.environ.get(CORRIDOR_DEATH_ENV, "").partition(":")
        self.room, self.calls = 0, 0
        self.dies_at = int(call) if call and type(self).setups % int(every or 1) == 0 else None

    def _door(self) -> str:
        words = _DOOR_WORDS[:self.task_spec.get("words") or len(_DOOR_WORDS)]
        return random.Random(self.task_spec["seed"] * 1000 + self.room).choice(words)

    async def get_prompt(self) -> list[TextBlock]:
        rooms = self.task_spec["rooms"]
        return [_text(f"You are in room 1 of a corridor of {rooms} rooms. Open each door with `open_door`, giving the "
                      f"word written on it, until you are out. The door in front of you says: {self._door()}.")]

    @tool
    async def open_door(self, params: DoorInput) -> ToolOutput:
        """Open the door in front of you with the word written on it."""
        self._count("open_door")
        self.calls += 1
        if self.dies_at is not None and self.calls >= self.dies_at:
            raise RuntimeError("the sandbox is gone")
        if params.word.strip().lower() != self._door():
            return ToolOutput(blocks=[_text(f"The door stays shut. It says: {self._door()}.")], reward=0.0)
        self.room += 1
        rooms = self.task_spec["rooms"]
        if self.room == rooms:
            return ToolOutput(blocks=[_text("You are out of the corridor.")], reward=1.0, finished=True)
        return ToolOutput(blocks=[_text(f"Room {self.room + 1} of {rooms}. The door says: {self._door()}.")],
                          reward=0.1, metadata={"room": self.room})


#: Short name -> class, for `ors-trl serve-echo --envs` (the first is the server's default environment).
ENVIRONMENTS: dict[str, type[Environment]] = {"echo": EchoEnvironment, "demo": DemoEnvironment,
                                              "look": LookEnvironment, "card": CardEnvironment,
                                              "corridor": CorridorEnvironment}
