"""The package's shape, checked: no import cycles, TRL internals behind one seam, a light core import."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "ors_trl"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every ors_trl module `name` imports, at module level or inside functions."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - max(node.level - 1, 0)] if node.level else []
            target = ".".join([*base, *([node.module] if node.module else [])]) if node.level else node.module or ""
            out |= {f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m in modules and m != name}


def test_no_import_cycles() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                pytest.fail("import cycle: " + " -> ".join([*path[path.index(nxt):], nxt]))
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_trl_internals_live_in_one_module() -> None:
    internals = re.compile(r"_generate_single_turn|_get_tool_suffix_ids|_tool_call_loop|_sync_tool_dicts|f_locals|"
                           r"sys\._getframe|\._tokenizer\b|_log_metric\b|_generate_and_score_completions")
    users = sorted(str(p.relative_to(SRC)) for p in PACKAGE.rglob("*.py") if internals.search(p.read_text()))
    assert users == ["ors_trl/_trl.py"], users


def test_core_import_is_light() -> None:
    code = ("import sys, ors_trl; "
            "print(' '.join(m for m in ('torch', 'trl', 'transformers', 'datasets', 'openreward') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == ""


#: What only the turn rule decides: why an episode ends on its own, and why a call is refused locally.
TURN_DECISIONS = {"no_tool_calls", "max_turns", "episode_finished", "max_tool_calls"}


def _code_strings(path: Path) -> set[str]:
    """The string constants of a module's code (docstrings left out)."""
    tree = ast.parse(path.read_text())
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return {node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs}


def test_only_the_core_decides_a_turn() -> None:
    """Drivers generate, schedule and say what the model replied (`Episode.reply`); they may stop an episode only
    for what the core cannot see (a token budget: `length`, `context_length`; a deadline). Which calls run, what a
    call after `finished` or past the cap is, and when a reply ends the episode are written in `_episode.py` alone."""
    deciders = sorted(str(p.relative_to(SRC)) for p in PACKAGE.rglob("*.py")
                      if _code_strings(p) & TURN_DECISIONS)
    assert deciders == ["ors_trl/_episode.py"], deciders
