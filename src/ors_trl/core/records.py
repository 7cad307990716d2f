"""Episode records: the schema (version 3), the one writer (appends and flushes, from any thread; images by hash,
their bytes once beside the log) and the one reader (upgrades versions 1 and 2). Records hold untrusted text: the
writer writes valid JSON (`jsonable`) or counts the record in `dropped`; the reader skips and counts what is not a
record. Nothing transport-level (headers, keys) is ever part of a record.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal, NotRequired, TypedDict

from ..protocol.files import is_regular, write_atomic
from ..protocol.images import as_bytes
from ..protocol.registry import RUN_ID
from ..protocol.text import clean_json, repair
from ..protocol.text import cut as cut_text

__all__ = ["MAX_DEPTH", "RECORD_VERSION", "RUN_ID", "CallRecord", "EndReason", "EpisodeRecord", "ImageRecord",
           "RecordWriter", "TurnRecord", "Unscored", "error_record", "image_record", "jsonable", "parse_line",
           "read_records", "token_fidelity", "upgrade"]

logger = logging.getLogger("ors_trl")

def token_fidelity(generated: int, masked: int = 0, rows: int = 1) -> dict[str, Any]:
    """A record's `tokens`: the tokens generated, how many of them a re-render changed (`masked`), the training rows;
    `exact` when none was changed and one row holds them all (every driver builds it here)."""
    return {"exact": masked == 0 and rows == 1, "generated": generated, "masked": masked, "rows": rows}


#: Version of the episode record schema (`EpisodeRecord`).
RECORD_VERSION = 3


class ErrorRecord(TypedDict):
    """A failure: `kind` is the error's `ORSError.kind` (the label metrics count), `reason` a refusal's reason."""

    kind: str
    message: str
    reason: NotRequired[str]


class ImageRecord(TypedDict, total=False):
    """One image of an episode (the key of `EpisodeRecord.images` is its SHA-256)."""

    mime_type: str
    bytes: int  # its size
    width: int | None
    height: int | None
    error: str  # why the model was not shown it
    file: str  # where its bytes are, relative to the log's folder (absent where they were not written)


class CallRecord(TypedDict, total=False):
    """One tool call of the model. `status`: ok, failed (the tool or the network failed; error kind `cancelled`: the
    episode's stop cut it short), refused (locally or by the server: the model is told why) or not_run (the reply was
    the last one the turn limit allows)."""

    id: str | None
    name: str  # the name the model saw
    arguments: Any
    status: Literal["ok", "failed", "refused", "not_run"]
    remote_name: str  # the environment's
    remote_arguments: dict[str, Any]
    output: str  # what the model read (TRL's `{'error': ...}` text for a failure; an image as `[image: ...]`)
    error: ErrorRecord
    reward: float | None
    finished: bool
    metadata: dict[str, Any] | None
    seconds: float
    images: list[str]  # the hashes of its images


class TurnRecord(TypedDict, total=False):
    """One model reply and its calls, in order; drivers add `raw`, `usage` and `generation_seconds`."""

    index: int
    assistant: str | None  # its visible text (None when nothing was parsed)
    tool_calls: list[CallRecord]
    unparsed: bool  # the text held the chat template's tool-call markup, yet parsed to no call
    raw: str  # the completion text
    reasoning: str  # an endpoint's reasoning apart from the content (kept in the history the policy sees next)
    usage: dict[str, Any]
    generation_seconds: float


#: Why an episode ended (`released`: it was closed before it ended).
EndReason = Literal["finished", "no_tool_calls", "max_turns", "length", "context_length", "timeout", "error",
                    "released"]
#: Why an episode has no reward.
Unscored = Literal["no_reward", "cut_off", "error", "timeout", "dropped"]


class EpisodeRecord(TypedDict, total=False):
    """One episode as a record (schema version `RECORD_VERSION`), the same for every driver: one JSON line of an
    episode log or eval output, and `Episode.record()`. docs/guides/metrics.md documents it."""

    version: int  # `RECORD_VERSION` (the reader upgrades older records)
    run: str  # the process run that wrote it (`RUN_ID`: tells runs apart in merged logs)
    # "manual": an adapter's episode opened with no trainer driving it, never read by a reward function
    source: Literal["trl", "engine", "eval", "manual"]
    environment: str
    target: str  # a catalog name or a server's URL
    split: str
    task_index: int | None  # the task's index in `split` (None for an explicit task)
    task_spec: dict[str, Any] | None  # the explicit task, if the episode ran one
    repeat: int  # added by eval: the repeat index of the task's episode
    policy: str  # added by eval: the policy's name
    step: int  # added by an evaluation during training: the training step
    stop_detail: str  # added by a driver that stopped the model: why
    harness: dict[str, int]  # a harness's episode: `model_calls`, `trained_calls`, `rows`, `joined_calls`
    env_reward: float | None  # a harness's episode with a `score` hook: the environment's reward it replaced
    started_at: str  # ISO 8601, UTC
    system: str | None  # the prompt's system message
    prompt: str | None  # the prompt's text (None: the episode never opened)
    turns: list[TurnRecord]
    final: dict[str, Any] | None  # the final plain message and a terminal tool's grade (`tool`, `output`, ... `error`)
    rewards: list[float | None]  # of each tool call that ran
    reward: float | None  # the episode's: its `reward_rule` over the per-call rewards the model saw
    reward_rule: str  # how per-call rewards made `reward` ("last", "sum", ... `OpenRewardSpec(reward=)`)
    group_reward: float | None  # the comparative reward from `/score_group`, when asked for
    finished: bool  # the environment said the episode is over
    end_reason: EndReason | None
    unscored: Unscored | None  # why `reward` is None
    tool_calls: int  # the model's tool calls
    tool_failures: int  # how many of them failed or were refused
    error: ErrorRecord | None  # why the episode failed outside a tool call
    replayed: int  # an episode a failure voided that was played again on a fresh session: which attempt this was
    tokens: dict[str, Any]  # token fidelity: `exact` (the ids trained on are the ids generated, plus tool tokens),
    #                         `generated`, `masked` (generated tokens a re-render changed) and `rows` (training rows)
    timings: dict[str, float]  # seconds: `open`, `prompt`, `generation`, `tools`, `session`, `total`
    images: dict[str, ImageRecord]  # an episode with images: each, by its SHA-256 (else no such key)
    prompt_images: list[str]  # an episode with images: the hashes of the prompt's, in order


def image_record(info: Any) -> ImageRecord:
    """How an image is recorded (`info`: an `ors_trl.protocol.images.ImageInfo`)."""
    out = ImageRecord(mime_type=info.mime_type, bytes=info.bytes, width=info.width, height=info.height)
    if info.error is not None:
        out["error"] = info.error
    return out


def error_record(exc: BaseException) -> ErrorRecord:
    """How a failure is recorded."""
    out = ErrorRecord(kind=getattr(exc, "kind", "internal"), message=str(exc))
    if getattr(exc, "reason", None):
        out["reason"] = exc.reason  # type: ignore[attr-defined]
    return out


def upgrade(record: dict[str, Any]) -> EpisodeRecord:
    """A record of any version in the current shape: version 1's flat `calls` list becomes one turn, version 2's
    calls gain their `status` (eval's `skipped` entries become `not_run`)."""
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
    if record.get("version") != RECORD_VERSION:  # fields of the wrong type are left as they are, never fatal
        turns = record.get("turns")
        for turn in turns if isinstance(turns, list) else []:
            made = turn.get("tool_calls") if isinstance(turn, dict) else None
            for call in made if isinstance(made, list) else []:
                if isinstance(call, dict) and "status" not in call:
                    error = call.get("error")
                    refused = isinstance(error, dict) and error.get("kind") == "refused"
                    call["status"] = ("not_run" if call.get("skipped") else "ok" if error is None
                                      else "refused" if refused else "failed")
    return record  # type: ignore[return-value]


# Record fields holding long free text, cut by `max_text` (top level, in turns, in tool calls).
_TEXT_FIELDS = frozenset(("prompt", "system", "assistant", "output", "message", "raw"))
#: Nesting a record keeps (the record itself is level 0); a deeper value is replaced by a marker string.
MAX_DEPTH = 100
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # a surrogate written as a JSON escape
_SHA256 = re.compile(r"[0-9a-f]{64}")


def jsonable(value: Any, *, max_text: int | None = None, fields: frozenset[str] | None = _TEXT_FIELDS,
             max_depth: int = MAX_DEPTH) -> Any:
    """A copy of `value` any JSON reader reads: surrogates repaired, NaN/inf as text, anything not JSON as its text, a
    container at `max_depth` or holding itself as a marker; `max_text` cuts strings under `fields` (None: all)."""

    def copy(v: Any, depth: int, cut: bool, path: set[int]) -> Any:
        if isinstance(v, str):
            v = repair(v)
            return cut_text(v, max_text, "output") if cut else v
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
    """Append records to a JSON-lines file `path`. `append=False` truncates it; `max_bytes` stops writing past that
    size, `max_text` cuts long texts visibly, `max_image_bytes` (None: `max_bytes`) bounds the images beside it.
    `written` and `dropped` count records (`drop_reasons` says why).
    """

    def __init__(self, path: str | os.PathLike[str], *, append: bool = True, max_bytes: int | None = None,
                 max_text: int | None = None, max_image_bytes: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.max_text = max_text
        self.max_image_bytes = max_bytes if max_image_bytes is None else max_image_bytes
        self.images_dir = self.path.with_name(self.path.name + ".images")
        self._stored: set[str] = set()
        self._image_size = sum(f.lstat().st_size for f in self.images_dir.iterdir()) if self.images_dir.is_dir() else 0
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
        self.written = self.dropped = self.images_dropped = 0
        self.drop_reasons: Counter[str] = Counter()

    def __repr__(self) -> str:
        return f"RecordWriter({str(self.path)!r}, written={self.written}, dropped={self.dropped})"

    def _drop(self, reason: str) -> None:
        self.dropped += 1
        self.drop_reasons[reason] += 1
        if self.drop_reasons[reason] == 1:
            logger.warning("episode log %s: a record was not written (%s); later ones for the same reason are "
                           "only counted", self.path, reason)

    def write(self, record: dict[str, Any], images: Mapping[str, Any] | None = None) -> None:
        """Append one record and flush it; never raises (see `dropped`). `images`: the episode's image blocks by hash:
        the bytes of each one the record lists are written beside the log once, its entry naming the file."""
        listed = record.get("images")
        if images and isinstance(listed, dict):
            stored = {sha: self._store(sha, entry, images.get(sha)) for sha, entry in listed.items()}
            record = {**record, "images": stored}
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

    def _store(self, sha: str, entry: Any, block: Any) -> Any:
        """An image's record entry, with its `file` once its bytes are beside the log (written the first time)."""
        if block is None or not isinstance(entry, dict) or "error" in entry or not _SHA256.fullmatch(sha):
            return entry
        name = f"{sha}.{block.info().extension}"
        with self._lock:
            if name not in self._stored and not is_regular(self.images_dir / name):
                raw = as_bytes(block.data)  # checked where it was parsed
                if self.max_image_bytes is not None and self._image_size + len(raw) > self.max_image_bytes:
                    self._drop_image(f"the images reached their {self.max_image_bytes}-byte limit")
                    return entry
                try:
                    self.images_dir.mkdir(exist_ok=True)
                    write_atomic(self.images_dir / name, raw, 0o644)  # never through a name planted there
                except OSError as exc:
                    self._drop_image(f"an image could not be written: {exc.strerror or exc}")
                    return entry
                self._image_size += len(raw)
            self._stored.add(name)
        return {**entry, "file": f"{self.images_dir.name}/{name}"}

    def _drop_image(self, reason: str) -> None:
        self.images_dropped += 1
        if self.images_dropped == 1:
            logger.warning("episode log %s: an image was not written beside it (%s); later ones are only counted",
                           self.path, reason)


def parse_line(line: str | bytes) -> tuple[Any, str | None]:
    """One JSON line as `(value, None)`, or `(None, why)` (never quoting it); lone surrogates repaired."""
    text = line.decode("utf-8", "replace") if isinstance(line, bytes) else line
    try:
        value = json.loads(text)
    except RecursionError:
        return None, "nested too deeply to read"
    except ValueError:
        return None, "not JSON (a cut or corrupt line)"
    return (clean_json(value) if _SURROGATE_ESCAPE.search(text) else value), None


def read_records(path: str | os.PathLike[str], skipped: Counter[str] | None = None) -> Iterator[dict[str, Any]]:
    """The records of a JSON-lines file, in order; lines that are not records are skipped, counted in `skipped`."""
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
                yield upgrade(record)
            else:
                bad[why] += 1
    if bad:
        logger.warning("%s: skipped %d unreadable line(s): %s", p, bad.total(),
                       ", ".join(f"{n} {why}" for why, n in bad.most_common()))
        if skipped is not None:
            skipped.update(bad)
