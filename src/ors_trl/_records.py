"""Episode records as JSON lines: the one writer (training's `episode_log=`, `ors-trl eval --output`)
and the one reader (eval's `--resume`, `ors-trl report`).

Every record is appended and flushed at once, from any thread, so an interrupted run loses at
most its running episodes. Optional bounds keep a training log from growing without limit: each
long text is cut with a visible mark (`max_text`), and the file stops growing at `max_bytes`
(with one warning). Nothing transport-level (headers, keys, secrets) is ever part of a record.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ._text import clip

__all__ = ["RecordWriter", "read_records"]

logger = logging.getLogger("ors_trl")

# Record fields holding long free text, cut by `max_text` (top level, in turns, in tool calls).
_TEXT_FIELDS = ("prompt", "system", "assistant", "output", "message", "raw")


class RecordWriter:
    """Append records to a JSON-lines file.

    Args:
        path: the file (created with its parent folders).
        append: keep what the file holds (a line cut short by an interruption is ended first);
            False truncates it.
        max_bytes: stop writing once the file would grow past this size (None: no bound).
        max_text: cut every long text (prompt, model text, tool output) to this many characters.
    """

    def __init__(self, path: str | os.PathLike[str], *, append: bool = True, max_bytes: int | None = None,
                 max_text: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.max_text = max_text
        self._lock = threading.Lock()
        if not append:
            self.path.write_bytes(b"")
        elif self.path.exists() and self.path.stat().st_size > 0:
            with self.path.open("rb+") as fh:
                fh.seek(-1, os.SEEK_END)
                if fh.read(1) != b"\n":  # a line cut short must not swallow the next record
                    fh.write(b"\n")
        self._size = self.path.stat().st_size if self.path.exists() else 0
        self.written = 0
        self.dropped = 0

    def __repr__(self) -> str:
        return f"RecordWriter({str(self.path)!r}, written={self.written})"

    def _cut(self, value: Any, depth: int = 0) -> Any:
        if isinstance(value, dict) and depth < 8:
            return {k: (clip(v, self.max_text) if k in _TEXT_FIELDS and isinstance(v, str) else self._cut(v, depth + 1))
                    for k, v in value.items()}
        if isinstance(value, list) and depth < 8:
            return [self._cut(v, depth + 1) for v in value]
        return value

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (a JSON-able dict) and flush it."""
        if self.max_text is not None:
            record = self._cut(record)
        data = (json.dumps(record, ensure_ascii=False, default=str) + "\n").encode("utf-8")
        with self._lock:
            if self.max_bytes is not None and self._size + len(data) > self.max_bytes:
                self.dropped += 1
                if self.dropped == 1:
                    logger.warning("episode log %s reached its %d-byte limit; later episodes are not recorded",
                                   self.path, self.max_bytes)
                return
            with self.path.open("ab") as fh:
                fh.write(data)
            self._size += len(data)
            self.written += 1


def read_records(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """The records of a JSON-lines file, in order; lines that are not complete JSON objects (an interrupted
    write) are skipped with one warning."""
    p = Path(path)
    if not p.exists():
        return
    bad = 0
    with p.open("r", encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if isinstance(record, dict):
                yield record
            else:
                bad += 1
    if bad:
        logger.warning("%s: skipped %d unreadable line(s) (an interrupted write?)", p, bad)
