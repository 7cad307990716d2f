"""Render ORS tool input schemas as Python annotations plus one-line parameter and tool descriptions.

TRL shows tools through `get_json_schema`, which reads only type hints and docstrings: each argument's schema becomes
the annotation it turns back into that structure (`hint_schema`), plus a one-line description of all an annotation
cannot carry (nested fields, defaults, bounds, patterns, ...), so nothing the environment says is lost.
"""

from __future__ import annotations

import keyword
import re
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin

from ..protocol.text import ascii_fold
from .jsonschema import MISSING, PRIMITIVES, Budget, Node, Normaliser, as_text, auto_title, one_line, quote, sentence
from .jsonschema import single_line as single_line

__all__ = ["DEFAULT_MAX_PARAM_DESCRIPTION", "DEFAULT_MAX_SCHEMA_NODES", "DEFAULT_MAX_TOOL_DESCRIPTION",
           "TRUNCATION_MARK", "ParameterInfo", "ToolInfo", "describe_tool", "hint_schema", "python_parameter_names",
           "tool_field", "unique_name"]

#: A parameter description longer than this is cut and marked with `TRUNCATION_MARK`.
DEFAULT_MAX_PARAM_DESCRIPTION = 2_000
#: A tool description longer than this is cut and marked with `TRUNCATION_MARK`.
DEFAULT_MAX_TOOL_DESCRIPTION = 8_000
#: Work units per tool (see `ors_trl.core.jsonschema.Budget`; a pydantic model uses a few hundred).
DEFAULT_MAX_SCHEMA_NODES = 100_000
TRUNCATION_MARK = " …[truncated]"

_INPUT_TEXT = DEFAULT_MAX_PARAM_DESCRIPTION * 2  # characters of field text worth producing for the tool description
_NONE = type(None)
_JSON_TYPES: dict[Any, str] = {hint: name for name, hint in PRIMITIVES.items()} | {list: "array", dict: "object"}


@dataclass(frozen=True)
class ParameterInfo:
    """One argument of a tool, ready to become a Python parameter."""

    remote_name: str  # the property name on the wire
    python_name: str  # the signature's identifier (see `python_parameter_names`)
    annotation: Any  # the type hint `get_json_schema` turns back into the schema
    description: str  # single-line text for the docstring
    required: bool


@dataclass(frozen=True)
class ToolInfo:
    """One tool ready to bind: parameters required first; `notes`: what could not be represented exactly."""

    name: str
    description: str
    parameters: tuple[ParameterInfo, ...]
    notes: tuple[str, ...] = ()


def hint_schema(hint: Any) -> dict[str, Any]:
    """The JSON schema `get_json_schema` writes for a hint `_annotation` makes, without importing transformers."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is None:  # a plain type, or Any
        return {"type": _JSON_TYPES[hint]} if hint in _JSON_TYPES else {}
    if origin is Union:
        parts = [hint_schema(arg) for arg in args if arg is not _NONE]
        if len(parts) == 1:
            out = parts[0]
        elif all(part.keys() == {"type"} and isinstance(part["type"], str) for part in parts):
            names = sorted({part["type"] for part in parts})
            out = {"type": names[0] if len(names) == 1 else names}
        else:
            out = {"anyOf": parts}
        return {**out, "nullable": True} if _NONE in args else out
    if origin is Literal:
        names = list(dict.fromkeys(_JSON_TYPES[type(value)] for value in args))
        return {"type": names[0] if len(names) == 1 else names, "enum": list(args)}
    if origin is list:
        return {"type": "array", "items": hint_schema(args[0])}
    if origin is tuple:
        return {"type": "array", "prefixItems": [hint_schema(arg) for arg in args]}
    return {"type": "object", "additionalProperties": hint_schema(args[1])}  # dict[str, T]


def _parameter_description(summary: Node, wire: str, python: str, max_length: int) -> tuple[str, bool]:
    description = one_line(summary.description)
    model_description = one_line(summary.model_description)
    title, default = summary.title, summary.default
    humane = one_line(wire.replace("_", " ")).strip()
    base = description or model_description or title or (humane[:1].upper() + humane[1:]) or "The argument"
    fields = f"{summary.header} fields" if summary.header else "Fields"
    sentences = [
        base,
        model_description if model_description and description and model_description != description else "",
        f"Title: {title}" if title and title != base and not auto_title(title, wire) else "",
        f"Type: {summary.label}" if summary.lossy and summary.header in (None, "") else "",
        "Constraints: " + ", ".join(summary.constraints) if summary.constraints else "",
        "Notes: " + "; ".join(summary.notes) if summary.notes else "",
        f"{fields}: {summary.fields}" if summary.fields else "",
        f"Default: {quote(default, _text_budget(max_length))}" if default is not MISSING else "",
        f"Wire name: {quote(wire, 400)}" if python != wire else "",
    ]
    sentences = [part for part in sentences if part.strip()]
    # The environment's own text stays exactly as written unless more sentences follow it.
    text = single_line(" ".join(sentence(text) for text in sentences) if len(sentences) > 1 else base)
    return _cap(text, max_length)


def _text_budget(max_length: int) -> int:
    """Characters of field text worth producing for a description cut at `max_length`."""
    return max(max_length, 200) * 2


def _cap(text: str, limit: int) -> tuple[str, bool]:
    if limit <= 0 or len(text) <= limit:
        return text, False
    keep = max(limit - len(TRUNCATION_MARK), 1)
    return text[:keep].rstrip() + TRUNCATION_MARK, True


def python_parameter_names(wire_names: list[str]) -> dict[str, str]:
    """Map wire property names to distinct, safe Python parameter names: a safe identifier is kept, others are
    sanitized (`"class"` -> `"class_"`, `"x-y"` -> `"x_y"`, `"__init__"` -> `"init_"`, `"1st"` -> `"arg_1st"`,
    `""` -> `"arg"`) and suffixed `_2`, `_3`... so none equals another property's wire or Python name."""
    kept = {name for name in wire_names if _is_safe_parameter_name(name)}
    taken = set(kept) | set(wire_names) | {"self"}
    mapping: dict[str, str] = {}
    for name in wire_names:
        if name not in mapping:
            mapping[name] = name if name in kept else unique_name(_sanitize_parameter_name(name), taken)
    return mapping


def unique_name(base: str, taken: set[str], *, limit: int | None = None, avoid: frozenset[str] = frozenset()) -> str:
    """`base`, else the first free `base_2`, `base_3`... (cut to `limit`) not in `taken`/`avoid`; added to `taken`."""
    candidate, index = base, 2
    while candidate in taken or candidate in avoid:
        suffix = f"_{index}"
        stem = base if limit is None else base[: limit - len(suffix)]
        candidate, index = f"{stem}{suffix}", index + 1
    taken.add(candidate)
    return candidate


def _is_safe_parameter_name(name: str) -> bool:
    return (name.isidentifier() and re.fullmatch(r"\w+", name) is not None and not keyword.iskeyword(name)
            and unicodedata.normalize("NFKC", name) == name and name != "self"
            and not (name.startswith("__") and name.endswith("__")))


def _sanitize_parameter_name(name: str) -> str:
    text = re.sub(r"[^A-Za-z0-9_]", "_", ascii_fold(name))
    if name.startswith("__") and name.endswith("__") and len(name) > 4:
        text = text.strip("_") + "_"
    if not text.strip("_"):
        return "arg"
    if text[0].isdigit():
        text = "arg_" + text
    if keyword.iskeyword(text) or text == "self":
        text += "_"
    return text


def tool_field(spec: Any, key: str) -> Any:
    """A tool spec's `name`, `description` or `input_schema`, from a mapping or an object's attributes."""
    if isinstance(spec, Mapping):
        return spec.get(key)
    return getattr(spec, key, None) if key in ("name", "description", "input_schema") else None


def describe_tool(tool_spec: Any, *, max_param_description: int = DEFAULT_MAX_PARAM_DESCRIPTION,
                  max_tool_description: int = DEFAULT_MAX_TOOL_DESCRIPTION,
                  max_schema_nodes: int = DEFAULT_MAX_SCHEMA_NODES, budget: Budget | None = None) -> ToolInfo:
    """The parameters and description of one ORS tool spec (see `tool_field`) within the tool list's `budget`.
    Never raises on odd schemas: what cannot be represented is described and listed in `ToolInfo.notes`."""
    name = as_text(tool_field(tool_spec, "name"))
    normaliser = Normaliser(tool_field(tool_spec, "input_schema"), max_schema_nodes, budget)
    arguments, required, sentences = normaliser.arguments(_text_budget(max_param_description), _INPUT_TEXT)
    names = python_parameter_names([wire for wire, _ in arguments])
    parameters: list[ParameterInfo] = []
    for wire, node in arguments:
        text, cut = _parameter_description(node, wire, names[wire], max_param_description)
        if cut:
            normaliser.note(f"description of parameter {quote(wire, 80)} truncated to {max_param_description} "
                            "characters")
        parameters.append(ParameterInfo(wire, names[wire], node.annotation, text, wire in required))
    parameters.sort(key=lambda parameter: not parameter.required)  # stable: required first, order kept
    description = as_text(tool_field(tool_spec, "description")).replace("\r\n", "\n").replace("\r", "\n").strip()
    if not description:
        description = f"Call the {one_line(name) or 'unnamed'} tool."
    if sentences:
        description += "\n\n" + " ".join(sentence(text) for text in sentences)
    description, cut = _cap(description, max_tool_description)
    if cut:
        normaliser.note(f"tool description truncated to {max_tool_description} characters")
    return ToolInfo(name, description, tuple(parameters), tuple(normaliser.notes))
