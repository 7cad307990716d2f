"""The report's inputs, recognised by content: JSON lines of episode records of any version, trainer states (a file or
a trainer output folder, also its latest `checkpoint-*`). Anything else is a `ConfigurationError` saying what was
expected; the page never replaces one of its inputs."""

from __future__ import annotations

import contextlib
import logging
import os
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.records import parse_line, read_records
from ..protocol.errors import ConfigurationError

logger = logging.getLogger("ors_trl")

_LONG_LINE = 64 * 1024 * 1024  # a line longer than this is not an episode record
_MAX_STATE_BYTES = 1024 ** 3
_EXPECTED = ("expected JSON lines of episode records (episode_log=, ors-trl eval --output), a trainer output folder, "
             "or a trainer_state.json")


@dataclass
class Input:
    """One recognised input: "episodes" or a "trainer_state" (parsed: `state`); `run`: the name the user gave it."""

    path: Path
    kind: str
    label: str
    state: dict[str, Any] | None = None
    run: str | None = None


def is_record(obj: Any) -> bool:
    """A JSON object shaped like an episode record of any version."""
    return isinstance(obj, dict) and ("turns" in obj or "calls" in obj or (
        "reward" in obj and ("environment" in obj or "task_index" in obj)))


def _trainer_state_in(folder: Path) -> Path | None:
    """A trainer output folder's `trainer_state.json`: its own, else the latest checkpoint's."""
    def latest_first(p: Path) -> tuple[int, str]:
        step = p.name.rsplit("-", 1)[1]
        return (int(step) if step.isdigit() else -1), p.name

    folders = (folder, *sorted(folder.glob("checkpoint-*"), key=latest_first, reverse=True))
    return next((p / "trainer_state.json" for p in folders if (p / "trainer_state.json").is_file()), None)


def recognise(raw: str | os.PathLike[str]) -> Input:
    """What one input is, by content; a ConfigurationError says clearly why it is none of them."""
    path = Path(raw)
    if not path.exists():
        raise ConfigurationError(f"{path}: no such file or folder")
    if path.is_dir():
        state = _trainer_state_in(path)
        if state is None:
            raise ConfigurationError(f"{path}: a folder without trainer_state.json (nor in checkpoint-*/); "
                                     f"{_EXPECTED}")
        return _state(state)
    try:
        with path.open("rb") as fh:
            head = [fh.readline(_LONG_LINE) for _ in range(20)]
    except OSError as exc:
        raise ConfigurationError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
    lines = [line for line in head if line.strip()]
    if not lines:
        logger.warning("%s is empty: no episodes in it", path)
        return Input(path, "episodes", path.name)
    for line in lines:
        obj, _ = parse_line(line)  # None: a cut line, a pretty-printed document, not JSON at all
        if isinstance(obj, dict) and isinstance(obj.get("log_history"), list):
            return _state(path, obj)
        if is_record(obj):
            return Input(path, "episodes", path.name)
    if lines[0].lstrip().startswith(b"{"):
        return _state(path)
    raise ConfigurationError(f"{path}: not an episode log, eval output or trainer state; {_EXPECTED}")


def _state(path: Path, doc: Any = None) -> Input:
    """A trainer state (its document read whole unless given), named after its trainer output folder."""
    if doc is None:
        try:
            if path.stat().st_size > _MAX_STATE_BYTES:
                raise ConfigurationError(f"{path}: too large for a trainer state")
            doc, _ = parse_line(path.read_bytes())
        except OSError as exc:
            raise ConfigurationError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("log_history"), list):
        raise ConfigurationError(f"{path}: not an episode log, eval output or trainer state (no episode records, "
                                 f"no log_history); {_EXPECTED}")
    parent = path.parent
    label = (parent.parent if parent.name.startswith("checkpoint-") else parent).name or str(parent)
    return Input(path, "trainer_state", label, doc)


def recognise_all(inputs: Sequence[str | os.PathLike[str]],
                  labels: Sequence[tuple[str, str | os.PathLike[str]]] = ()) -> list[Input]:
    """Every input (and labelled file) recognised, each file once, a labelled one named after its label."""
    found: dict[Path, Input] = {}
    for raw in inputs:
        item = recognise(raw)
        found.setdefault(item.path.resolve(), item)
    for name, raw in labels:
        if not isinstance(name, str) or not name.strip():
            raise ConfigurationError(f"the label of {raw} has no name; write NAME=FILE")
        item = recognise(raw)
        item = found.setdefault(item.path.resolve(), item)
        if item.run is not None and item.run != name:
            raise ConfigurationError(f"{raw} is labelled twice, {item.run!r} and {name!r}; give it one name")
        item.run = name
        if item.kind == "trainer_state":
            item.label = name
    return list(found.values())


def episode_records(items: Sequence[Input], skipped: Counter[str]) -> Iterator[tuple[dict[str, Any], Input]]:
    """Every episode record (current shape) with its input; the other lines are counted in `skipped` by reason."""
    for item in items:
        if item.kind != "episodes":
            continue
        for record in read_records(item.path, skipped):
            if is_record(record):
                yield record, item
            else:
                skipped["not an episode record"] += 1


def check_not_an_input(out: Path, items: Sequence[Input]) -> None:
    """Refuse to write the page over a file it is made from (also through a link or another path to it)."""
    for item in items:
        with contextlib.suppress(OSError):  # an output that does not exist (or cannot be looked at) is no input
            if os.path.samefile(out, item.path):
                raise ConfigurationError(f"the output {out} is the input {item.path}: writing the page there would "
                                         "replace it; pass another --output")
