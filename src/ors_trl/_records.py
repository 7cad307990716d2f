"""Episode records as JSON lines: the one writer (training's `episode_log=`, `ors-trl eval --output`)
and the one reader (eval's `--resume`, `ors-trl report`).

Every record is appended and flushed at once, from any thread, so an interrupted run loses at
most its running episodes. Optional bounds keep a training log from growing without limit: each
long text is cut with a visible mark (`max_text`), and the file stops growing at `max_bytes`
(with one warning). Nothing transport-level (headers, keys, secrets) is ever part of a record.

A record holds untrusted text (the environment's, the model's, the user's), so the writer never
fails on it and never loses it silently: every record is written as valid, encodable JSON
(`jsonable`: lone surrogates repaired, NaN and infinities spelled as strings, anything else that
is not JSON written as its text, a value nested deeper than `MAX_DEPTH` replaced by a marker), and
a record it still cannot write (the size bound, a failing disk) is counted in `dropped`, its
reason logged once. The reader skips, counts and names whatever is not a record.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ._text import clean_json, clip, repair

__all__ = ["MAX_DEPTH", "RecordWriter", "jsonable", "parse_line", "read_records"]

logger = logging.getLogger("ors_trl")

# Record fields holding long free text, cut by `max_text` (top level, in turns, in tool calls).
_TEXT_FIELDS = frozenset(("prompt", "system", "assistant", "output", "message", "raw"))
#: Nesting a record keeps (the record itself is level 0); a deeper value is replaced by a marker string.
MAX_DEPTH = 100
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # a surrogate written as a JSON escape


def jsonable(value: Any, *, max_text: int | None = None, fields: frozenset[str] | None = _TEXT_FIELDS,
             max_depth: int = MAX_DEPTH) -> Any:
    """A copy of `value` that `json.dumps(..., allow_nan=False)` writes and any JSON reader reads.

    Text has its lone surrogates repaired (`repair`); NaN and the infinities become the strings `"nan"`,
    `"inf"`, `"-inf"`; a dict key that is not text becomes its text; anything else that is not JSON (a
    set, bytes, an object) becomes its text too. A list or dict at `max_depth`, or one containing itself,
    becomes a marker saying so. `max_text` cuts, with a visible mark, the strings under the keys in
    `fields` (every string with `fields=None`).
    """

    def copy(v: Any, depth: int, cut: bool, path: set[int]) -> Any:
        if isinstance(v, str):
            v = repair(v)
            return clip(v, max_text) if cut else v
        if v is None or isinstance(v, bool):
            return v
        if isinstance(v, int):
            return v if v.bit_length() < 4096 else f"[... an integer of {v.bit_length()} bits ...]"
        if isinstance(v, float):
            return v if math.isfinite(v) else str(v)
        if not isinstance(v, dict | list | tuple):
            return repair(_text(v))
        if depth >= max_depth:
            return f"[... nested deeper than {max_depth} levels: not recorded ...]"
        if id(v) in path:
            return "[... a value containing itself: not recorded ...]"
        path.add(id(v))
        if isinstance(v, dict):
            out: Any = {}
            for k, item in v.items():
                key = repair(k if isinstance(k, str) else _text(k))
                out[key] = copy(item, depth + 1, max_text is not None and (fields is None or key in fields), path)
        else:
            out = [copy(item, depth + 1, cut and fields is None, path) for item in v]
        path.discard(id(v))
        return out

    return copy(value, 0, max_text is not None and fields is None, set())


def _text(value: Any) -> str:
    try:
        return str(value)
    except Exception:  # a hostile or broken __str__: the type is all there is to say
        return f"<{type(value).__name__}>"


class RecordWriter:
    """Append records to a JSON-lines file.

    Args:
        path: the file (created with its parent folders).
        append: keep what the file holds (a line cut short by an interruption is ended first);
            False truncates it.
        max_bytes: stop writing once the file would grow past this size (None: no bound).
        max_text: cut every long text (prompt, model text, tool output) to this many characters.

    Attributes:
        written, dropped: records written, and records that could not be (`drop_reasons` says why).
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
        self._cut = False  # the last write failed part-way: end its line before the next record
        self.written = 0
        self.dropped = 0
        self.drop_reasons: Counter[str] = Counter()

    def __repr__(self) -> str:
        return f"RecordWriter({str(self.path)!r}, written={self.written}, dropped={self.dropped})"

    def _drop(self, reason: str) -> None:
        self.dropped += 1
        self.drop_reasons[reason] += 1
        if self.drop_reasons[reason] == 1:
            logger.warning("episode log %s: a record was not written (%s); later ones for the same reason are "
                           "only counted", self.path, reason)

    def write(self, record: dict[str, Any]) -> None:
        """Append one record and flush it. Never raises: what cannot be written is counted in `dropped`."""
        try:
            data = (json.dumps(jsonable(record, max_text=self.max_text), ensure_ascii=False, allow_nan=False)
                    + "\n").encode("utf-8")
        except Exception as exc:  # jsonable leaves nothing json.dumps refuses; should it still, count it
            self._drop(f"it could not be encoded: {type(exc).__name__}")
            return
        with self._lock:
            if self.max_bytes is not None and self._size + len(data) > self.max_bytes:
                self._drop(f"the file reached its {self.max_bytes}-byte limit")
                return
            data = b"\n" + data if self._cut else data
            try:
                with self.path.open("ab") as fh:
                    fh.write(data)
            except OSError as exc:
                self._cut = True
                self._drop(f"the file could not be written: {exc.strerror or exc}")
                return
            self._cut = False
            self._size += len(data)
            self.written += 1


def parse_line(line: str | bytes) -> tuple[Any, str | None]:
    """One JSON line as `(value, None)`, or `(None, why)` where it cannot be read (the line is never quoted).

    Invalid UTF-8 is replaced (U+FFFD), lone surrogates written as escapes are repaired."""
    text = line.decode("utf-8", "replace") if isinstance(line, bytes) else line
    try:
        value = json.loads(text)
    except RecursionError:
        return None, "nested too deeply to read"
    except ValueError:
        return None, "not JSON (a cut or corrupt line)"
    return (clean_json(value) if _SURROGATE_ESCAPE.search(text) else value), None


def read_records(path: str | os.PathLike[str], skipped: Counter[str] | None = None) -> Iterator[dict[str, Any]]:
    """The records of a JSON-lines file, in order. Lines that are not JSON objects (an interrupted write, a
    foreign line) are skipped, with one warning, and counted by reason in `skipped` when given."""
    p = Path(path)
    if not p.exists():
        return
    bad: Counter[str] = Counter()
    with p.open("r", encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if not line.strip():
                continue
            record, why = parse_line(line)
            if why is None and not isinstance(record, dict):
                why = "not a JSON object"
            if why is None:
                yield record
            else:
                bad[why] += 1
    if bad:
        logger.warning("%s: skipped %d unreadable line(s): %s", p, bad.total(),
                       ", ".join(f"{n} {why}" for why, n in bad.most_common()))
        if skipped is not None:
            skipped.update(bad)
