"""`ors-trl report`: one self-contained HTML page of what the episodes did and how training went. The inputs are
recognised here by content (JSON lines of episode records of any version; trainer states, a file or a trainer output
folder, also its latest `checkpoint-*`; anything else is a `ConfigurationError` saying what was expected), `tally`
counts episodes and samples bodies, `render` draws the curves and writes the page, never over one of its inputs. A
line that is not a record is skipped and counted on the page; a chart matplotlib cannot draw is a note.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import stat
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.metrics import DEFAULT_SUCCESS_THRESHOLD
from ..core.records import parse_line, read_records
from ..core.stats import check_threshold
from ..protocol.errors import ConfigurationError
from ..protocol.files import write_atomic
from ..tasks.selection import is_int
from .render import render
from .tally import DEFAULT_MAX_EPISODES, Input, Tally

__all__ = ["ReportSummary", "write_report"]


@dataclass
class ReportSummary:
    """What [`write_report`] wrote: the counts behind the page, and where it is.

    Attributes:
        output (`str`):
            The page's path.
        episodes (`int`):
            Episode records counted (every one, embedded or not).
        embedded (`int`):
            Episode bodies embedded in the page (a deterministic sample).
        environments (`list[str]`):
            The environments' names, sorted.
        runs (`int`):
            The runs set side by side (named inputs; else by process run, source, policy and step).
        run_names (`list[str]`):
            Their names, in the page's order.
        tasks (`int`):
            Distinct tasks (environment and task).
        trainer_states (`int`):
            Trainer states read for the curves.
        log_steps (`int`):
            Logged training steps the curves draw.
        bytes (`int`):
            The page's size.
        skipped (`int`):
            Lines of the inputs that were not episode records (cut, corrupt, foreign).
        skipped_reasons (`dict[str, int]`):
            `skipped` by reason.
    """

    output: str
    episodes: int
    embedded: int
    environments: list[str]
    runs: int
    tasks: int
    trainer_states: int
    log_steps: int
    bytes: int
    run_names: list[str] = field(default_factory=list)
    skipped: int = 0
    skipped_reasons: dict[str, int] = field(default_factory=dict)


logger = logging.getLogger("ors_trl")

_LONG_LINE = 64 * 1024 * 1024  # a line longer than this is not an episode record
_MAX_STATE_BYTES = 1024 ** 3
_EXPECTED = ("expected JSON lines of episode records (episode_log=, ors-trl eval --output), a trainer output folder, "
             "or a trainer_state.json")


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
            return _state(path)
        if is_record(obj):
            return Input(path, "episodes", path.name)
    if lines[0].lstrip().startswith(b"{"):
        return _state(path)
    raise ConfigurationError(f"{path}: not an episode log, eval output or trainer state; {_EXPECTED}")


def _state(path: Path) -> Input:
    """A trainer state (its document read whole), named after its trainer output folder."""
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


def write_report(inputs: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
                 output: str | os.PathLike[str] = "report.html", *,
                 max_episodes: int = DEFAULT_MAX_EPISODES, title: str | None = None,
                 success_threshold: float | None = None,
                 labels: Mapping[str, str | os.PathLike[str]] | Sequence[tuple[str, str | os.PathLike[str]]] = (),
                 ) -> ReportSummary:
    """Write one self-contained HTML page about episode logs, eval outputs and trainer logs.

    The page (nothing is fetched when it opens) shows the runs side by side (against the first: each shared task's
    change, the tasks that flipped, a paired test over tasks of whether the difference is beyond noise), a summary
    of every episode, the curves of the trainers' `log_history` (evaluation during training's pass@k included), a
    sortable table per task and a browser of a deterministic sample of episode bodies.

    Args:
        inputs (`str`, `os.PathLike` or a sequence of them):
            Episode logs (`episode_log=`) and eval outputs (`ors-trl eval --output`) of any record version, trainer
            output folders (their `trainer_state.json`, or the latest `checkpoint-*`'s) and `trainer_state.json`
            files, in any order: recognised by content.
        output (`str` or `os.PathLike`, *optional*, defaults to `"report.html"`):
            The HTML file to write, replaced whole at once; it may not be one of the `inputs`.
        max_episodes (`int`, *optional*, defaults to `2000`):
            Episode bodies embedded (`0`: none; 12 MB at most), a deterministic sample that keeps examples of every
            failure, error, unscored and end reason, environment and run.
        title (`str`, *optional*):
            The page's title; by default one naming the environments.
        success_threshold (`float`, *optional*):
            The reward at or above which an episode succeeded (by default 1.0); one given must lie within the
            rewards seen.
        labels (`Mapping[str, path]` or a sequence of `(name, path)`, *optional*):
            Names for the runs of these episode inputs (each also an input), in the page's order, the first the
            baseline; needed where inputs hold one process's episodes of the same task (before and after training).

    Raises:
        `ConfigurationError`: An input or labelled file that is missing, unreadable or not a log; two inputs that
            hold one run's episodes of a task; an `output` that is one of the inputs; an invalid `max_episodes` or
            `success_threshold`. Nothing is written then.
        `OSError`: The page cannot be written.
    """
    if not is_int(max_episodes, 0):
        raise ConfigurationError(f"max_episodes must be an int >= 0, got {max_episodes!r}")
    threshold = DEFAULT_SUCCESS_THRESHOLD if success_threshold is None else success_threshold
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not math.isfinite(threshold):
        raise ConfigurationError(f"success_threshold must be a finite number, got {success_threshold!r}")
    if isinstance(inputs, str | os.PathLike):
        inputs = [inputs]
    named = list(labels.items()) if isinstance(labels, Mapping) else list(labels)
    if not inputs and not named:
        raise ConfigurationError("no inputs given")
    items = recognise_all(inputs, named)
    out = Path(output)
    for item in items:  # never the page over a file it is made from (also through a link or another path to it)
        with contextlib.suppress(OSError):  # an output that does not exist (or cannot be looked at) is no input
            if os.path.samefile(out, item.path):
                raise ConfigurationError(f"the output {out} is the input {item.path}: writing the page there would "
                                         "replace it; pass another --output")
    tally = Tally(max_episodes, float(threshold), list(dict.fromkeys(name for name, _ in named)))
    skipped: Counter[str] = Counter()
    for record, item in episode_records(items, skipped):
        try:
            tally.add(record, item.label, item.run, str(item.path))
        except ConfigurationError:
            raise
        except Exception as exc:  # a record shaped like no version: counted on the page, the rest stands
            skipped[f"unreadable as an episode ({type(exc).__name__})"] += 1
    if success_threshold is not None:
        check_threshold(threshold, tally.rewards)
    sample = tally.sample()
    page, steps = render(items, tally, sample, skipped, title)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:  # the page keeps the mode a page it replaces had; a new one is 0666 less the umask
        mode = stat.S_IMODE(out.stat().st_mode)
    except OSError:
        mode = 0o666
    write_atomic(out, page.encode("utf-8"), mode)  # whole or not at all, never through a name planted there
    names = [name for key, name in tally.run_names.items() if tally.runs[key].episodes]
    return ReportSummary(output=os.fspath(out), episodes=tally.total.episodes, embedded=len(sample.episodes),
                         environments=sorted(tally.envs), runs=len(names), run_names=names, tasks=len(tally.tasks),
                         trainer_states=sum(i.kind == "trainer_state" for i in items), log_steps=steps,
                         bytes=out.stat().st_size, skipped=skipped.total(), skipped_reasons=dict(skipped))
