"""Which tasks a run uses, and their fields: selection checks, batched fetching, dataset columns (shared by the
spec, the mix and evaluation, below all three)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from ..protocol.client import AsyncClient
from ..protocol.errors import ConfigurationError, ProtocolError
from ..protocol.text import show_name

__all__ = ["EXTRA_COLUMN", "MAX_FIELD_DEPTH", "MAX_TASK_COLUMNS", "MAX_WHOLE_SPLIT", "RESERVED_COLUMNS",
           "SPARSE_FIELD", "TRL_KEYWORDS", "check_in_range", "check_selection", "fetch_tasks", "is_int", "json_text",
           "select", "task_columns"]

logger = logging.getLogger("ors_trl")

#: Names TRL passes to every reward function itself or reads from a row (`prompt`, `image(s)`, `environment`), as
#: verified for `ors_trl.trl.backend.VERIFIED` (tests/test_architecture.py reads them out of TRL's source).
TRL_KEYWORDS = frozenset({"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric",
                          "environments", "prompt", "completion", "image", "images", "environment"})
#: Names a task field may not keep as its column (it becomes `task_<name>`): `TRL_KEYWORDS`, ors-trl's own columns
#: and parameters, and the fields the rollout engine adds to every row (`env_mask`, any `ors_...`).
RESERVED_COLUMNS = TRL_KEYWORDS | {"prompt", "task_index", "task_spec", "self", "unscored_reward", "env_mask"}
_RESERVED_PREFIX = "ors_"
#: The most tasks a split may claim when the whole of it is selected (past it, the user picks: `num_tasks`, `indices`).
MAX_WHOLE_SPLIT = 100_000
_PAGE = 500
#: A task field has a column of its own when one task in `SPARSE_FIELD` has it and it is among the `MAX_TASK_COLUMNS`
#: most common; the others share `EXTRA_COLUMN`, JSON text (a table has at most `SPARSE_FIELD` cells per value held).
SPARSE_FIELD = 16
MAX_TASK_COLUMNS = 128
EXTRA_COLUMN = "task_extra"
_MIN_CELLS = 4096
#: A field's value nested deeper is JSON text: Arrow refuses 64 levels, `datasets` recurses ~16 frames per level.
MAX_FIELD_DEPTH = 16
_FETCH_CONCURRENCY = 8


def is_int(value: Any, low: int | None = None) -> bool:
    """`value` is an int (not a bool), at least `low` where given."""
    return isinstance(value, int) and not isinstance(value, bool) and (low is None or value >= low)


def check_selection(num_tasks: int | None, indices: Sequence[int] | None) -> list[int] | None:
    """A `num_tasks` / `indices` choice checked; `indices` as a list."""
    if num_tasks is not None and indices is not None:
        raise ConfigurationError("Provide num_tasks or indices, not both.")
    if num_tasks is not None and not is_int(num_tasks, 1):
        raise ConfigurationError(f"num_tasks must be a positive int, got {num_tasks!r}")
    if indices is None:
        return None
    indices = list(indices)
    if not indices:
        raise ConfigurationError("indices is empty; pass at least one task index or leave it None.")
    bad = [i for i in indices if not is_int(i, 0)]
    if bad:
        raise ConfigurationError(f"indices must be non-negative ints; got {bad[:5]}")
    return indices


def check_in_range(indices: Sequence[int], total: int, split: str) -> None:
    """Refuse an index past the split's end, naming the valid range."""
    out_of_range = sorted({i for i in indices if i >= total})
    if out_of_range:
        raise ConfigurationError(f"indices {out_of_range[:10]} are out of range for split {split!r}, which has "
                                 f"{total} tasks (0..{total - 1}).")


def select(total: int, split: str, num_tasks: int | None, indices: Sequence[int] | None, *, name: str = "",
           warn: bool = True) -> list[int]:
    """The task indices of a selection: `indices`, else the first `num_tasks`, else all (`MAX_WHOLE_SPLIT` at most);
    never none (an empty split would train on nothing, or take a mix's rows with it)."""
    if total == 0:
        raise ConfigurationError(f"{name + ': ' if name else ''}split {split!r} has no tasks; choose a split that has.")
    if indices is not None:
        check_in_range(indices, total, split)
        return list(indices)
    if num_tasks is None and total > MAX_WHOLE_SPLIT:
        raise ConfigurationError(
            f"{name + ': ' if name else ''}split {split!r} has {total} tasks, more than the {MAX_WHOLE_SPLIT} a whole "
            "split may be loaded with; pass num_tasks=N (the first N tasks) or indices=[...] (a page of them).")
    if num_tasks is not None and num_tasks > total and warn:
        logger.warning("%s: num_tasks=%d but split %r has %d tasks; using all %d.", name, num_tasks, split, total,
                       total)
    return list(range(total if num_tasks is None else min(num_tasks, total)))


async def fetch_tasks(client: AsyncClient, split: str, wanted: Sequence[int], *, name: str = "",
                      progress: bool = True) -> dict[int, Any]:
    """The task specs of `wanted` indices, in pages of contiguous runs; a progress bar where there are many and
    `progress`."""
    from tqdm.auto import tqdm

    wanted_set = set(wanted)
    runs: list[tuple[int, int]] = []
    for i in sorted(wanted_set):
        if runs and i - runs[-1][1] <= 8 and i - runs[-1][0] < _PAGE:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    gate = asyncio.Semaphore(_FETCH_CONCURRENCY)
    bar = tqdm(total=len(wanted_set), desc=f"tasks from {name}", unit="task", leave=False,
               disable=not progress or (len(runs) <= 4 and len(wanted_set) <= 2 * _PAGE))
    out: dict[int, Any] = {}

    async def fetch(start: int, stop: int) -> None:
        async with gate:
            tasks = await client.task_range(split, start, stop)
        if len(tasks) != stop - start:
            raise ProtocolError(f"task_range({start}, {stop}) returned {len(tasks)} tasks")
        for offset, task in enumerate(tasks):
            if start + offset in wanted_set:
                out[start + offset] = task
        bar.update(sum(1 for i in range(start, stop) if i in wanted_set))

    try:
        await asyncio.gather(*(fetch(a, b) for a, b in runs))
    finally:
        bar.close()
    return out


def _arrow_safe(values: list[Any]) -> bool:
    import pyarrow as pa

    try:
        pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError, TypeError, ValueError,
            RecursionError):
        return False
    return True


def _as_json(values: list[Any]) -> str | None:
    """Why a column's values must be JSON text, or None: nested past `MAX_FIELD_DEPTH`, a key with a NUL (Arrow cuts
    the name there), or objects whose keys differ so much that Arrow's struct would be a sparse table."""
    paths: dict[tuple[int, str | None], int] = {}  # (parent path, key; None: a list's items) -> path id
    objects: Counter[int] = Counter()
    keys: dict[int, set[str]] = {}
    entries = 0
    stack: list[tuple[Any, int, int]] = [(v, 1, 0) for v in values if isinstance(v, Mapping | list | tuple)]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, Mapping | list | tuple) and depth > MAX_FIELD_DEPTH:
            return f"values nested more than {MAX_FIELD_DEPTH} levels deep"
        if isinstance(value, Mapping):
            objects[path] += 1
            seen = keys.setdefault(path, set())
            for key, item in value.items():
                if isinstance(key, str) and "\x00" in key:
                    return "keys with a NUL in them"
                seen.add(key)
                entries += 1
                if isinstance(item, Mapping | list | tuple):
                    stack.append((item, depth + 1, paths.setdefault((path, key), len(paths) + 1)))
        elif isinstance(value, list | tuple):
            items = paths.setdefault((path, None), len(paths) + 1)
            stack.extend((item, depth + 1, items) for item in value if isinstance(item, Mapping | list | tuple))
    if sum(count * len(keys[path]) for path, count in objects.items()) > SPARSE_FIELD * entries + _MIN_CELLS:
        return "objects whose keys differ from task to task"
    return None


def json_text(value: Any) -> str:
    """`value` as JSON text (keys sorted, what JSON cannot hold as its `str`), however deeply nested."""
    try:
        return json.dumps(value, sort_keys=True, default=str)
    except RecursionError:
        pass
    parts: list[str] = []
    stack: list[tuple[bool, Any]] = [(False, value)]  # (literal text?, item)
    while stack:
        literal, item = stack.pop()
        if literal:
            parts.append(item)
        elif isinstance(item, Mapping | list | tuple):
            pairs = sorted(item.items(), key=lambda kv: str(kv[0])) if isinstance(item, Mapping) else list(item)
            stack.append((True, "}" if isinstance(item, Mapping) else "]"))
            for i, pair in enumerate(reversed(pairs)):
                if isinstance(item, Mapping):
                    stack += [(False, pair[1]), (True, json.dumps(str(pair[0])) + ": ")]
                else:
                    stack.append((False, pair))
                if i < len(pairs) - 1:
                    stack.append((True, ", "))
            stack.append((True, "{" if isinstance(item, Mapping) else "["))
        else:
            parts.append(json.dumps(item, default=str))
    return "".join(parts)


def _reserved(name: str, reserved: frozenset[str]) -> bool:
    return name in reserved or name.startswith(_RESERVED_PREFIX)


def _free(name: str, taken: set[str], reserved: frozenset[str]) -> str:
    """`name` as a column: prefixed with `task_` until it is neither taken nor reserved; it is taken then."""
    while name in taken or _reserved(name, reserved):
        name = f"task_{name}"
    taken.add(name)
    return name


def task_columns(task_specs: Sequence[Any], reserved: frozenset[str] = RESERVED_COLUMNS
                 ) -> tuple[dict[str, list[Any]], list[str]]:
    """Task fields as dataset columns, and notes on what had to change (never fails, loses nothing): a reserved name
    becomes `task_<name>`, a NUL in a name U+FFFD; values Arrow cannot hold in one column are JSON text; sparse fields
    share `EXTRA_COLUMN` (else a tasks x fields table: 6,000 tasks of 69 KB made 36 million cells, +1.9 GB)."""
    notes: list[str] = []
    counts = Counter(k for spec in task_specs if isinstance(spec, Mapping) for k in spec if isinstance(k, str))
    ranked = sorted(counts, key=lambda k: (-counts[k], k))
    own = {k for k in ranked[:MAX_TASK_COLUMNS] if counts[k] * SPARSE_FIELD >= len(task_specs)}
    extra = [k for k in ranked if k not in own]
    taken = set(counts) | set(reserved)
    renamed: list[str] = []
    columns: dict[str, list[Any]] = {}
    for key in sorted(own):
        column = key.replace("\x00", "\ufffd")
        if column != key or _reserved(key, reserved):
            column = _free(column, taken, reserved)
            renamed.append(f"{key!r} -> {column!r}" if "\x00" in key else f"{key} -> {column}")
        values = [spec.get(key) if isinstance(spec, Mapping) else None for spec in task_specs]
        why = _as_json(values) or (None if _arrow_safe(values) else "values of mixed shapes")
        if why:
            values = [None if v is None else json_text(v) for v in values]
            notes.append(f"task field {column!r} has {why}; stored as JSON text")
        columns[column] = values
    if extra:
        column = _free(EXTRA_COLUMN, taken, reserved)
        wanted = set(extra)
        columns[column] = [json_text(rest) if isinstance(spec, Mapping) and (rest := {
            k: v for k, v in spec.items() if k in wanted}) else None for spec in task_specs]
        more = f" (+{len(extra) - 20} more)" if len(extra) > 20 else ""
        shown = ", ".join(show_name(k, 40) for k in extra[:20]) + more
        notes.append(f"{len(extra)} task field(s) that fewer than 1 in {SPARSE_FIELD} tasks have, or past the "
                     f"{MAX_TASK_COLUMNS} most common, are stored together as JSON text in column {column!r} (an "
                     f"object of each task's own): {shown}")
    if renamed:
        notes.insert(0, "task fields renamed in the dataset (TRL or ors-trl passes these names itself, or Arrow "
                        f"cannot store them): {', '.join(renamed)}")
    return columns, notes


def log_notes(notes: list[str], name: str) -> None:
    """Log what building the dataset changed, one line each."""
    for note in notes:
        logger.warning("%s: %s", name, note)
