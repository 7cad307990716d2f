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

__all__ = ["ascii_fold", "clean_json", "clip", "escape_controls", "json_size", "one_line", "repair", "shorten",
           "show_json", "show_name", "unescape_json"]

_SURROGATE = re.compile("[\ud800-\udfff]")
_JSON_ESCAPE = re.compile(r'\\(?:u([0-9a-fA-F]{4})|(["\\/bfnrt]))')
_SHORT_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def one_line(text: str) -> str:
    """Every run of whitespace (newlines included) as one space."""
    return " ".join(text.split())


def ascii_fold(text: str) -> str:
    """`text` with accents stripped and anything else non-ASCII dropped (`"café"` -> `"cafe"`)."""
    return unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")


def shorten(text: str, limit: int) -> str:
    """`text` cut to at most `limit` characters, ending with `…` when cut (for messages and tables)."""
    return text if len(text) <= limit else text[: max(limit - 1, 0)] + "…"


def show_name(name: str, limit: int = 80) -> str:
    """A name for a message or a warning (a tool's, which the server chooses): its repr, so that control characters
    show escaped, cut to `limit` characters with a `…` (a name of 10,000 characters would bury the message)."""
    return repr(name) if len(name) <= limit else repr(name[:limit]) + "…"


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
        renamed = False  # a dict's keys are fixed too: a list's keys are its indices
        for key, item in enumerate(node) if isinstance(node, list) else node.items():
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


def unescape_json(text: str) -> str:
    """`text` with JSON's string escapes (`\\u0073`, `\\n`, `\\/`...) written as the characters they stand for (pairs
    of surrogate escapes joined, lone ones as U+FFFD): how a piece of JSON that does not decode says what it holds."""
    if "\\" not in text:
        return text
    out = _JSON_ESCAPE.sub(lambda m: chr(int(m[1], 16)) if m[1] else _SHORT_ESCAPES[m[2]], text)
    return out.encode("utf-16", "surrogatepass").decode("utf-16", "replace") if not out.isascii() else out


def json_size(value: Any, limit: int) -> int:
    """About how many characters `value` takes as JSON, counted without serialising it (iteratively, so depth is no
    problem) and only until the count passes `limit`: what bounding a decoded answer costs stays bounded too."""
    total, stack = 0, [value]
    while stack and total <= limit:
        node = stack.pop()
        if isinstance(node, str):
            total += len(node) + 2
        elif isinstance(node, dict):
            total += 2 + sum(len(k) + 4 if isinstance(k, str) else 8 for k in node)
            stack.extend(node.values())
        elif isinstance(node, list):
            total += 2 + len(node)
            stack.extend(node)
        else:
            total += 6
    return total
