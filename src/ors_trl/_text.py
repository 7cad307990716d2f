"""Text helpers shared by every module: one line, ASCII folding, shortening with a visible mark.

Whatever ors-trl cuts says so in the text itself, so neither a model nor a reader mistakes a cut
for the whole.
"""

from __future__ import annotations

import json
import unicodedata
from typing import Any

__all__ = ["ascii_fold", "clip", "one_line", "shorten", "show_json"]


def one_line(text: str) -> str:
    """Every run of whitespace (newlines included) as one space."""
    return " ".join(text.split())


def ascii_fold(text: str) -> str:
    """`text` with accents stripped and anything else non-ASCII dropped (`"café"` -> `"cafe"`)."""
    return unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")


def shorten(text: str, limit: int) -> str:
    """`text` cut to at most `limit` characters, ending with `…` when cut (for messages and tables)."""
    return text if len(text) <= limit else text[: max(limit - 1, 0)] + "…"


def show_json(value: Any, limit: int = 120) -> str:
    """A JSON rendering of `value` (anything else as `str`), shortened for a log line or a table cell."""
    return shorten(json.dumps(value, ensure_ascii=False, default=str), limit)


def clip(text: str, limit: int | None) -> str:
    """`text` cut to `limit` characters with a mark saying how much was shown (tool output, records)."""
    if limit is None or len(text) <= limit:
        return text
    return text[:limit] + f"\n[... output truncated: {limit} of {len(text)} characters shown ...]"
