"""Translate ORS tool input schemas (JSON Schema) into Python annotations plus parameter descriptions.

TRL shows an environment's tools to the model through ``transformers.utils.get_json_schema``, which reads only a
function's type hints and its Google-style docstring. It can express ``string``/``integer``/``number``/``boolean``/
``null``, ``list[T]`` (``items``), ``tuple[A, B]`` (``prefixItems``), ``dict[str, T]`` (``additionalProperties``),
``Literal[...]`` (``enum`` of JSON scalars), ``Union`` (type lists / ``anyOf``) and ``Optional`` (``nullable``), and
nothing else. This module maps every schema to the annotation that makes ``get_json_schema`` reproduce the
environment's structure as closely as it can, and writes everything the annotation cannot carry (fields of nested
objects and whether they are required, defaults, numeric bounds, string patterns and formats, item counts, titles of
nested models, ...) into a compact, deterministic, single-line description of the parameter, so nothing the
environment says about an argument is lost.

Schemas come from the network: ``$ref`` (``#/$defs/...``, ``#/definitions/...`` or any local JSON pointer) is
resolved with cycle detection (a recursive model is cut and described as ``recursive Name``), the total work per tool
is bounded, and nothing in a schema is ever executed. Only the standard library is imported.
"""

from __future__ import annotations

import json
import keyword
import re
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Union
from urllib.parse import unquote

__all__ = [
    "DEFAULT_MAX_PARAM_DESCRIPTION",
    "DEFAULT_MAX_SCHEMA_NODES",
    "DEFAULT_MAX_TOOL_DESCRIPTION",
    "TRUNCATION_MARK",
    "ParameterInfo",
    "ToolInfo",
    "describe_schema",
    "describe_tool",
    "python_parameter_names",
    "schema_to_annotation",
    "single_line",
]

#: A parameter description longer than this is cut and marked with :data:`TRUNCATION_MARK`.
DEFAULT_MAX_PARAM_DESCRIPTION = 2_000
#: A tool description longer than this is cut and marked with :data:`TRUNCATION_MARK`.
DEFAULT_MAX_TOOL_DESCRIPTION = 8_000
#: Work units per tool (one per schema node visited plus one per keyword / enum value / alternative in it) before
#: the rest is typed ``Any`` and elided as "…": bounds hostile or huge schemas (a pydantic model uses a few hundred).
DEFAULT_MAX_SCHEMA_NODES = 100_000
TRUNCATION_MARK = " …[truncated]"

_NONE = type(None)
_JSON_SCALAR_TYPES = (str, int, float, bool, _NONE)
_PRIMITIVES: dict[str, Any] = {"string": str, "integer": int, "number": float, "boolean": bool, "null": _NONE}
_MAX_TYPE_DEPTH = 24  # nesting depth of generated annotations (list[list[...]])
_MAX_FIELD_DEPTH = 6  # nesting depth of "field {subfield {...}}" descriptions
_MAX_REF_HOPS = 64  # $ref -> $ref -> ... chains
_SNIPPET = 160  # longest JSON value quoted inside a nested description
_MAX_TEXT = 10_000  # longest free text (description, title) read from one schema node
_MAX_JSON_DEPTH = 32
_SIMPLE_NAME_RE = re.compile(r"[\w.-]+")

# Keywords this module renders (or deliberately ignores); every other keyword is rendered as "key <json>".
_HANDLED_KEYS = frozenset(
    {
        "type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "properties", "required",
        "additionalProperties", "patternProperties", "propertyNames", "items", "prefixItems", "title",
        "description", "default", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
        "minLength", "maxLength", "pattern", "format", "minItems", "maxItems", "uniqueItems", "contains",
        "minContains", "maxContains", "minProperties", "maxProperties", "not", "deprecated", "readOnly",
        "writeOnly", "examples", "example", "discriminator", "nullable", "contentEncoding", "contentMediaType",
        "definitions",
    }
)  # fmt: skip


class _Missing:
    __slots__ = ()

    def __repr__(self) -> str:
        return "<missing>"


_MISSING: Any = _Missing()


@dataclass(frozen=True)
class ParameterInfo:
    """One argument of a tool, ready to become a Python parameter.

    ``remote_name`` is the property name on the wire, ``python_name`` the identifier used in the signature (equal
    unless the wire name is a keyword, not an identifier, a dunder or ``self``), ``annotation`` the type hint
    ``get_json_schema`` turns back into the schema, and ``description`` the single-line text for the docstring.
    """

    remote_name: str
    python_name: str
    annotation: Any
    description: str
    required: bool


@dataclass(frozen=True)
class ToolInfo:
    """Everything needed to bind one tool: its remote name, description, parameters (required first) and notes.

    ``notes`` lists what could not be represented exactly (recursion cut, unresolved ``$ref``, truncation, ...).
    """

    name: str
    description: str
    parameters: tuple[ParameterInfo, ...]
    notes: tuple[str, ...] = ()


# ----------------------------------------------------------------------------------------------------------- text


# Characters that str.splitlines() breaks on: none may survive in a parameter description.
_LINE_BREAKS = "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"
_LINE_BREAKS_TO_SPACE = str.maketrans(dict.fromkeys(_LINE_BREAKS, " "))
_LINE_BREAKS_TO_ESCAPE = str.maketrans({char: f"\\u{ord(char):04x}" for char in _LINE_BREAKS})


def _one_line(text: Any) -> str:
    """Collapse every run of whitespace (newlines included) into one space (reads at most ``_MAX_TEXT`` chars)."""
    return " ".join(_text(text)[:_MAX_TEXT].split())


def single_line(text: str) -> str:
    """Replace line breaks with spaces, keeping other spacing (quoted JSON values stay exact)."""
    return text.translate(_LINE_BREAKS_TO_SPACE).strip()


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    return _json(value)


def _unjsonable(value: Any) -> str:
    # Never call repr()/str() on an arbitrary object: that could run foreign code.
    return f"<{type(value).__name__}>"


def _json(value: Any, limit: int | None = _SNIPPET) -> str:
    """Compact JSON (``json.dumps`` spacing) for a value quoted in a description, cut to ``limit`` characters.

    The work is bounded by ``limit`` whatever the value's size; line breaks inside strings are escaped so the text
    stays valid JSON on one line, and objects that are not JSON are shown as ``<type>`` (never ``repr()``-ed).
    """
    budget = _MAX_TEXT * 10 if limit is None else limit + 1
    parts: list[str] = []
    size = 0

    def emit(text: str) -> bool:
        nonlocal size
        parts.append(text)
        size += len(text)
        return size < budget

    def scalar(item: Any) -> str:
        if isinstance(item, str):
            return json.dumps(item[:budget], ensure_ascii=False)
        try:
            return json.dumps(item)
        except ValueError:  # an int too long to print
            return "<number>"

    def walk(item: Any, depth: int) -> bool:
        if item is None or isinstance(item, str | int | float):
            return emit(scalar(item))
        if depth >= _MAX_JSON_DEPTH:
            return emit("…")
        if isinstance(item, dict):
            if not emit("{"):
                return False
            for index, (key, sub) in enumerate(item.items()):
                key_text = (
                    key if isinstance(key, str) else scalar(key) if _is_scalar(key) else f"<{type(key).__name__}>"
                )
                if (index and not emit(", ")) or not emit(scalar(key_text) + ": ") or not walk(sub, depth + 1):
                    return False
            return emit("}")
        if isinstance(item, list | tuple):
            if not emit("["):
                return False
            for index, sub in enumerate(item):
                if (index and not emit(", ")) or not walk(sub, depth + 1):
                    return False
            return emit("]")
        return emit(_unjsonable(item))

    walk(value, 0)
    text = "".join(parts).translate(_LINE_BREAKS_TO_ESCAPE)
    if limit is not None and len(text) > limit:
        text = text[: limit - 1] + "…"
    return text


def _cap(text: str, limit: int) -> tuple[str, bool]:
    if limit <= 0 or len(text) <= limit:
        return text, False
    keep = max(limit - len(TRUNCATION_MARK), 1)
    return text[:keep].rstrip() + TRUNCATION_MARK, True


def _sentence(text: str) -> str:
    text = text.strip()
    return text if not text or text[-1] in ".!?:;" else text + "."


def _simple_key(text: str) -> str:
    return re.sub(r"[^0-9a-z]", "", text.lower())


def _is_auto_title(title: str, name: str) -> bool:
    """True for titles generated from the property name (pydantic's ``"days" -> "Days"``): they carry nothing."""
    return _simple_key(title) == _simple_key(name)


def _name_text(name: str) -> str:
    return name if len(name) <= _SNIPPET and _SIMPLE_NAME_RE.fullmatch(name) else _json(name)


def _paren(label: str) -> str:
    return f"({label})" if " | " in label or ", " in label else label


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_scalar(value: Any) -> bool:
    return type(value) in _JSON_SCALAR_TYPES


def _ascii_fold(text: str) -> str:
    return unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")


def _ref_name(ref: str) -> str:
    tail = ref.rsplit("/", 1)[-1] or ref
    return unquote(tail).replace("~1", "/").replace("~0", "~")


# ------------------------------------------------------------------------------------------------------ annotations


def _union(annotations: list[Any]) -> Any:
    unique: list[Any] = []
    for annotation in annotations:
        if annotation is Any:
            return Any
        if annotation not in unique:
            unique.append(annotation)
    if not unique:
        return Any
    if len(unique) == 1:
        return unique[0]
    return Union[tuple(unique)]  # noqa: UP007 - built from a runtime list


# ---------------------------------------------------------------------------------------------------------- walker


@dataclass
class _View:
    """A schema node with ``$ref`` / single-``allOf`` wrappers followed and their sibling keywords merged in."""

    schema: dict
    stack: tuple[str, ...]
    model: str | None = None  # title or $defs name of the model reached through a $ref
    model_description: str = ""
    description: str = ""  # the node's own (property-level) description
    cut: str | None = None  # label when expansion stopped (recursion, unresolved reference)
    target: Any = None  # for a recursive cut: the schema the reference points back to


@dataclass
class _Summary:
    """What a schema says, as text: a type label, constraints, notes and the fields of objects inside it."""

    label: str = "any"
    constraints: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    fields: str | None = None
    header: str | None = None  # whose fields ``fields`` lists ("Object", "Item (Loc object)", "" when several)
    lossy: bool = False  # the label says something the annotation cannot (and ``fields`` does not)
    description: str = ""
    model_description: str = ""
    title: str = ""
    default: Any = _MISSING


class _Walker:
    """Walks one tool's input schema with a shared node budget, reference resolution and a list of notes."""

    def __init__(self, root: Any, max_nodes: int) -> None:
        self.root = root
        self.left = max_nodes
        self.text_left = DEFAULT_MAX_PARAM_DESCRIPTION * 2  # characters of field text still worth producing
        self.notes: list[str] = []

    # -- bookkeeping

    def note(self, message: str) -> None:
        if message not in self.notes:
            self.notes.append(message)

    def tick(self, cost: int = 1) -> bool:
        """Spend ``cost`` work units; False (and a note) once the budget is exhausted."""
        if self.left <= 0:
            self.note("schema too large: the rest of it is typed Any and elided in descriptions")
            return False
        self.left -= cost
        return True

    def as_schema(self, node: Any) -> dict:
        if isinstance(node, dict):
            return node
        if node is True or node is None:
            return {}
        if node is False:
            return {"not": {}}
        self.note(f"invalid schema node {_json(node, 60)} treated as 'any'")
        return {}

    def resolve(self, ref: str) -> Any:
        """Resolve a local reference (``#``, ``#/$defs/X``, ``#/definitions/X``, any JSON pointer)."""
        if not ref.startswith("#"):
            return _MISSING
        pointer = unquote(ref[1:])
        if not pointer:
            return self.root
        if not pointer.startswith("/"):
            return _MISSING
        node = self.root
        for raw in pointer[1:].split("/"):
            part = raw.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif (
                isinstance(node, list)
                and part.isascii()
                and part.isdecimal()
                and len(part) < 10
                and int(part) < len(node)
            ):
                node = node[int(part)]
            else:
                return _MISSING
        return node

    def deref(self, node: Any, stack: tuple[str, ...]) -> _View:
        """Follow ``$ref`` and single-element ``allOf``; outer keywords override the target's."""
        outer: dict = {}
        model: str | None = None
        first = True
        description = ""
        for _ in range(_MAX_REF_HOPS):
            node = self.as_schema(node)
            if first:
                description = _text(node.get("description"))
                first = False
            ref = node.get("$ref")
            all_of = node.get("allOf")
            if isinstance(ref, str):
                for key, value in node.items():
                    if key != "$ref":
                        outer.setdefault(key, value)
                name = _ref_name(ref)
                if ref in stack:
                    self.note(f"recursive reference {_json(ref, 80)} cut")
                    target = self.resolve(ref)
                    if isinstance(target, dict) and isinstance(target.get("title"), str) and target["title"].strip():
                        name = target["title"]
                    return _View(
                        outer, stack, model=name, description=description, cut=f"recursive {name}", target=target
                    )
                target = self.resolve(ref)
                if target is _MISSING:
                    self.note(f"unresolved reference {_json(ref, 80)} typed Any")
                    return _View(outer, stack, description=description, cut=f"unresolved reference {_json(ref)}")
                stack = (*stack, ref)
                model = name
                node = target
                continue
            if isinstance(all_of, list) and len(all_of) == 1:
                for key, value in node.items():
                    if key != "allOf":
                        outer.setdefault(key, value)
                node = all_of[0]
                continue
            break
        else:
            self.note("reference chain too long, typed Any")
            return _View(outer, stack, description=description, cut="reference chain too long")
        model_description = ""
        if model is not None:
            title = node.get("title")
            model = title if isinstance(title, str) and title.strip() else model
            model_description = _text(node.get("description"))
        merged = {**node, **outer}
        all_of = merged.get("allOf")
        if isinstance(all_of, list) and len(all_of) > 1:
            merged = self._merge_all_of(merged, all_of, stack)
        return _View(merged, stack, model, model_description, description)

    def _merge_all_of(self, schema: dict, arms: list, stack: tuple[str, ...]) -> dict:
        """Merge ``allOf`` arms into one schema: properties are united, other keywords first-come."""
        merged = {key: value for key, value in schema.items() if key != "allOf"}
        properties = dict(merged.get("properties") or {}) if isinstance(merged.get("properties"), dict) else {}
        raw_required = merged.get("required")
        required = [name for name in raw_required if isinstance(name, str)] if isinstance(raw_required, list) else []
        leftovers: list[str] = []
        for arm in arms:
            if not self.tick():
                break
            view = self.deref(arm, stack)
            if view.cut:
                leftovers.append(view.cut)
                continue
            for key, value in view.schema.items():
                if key == "properties" and isinstance(value, dict):
                    for name, sub in value.items():
                        properties.setdefault(name, sub)
                elif key == "required" and isinstance(value, list):
                    known = set(required)
                    required.extend(
                        dict.fromkeys(name for name in value if isinstance(name, str) and name not in known)
                    )
                elif key in ("title", "description"):
                    continue
                elif key not in merged:
                    merged[key] = value
                elif merged[key] != value:
                    leftovers.append(f"{key} {_json(value, 60)}")
        if properties:
            merged["properties"] = properties
        if required:
            merged["required"] = required
        if leftovers:
            merged["x-also-must-match"] = leftovers
        return merged

    # -- annotations

    def annotation(self, node: Any, stack: tuple[str, ...], depth: int) -> Any:
        """The type hint for a schema node."""
        if depth > _MAX_TYPE_DEPTH:
            self.note("schema nested too deeply: inner part typed Any")
            return Any
        if not self.tick():
            return Any
        view = self.deref(node, stack)
        if view.cut:
            # A recursive reference keeps its outermost structural type (object -> dict, array -> list, ...).
            kind = view.target.get("type") if isinstance(view.target, dict) else None
            if kind == "object" or (kind is None and isinstance(view.target, dict) and "properties" in view.target):
                return dict
            if kind == "array":
                return list
            return _PRIMITIVES.get(kind, Any) if isinstance(kind, str) else Any
        schema = view.schema
        annotation = self._annotation_of(schema, view.stack, depth)
        if schema.get("nullable") is True:
            annotation = _union([annotation, _NONE])
        return annotation

    def _annotation_of(self, schema: dict, stack: tuple[str, ...], depth: int) -> Any:
        if "const" in schema and _is_scalar(schema["const"]):
            return Literal[schema["const"]]
        enum = schema.get("enum")
        if isinstance(enum, list) and enum and self.tick(len(enum)) and all(_is_scalar(value) for value in enum):
            return Literal[tuple(enum)]
        kind = schema.get("type")
        arms = _arms(schema)
        if kind is None and arms:
            return _union([self.annotation(arm, stack, depth + 1) for arm in arms])
        if isinstance(kind, list):
            names = list(dict.fromkeys(name for name in kind if isinstance(name, str)))
            return _union([self._annotation_for(name, schema, stack, depth) for name in names])
        if isinstance(kind, str):
            return self._annotation_for(kind, schema, stack, depth)
        if any(key in schema for key in ("properties", "additionalProperties", "patternProperties")):
            return self._annotation_for("object", schema, stack, depth)
        if any(key in schema for key in ("items", "prefixItems")):
            return self._annotation_for("array", schema, stack, depth)
        return Any

    def _annotation_for(self, kind: str, schema: dict, stack: tuple[str, ...], depth: int) -> Any:
        if kind in _PRIMITIVES:
            return _PRIMITIVES[kind]
        if kind == "array":
            prefix = _prefix_items(schema)
            if prefix is not None:
                parts = [self.annotation(part, stack, depth + 1) for part in prefix]
                if len(parts) >= 2:
                    return tuple[tuple(parts)]
                # get_json_schema refuses one-element tuples; the item count goes in the description.
                return list[parts[0]] if parts else list
            items = schema.get("items")
            if items is None or items is True or items is False:
                return list
            return list[self.annotation(items, stack, depth + 1)]
        if kind == "object":
            properties = schema.get("properties")
            if (
                (isinstance(properties, dict) and properties)
                or schema.get("patternProperties")
                or schema.get("required")
            ):
                return dict  # get_json_schema can only say {"type": "object"}; the fields go in the description
            extra = schema.get("additionalProperties")
            if isinstance(extra, dict):
                return dict[str, self.annotation(extra, stack, depth + 1)]
            return dict
        return Any

    # -- descriptions

    def summarize(self, node: Any, stack: tuple[str, ...], depth: int) -> _Summary:
        """Describe a schema node (see :class:`_Summary`)."""
        if depth > _MAX_TYPE_DEPTH:
            self.note("schema nested too deeply: inner part typed Any")
            return _Summary(label="…", lossy=True)
        if not self.tick():
            return _Summary(label="…", lossy=True)
        view = self.deref(node, stack)
        schema = view.schema
        self.tick(
            len(schema) + len(_arms(schema)) + (len(schema["enum"]) if isinstance(schema.get("enum"), list) else 0)
        )
        title = schema.get("title") if view.model is None else _node_title(node)
        summary = _Summary(
            description=view.description,
            model_description=view.model_description,
            title=_one_line(title) if isinstance(title, str) else "",
            default=schema.get("default", _MISSING),
        )
        if view.cut:
            summary.label = view.cut
            summary.lossy = True
            return summary
        self._fill(summary, schema, view, depth)
        if schema.get("nullable") is True and summary.label != "null":
            summary.label = f"{summary.label} | null"
        return summary

    def _fill(self, out: _Summary, schema: dict, view: _View, depth: int) -> None:
        stack = view.stack
        kind = schema.get("type")
        arms = _arms(schema)
        if isinstance(kind, str):
            type_names = [kind]
        elif isinstance(kind, list):
            type_names = [name for name in kind if isinstance(name, str)]
        else:
            type_names = []
        if kind is None:
            if any(key in schema for key in ("properties", "additionalProperties", "patternProperties")):
                type_names = ["object"]
            elif any(key in schema for key in ("items", "prefixItems")):
                type_names = ["array"]

        labels: list[str] = []
        if "const" in schema:
            value = schema["const"]
            labels.append(_json(value) if _is_scalar(value) else f"exactly {_json(value)}")
            out.lossy = out.lossy or not _is_scalar(value)
        elif isinstance(schema.get("enum"), list):
            values = schema["enum"]
            if not values:
                labels.append("nothing (empty enum)")
                out.lossy = True
            elif all(_is_scalar(value) for value in values):
                labels.append(self._join((_json(value) for value in values), " | "))
            else:
                labels.append("one of " + self._join((_json(value) for value in values), ", "))
                out.lossy = True
        elif arms and kind is None:
            labels.append(self._fill_arms(out, arms, stack, depth))
        else:
            for name in dict.fromkeys(type_names):
                labels.append(self._fill_type(out, name, schema, view, depth))
        if arms and (kind is not None or "const" in schema or "enum" in schema):
            out.notes.append("also matches one of: " + self._join((_json(arm, 80) for arm in arms), ", "))
        out.label = " | ".join(label for label in labels if label) or "any"
        self._constraints(out, schema, stack, depth)

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

    def _fill_arms(self, out: _Summary, arms: list, stack: tuple[str, ...], depth: int) -> str:
        summaries = [self.summarize(arm, stack, depth) for arm in arms]
        non_null = [s for s in summaries if s.label != "null"]
        labels = list(dict.fromkeys(s.label for s in summaries))
        with_fields = [s for s in summaries if s.fields]
        for s in summaries:
            out.lossy = out.lossy or (s.lossy and not s.fields)
            prefix = "" if len(non_null) <= 1 else f"if {s.label}: "
            if s.constraints:
                out.constraints.append(prefix + ", ".join(s.constraints))
            extra = list(s.notes)
            if s.description:
                extra.append(_one_line(s.description))
            if s.model_description and not (len(non_null) == 1 and s.fields):
                extra.append(_one_line(s.model_description))
            if s.default is not _MISSING:
                extra.append(f"default {_json(s.default)}")
            if extra:
                out.notes.append(prefix + "; ".join(extra))
        if len(with_fields) == 1:
            out.fields, out.header = with_fields[0].fields, with_fields[0].header
            if len(non_null) == 1 and not out.model_description:
                out.model_description = with_fields[0].model_description
        elif with_fields:
            out.fields = " | ".join(f"{s.header or s.label}: {s.fields}" for s in with_fields)
            out.header = ""
        return " | ".join(labels)

    def _fill_type(self, out: _Summary, kind: str, schema: dict, view: _View, depth: int) -> str:
        stack = view.stack
        if kind in _PRIMITIVES:
            return kind
        if kind == "array":
            return self._fill_array(out, schema, stack, depth)
        if kind == "object":
            return self._fill_object(out, schema, view, depth)
        out.lossy = True
        return f"unknown type {_json(kind, 40)}"

    def _fill_array(self, out: _Summary, schema: dict, stack: tuple[str, ...], depth: int) -> str:
        prefix = _prefix_items(schema)
        if prefix is not None:
            parts = [self.summarize(part, stack, depth + 1) for part in prefix]
            for index, part in enumerate(parts, 1):
                details = part.constraints + part.notes
                if part.description or part.model_description:
                    details.append(_one_line(part.description or part.model_description))
                if details:
                    out.constraints.append(f"item {index}: " + ", ".join(details))
                out.lossy = out.lossy or (part.lossy and not part.fields)
            with_fields = [(index, part) for index, part in enumerate(parts, 1) if part.fields]
            if with_fields:
                out.fields = " | ".join(f"item {index}: {part.fields}" for index, part in with_fields)
                out.header = ""
            items = schema.get("items") if isinstance(schema.get("prefixItems"), list) else None
            if items is False:
                out.constraints.append("no further items")
            elif items is not None and items is not True:
                rest = self.summarize(items, stack, depth + 1)
                out.constraints.append(f"further items {rest.label}")
            return "array [" + ", ".join(part.label for part in parts) + "]"
        items = schema.get("items")
        if items is None or items is True:
            return "array"
        if items is False:
            out.constraints.append("must be empty")
            return "array"
        item = self._lift(out, "Item", "each item", self.summarize(items, stack, depth + 1))
        out.lossy = out.lossy or (item.lossy and not item.fields)
        return f"array of {_paren(item.label)}"

    def _lift(self, out: _Summary, header: str, phrase: str, inner: _Summary) -> _Summary:
        """Carry an array item's / map value's constraints, notes and fields up to the container."""
        if inner.constraints:
            out.constraints.append(f"{phrase} " + ", ".join(inner.constraints))
        notes = list(inner.notes)
        if inner.description:
            notes.append(_one_line(inner.description))
        if inner.model_description and not inner.fields:
            notes.append(_one_line(inner.model_description))
        if inner.default is not _MISSING:
            notes.append(f"default {_json(inner.default)}")
        if notes:
            out.notes.append(f"{phrase}: " + "; ".join(notes))
        if inner.fields:
            about = inner.header or ""
            if inner.model_description:
                about = (
                    f"{about}: {_one_line(inner.model_description).rstrip('.')}"
                    if about
                    else _one_line(inner.model_description).rstrip(".")
                )
            out.fields = inner.fields
            out.header = header if about in ("", "Object") else f"{header} ({about})"
        return inner

    def _fill_object(self, out: _Summary, schema: dict, view: _View, depth: int) -> str:
        stack = view.stack
        label = f"{view.model} object" if view.model else "object"
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required_raw = schema.get("required")
        required = [name for name in required_raw if isinstance(name, str)] if isinstance(required_raw, list) else []
        extra = schema.get("additionalProperties")
        if properties or required:
            if depth >= _MAX_FIELD_DEPTH:
                out.fields = "…"
                self.note("object nesting too deep: inner fields elided")
            else:
                required_set = set(required)
                parts: list[str] = []
                for name, sub in properties.items():
                    if self.text_left <= 0:
                        parts.append("…")
                        break
                    if isinstance(name, str):
                        parts.append(self._field(name, sub, name in required_set, stack, depth + 1))
                else:
                    missing = (f"{_name_text(name)} (any, required)" for name in required if name not in properties)
                    parts.append(self._join(missing, "; "))
                out.fields = "; ".join(part for part in parts if part)
            out.header = label[:1].upper() + label[1:]
            if isinstance(extra, dict):
                other = self.summarize(extra, stack, depth + 1)
                out.constraints.append(
                    f"other keys {_paren(other.label)}" + "".join(f", {detail}" for detail in other.constraints)
                )
            elif extra is False:
                out.constraints.append("no other keys")
        elif isinstance(extra, dict):
            value = self._lift(out, "Value", "each value", self.summarize(extra, stack, depth + 1))
            out.lossy = out.lossy or (value.lossy and not value.fields)
            return f"{label} of {_paren(value.label)}"
        else:
            if view.model:
                out.lossy = True
            if extra is False:
                out.constraints.append("no keys")
        return label

    def _field(self, name: str, node: Any, required: bool, stack: tuple[str, ...], depth: int) -> str:
        """``name (label, required, constraints, default X): description {subfields}``."""
        sub = self.summarize(node, stack, depth)
        parts = [sub.label]
        if required:
            parts.append("required")
        parts += sub.constraints + sub.notes
        if sub.default is not _MISSING:
            parts.append(f"default {_json(sub.default)}")
        description = _one_line(sub.description)
        model_description = _one_line(sub.model_description)
        if model_description and model_description != description:
            description = f"{_sentence(description)} {model_description}" if description else model_description
        if sub.title and not _is_auto_title(sub.title, name) and sub.title != description:
            parts.append(f"title {_json(sub.title)}")
        text = f"{_name_text(name)} ({', '.join(parts)})"
        if description:
            text += f": {description.rstrip('.')}"
        self.text_left -= len(text)  # the subfields below were counted when they were written
        if sub.fields:
            text += f" {{{sub.fields}}}"
        return text

    def _constraints(self, out: _Summary, schema: dict, stack: tuple[str, ...], depth: int) -> None:
        """Append everything except type/structure: bounds, lengths, patterns, formats, item counts, notes."""
        add = out.constraints.append
        bounds = _numeric_bounds(schema)
        if bounds:
            add(bounds)
        if _is_number(schema.get("multipleOf")):
            add(f"multiple of {_json(schema['multipleOf'])}")
        count = _count_range(schema.get("minLength"), schema.get("maxLength"), "chars")
        if count:
            add(count)
        pattern = schema.get("pattern")
        if isinstance(pattern, str):
            plain = pattern.strip() and not any(char.isspace() for char in pattern)
            add(f"pattern {pattern if plain else _json(pattern)}")
        for key, word in (("format", "format"), ("contentEncoding", "encoding"), ("contentMediaType", "media type")):
            if isinstance(schema.get(key), str):
                add(f"{word} {_one_line(schema[key])}")
        count = _count_range(schema.get("minItems"), schema.get("maxItems"), "items")
        if count:
            add(count)
        if schema.get("uniqueItems") is True:
            add("unique items")
        if "contains" in schema:
            contained = self.summarize(schema["contains"], stack, depth + 1)
            count = _count_range(schema.get("minContains"), schema.get("maxContains"), "")
            add(f"contains {_paren(contained.label)}" + (f" ({count.strip()})" if count else ""))
        count = _count_range(schema.get("minProperties"), schema.get("maxProperties"), "keys")
        if count:
            add(count)
        patterns = schema.get("patternProperties")
        if isinstance(patterns, dict):
            for key_pattern, sub in patterns.items():
                value = self.summarize(sub, stack, depth + 1)
                add(f"keys matching {_json(key_pattern)}: {_paren(value.label)}")
        if "propertyNames" in schema:
            names = self.summarize(schema["propertyNames"], stack, depth + 1)
            add("keys " + ", ".join([names.label, *names.constraints]))
        if "not" in schema:
            negated = self.summarize(schema["not"], stack, depth + 1)
            add("never allowed" if negated.label == "any" and not negated.constraints else f"not {negated.label}")
        notes = out.notes
        if schema.get("deprecated") is True:
            notes.append("deprecated")
        if schema.get("readOnly") is True:
            notes.append("read-only")
        if schema.get("writeOnly") is True:
            notes.append("write-only")
        if isinstance(schema.get("examples"), list):
            notes.append(f"examples {_json(schema['examples'])}")
        if "example" in schema:
            notes.append(f"example {_json(schema['example'])}")
        discriminator = schema.get("discriminator")
        if isinstance(discriminator, dict) and isinstance(discriminator.get("propertyName"), str):
            notes.append(f"discriminated by {_name_text(discriminator['propertyName'])}")
        elif isinstance(discriminator, str):
            notes.append(f"discriminated by {_name_text(discriminator)}")
        also = schema.get("x-also-must-match")
        if isinstance(also, list) and also and all(isinstance(item, str) for item in also):
            notes.append("also must match " + ", ".join(also))
        for key, value in schema.items():
            if (
                isinstance(key, str)
                and key not in _HANDLED_KEYS
                and not key.startswith("$")
                and key != "x-also-must-match"
            ):
                notes.append(f"{_name_text(key)} {_json(value)}")


def _node_title(node: Any) -> Any:
    """The title written next to a ``$ref`` (the property's own title), if any."""
    return node.get("title") if isinstance(node, dict) else None


def _arms(schema: dict) -> list:
    for key in ("anyOf", "oneOf"):
        arms = schema.get(key)
        if isinstance(arms, list) and arms:
            return arms
    return []


def _prefix_items(schema: dict) -> list | None:
    prefix = schema.get("prefixItems")
    if isinstance(prefix, list):
        return prefix
    items = schema.get("items")
    if isinstance(items, list):  # draft 4-2019 tuple form (pydantic v1)
        return items
    return None


def _numeric_bounds(schema: dict) -> str:
    low, high = schema.get("minimum"), schema.get("maximum")
    low = low if _is_number(low) else None
    high = high if _is_number(high) else None
    low_strict = high_strict = False
    exclusive_low, exclusive_high = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    if exclusive_low is True and low is not None:  # draft 4 boolean form
        low_strict = True
    elif _is_number(exclusive_low) and (low is None or exclusive_low >= low):
        low, low_strict = exclusive_low, True
    if exclusive_high is True and high is not None:
        high_strict = True
    elif _is_number(exclusive_high) and (high is None or exclusive_high <= high):
        high, high_strict = exclusive_high, True
    if low is not None and high is not None:
        return f"{_json(low)} {'<' if low_strict else '≤'} x {'<' if high_strict else '≤'} {_json(high)}"
    if low is not None:
        return f"x {'>' if low_strict else '≥'} {_json(low)}"
    if high is not None:
        return f"x {'<' if high_strict else '≤'} {_json(high)}"
    return ""


def _count_range(low: Any, high: Any, unit: str) -> str:
    low = low if _is_number(low) and low > 0 else None
    high = high if _is_number(high) else None
    unit = f" {unit}" if unit else ""
    if low is not None and high is not None:
        return f"exactly {_json(low)}{unit}" if low == high else f"{_json(low)}–{_json(high)}{unit}"
    if low is not None:
        return f"≥ {_json(low)}{unit}"
    if high is not None:
        return f"≤ {_json(high)}{unit}"
    return ""


# ------------------------------------------------------------------------------------------------------- public API


def schema_to_annotation(schema: Any, *, root: Any = None, max_nodes: int = DEFAULT_MAX_SCHEMA_NODES) -> Any:
    """The type hint that ``get_json_schema`` renders as (the structural part of) ``schema``.

    ``root`` is the document ``$ref`` pointers resolve against (defaults to ``schema`` itself).
    """
    walker = _Walker(schema if root is None else root, max_nodes)
    return walker.annotation(schema, (), 0)


def describe_schema(
    schema: Any,
    *,
    name: str = "value",
    root: Any = None,
    max_length: int = DEFAULT_MAX_PARAM_DESCRIPTION,
    max_nodes: int = DEFAULT_MAX_SCHEMA_NODES,
) -> str:
    """The one-line parameter description for ``schema``: its own description plus everything types cannot say."""
    walker = _Walker(schema if root is None else root, max_nodes)
    text, _ = _parameter_description(walker, name, name, schema, (), max_length)
    return text


def python_parameter_names(wire_names: list[str]) -> dict[str, str]:
    """Map wire property names to distinct, safe Python parameter names.

    A name is kept when it is an identifier (matching ``\\w+``, NFKC-stable), not a keyword, not ``self`` and not a
    dunder; otherwise it is sanitized (``"class"`` -> ``"class_"``, ``"self"`` -> ``"self_"``, ``"x-y"`` -> ``"x_y"``,
    ``"__init__"`` -> ``"init_"``, ``"1st"`` -> ``"arg_1st"``, ``""`` -> ``"arg"``) and de-duplicated with ``_2``,
    ``_3``... so it never equals another property's wire or Python name.
    """
    kept = {name for name in wire_names if _is_safe_parameter_name(name)}
    taken = set(kept) | set(wire_names) | {"self"}
    mapping: dict[str, str] = {}
    for name in wire_names:
        if name in mapping:
            continue
        if name in kept:
            mapping[name] = name
            continue
        base = _sanitize_parameter_name(name)
        candidate, index = base, 2
        while candidate in taken:
            candidate, index = f"{base}_{index}", index + 1
        taken.add(candidate)
        mapping[name] = candidate
    return mapping


def _is_safe_parameter_name(name: str) -> bool:
    return (
        name.isidentifier()
        and re.fullmatch(r"\w+", name) is not None
        and unicodedata.normalize("NFKC", name) == name
        and not keyword.iskeyword(name)
        and name != "self"
        and not (name.startswith("__") and name.endswith("__"))
    )


def _sanitize_parameter_name(name: str) -> str:
    text = re.sub(r"[^A-Za-z0-9_]", "_", _ascii_fold(name))
    if name.startswith("__") and name.endswith("__") and len(name) > 4:
        text = text.strip("_") + "_"
    if not text.strip("_"):
        return "arg"
    if text[0].isdigit():
        text = "arg_" + text
    if keyword.iskeyword(text) or text == "self":
        text += "_"
    return text


def _parameter_description(
    walker: _Walker, wire: str, python: str, node: Any, stack: tuple[str, ...], max_length: int
) -> tuple[str, bool]:
    walker.text_left = max(max_length, 200) * 2
    summary = walker.summarize(node, stack, 0)
    description = _one_line(summary.description)
    model_description = _one_line(summary.model_description)
    title = summary.title
    humane = _one_line(wire.replace("_", " ")).strip()
    base = description or model_description or title or (humane[:1].upper() + humane[1:]) or "The argument"
    sentences = [base]
    if model_description and description and model_description != description:
        sentences.append(model_description)
    if title and title != base and not _is_auto_title(title, wire):
        sentences.append(f"Title: {title}")
    if summary.lossy and summary.header in (None, ""):
        sentences.append(f"Type: {summary.label}")
    if summary.constraints:
        sentences.append("Constraints: " + ", ".join(summary.constraints))
    if summary.notes:
        sentences.append("Notes: " + "; ".join(summary.notes))
    if summary.fields:
        sentences.append(
            f"{summary.header} fields: {summary.fields}" if summary.header else f"Fields: {summary.fields}"
        )
    if summary.default is not _MISSING:
        sentences.append(f"Default: {_json(summary.default, max(max_length, 200) * 2)}")
    if python != wire:
        sentences.append(f"Wire name: {_json(wire, 400)}")
    sentences = [sentence for sentence in sentences if sentence.strip()]
    # The environment's own text stays exactly as written unless more sentences follow it.
    text = single_line(" ".join(_sentence(sentence) for sentence in sentences) if len(sentences) > 1 else base)
    return _cap(text, max_length)


def _tool_text(spec: Any, key: str) -> Any:
    if isinstance(spec, Mapping):
        return spec.get(key)
    return getattr(spec, key, None) if key in ("name", "description", "input_schema") else None


def describe_tool(
    tool_spec: Any,
    *,
    max_param_description: int = DEFAULT_MAX_PARAM_DESCRIPTION,
    max_tool_description: int = DEFAULT_MAX_TOOL_DESCRIPTION,
    max_schema_nodes: int = DEFAULT_MAX_SCHEMA_NODES,
) -> ToolInfo:
    """Compute the parameters (required first) and description of one ORS tool spec.

    ``tool_spec`` is a mapping (or an object with attributes) with ``name``, ``description`` and ``input_schema``
    (a JSON Schema object, ``{}`` or ``None``). Never raises on odd schemas: what cannot be represented is described
    and listed in :attr:`ToolInfo.notes`.
    """
    name = _text(_tool_text(tool_spec, "name"))
    schema = _tool_text(tool_spec, "input_schema")
    walker = _Walker(schema, max_schema_nodes)
    extras: list[str] = []
    parameters: list[ParameterInfo] = []
    if schema not in (None, {}, True):
        root = walker.deref(schema, ())
        properties, required, extras = _root_arguments(walker, root)
        names = python_parameter_names(list(properties))
        for wire, node in properties.items():
            annotation = walker.annotation(node, root.stack, 0)
            text, cut = _parameter_description(walker, wire, names[wire], node, root.stack, max_param_description)
            if cut:
                walker.note(
                    f"description of parameter {_json(wire, 80)} truncated to {max_param_description} characters"
                )
            parameters.append(ParameterInfo(wire, names[wire], annotation, text, wire in required))
        parameters.sort(key=lambda parameter: not parameter.required)  # stable: required first, order kept
    description = _text(_tool_text(tool_spec, "description")).replace("\r\n", "\n").replace("\r", "\n").strip()
    if not description:
        description = f"Call the {_one_line(name) or 'unnamed'} tool."
    if extras:
        description += "\n\n" + " ".join(_sentence(extra) for extra in extras)
    description, cut = _cap(description, max_tool_description)
    if cut:
        walker.note(f"tool description truncated to {max_tool_description} characters")
    return ToolInfo(name, description, tuple(parameters), tuple(walker.notes))


def _root_arguments(walker: _Walker, root: _View) -> tuple[dict[str, Any], set[str], list[str]]:
    """The argument properties, the required set and description sentences for the input schema itself."""
    if root.cut:
        return {}, set(), [f"Input: {root.cut}"]
    schema = root.schema
    extras: list[str] = []
    properties = schema.get("properties")
    required_raw = schema.get("required")
    required = {name for name in required_raw if isinstance(name, str)} if isinstance(required_raw, list) else set()
    if isinstance(properties, dict):
        properties = {name: sub for name, sub in properties.items() if isinstance(name, str)}
    else:
        properties = {}
        arms = _arms(schema)
        kind = schema.get("type")
        if arms and kind in (None, "object"):
            # Alternative argument sets: offer every argument; required = required in every alternative.
            sets: list[str] = []
            common: set[str] | None = None
            for arm in arms:
                view = walker.deref(arm, root.stack)
                arm_properties = view.schema.get("properties")
                arm_required = view.schema.get("required")
                arm_required = (
                    {n for n in arm_required if isinstance(n, str)} if isinstance(arm_required, list) else set()
                )
                if isinstance(arm_properties, dict):
                    for name, sub in arm_properties.items():
                        if isinstance(name, str):
                            properties.setdefault(name, sub)
                    sets.append(
                        ", ".join(
                            f"{_name_text(n)}{'' if n in arm_required else '?'}"
                            for n in arm_properties
                            if isinstance(n, str)
                        )
                    )
                common = arm_required if common is None else common & arm_required
            required = common or set()
            if sets:
                extras.append(
                    "Accepts one of these argument sets (? = optional): " + " | ".join(f"({item})" for item in sets)
                )
        elif kind not in (None, "object"):
            walker.note(f"input schema is not an object (type {_json(kind, 40)}); arguments are passed through")
            extras.append(f"Input: {walker.summarize(schema, (), 0).label}")
    for name in required:
        properties.setdefault(name, {})
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict) and extra:
        extras.append(f"Extra arguments allowed: {walker.summarize(extra, root.stack, 1).label}")
    root_description = _one_line(root.description or root.model_description)
    if root_description:
        extras.append(f"Input: {root_description}")
    count = _count_range(schema.get("minProperties"), schema.get("maxProperties"), "arguments")
    if count:
        extras.append(f"Input constraints: {count}")
    return properties, required, extras
