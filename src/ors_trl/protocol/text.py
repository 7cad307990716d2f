"""Text helpers shared by every module: the one rule for cutting text (`cut`: whatever ors-trl cuts says so in the
text itself), and the repairs untrusted text needs (lone surrogates, control characters, JSON escapes)."""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Callable, Mapping
from typing import Any, Literal

__all__ = ["ascii_fold", "clean_json", "cut", "escape_controls", "json_size", "label", "one_line", "readable",
           "repair", "show_json", "show_name", "task_label", "unescape_json"]

_SURROGATE = re.compile("[\ud800-\udfff]")
_JSON_ESCAPE = re.compile(r'\\(?:u([0-9a-fA-F]{4})|(["\\/bfnrt]))')
JSON_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def cut(text: str, limit: int | None, mark: Literal["…", "output", "more", ""] = "…") -> str:
    """`text` cut to `limit` characters (None: never), the cut said by `mark`: `"…"` ends it within `limit` (logs,
    tables, names), `"output"` adds a line `[... output truncated ...]` (tool output: models read it), `"more"` adds
    `... [N more characters]` (a server's words in a message), `""` nothing (a repr in an error)."""
    if limit is None or len(text) <= limit:
        return text
    if mark == "…":
        return text[: max(limit - 1, 0)] + "…"
    if mark == "output":
        return f"{text[:limit]}\n[... output truncated: {limit} of {len(text)} characters shown ...]"
    return f"{text[:limit]}... [{len(text) - limit} more characters]" if mark == "more" else text[:limit]


def readable(text: str, limit: int = 2000) -> str:
    """Server-provided `text` fit for a message: stripped, cut (`"more"`), control characters escaped. Mask secrets
    before: a cut through a secret would leave part of it."""
    return escape_controls(cut(text.strip(), limit, "more"))


def show_name(name: str, limit: int = 80) -> str:
    """A name a server chose (a tool's), for a message: its repr, cut with `…`."""
    return repr(name) if len(name) <= limit else repr(name[:limit]) + "…"


def show_json(value: Any, limit: int = 120) -> str:
    """`value` as JSON (anything else as `str`), cut with `…` for a log line or a table cell; `<type>` for one the
    encoder cannot write (a cycle, nesting past what it recurses through)."""
    try:
        return cut(json.dumps(value, ensure_ascii=False, default=str), limit)
    except (ValueError, RecursionError):
        return f"<{type(value).__name__}>"


def label(value: Any, limit: int = 200) -> str:
    """A record value as a short label: text as it is, a number or None as `str` gives it, anything else as JSON."""
    if not isinstance(value, str):
        value = str(value) if value is None or isinstance(value, int | float) else repair(show_json(value, limit))
    return cut(value, limit)


def task_label(record: Mapping[str, Any]) -> str:
    """Which task an episode record ran, as reports, eval and the rollout viewer name it: `test #3`, or
    `train spec {...}`."""
    split = label(record.get("split") or "-")
    if record.get("task_spec") is not None:
        return f"{split} spec {label(record['task_spec'], 60)}"
    return f"{split} #{label(record.get('task_index'))}"


def one_line(text: str) -> str:
    """Every run of whitespace (newlines included) as one space."""
    return " ".join(text.split())


def ascii_fold(text: str) -> str:
    """`text` with accents stripped and anything else non-ASCII dropped (`"café"` -> `"cafe"`)."""
    return unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")


def repair(text: str) -> str:
    """`text` with every lone surrogate (valid JSON, fatal to a tokenizer or a file write) as U+FFFD."""
    return text if text.isascii() else _SURROGATE.sub("\ufffd", text)


def clean_json(value: Any, fix: Callable[[str], str] = repair) -> Any:
    """Every string of a decoded JSON value, dict keys included, passed through `fix`, in place where possible
    (iterative: no recursion limit)."""
    if isinstance(value, str):
        return fix(value)
    stack = [value] if isinstance(value, dict | list) else []
    while stack:
        node = stack.pop()
        renamed = False
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
    """`text` with control and format characters escaped (newline and tab kept), so that a terminal or a log shows
    them instead of obeying them (setting the title, hiding lines)."""
    if text.isprintable():
        return text
    return "".join(c if c in "\n\t" or unicodedata.category(c) not in ("Cc", "Cf")
                   else c.encode("unicode_escape").decode("ascii") for c in text)


def unescape_json(text: str) -> str:
    """`text` with JSON's string escapes written as the characters they stand for (lone surrogates as U+FFFD): what
    a piece of JSON that does not decode holds."""
    if "\\" not in text:
        return text
    out = _JSON_ESCAPE.sub(lambda m: chr(int(m[1], 16)) if m[1] else JSON_ESCAPES[m[2]], text)
    return out.encode("utf-16", "surrogatepass").decode("utf-16", "replace") if not out.isascii() else out


def json_size(value: Any, limit: int) -> int:
    """About how many characters `value` takes as JSON, counted (iteratively) only until the count passes `limit`."""
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
