"""Episode records: every finished episode as one JSON line, so a user can read what the model did.

Off by default (`episode_log=` on a spec or mix turns it on). Bounded: each tool output is cut to
`max_output_chars` and the file stops growing at `max_bytes` (with a warning, once). Writes are
appended and flushed per episode, from any thread. Nothing transport-level (headers, keys,
secrets) is ever part of a record.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

__all__ = ["EpisodeRecorder"]

logger = logging.getLogger("ors_trl")


class EpisodeRecorder:
    """Append episodes to a JSON-lines file.

    Args:
        path: the file (created with its parent folders; appended to if it exists).
        max_bytes: stop recording once the file reaches this size.
        max_output_chars: cut every recorded tool output / prompt to this many characters.
    """

    def __init__(self, path: str | os.PathLike[str], *, max_bytes: int = 256 * 1024 * 1024,
                 max_output_chars: int = 8_000) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.max_output_chars = max_output_chars
        self._lock = threading.Lock()
        self._size = self.path.stat().st_size if self.path.exists() else 0
        self._full_warned = False
        self.written = 0
        self.dropped = 0

    def __repr__(self) -> str:
        return f"EpisodeRecorder({str(self.path)!r}, written={self.written})"

    def _cut(self, text: Any) -> Any:
        if isinstance(text, str) and len(text) > self.max_output_chars:
            return text[: self.max_output_chars] + f"... [{len(text) - self.max_output_chars} more characters]"
        return text

    def write(self, episode: dict[str, Any]) -> None:
        """Append one episode (a JSON-able dict); long texts are cut, the file size is bounded."""
        record = dict(episode)
        record["prompt"] = self._cut(record.get("prompt"))
        calls = []
        for call in record.get("calls") or []:
            call = dict(call)
            if "output" in call:
                call["output"] = self._cut(call["output"])
            calls.append(call)
        record["calls"] = calls
        line = json.dumps(record, default=str, ensure_ascii=False) + "\n"
        data = line.encode("utf-8")
        with self._lock:
            if self._size + len(data) > self.max_bytes:
                self.dropped += 1
                if not self._full_warned:
                    self._full_warned = True
                    logger.warning("episode log %s reached its %d-byte limit; later episodes are not recorded",
                                   self.path, self.max_bytes)
                return
            with self.path.open("ab") as fh:
                fh.write(data)
                fh.flush()
            self._size += len(data)
            self.written += 1

    # -- adapter hooks -----------------------------------------------------------------------------

    def episode_end(self, adapter: Any) -> None:
        """Called once per adapter episode."""
        runtime = adapter._runtime
        self.write({
            "environment": runtime.name,
            "task_index": adapter.task_index,
            "task_spec": adapter.task_spec,
            "prompt": adapter.prompt_text,
            "calls": adapter.trace,
            "reward": adapter.reward,
            "finished": adapter.finished,
            "error": adapter.error,
            "timed_out": False,
            "seconds": adapter.episode_seconds,
        })
