"""`ors-trl report`: one self-contained HTML page of what the episodes did and how training went. `inputs` recognises
the inputs, `tally` counts episodes and samples bodies, `charts` draws the curves, `render` writes the page. A line
that is not a record is skipped and counted on the page; a chart matplotlib cannot draw is a note.
"""

from __future__ import annotations

import math
import os
import stat
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..core.metrics import DEFAULT_SUCCESS_THRESHOLD
from ..core.stats import check_threshold
from ..protocol.errors import ConfigurationError
from ..protocol.files import write_atomic
from ..tasks.selection import is_int
from .inputs import check_not_an_input, episode_records, recognise_all
from .render import render
from .tally import DEFAULT_MAX_EPISODES, Tally

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
    check_not_an_input(out, items)
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
