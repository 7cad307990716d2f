"""Episode records: the schema (version 3, typed below), the one writer (training's `episode_log=`,
`ors-trl eval --output`) and the one reader (eval's `--resume`, `ors-trl report`), which upgrades the
records of versions 1 and 2 to the current shape.

Every record is appended and flushed at once, from any thread, so an interrupted run loses at
most its running episodes. Optional bounds keep a training log from growing without limit: each
long text is cut with a visible mark (`max_text`), and the file stops growing at `max_bytes`
(with one warning). Nothing transport-level (headers, keys, secrets) is ever part of a record.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, NotRequired, TypedDict

from ._text import clip

__all__ = ["RECORD_VERSION", "RUN_ID", "CallRecord", "EpisodeRecord", "RecordWriter", "TurnRecord", "error_record",
           "read_records", "upgrade"]

logger = logging.getLogger("ors_trl")

#: Version of the episode record schema (`EpisodeRecord`).
RECORD_VERSION = 3
#: Tells the records of one process run apart from another's in merged logs.
RUN_ID = f"{socket.gethostname()}-{os.getpid()}-{int(time.time())}"


class ErrorRecord(TypedDict):
    """A failure: `kind` is the error's `ORSError.kind` (the label metrics count), `reason` a refusal's reason."""

    kind: str
    message: str
    reason: NotRequired[str]


class CallRecord(TypedDict, total=False):
    """One tool call of the model. `status`: ok, failed (the tool or the network failed), refused (locally or by
    the server: the model is told why) or not_run (the reply was the last one the turn limit allows). `name` is
    the name the model saw, `remote_name` the environment's; `output` is what the model read (TRL's
    `{'error': ...}` text for a failure)."""

    id: str | None
    name: str
    arguments: Any
    status: Literal["ok", "failed", "refused", "not_run"]
    remote_name: str
    remote_arguments: dict[str, Any]
    output: str
    error: ErrorRecord
    reward: float | None
    finished: bool
    metadata: dict[str, Any] | None
    seconds: float


class TurnRecord(TypedDict, total=False):
    """One model reply: its visible text (None when nothing was parsed) and its calls, in order; drivers add
    `raw` (the completion text), `usage` and `generation_seconds` where they have them."""

    index: int
    assistant: str | None
    tool_calls: list[CallRecord]
    raw: str
    usage: dict[str, Any]
    generation_seconds: float


class EpisodeRecord(TypedDict, total=False):
    """One episode, the same for every driver (`source`: trl, engine, eval). `final` is the final plain message
    and, for an environment with a terminal tool, its grade (`tool`, `output`, `reward`, ... or `error`);
    `unscored` says why `reward` is None (timeout, error, cut_off, no_reward). Drivers add `repeat` and
    `policy` (eval) and `stop_detail` (why the model was stopped)."""

    version: int
    run: str
    source: str
    environment: str
    target: str
    split: str
    task_index: int | None
    task_spec: dict[str, Any] | None
    repeat: int
    policy: str
    stop_detail: str
    started_at: str
    system: str | None
    prompt: str | None
    turns: list[TurnRecord]
    final: dict[str, Any] | None
    rewards: list[float | None]
    reward: float | None
    group_reward: float | None
    finished: bool
    end_reason: str | None
    unscored: str | None
    tool_calls: int
    tool_failures: int
    error: ErrorRecord | None
    timings: dict[str, float]


def error_record(exc: BaseException) -> ErrorRecord:
    """How a failure is recorded."""
    out = ErrorRecord(kind=getattr(exc, "kind", "internal"), message=str(exc))
    if getattr(exc, "reason", None):
        out["reason"] = exc.reason  # type: ignore[attr-defined]
    return out


def _status(call: dict[str, Any]) -> str:
    if call.get("skipped"):
        return "not_run"
    error = call.get("error")
    if error is None:
        return "ok"
    return "refused" if isinstance(error, dict) and error.get("kind") == "refused" else "failed"


def upgrade(record: dict[str, Any]) -> EpisodeRecord:
    """A record of any version in the current shape. Version 1 (training logs before the episode core) had one
    flat `calls` list (`tool`, `arguments`, `output` or `error` text, `error_kind`): it becomes one turn. Version 2
    calls gain their `status` (eval's `skipped` entries, calls after the episode finished, become `not_run`)."""
    if "turns" not in record and isinstance(record.get("calls"), list):
        calls = []
        for c in record["calls"]:
            if not isinstance(c, dict):
                continue
            entry: dict[str, Any] = {"name": c.get("tool", c.get("name")), "arguments": c.get("arguments")}
            entry.update({k: c[k] for k in ("output", "reward", "finished", "metadata", "seconds") if k in c})
            if c.get("error") is not None or c.get("error_kind"):
                entry["error"] = {"kind": c.get("error_kind") or "failed", "message": c.get("error")}
            calls.append(entry)
        record = {k: v for k, v in record.items() if k != "calls"}
        record["turns"] = [{"index": 0, "assistant": None, "tool_calls": calls}]
        record.setdefault("tool_calls", len(calls))
        record.setdefault("tool_failures", sum(1 for c in calls if "error" in c))
    if record.get("version") != RECORD_VERSION:
        for turn in record.get("turns") or []:
            for call in (turn.get("tool_calls") or []) if isinstance(turn, dict) else []:
                if isinstance(call, dict) and "status" not in call:
                    call["status"] = _status(call)
    return record  # type: ignore[return-value]

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
                yield upgrade(record)
            else:
                bad += 1
    if bad:
        logger.warning("%s: skipped %d unreadable line(s) (an interrupted write?)", p, bad)
