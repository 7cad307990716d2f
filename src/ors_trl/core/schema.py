"""Render ORS tool input schemas as Python annotations plus one-line parameter and tool descriptions.

TRL shows tools through `get_json_schema`, which reads only type hints and docstrings: each normalised schema becomes
the annotation it turns back into that structure (`hint_schema`), plus a one-line description of all an annotation
cannot carry (nested fields, defaults, bounds, patterns, ...), so nothing the environment says is lost.
"""

from __future__ import annotations

import keyword
import re
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Union, get_args, get_origin

from ..protocol.text import ascii_fold
from .jsonschema import MISSING, Budget, Node, Normaliser, as_text, is_scalar, name_text, one_line, quote
from .jsonschema import single_line as single_line

__all__ = ["DEFAULT_MAX_PARAM_DESCRIPTION", "DEFAULT_MAX_SCHEMA_NODES", "DEFAULT_MAX_TOOL_DESCRIPTION",
           "TRUNCATION_MARK", "ParameterInfo", "ToolInfo", "describe_tool", "hint_schema", "python_parameter_names",
           "single_line", "tool_field", "unique_name"]

#: A parameter description longer than this is cut and marked with `TRUNCATION_MARK`.
DEFAULT_MAX_PARAM_DESCRIPTION = 2_000
#: A tool description longer than this is cut and marked with `TRUNCATION_MARK`.
DEFAULT_MAX_TOOL_DESCRIPTION = 8_000
#: Work units per tool (see `ors_trl.core.jsonschema.Budget`; a pydantic model uses a few hundred).
DEFAULT_MAX_SCHEMA_NODES = 100_000
TRUNCATION_MARK = " …[truncated]"

_INPUT_TEXT = DEFAULT_MAX_PARAM_DESCRIPTION * 2  # characters of field text worth producing for the tool description
_NONE = type(None)
_PRIMITIVES: dict[str, Any] = {"string": str, "integer": int, "number": float, "boolean": bool, "null": _NONE}
_JSON_TYPES: dict[Any, str] = {hint: name for name, hint in _PRIMITIVES.items()} | {list: "array", dict: "object"}


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


def _annotation(node: Node) -> Any:
    """The type hint for a normalised schema."""
    if node.cut:  # a recursive reference keeps its outermost structural type (object -> dict, array -> list, ...)
        return {"object": dict, "array": list, **_PRIMITIVES}.get(node.types[0], Any) if node.types else Any
    if node.const is not MISSING and is_scalar(node.const):
        annotation = Literal[node.const]
    elif node.enum and all(is_scalar(value) for value in node.enum):
        annotation = Literal[node.enum]
    elif node.arms:
        annotation = _union([_annotation(arm) for arm in node.arms])
    else:
        annotation = _union([_type_annotation(name, node) for name in node.types])
    return _union([annotation, _NONE]) if node.nullable else annotation


def _type_annotation(kind: str, node: Node) -> Any:
    if kind in _PRIMITIVES:
        return _PRIMITIVES[kind]
    if kind == "array":
        if node.prefix is not None:
            parts = [_annotation(part) for part in node.prefix]
            if len(parts) >= 2:
                return tuple[tuple(parts)]
            # get_json_schema refuses one-element tuples; the item count goes in the description.
            return list[parts[0]] if parts else list
        return list[_annotation(node.items)] if isinstance(node.items, Node) else list
    if kind == "object":
        # get_json_schema can only say {"type": "object"} for named keys; the fields go in the description.
        return dict[str, _annotation(node.extra)] if isinstance(node.extra, Node) and not node.keyed else dict
    return Any


def _union(annotations: list[Any]) -> Any:
    unique = list(dict.fromkeys(annotations))
    if not unique or any(annotation is Any for annotation in unique):
        return Any
    return unique[0] if len(unique) == 1 else Union[tuple(unique)]  # noqa: UP007 - built from a runtime list


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


@dataclass
class _Summary:
    """What a schema says, as text: a type label, constraints, notes and the fields of objects inside it."""

    node: Node  # what is summarized (its description, title and default)
    model_description: str  # the node's, or that of the only object among its alternatives
    label: str = "any"
    constraints: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    fields: str | None = None
    header: str | None = None  # whose fields `fields` lists ("Object", "Item (Loc object)", "" when several)
    lossy: bool = False  # the label says something the annotation cannot (and `fields` does not)

    def carry(self, part: _Summary, constraints: str, notes: str, model: bool) -> None:
        """Take up a part's (an alternative's, an item's, a value's) constraints and details, each under its prefix."""
        if part.constraints:
            self.constraints.append(constraints + ", ".join(part.constraints))
        texts = (part.node.description, part.model_description if model else "")
        details = [*part.notes, *(one_line(text) for text in texts if text)]
        if part.node.default is not MISSING:
            details.append(f"default {quote(part.node.default)}")
        if details:
            self.notes.append(notes + "; ".join(details))
        self.lossy = self.lossy or (part.lossy and not part.fields)


@dataclass
class _Describer:
    """Summarizes normalised schemas within `text_left` characters of field text (one budget per parameter)."""

    text_left: int

    def summarize(self, node: Node) -> _Summary:
        out = _Summary(node, node.model_description)
        if node.cut:
            out.label, out.lossy = node.cut, True
            return out
        labels: list[str] = []
        if node.const is not MISSING:
            labels.append(quote(node.const) if is_scalar(node.const) else f"exactly {quote(node.const)}")
            out.lossy = not is_scalar(node.const)
        elif node.enum is not None:
            if not node.enum:
                labels.append("nothing (empty enum)")
                out.lossy = True
            elif all(is_scalar(value) for value in node.enum):
                labels.append(self._join((quote(value) for value in node.enum), " | "))
            else:
                labels.append("one of " + self._join((quote(value) for value in node.enum), ", "))
                out.lossy = True
        elif node.arms:
            labels.append(self._fill_arms(out, node.arms))
        else:
            labels += (self._fill_type(out, name, node) for name in node.types)
        if node.also:
            out.notes.append("also matches one of: " + self._join((quote(arm, 80) for arm in node.also), ", "))
        out.label = " | ".join(label for label in labels if label) or "any"
        out.constraints += (self._check(check) for check in node.checks)
        out.notes += node.notes
        if node.nullable and out.label != "null":
            out.label = f"{out.label} | null"
        return out

    def _join(self, texts: Any, separator: str) -> str:
        """Join texts, stopping with "…" once the parameter's text budget is used up."""
        out: list[str] = []
        size = 0
        for text in texts:
            if size > self.text_left:
                out.append("…")
                break
            out.append(text)
            size += len(text) + len(separator)
        return separator.join(out)

    def _check(self, check: str | tuple[str, str, Node]) -> str:
        if isinstance(check, str):
            return check
        word, text, node = check
        sub = self.summarize(node)
        if word == "contains":
            return f"contains {_paren(sub.label)}" + (f" ({text})" if text else "")
        if word == "keys matching":
            return f"keys matching {text}: {_paren(sub.label)}"
        if word == "keys":
            return "keys " + ", ".join([sub.label, *sub.constraints])
        return "never allowed" if sub.label == "any" and not sub.constraints else f"not {sub.label}"

    def _fill_arms(self, out: _Summary, arms: tuple[Node, ...]) -> str:
        summaries = [self.summarize(arm) for arm in arms]
        non_null = [s for s in summaries if s.label != "null"]
        labels = list(dict.fromkeys(s.label for s in summaries))
        with_fields = [s for s in summaries if s.fields]
        for s in summaries:
            prefix = "" if len(non_null) <= 1 else f"if {s.label}: "
            out.carry(s, prefix, prefix, model=not (len(non_null) == 1 and s.fields))
        if len(with_fields) == 1:
            out.fields, out.header = with_fields[0].fields, with_fields[0].header
            if len(non_null) == 1 and not out.model_description:
                out.model_description = with_fields[0].model_description
        elif with_fields:
            out.fields = " | ".join(f"{s.header or s.label}: {s.fields}" for s in with_fields)
            out.header = ""
        return " | ".join(labels)

    def _fill_type(self, out: _Summary, kind: str, node: Node) -> str:
        if kind in _PRIMITIVES:
            return kind
        if kind == "array":
            return self._fill_array(out, node)
        if kind == "object":
            return self._fill_object(out, node)
        out.lossy = True
        return f"unknown type {quote(kind, 40)}"

    def _fill_array(self, out: _Summary, node: Node) -> str:
        if node.prefix is not None:
            parts = [self.summarize(part) for part in node.prefix]
            for index, part in enumerate(parts, 1):
                details = part.constraints + part.notes
                if part.node.description or part.model_description:
                    details.append(one_line(part.node.description or part.model_description))
                if details:
                    out.constraints.append(f"item {index}: " + ", ".join(details))
                out.lossy = out.lossy or (part.lossy and not part.fields)
            with_fields = [(index, part) for index, part in enumerate(parts, 1) if part.fields]
            if with_fields:
                out.fields = " | ".join(f"item {index}: {part.fields}" for index, part in with_fields)
                out.header = ""
            if node.items is False:
                out.constraints.append("no further items")
            elif isinstance(node.items, Node):
                out.constraints.append(f"further items {self.summarize(node.items).label}")
            return "array [" + ", ".join(part.label for part in parts) + "]"
        if node.items is False:
            out.constraints.append("must be empty")
        if not isinstance(node.items, Node):
            return "array"
        item = self._lift(out, "Item", "each item", self.summarize(node.items))
        return f"array of {_paren(item.label)}"

    def _lift(self, out: _Summary, header: str, phrase: str, inner: _Summary) -> _Summary:
        """Carry an array item's / map value's constraints, notes and fields up to the container."""
        out.carry(inner, f"{phrase} ", f"{phrase}: ", model=not inner.fields)
        if inner.fields:
            about = inner.header or ""
            if inner.model_description:
                model = one_line(inner.model_description).rstrip(".")
                about = f"{about}: {model}" if about else model
            out.fields = inner.fields
            out.header = header if about in ("", "Object") else f"{header} ({about})"
        return inner

    def _fill_object(self, out: _Summary, node: Node) -> str:
        label = f"{node.model} object" if node.model else "object"
        if node.fields is not None:
            required = set(node.required)
            parts: list[str] = []
            for name, sub in node.fields:
                if self.text_left <= 0:
                    parts.append("…")
                    break
                parts.append(self._field(name, sub, name in required))
            else:
                named = {name for name, _ in node.fields}
                missing = (f"{name_text(name)} (any, required)" for name in node.required if name not in named)
                parts.append("…" if node.fields_cut else self._join(missing, "; "))
            out.fields = "; ".join(part for part in parts if part)
            out.header = label[:1].upper() + label[1:]
            if isinstance(node.extra, Node):
                other = self.summarize(node.extra)
                out.constraints.append(", ".join([f"other keys {_paren(other.label)}", *other.constraints]))
        elif isinstance(node.extra, Node):
            value = self._lift(out, "Value", "each value", self.summarize(node.extra))
            return f"{label} of {_paren(value.label)}"
        else:
            out.lossy = out.lossy or bool(node.model)
        if node.extra is False:
            out.constraints.append("no other keys" if node.fields is not None else "no keys")
        return label

    def _field(self, name: str, node: Node, required: bool) -> str:
        """`name (label, required, constraints, default X): description {subfields}`."""
        sub = self.summarize(node)
        parts = [sub.label, *(["required"] if required else []), *sub.constraints, *sub.notes]
        if sub.node.default is not MISSING:
            parts.append(f"default {quote(sub.node.default)}")
        description = one_line(sub.node.description)
        model_description = one_line(sub.model_description)
        if model_description and model_description != description:
            description = f"{_sentence(description)} {model_description}" if description else model_description
        if sub.node.title and not _is_auto_title(sub.node.title, name) and sub.node.title != description:
            parts.append(f"title {quote(sub.node.title)}")
        text = f"{name_text(name)} ({', '.join(parts)})"
        if description:
            text += f": {description.rstrip('.')}"
        self.text_left -= len(text)  # the subfields below were counted when they were written
        if sub.fields:
            text += f" {{{sub.fields}}}"
        return text


def _parameter_description(node: Node, wire: str, python: str, max_length: int) -> tuple[str, bool]:
    summary = _Describer(_text_budget(max_length)).summarize(node)
    description = one_line(summary.node.description)
    model_description = one_line(summary.model_description)
    title, default = summary.node.title, summary.node.default
    humane = one_line(wire.replace("_", " ")).strip()
    base = description or model_description or title or (humane[:1].upper() + humane[1:]) or "The argument"
    fields = f"{summary.header} fields" if summary.header else "Fields"
    sentences = [
        base,
        model_description if model_description and description and model_description != description else "",
        f"Title: {title}" if title and title != base and not _is_auto_title(title, wire) else "",
        f"Type: {summary.label}" if summary.lossy and summary.header in (None, "") else "",
        "Constraints: " + ", ".join(summary.constraints) if summary.constraints else "",
        "Notes: " + "; ".join(summary.notes) if summary.notes else "",
        f"{fields}: {summary.fields}" if summary.fields else "",
        f"Default: {quote(default, _text_budget(max_length))}" if default is not MISSING else "",
        f"Wire name: {quote(wire, 400)}" if python != wire else "",
    ]
    sentences = [sentence for sentence in sentences if sentence.strip()]
    # The environment's own text stays exactly as written unless more sentences follow it.
    text = single_line(" ".join(_sentence(sentence) for sentence in sentences) if len(sentences) > 1 else base)
    return _cap(text, max_length)


def _text_budget(max_length: int) -> int:
    """Characters of field text worth producing for a description cut at `max_length`."""
    return max(max_length, 200) * 2


def _cap(text: str, limit: int) -> tuple[str, bool]:
    if limit <= 0 or len(text) <= limit:
        return text, False
    keep = max(limit - len(TRUNCATION_MARK), 1)
    return text[:keep].rstrip() + TRUNCATION_MARK, True


def _sentence(text: str) -> str:
    text = text.strip()
    return text if not text or text[-1] in ".!?:;" else text + "."


def _is_auto_title(title: str, name: str) -> bool:
    """True for titles generated from the property name (pydantic's `"days" -> "Days"`): they carry nothing."""
    return re.sub(r"[^0-9a-z]", "", title.lower()) == re.sub(r"[^0-9a-z]", "", name.lower())


def _paren(label: str) -> str:
    return f"({label})" if " | " in label or ", " in label else label


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
        parameters.append(ParameterInfo(wire, names[wire], _annotation(node), text, wire in required))
    parameters.sort(key=lambda parameter: not parameter.required)  # stable: required first, order kept
    description = as_text(tool_field(tool_spec, "description")).replace("\r\n", "\n").replace("\r", "\n").strip()
    if not description:
        description = f"Call the {one_line(name) or 'unnamed'} tool."
    describer = _Describer(_INPUT_TEXT)  # one text budget for all the sentences about the input as a whole
    extras = [part if isinstance(part, str) else part[0] + describer.summarize(part[1]).label for part in sentences]
    if extras:
        description += "\n\n" + " ".join(_sentence(extra) for extra in extras)
    description, cut = _cap(description, max_tool_description)
    if cut:
        normaliser.note(f"tool description truncated to {max_tool_description} characters")
    return ToolInfo(name, description, tuple(parameters), tuple(normaliser.notes))
