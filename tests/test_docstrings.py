"""The public API's docstrings are in TRL's format: Markdown only, and one `name (`type`):` entry per parameter in an
`Args:` section (a class may list its constructor's parameters under `Parameters:` or `Attributes:`, as TRL's
dataclasses do)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import ors_trl
import ors_trl.testing

# converted by the lead in _spec.py/_mix.py
EXEMPT: set[str] = set()

RST = re.compile(r"``|:(?:class|func|meth|data|attr|mod|exc|obj|ref|py:\w+):`")
#: The sections whose entries name parameters or attributes, one each: `name (`type`, *optional*, defaults to `x`):`.
ENTRY_SECTIONS = ("Args", "Parameters", "Attributes")
ENTRY = re.compile(r"(?P<name>\w+) \(`.*\):|\*{1,2}\w+:")  # `**kwargs:` as TRL writes it
SECTION = re.compile(r"(?P<title>[A-Z]\w*( \w+)*):")


def _sections(doc: str) -> dict[str, list[str]]:
    """Each `Title:` section of a (cleaned) docstring: its lines at the entries' indentation, an entry per line."""
    lines = doc.splitlines()
    out: dict[str, list[str]] = {}
    for i, line in enumerate(lines):
        if not SECTION.fullmatch(line.strip()):
            continue
        indent = len(line) - len(line.lstrip())
        body = []
        for nxt in lines[i + 1:]:
            if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= indent:
                break
            body.append(nxt)
        entry_indent = min((len(x) - len(x.lstrip()) for x in body if x.strip()), default=0)
        out[line.strip()[:-1]] = [x.strip() for x in body if x.strip() and len(x) - len(x.lstrip()) == entry_indent]
    return out


def _members(cls: type) -> Iterator[tuple[str, Any]]:
    """The public methods and properties a class defines (or inherits from an ors-trl class)."""
    for klass in cls.__mro__:
        if not klass.__module__.startswith("ors_trl"):
            continue
        for name, value in vars(klass).items():
            method = isinstance(value, staticmethod | classmethod | property) or callable(value)
            if name.startswith("_") or not method or isinstance(value, type):
                continue
            yield f"{cls.__name__}.{name}", value


def _public() -> Iterator[tuple[str, Any]]:
    """Every public class and function of `ors_trl` and `ors_trl.testing`, and their public methods."""
    seen: set[int] = set()
    names = [(ors_trl, n) for n in ors_trl.__all__ if n != "__version__"]
    names += [(ors_trl.testing, n) for n in ors_trl.testing.__all__]
    for module, name in names:
        if name in EXEMPT:
            continue
        obj = getattr(module, name)
        if isinstance(obj, ModuleType):  # `counters`: its own public names
            names += [(obj, n) for n in obj.__all__]
            continue
        yield name, obj
        if isinstance(obj, type):
            for qualname, member in _members(obj):
                if id(member) not in seen:
                    seen.add(id(member))
                    yield qualname, member


def _function(obj: Any) -> Any:
    return obj.__func__ if isinstance(obj, staticmethod | classmethod) else obj


def _parameters(obj: Any) -> list[str]:
    """The parameters `obj`'s docstring documents. A class documents those of the constructor it defines; one it
    inherits (an error class) is documented on the class that defines it."""
    if isinstance(obj, property):
        return []
    if isinstance(obj, type) and not {"__init__", "__new__"} & set(vars(obj)):
        return []
    try:
        signature = inspect.signature(_function(obj))
    except (TypeError, ValueError):
        return []
    return [p.name for p in signature.parameters.values() if p.name not in ("self", "cls")
            and not p.name.startswith("_") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _problems(name: str, obj: Any) -> list[str]:
    raw = obj.__doc__ if isinstance(obj, property) else _function(obj).__doc__
    if dataclasses.is_dataclass(obj) and raw and raw.startswith(f"{obj.__name__}("):  # the signature dataclass wrote
        raw = None
    if not raw or not raw.strip():
        return [f"{name}: no docstring"]
    doc = inspect.cleandoc(raw)
    out = [f"{name}: RST markup {m.group()!r} (write Markdown: single backticks)" for m in RST.finditer(doc)]
    sections = _sections(doc)
    for title in ENTRY_SECTIONS:
        for line in sections.get(title, []):
            if not ENTRY.fullmatch(line):
                out.append(f"{name}: {title} entry {line!r} is not `name (`type`):` (one name per entry, its "
                           "description on the next lines)")
    titles = ENTRY_SECTIONS if isinstance(obj, type) else ("Args",)
    documented = {m.group("name") for t in titles for line in sections.get(t, []) if (m := ENTRY.fullmatch(line))}
    missing = [p for p in _parameters(obj) if p not in documented]
    if missing:
        out.append(f"{name}: parameters without an entry in {' or '.join(f'`{t}:`' for t in titles)}: "
                   f"{', '.join(missing)}")
    return out


def test_public_docstrings_are_in_trl_format() -> None:
    problems = [p for name, obj in _public() for p in _problems(name, obj)]
    assert not problems, "\n".join(problems)


def test_the_check_sees_what_it_must() -> None:
    """The checker itself: it catches RST, a multi-name entry, an undocumented parameter and a missing section."""

    def bad(split: str, index: int, task_spec: dict[str, Any] | None = None) -> None:
        """Uses ``RST`` and :class:`roles`.

        Args:
            split, index (`str`):
                Two at once.
        """

    def good(self: Any, split: str = "train", *args: Any, **kwargs: Any) -> None:
        """Fine.

        Args:
            split (`str`, *optional*, defaults to `"train"`):
                The split.
        """

    class Config:
        """A class may list its constructor's parameters as attributes, one per entry.

        Attributes:
            split (`str`):
                The split.
        """

        def __init__(self, split: str, index: int) -> None: ...

    problems = "\n".join(_problems("bad", bad))
    assert "'``'" in problems and "':class:`'" in problems
    assert "'split, index (`str`):'" in problems
    assert "bad: parameters without an entry in `Args:`: split, index, task_spec" in problems
    assert _problems("good", good) == []
    assert _problems("nothing", lambda x: x) == ["nothing: no docstring"]
    assert _problems("Config", Config) == [
        "Config: parameters without an entry in `Args:` or `Parameters:` or `Attributes:`: index"]


def _docstrings(path: Path) -> Iterator[tuple[int, str]]:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                yield getattr(node, "lineno", 1), doc


PACKAGE = Path(ors_trl.__file__).parent


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_no_rst_in_any_docstring(path: Path) -> None:
    """Private modules too: one markup dialect in the whole package."""
    if path in {Path(inspect.getfile(getattr(ors_trl, name))) for name in EXEMPT}:
        pytest.skip(f"exempt: {path.name}")
    found = [f"{path.name}:{line}: {m.group()!r}" for line, doc in _docstrings(path) for m in RST.finditer(doc)]
    assert not found, "\n".join(found)


def test_inspect_target_lists_the_parameters_it_forwards() -> None:
    """`inspect_target` spells out `collect`'s parameters (no `**kwargs` hiding them), and documents each."""
    from ors_trl.cli.inspect import collect, inspect_target

    assert inspect.signature(inspect_target).parameters == inspect.signature(collect).parameters
    assert _problems("inspect_target", inspect_target) == []
