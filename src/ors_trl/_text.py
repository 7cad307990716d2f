"""Text helpers shared by every module: one line, ASCII folding, shortening with a visible mark, and the
two repairs untrusted text needs (lone surrogates, terminal control characters).

Whatever ors-trl cuts says so in the text itself, so neither a model nor a reader mistakes a cut
for the whole.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Callable
from typing import Any

__all__ = ["ascii_fold", "clean_json", "clip", "escape_controls", "one_line", "repair", "shorten", "show_json"]

_SURROGATE = re.compile("[\ud800-\udfff]")


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


def repair(text: str) -> str:
    """`text` with every lone surrogate (valid in JSON as `"\\ud800"`, not encodable as UTF-8, so fatal to a
    tokenizer or a file write) replaced by U+FFFD."""
    return text if text.isascii() else _SURROGATE.sub("\ufffd", text)


def clean_json(value: Any, fix: Callable[[str], str] = repair) -> Any:
    """Every string of a decoded JSON value, dict keys included, passed through `fix`, in place where possible.

    Iterative, so a value nested as deeply as the JSON decoder allows is no recursion problem here.
    """
    if isinstance(value, str):
        return fix(value)
    stack = [value] if isinstance(value, dict | list) else []
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            for i, item in enumerate(node):
                if isinstance(item, str):
                    node[i] = fix(item)
                elif isinstance(item, dict | list):
                    stack.append(item)
            continue
        renamed = False
        for key, item in node.items():
            if isinstance(item, str):
                node[key] = fix(item)
            elif isinstance(item, dict | list):
                stack.append(item)
            renamed = renamed or (isinstance(key, str) and fix(key) != key)
        if renamed:
            items = list(node.items())
            node.clear()
            node.update((fix(k) if isinstance(k, str) else k, v) for k, v in items)
    return value


def escape_controls(text: str) -> str:
    """`text` with control and format characters escaped (`\\x1b`, `\\u202e`; newline and tab kept), so that a
    terminal or a log shows them instead of obeying them (setting the title, clearing the screen, hiding lines)."""
    if text.isprintable():
        return text
    return "".join(c if c in "\n\t" or unicodedata.category(c) not in ("Cc", "Cf")
                   else c.encode("unicode_escape").decode("ascii") for c in text)
