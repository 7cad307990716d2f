"""MkDocs hook: `<!-- cli-help: COMMAND -->` in a page becomes the `ors-trl COMMAND --help` of this checkout, so the
command-line reference is generated like the Python one. Only the docs build loads this file."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

_MARKER = re.compile(r"^<!-- cli-help: ?([\w-]*) -->$", re.MULTILINE)
_SRC = str(Path(__file__).resolve().parents[1] / "src")


def _printable(text: str) -> str:
    """Control and format characters as `\\x..` escapes (a help text is shown, never interpreted)."""
    return "".join(c if c in "\n\t" or c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def _help(command: str) -> str:
    env = {**os.environ, "COLUMNS": "100", "PYTHONPATH": os.pathsep.join(filter(None, [_SRC, os.environ.get(
        "PYTHONPATH")]))}
    argv = [sys.executable, "-m", "ors_trl", *filter(None, [command]), "--help"]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, check=False)
    if run.returncode != 0:
        raise RuntimeError(f"`ors-trl {command} --help` exited {run.returncode}: {run.stderr[-2000:]}")
    return f"```text\n{_printable(run.stdout).rstrip()}\n```"


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return _MARKER.sub(lambda match: _help(match[1]), markdown)
