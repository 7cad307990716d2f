"""A griffe extension for the reference pages: TRL's docstring format, read as Google style.

TRL writes an argument as ``name (`type`, *optional*, defaults to `x`):`` and a return as `` `type`: text``. Google
style wants ``name (type):`` and ``type: text``; the default is already in the signature, so the table's type column
gets the bare type and its default column the signature's value. Only the docs build loads this file.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ARGUMENT = re.compile(r"^(\s+\**\w+) \((.+)\):(.*)$")
_RETURN = re.compile(r"^(\s+)`([^`]+)`:(.*)$")
_EXTRAS = re.compile(r",?\s*(\*optional\*|defaults to .*)$")


def _bare(kind: str) -> str:
    """`` `str`, *optional*, defaults to `"a"` `` -> ``str``."""
    while (shorter := _EXTRAS.sub("", kind)) != kind:
        kind = shorter
    return kind.replace("`", "").strip() or "Any"


def rewrite(text: str) -> str:
    """A TRL-format docstring as Google style (the lines that name a type; the rest as it is)."""
    lines = []
    for line in text.splitlines():
        if match := _ARGUMENT.match(line):
            line = f"{match[1]} ({_bare(match[2])}):{match[3]}"
        elif match := _RETURN.match(line):
            line = f"{match[1]}{match[2]}:{match[3]}"
        lines.append(line)
    return "\n".join(lines)


class TRLDocstrings(griffe.Extension):
    """Rewrites every docstring as it is loaded."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj.docstring.value)
