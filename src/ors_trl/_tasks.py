"""Which tasks a run uses, and their fields: selection checks, batched fetching, dataset columns.

Shared by the spec, the mix and evaluation, below all three (so none of them imports another).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from ._client import AsyncClient
from ._exceptions import ConfigurationError, ProtocolError
from ._trl import TRL_KEYWORDS

__all__ = ["MAX_WHOLE_SPLIT", "RESERVED_COLUMNS", "check_in_range", "check_selection", "fetch_tasks", "select",
           "task_columns"]

logger = logging.getLogger("ors_trl")

#: Names a task field may not keep as its dataset column: ors-trl's own columns (`prompt`, `task_index`, `task_spec`),
#: what TRL passes to `reset(**row)` and reward functions itself or reads from a row (`ors_trl._trl.TRL_KEYWORDS`),
#: the adapter's and the reward functions' own parameters (`self`, `unscored_reward`) and the fields the rollout
#: engine adds to every row (`env_mask`, and any name starting with `ors_`). Such a field is kept as `task_<name>`.
RESERVED_COLUMNS = frozenset({"prompt", "task_index", "task_spec", "self", "unscored_reward", "env_mask"}) | TRL_KEYWORDS
_RESERVED_PREFIX = "ors_"
#: The most tasks a split may claim when the whole of it is selected (no `num_tasks`, no `indices`): past it,
#: choosing which tasks is the user's (`num_tasks=N` takes the first N, `indices=` a page), not a server's count.
MAX_WHOLE_SPLIT = 100_000
_PAGE = 500
_FETCH_CONCURRENCY = 8


def check_selection(num_tasks: int | None, indices: Sequence[int] | None) -> list[int] | None:
    """Validate a `num_tasks` / `indices` choice (mutually exclusive); return `indices` as a list."""
    if num_tasks is not None and indices is not None:
        raise ConfigurationError("Provide num_tasks or indices, not both.")
    if num_tasks is not None and (isinstance(num_tasks, bool) or not isinstance(num_tasks, int) or num_tasks < 1):
        raise ConfigurationError(f"num_tasks must be a positive int, got {num_tasks!r}")
    if indices is None:
        return None
    indices = list(indices)
    if not indices:
        raise ConfigurationError("indices is empty; pass at least one task index or leave it None.")
    bad = [i for i in indices if isinstance(i, bool) or not isinstance(i, int) or i < 0]
    if bad:
        raise ConfigurationError(f"indices must be non-negative ints; got {bad[:5]}")
    return indices


def check_in_range(indices: Sequence[int], total: int, split: str) -> None:
    """Raise a `ConfigurationError` naming the valid range if any index is past the split's end."""
    out_of_range = sorted({i for i in indices if i >= total})
    if out_of_range:
        raise ConfigurationError(
            f"indices {out_of_range[:10]} are out of range for split {split!r}, which has {total} tasks "
            f"(0..{total - 1})."
        )


def select(total: int, split: str, num_tasks: int | None, indices: Sequence[int] | None, *, name: str = "",
           warn: bool = True) -> list[int]:
    """The task indices of a selection: `indices` as given (checked), else the first `num_tasks`, else all (at most
    `MAX_WHOLE_SPLIT`). The work is that of the selection, never of the split's size."""
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


async def fetch_tasks(client: AsyncClient, split: str, wanted: Sequence[int], *, name: str = "") -> dict[int, Any]:
    """The task specs of `wanted` indices, in as few `task_range` requests as sensible (pages of contiguous runs)."""
    runs: list[tuple[int, int]] = []
    for i in sorted(set(wanted)):
        if runs and i - runs[-1][1] <= 8 and i - runs[-1][0] < _PAGE:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    gate = asyncio.Semaphore(_FETCH_CONCURRENCY)
    wanted_set = set(wanted)
    bar = None
    if len(runs) > 4 or len(wanted_set) > 2 * _PAGE:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(wanted_set), desc=f"tasks from {name}", unit="task", leave=False)
    out: dict[int, Any] = {}

    async def fetch(start: int, stop: int) -> None:
        async with gate:
            tasks = await client.task_range(split, start, stop)
        if len(tasks) != stop - start:
            raise ProtocolError(f"task_range({start}, {stop}) returned {len(tasks)} tasks")
        for offset, task in enumerate(tasks):
            if start + offset in wanted_set:
                out[start + offset] = task
        if bar is not None:
            bar.update(sum(1 for i in range(start, stop) if i in wanted_set))

    try:
        await asyncio.gather(*(fetch(a, b) for a, b in runs))
    finally:
        if bar is not None:
            bar.close()
    return out


def _arrow_safe(values: list[Any]) -> bool:
    import pyarrow as pa

    try:
        pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError, TypeError, ValueError):
        return False
    return True


def _nul_keys(values: list[Any]) -> bool:
    """Whether a mapping anywhere in `values` has a key with a NUL in it: Arrow cuts such a name at the NUL (a column
    fails to build; a nested value silently loses its entry)."""
    stack: list[Any] = list(values)
    while stack:
        value = stack.pop()
        if isinstance(value, Mapping):
            if any(isinstance(k, str) and "\x00" in k for k in value):
                return True
            stack.extend(value.values())
        elif isinstance(value, list | tuple):
            stack.extend(value)
    return False


def _reserved(name: str, reserved: frozenset[str]) -> bool:
    return name in reserved or name.startswith(_RESERVED_PREFIX)


def task_columns(task_specs: Sequence[Any], reserved: frozenset[str] = RESERVED_COLUMNS
                 ) -> tuple[dict[str, list[Any]], list[str]]:
    """Task fields as dataset columns, plus notes on what had to change.

    A field named like a reserved column (see `RESERVED_COLUMNS`) is kept as `task_<name>` (prefixed again until
    the name is free), so that TRL can still call `reset(**row)` and the reward functions with the row; a NUL in a
    field's name, which Arrow cannot store, becomes U+FFFD; a field whose values Arrow cannot store in one column
    (mixed types, ragged nesting, a NUL in a nested key) is stored as JSON text, so dataset creation never fails
    and loses nothing.
    """
    notes: list[str] = []
    keys = list(dict.fromkeys(k for spec in task_specs if isinstance(spec, Mapping) for k in spec if isinstance(k, str)))
    taken = set(keys) | set(reserved)
    renamed: list[str] = []
    columns: dict[str, list[Any]] = {}
    for key in sorted(keys):
        column = key.replace("\x00", "\ufffd")
        if column != key or _reserved(key, reserved):
            while column in taken or _reserved(column, reserved):
                column = f"task_{column}"
            taken.add(column)
            renamed.append(f"{key!r} -> {column!r}" if "\x00" in key else f"{key} -> {column}")
        values = [spec.get(key) if isinstance(spec, Mapping) else None for spec in task_specs]
        nul = _nul_keys(values)
        if nul or not _arrow_safe(values):
            values = [None if v is None else json.dumps(v, sort_keys=True, default=str) for v in values]
            why = "keys with a NUL in them" if nul else "values of mixed shapes"
            notes.append(f"task field {column!r} has {why}; stored as JSON text")
        columns[column] = values
    if renamed:
        notes.insert(0, f"task fields renamed in the dataset (TRL or ors-trl passes these names itself, or "
                        "Arrow cannot store them): "
                        f"{', '.join(renamed)}")
    return columns, notes


def log_notes(notes: list[str], name: str) -> None:
    """Say once, in one line each, what building the dataset changed (renamed fields, values stored as JSON)."""
    for note in notes:
        logger.warning("%s: %s", name, note)
