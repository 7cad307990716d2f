"""Read a tool's input schema (untrusted JSON Schema) in one pass into a `Node` per argument: its type hint and the
text an annotation cannot carry. The only reader of raw schemas: it resolves local `$ref`s (cycles cut), merges
`allOf`, bounds all a hostile schema could blow up (`Budget`) and never `repr()`s foreign objects (`quote`: JSON).
"""

from __future__ import annotations

import json
import operator
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, Union
from urllib.parse import unquote

from ..protocol.text import json_size
from ..protocol.text import one_line as _one_line

__all__ = [
    "EXPANSION_FACTOR", "EXPANSION_FLOOR", "MISSING", "PRIMITIVES", "Budget", "Node", "Normaliser", "as_text",
    "auto_title", "one_line", "quote", "sentence", "single_line",
]  # fmt: skip

_MAX_DEPTH = 24  # schemas inside schemas: list[list[...]], alternatives of alternatives, fields of fields
_MAX_FIELD_DEPTH = 6  # nesting of "field {subfield {...}}" descriptions
_MAX_REF_HOPS = 64  # $ref -> $ref -> ... chains
_SNIPPET = 160  # longest JSON value quoted inside a description
_MAX_TEXT = 10_000  # longest free text (description, title) read from one schema node
_MAX_JSON_DEPTH = 32
#: What `$ref` expansions may copy (see `Budget`; a pydantic schema expands each of its definitions about once: x1-2).
EXPANSION_FACTOR = 4
EXPANSION_FLOOR = 64 * 1024
_SIMPLE_NAME_RE = re.compile(r"[\w.-]+")
_NONE = type(None)
PRIMITIVES: dict[str, Any] = {"string": str, "integer": int, "number": float, "boolean": bool, "null": _NONE}
_SHAPES = (("object", ("properties", "additionalProperties", "patternProperties")),
           ("array", ("items", "prefixItems")))

# Keywords this module reads (or deliberately ignores); every other keyword becomes the note "key <json>".
_HANDLED_KEYS = frozenset({
    "type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "properties", "required", "additionalProperties",
    "patternProperties", "propertyNames", "items", "prefixItems", "title", "description", "default", "minimum",
    "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength", "maxLength", "pattern", "format",
    "minItems", "maxItems", "uniqueItems", "contains", "minContains", "maxContains", "minProperties", "maxProperties",
    "not", "deprecated", "readOnly", "writeOnly", "examples", "example", "discriminator", "nullable",
    "contentEncoding", "contentMediaType", "definitions", "x-also-must-match"})


MISSING: Any = type("_Missing", (), {"__repr__": lambda self: "<missing>"})()

# Characters that str.splitlines() breaks on: none may survive in a parameter description.
_LINE_BREAKS = "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"
_LINE_BREAKS_TO_SPACE = str.maketrans(dict.fromkeys(_LINE_BREAKS, " "))
_LINE_BREAKS_TO_ESCAPE = str.maketrans({char: f"\\u{ord(char):04x}" for char in _LINE_BREAKS})


def single_line(text: str) -> str:
    """Replace line breaks with spaces, keeping other spacing (quoted JSON values stay exact)."""
    return text.translate(_LINE_BREAKS_TO_SPACE).strip()


def one_line(text: Any) -> str:
    """Collapse every run of whitespace (newlines included) into one space (reads at most `_MAX_TEXT` chars)."""
    return _one_line(as_text(text)[:_MAX_TEXT])


def as_text(value: Any) -> str:
    """A string as it is, None as "", any other value quoted as JSON."""
    return value if isinstance(value, str) else "" if value is None else quote(value)


def quote(value: Any, limit: int | None = _SNIPPET) -> str:
    """Compact one-line JSON of a value, cut (with the work) to `limit` characters; non-JSON objects as `<type>`."""
    budget = _MAX_TEXT * 10 if limit is None else limit + 1

    def scalar(item: Any) -> str:
        try:
            return json.dumps(item[:budget] if isinstance(item, str) else item, ensure_ascii=False)
        except ValueError:  # an int too long to print
            return "<number>"

    def tokens(item: Any, depth: int) -> Iterator[str]:
        if item is None or isinstance(item, str | int | float):
            yield scalar(item)
        elif depth >= _MAX_JSON_DEPTH:
            yield "…"
        elif not isinstance(item, dict | list | tuple):
            yield f"<{type(item).__name__}>"
        else:
            mapping = isinstance(item, dict)
            yield "{" if mapping else "["
            for index, (key, sub) in enumerate(item.items() if mapping else ((None, sub) for sub in item)):
                if index:
                    yield ", "
                if mapping:
                    yield scalar(key if isinstance(key, str) else scalar(key) if is_scalar(key) else
                                 f"<{type(key).__name__}>") + ": "
                yield from tokens(sub, depth + 1)
            yield "}" if mapping else "]"

    parts: list[str] = []
    size = 0
    for token in tokens(value, 0):
        parts.append(token)
        size += len(token)
        if size >= budget:
            break
    text = "".join(parts).translate(_LINE_BREAKS_TO_ESCAPE)
    if limit is not None and len(text) > limit:
        text = text[: limit - 1] + "…"
    return text


def name_text(name: str) -> str:
    """A property name as written in a description: bare when simple, else quoted."""
    return name if len(name) <= _SNIPPET and _SIMPLE_NAME_RE.fullmatch(name) else quote(name)


def sentence(text: str) -> str:
    text = text.strip()
    return text if not text or text[-1] in ".!?:;" else text + "."


def _paren(label: str) -> str:
    return f"({label})" if " | " in label or ", " in label else label


def auto_title(title: str, name: str) -> bool:
    """True for titles generated from the property name (pydantic's `"days" -> "Days"`): they carry nothing."""
    return re.sub(r"[^0-9a-z]", "", title.lower()) == re.sub(r"[^0-9a-z]", "", name.lower())


def _union(annotations: list[Any]) -> Any:
    unique = list(dict.fromkeys(annotations))
    if not unique or any(annotation is Any for annotation in unique):
        return Any
    return unique[0] if len(unique) == 1 else Union[tuple(unique)]  # noqa: UP007 - built from a runtime list


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_scalar(value: Any) -> bool:
    return type(value) in (str, int, float, bool, type(None))


def count_range(low: Any, high: Any, unit: str) -> str:
    """`"2–5 items"`, `"exactly 2 items"`, `"≥ 1 items"`, `"≤ 3 items"` or `""`."""
    low = low if _is_number(low) and low > 0 else None
    high = high if _is_number(high) else None
    unit = f" {unit}" if unit else ""
    if low is not None and high is not None:
        return f"exactly {quote(low)}{unit}" if low == high else f"{quote(low)}–{quote(high)}{unit}"
    if low is not None:
        return f"≥ {quote(low)}{unit}"
    if high is not None:
        return f"≤ {quote(high)}{unit}"
    return ""


def _numeric_bounds(schema: dict) -> str:
    bounds = []
    for key, exclusive_key, signs, tighter in (("minimum", "exclusiveMinimum", "≥>", operator.ge),
                                               ("maximum", "exclusiveMaximum", "≤<", operator.le)):
        bound, exclusive = schema.get(key), schema.get(exclusive_key)
        bound = bound if _is_number(bound) else None
        strict = exclusive is True and bound is not None  # draft 4 boolean form
        if _is_number(exclusive) and (bound is None or tighter(exclusive, bound)):
            bound, strict = exclusive, True
        if bound is not None:
            # No variable: "0 ≤ x ≤ 9" would read as a bound on a field named x (`y (integer, 0 ≤ x ≤ 9)`).
            bounds.append(f"{signs[strict]} {quote(bound)}")
    return " and ".join(bounds)


@dataclass
class Node:
    """One schema, normalised and summarized in one pass: the type hint `get_json_schema` turns back into it, a type
    label, constraints, notes and the fields of objects inside it; its own texts. `default`: raw JSON (`quote` it)."""

    annotation: Any = Any
    label: str = "any"
    title: str = ""
    description: str = ""  # the node's own (property-level) description
    model_description: str = ""  # its $ref target's, or that of the only object among its alternatives
    default: Any = MISSING
    constraints: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    fields: str | None = None
    header: str | None = None  # whose fields `fields` lists ("Object", "Item (Loc object)", "" when several)
    lossy: bool = False  # the label says something the annotation cannot (and `fields` does not)
    size: int = 0  # the least text its own description takes when listed as a field

    def carry(self, part: Node, constraints: str, notes: str, model: bool) -> None:
        """Take up a part's (an alternative's, an item's, a value's) constraints and details, each under its prefix."""
        if part.constraints:
            self.constraints.append(constraints + ", ".join(part.constraints))
        texts = (part.description, part.model_description if model else "")
        details = [*part.notes, *(one_line(text) for text in texts if text)]
        if part.default is not MISSING:
            details.append(f"default {quote(part.default)}")
        if details:
            self.notes.append(notes + "; ".join(details))
        self.lossy = self.lossy or (part.lossy and not part.fields)


@dataclass
class _View:
    """A schema node with `$ref` / single-`allOf` wrappers followed and their sibling keywords merged in."""

    schema: dict
    stack: tuple[str, ...]
    model: str | None = None  # title or $defs name of the model reached through a $ref
    model_description: str = ""
    description: str = ""  # the node's own (property-level) description
    cut: str | None = None  # label when expansion stopped (recursion, unresolved reference)
    target: Any = None  # for a recursive cut: the schema the reference points back to


class Budget:
    """What normalising one tool list's schemas (`received` characters of JSON) may cost: work units (one per node,
    keyword, enum value, alternative) and `$ref` expansion (each tool `EXPANSION_FACTOR` times its size, all together
    `EXPANSION_FLOOR` more). Past a bound the rest is cut ("…", Any) or a reference left unexpanded (`refs_cut`).
    """

    def __init__(self, received: int) -> None:
        self.received = received
        self.floor = EXPANSION_FLOOR
        self.work = (1 + EXPANSION_FACTOR) * received + EXPANSION_FLOOR
        self.expanded = self.refs_cut = self.work_spent = 0


class Normaliser:
    """Normalises one tool's schemas against `root` within `max_nodes` work units and the list's `budget`."""

    def __init__(self, root: Any, max_nodes: int, budget: Budget | None = None) -> None:
        self.root = root
        size = json_size(root, 1 << 62)
        self.budget = Budget(size) if budget is None else budget
        self.left = min(max_nodes, self.budget.work)
        self.own = EXPANSION_FACTOR * size  # characters this tool may expand before it draws on the shared floor
        self.text_left = 0  # characters of field text a description can still list (see _object)
        self.room = 0  # characters of text the description being written can still take (see _join, _field)
        self.notes: list[str] = []
        self._sizes: dict[int, int] = {}  # id of a $ref target -> its size (measured once)

    def note(self, message: str) -> None:
        if message not in self.notes:
            self.notes.append(message)

    def tick(self, cost: int = 1) -> bool:
        """Spend `cost` work units; False (and a note) once the budget is exhausted."""
        if self.left <= 0:
            self.note("schema too large: the rest of it is typed Any and elided in descriptions")
            return False
        self.left -= cost
        self.budget.work -= cost
        self.budget.work_spent += cost
        return True

    def expand(self, target: Any) -> bool:
        """Spend a `$ref` target's size on expanding it; False (and a note) when the tool's share cannot pay it."""
        left = self.own + self.budget.floor
        size = self._sizes.get(id(target))
        if size is None:  # measured once, only as far as what is left (which only shrinks)
            size = self._sizes[id(target)] = json_size(target, left)
        if size > left:
            self.budget.refs_cut += 1
            self.note("schema expansion budget spent: references past it are not expanded (typed by what they point "
                      "to at its top level, an object as dict)")
            return False
        self.budget.floor -= max(size - self.own, 0)
        self.own = max(self.own - size, 0)
        self.budget.expanded += size
        return True

    def parameter(self, raw: Any, stack: tuple[str, ...], text: int, depth: int = 0, room: int | None = None) -> Node:
        """One argument's schema, expanding no more object fields than `text` characters can list, its text within
        `room` (None: what the last one left)."""
        self.text_left = text
        self.room = self.room if room is None else room
        return self.node(raw, stack, depth, depth)

    def arguments(self, text: int, input_text: int) -> tuple[list[tuple[str, Node]], dict[str, None], list[str]]:
        """The root as a tool's input: (wire name, node) per argument, the required ones (schema order: no set), and
        sentences about the input; `text`/`input_text`: field text for each (the input's sentences share theirs)."""
        if self.root in (None, {}, True):
            return [], {}, []
        root = self.deref(self.root, ())
        if root.cut:
            return [], {}, [f"Input: {root.cut}"]
        schema = root.schema
        properties = schema.get("properties")
        required = dict.fromkeys(_names(schema.get("required")))
        sentences: list[str] = []
        self.room = input_text
        if isinstance(properties, dict):
            properties = {name: sub for name, sub in properties.items() if isinstance(name, str)}
        else:
            properties, arms, kind = {}, _arms(schema), schema.get("type")
            if arms and kind in (None, "object"):
                # Alternative argument sets: offer every argument (typed by any of its alternatives' schemas);
                # required = required in every alternative.
                sets, common, options = [], None, {}
                for arm in arms:
                    view = self.deref(arm, root.stack)
                    arm_properties = view.schema.get("properties")
                    arm_required = dict.fromkeys(_names(view.schema.get("required")))
                    if isinstance(arm_properties, dict):
                        names = [name for name in arm_properties if isinstance(name, str)]
                        for name in names:
                            sub = arm_properties[name]
                            options.setdefault(name, {}).setdefault(quote(sub, None), sub)  # by JSON: linear cost
                        sets.append(", ".join(f"{name_text(n)}{'' if n in arm_required else '?'}" for n in names))
                    common = arm_required if common is None else dict.fromkeys(n for n in common if n in arm_required)
                required = common or {}
                properties = {name: {"anyOf": [*subs.values()]} if len(subs) > 1 else next(iter(subs.values()))
                              for name, subs in options.items()}
                if sets:
                    sentences.append("Accepts one of these argument sets (? = optional): "
                                     + " | ".join(f"({s})" for s in sets))
            elif kind not in (None, "object"):
                self.note(f"input schema is not an object (type {quote(kind, 40)}); arguments are passed through")
                sentences.append("Input: " + self.parameter(schema, (), input_text).label)
        for name in required:
            properties.setdefault(name, {})
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict) and extra:
            sentences.append("Extra arguments allowed: " + self.parameter(extra, root.stack, input_text, 1).label)
        if description := one_line(root.description or root.model_description):
            sentences.append(f"Input: {description}")
        if count := count_range(schema.get("minProperties"), schema.get("maxProperties"), "arguments"):
            sentences.append(f"Input constraints: {count}")
        # What else the input must match, as a property's notes say it (arms beside properties: "url or path").
        arms = _arms(schema) if isinstance(schema.get("properties"), dict) else []
        notes = ["also matches one of: " + self._join((quote(arm, 80) for arm in arms), ", ")] if arms else []
        if notes := [*notes, *_notes(schema)]:
            sentences.append("Input notes: " + "; ".join(notes))
        arguments = [(wire, self.parameter(sub, root.stack, text, room=text)) for wire, sub in properties.items()]
        return arguments, required, sentences

    def as_schema(self, node: Any) -> dict:
        if isinstance(node, dict):
            return node
        if node is True or node is None:
            return {}
        if node is False:
            return {"not": {}}
        self.note(f"invalid schema node {quote(node, 60)} treated as 'any'")
        return {}

    def resolve(self, ref: str) -> Any:
        """Resolve a local reference (`#`, `#/$defs/X`, `#/definitions/X`, any JSON pointer)."""
        if not ref.startswith("#"):
            return MISSING
        pointer = unquote(ref[1:])
        if not pointer:
            return self.root
        if not pointer.startswith("/"):
            return MISSING
        node = self.root
        for raw in pointer[1:].split("/"):
            part = raw.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and re.fullmatch(r"[0-9]{1,9}", part) and int(part) < len(node):
                node = node[int(part)]
            else:
                return MISSING
        return node

    def deref(self, node: Any, stack: tuple[str, ...]) -> _View:
        """Follow `$ref` and single-element `allOf`; outer keywords override the target's."""
        outer: dict = {}
        model: str | None = None
        description = as_text(self.as_schema(node).get("description"))
        for _ in range(_MAX_REF_HOPS):
            node = self.as_schema(node)
            ref, all_of = node.get("$ref"), node.get("allOf")
            single = isinstance(all_of, list) and len(all_of) == 1
            wrapper = "$ref" if isinstance(ref, str) else "allOf" if single else ""
            if not wrapper:
                break
            for key, value in node.items():
                if key != wrapper:
                    outer.setdefault(key, value)
            if wrapper == "allOf":
                node = all_of[0]
                continue
            target = self.resolve(ref)
            name = unquote(ref.rsplit("/", 1)[-1] or ref).replace("~1", "/").replace("~0", "~")
            if target is MISSING:
                self.note(f"unresolved reference {quote(ref, 80)} typed Any")
                return _View(outer, stack, description=description, cut=f"unresolved reference {quote(ref)}")
            if ref in stack or not self.expand(target):  # a ref in the stack resolved before: never MISSING
                if ref in stack:
                    self.note(f"recursive reference {quote(ref, 80)} cut")
                name = _model_name(target, name)
                cut = f"recursive {name}" if ref in stack else f"{name} (not expanded: schema too large)"
                return _View(outer, stack, name, description=description, cut=cut, target=target)
            stack, model, node = (*stack, ref), name, target
        else:
            self.note("reference chain too long, typed Any")
            return _View(outer, stack, description=description, cut="reference chain too long")
        model_description = ""
        if model is not None:
            model, model_description = _model_name(node, model), as_text(node.get("description"))
        merged = {**node, **outer}
        all_of = merged.get("allOf")
        if isinstance(all_of, list) and len(all_of) > 1:
            merged = self._merge_all_of(merged, all_of, stack)
            description = description if model else as_text(merged.get("description"))
        return _View(merged, stack, model, model_description, description)

    def _merge_all_of(self, schema: dict, arms: list, stack: tuple[str, ...]) -> dict:
        """Merge `allOf` arms into one schema: properties are united (their keywords merged), other keywords
        first-come."""
        merged = {key: value for key, value in schema.items() if key != "allOf"}
        properties = dict(merged["properties"]) if isinstance(merged.get("properties"), dict) else {}
        required = _names(merged.get("required"))
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
                    for name, sub in value.items():  # a property several arms constrain: first-come keywords
                        known = properties.setdefault(name, sub)
                        if isinstance(known, dict) and isinstance(sub, dict):
                            properties[name] = {**sub, **known}
                elif key == "required" and isinstance(value, list):
                    known = set(required)
                    required += dict.fromkeys(name for name in value if isinstance(name, str) and name not in known)
                elif key in ("title", "description") and (view.model or key in merged):
                    continue  # a model's texts are not the property's; an inline arm's fill in what is missing
                elif key not in merged:
                    merged[key] = value
                elif merged[key] != value:
                    leftovers.append(f"{key} {quote(value, 60)}")
        if properties:
            merged["properties"] = properties
        if required:
            merged["required"] = required
        if leftovers:
            merged["x-also-must-match"] = leftovers
        return merged

    def node(self, raw: Any, stack: tuple[str, ...], depth: int, nested: int) -> Node:
        """Normalise and summarize one schema; `depth` counts enclosing containers and fields, `nested` alternatives
        too. Its text stops (with "…") once the parameter's `room` is spent."""
        if nested > _MAX_DEPTH:
            self.note("schema nested too deeply: inner part typed Any")
            return Node(label="…", lossy=True)
        if not self.tick():
            return Node(label="…", lossy=True)
        view = self.deref(raw, stack)
        schema, stack = view.schema, view.stack
        arms = _arms(schema)
        enum = schema.get("enum")
        self.tick(len(schema) + len(arms) + (len(enum) if isinstance(enum, list) else 0))
        title = schema.get("title") if view.model is None else raw.get("title") if isinstance(raw, dict) else None
        own = max(len(one_line(text).rstrip(".")) for text in (view.description, view.model_description))
        out = Node(title=one_line(title) if isinstance(title, str) else "", description=view.description,
                   model_description=view.model_description, default=schema.get("default", MISSING),
                   size=own + 2 if own else 0)
        if view.cut:  # typed by what its target is at the top: its type, or an object when it has properties
            target = view.target if isinstance(view.target, dict) else {}
            kind = target.get("type")
            kind = "object" if kind is None and "properties" in target else kind
            out.label, out.lossy = view.cut, True
            out.annotation = {"object": dict, "array": list, **PRIMITIVES}.get(kind, Any) if isinstance(kind, str) \
                else Any
            return out
        kind = schema.get("type")
        names = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else None
        if names is not None:
            types = tuple(dict.fromkeys(name for name in names if isinstance(name, str)))
        else:  # no (valid) type: inferred from the keywords
            types = tuple([name for name, keys in _SHAPES if any(key in schema for key in keys)][:1])
        const = schema.get("const", MISSING)
        listed = isinstance(enum, list)
        labels: list[str] = []
        if is_scalar(const) or (listed and enum and all(is_scalar(value) for value in enum)):
            out.annotation = Literal[const] if is_scalar(const) else Literal[tuple(enum)]
        else:  # the structure, described unless a const or an enum says what the value is
            shape, room = (out, None) if const is MISSING and not listed else (Node(), self.room)
            if kind is None and arms:
                parts = [self.node(arm, stack, depth, nested + 1) for arm in arms]
                out.annotation = _union([part.annotation for part in parts])
                labels.append(self._arms(shape, parts))
            else:
                typed = [self._type(shape, name, schema, stack, depth, nested + 1, view.model, shape is out)
                         for name in types]
                labels += (label for label, _ in typed)
                out.annotation = _union([hint for _, hint in typed])
            if room is not None:
                labels, self.room = [], room
        if const is not MISSING:
            labels.append(quote(const) if is_scalar(const) else f"exactly {quote(const)}")
            out.lossy = not is_scalar(const)
        elif listed:
            if not enum:
                labels.append("nothing (empty enum)")
                out.lossy = True
            elif all(is_scalar(value) for value in enum):
                labels.append(self._join((quote(value) for value in enum), " | "))
            else:
                labels.append("one of " + self._join((quote(value) for value in enum), ", "))
                out.lossy = True
        if arms and (kind is not None or "const" in schema or "enum" in schema):
            out.notes.append("also matches one of: " + self._join((quote(arm, 80) for arm in arms), ", "))
        out.label = " | ".join(label for label in labels if label) or "any"
        self._checks(out, schema, stack, depth + 1, nested + 1)
        out.notes += _notes(schema)
        if schema.get("nullable") is True:
            out.annotation = _union([out.annotation, _NONE])
            if out.label != "null":
                out.label = f"{out.label} | null"
        return out

    def _join(self, texts: Any, separator: str) -> str:
        """Join texts, stopping with "…" once the parameter's text `room` is used up."""
        out: list[str] = []
        size = 0
        for text in texts:
            if size > self.room:
                out.append("…")
                break
            out.append(text)
            size += len(text) + len(separator)
        return separator.join(out)

    def _type(self, out: Node, kind: str, schema: dict, stack: tuple[str, ...], depth: int, nested: int,
              model: str | None, described: bool) -> tuple[str, Any]:
        """The label and hint of one of a schema's types, its structure described into `out`."""
        if kind in PRIMITIVES:
            return kind, PRIMITIVES[kind]
        if kind == "array":
            return self._array(out, schema, stack, depth + 1, nested)
        if kind == "object":
            return self._object(out, schema, stack, depth, nested, model, described)
        out.lossy = True
        return f"unknown type {quote(kind, 40)}", Any

    def _arms(self, out: Node, parts: list[Node]) -> str:
        non_null = [s for s in parts if s.label != "null"]
        labels = list(dict.fromkeys(s.label for s in parts))
        with_fields = [s for s in parts if s.fields]
        for s in parts:
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

    def _array(self, out: Node, schema: dict, stack: tuple[str, ...], depth: int, nested: int) -> tuple[str, Any]:
        prefix, items = schema.get("prefixItems"), schema.get("items")
        if not isinstance(prefix, list):  # a list of items: draft 4-2019 tuple form (pydantic v1)
            prefix, items = (items, None) if isinstance(items, list) else (None, items)
        if prefix is None:
            items = self._optional(items, stack, depth, nested)
            if items is False:
                out.constraints.append("must be empty")
            if not isinstance(items, Node):
                return "array", list
            self._lift(out, "Item", "each item", items)
            return f"array of {_paren(items.label)}", list[items.annotation]
        parts = [self.node(part, stack, depth, nested) for part in prefix]
        items = self._optional(items, stack, depth, nested)
        for index, part in enumerate(parts, 1):
            details = part.constraints + part.notes
            if part.description or part.model_description:
                details.append(one_line(part.description or part.model_description))
            if details:
                out.constraints.append(f"item {index}: " + ", ".join(details))
            out.lossy = out.lossy or (part.lossy and not part.fields)
        with_fields = [(index, part) for index, part in enumerate(parts, 1) if part.fields]
        if with_fields:
            out.fields = " | ".join(f"item {index}: {part.fields}" for index, part in with_fields)
            out.header = ""
        if items is False:
            out.constraints.append("no further items")
        elif isinstance(items, Node):
            out.constraints.append(f"further items {items.label}")
        # get_json_schema refuses one-element tuples; the item count goes in the description.
        hint = tuple[tuple(part.annotation for part in parts)] if len(parts) >= 2 else list[parts[0].annotation] \
            if parts else list
        return "array [" + ", ".join(part.label for part in parts) + "]", hint

    def _lift(self, out: Node, header: str, phrase: str, inner: Node) -> None:
        """Carry an array item's / map value's constraints, notes and fields up to the container."""
        out.carry(inner, f"{phrase} ", f"{phrase}: ", model=not inner.fields)
        if inner.fields:
            about = inner.header or ""
            if inner.model_description:
                model = one_line(inner.model_description).rstrip(".")
                about = f"{about}: {model}" if about else model
            out.fields = inner.fields
            out.header = header if about in ("", "Object") else f"{header} ({about})"

    def _object(self, out: Node, schema: dict, stack: tuple[str, ...], depth: int, nested: int, model: str | None,
                described: bool) -> tuple[str, Any]:
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = tuple(_names(schema.get("required")))
        keyed = bool(properties or schema.get("patternProperties") or schema.get("required"))
        label = f"{model} object" if model else "object"
        listed = (properties or required) and described
        if listed:
            parts: list[str] = []
            named: set[str] = set()
            room = None  # the room left when the text stopped (the fields past it are normalised, not described)
            cut = depth >= _MAX_FIELD_DEPTH
            if cut:
                self.note("object nesting too deep: inner fields elided")
            for name, sub in () if cut else properties.items():
                if isinstance(name, str):
                    if self.text_left <= 0:  # the description has no room for more fields
                        cut = True
                        break
                    if room is None and self.room <= 0:
                        parts.append("…")
                        room = self.room
                    node = self.node(sub, stack, depth + 1, nested)
                    if room is None:
                        parts.append(self._field(name, node, name in required))
                        named.add(name)
                    self.text_left -= min(len(name), _SNIPPET) + 4 + node.size  # after its subfields, as listed
            if room is None:
                missing = (f"{name_text(name)} (any, required)" for name in required if name not in named)
                parts.append("…" if cut else self._join(missing, "; "))
            else:
                self.room = room
            out.fields = "; ".join(part for part in parts if part)
            out.header = label[:1].upper() + label[1:]
        extra = schema.get("additionalProperties")
        extra = self._optional(extra if isinstance(extra, dict | bool) else None, stack, depth + 1, nested)
        if isinstance(extra, Node) and listed:
            out.constraints.append(", ".join([f"other keys {_paren(extra.label)}", *extra.constraints]))
        elif isinstance(extra, Node):
            self._lift(out, "Value", "each value", extra)
            label = f"{label} of {_paren(extra.label)}"
        else:
            out.lossy = out.lossy or (bool(model) and not listed)
        if extra is False:
            out.constraints.append("no other keys" if listed else "no keys")
        return label, dict[str, extra.annotation] if isinstance(extra, Node) and not keyed else dict

    def _field(self, name: str, sub: Node, required: bool) -> str:
        """`name (label, required, constraints, default X): description {subfields}`."""
        parts = [sub.label, *(["required"] if required else []), *sub.constraints, *sub.notes]
        if sub.default is not MISSING:
            parts.append(f"default {quote(sub.default)}")
        description = one_line(sub.description)
        model_description = one_line(sub.model_description)
        if model_description and model_description != description:
            description = f"{sentence(description)} {model_description}" if description else model_description
        if sub.title and not auto_title(sub.title, name) and sub.title != description:
            parts.append(f"title {quote(sub.title)}")
        text = f"{name_text(name)} ({', '.join(parts)})"
        if description:
            text += f": {description.rstrip('.')}"
        self.room -= len(text)  # the subfields below were counted when they were written
        if sub.fields:
            text += f" {{{sub.fields}}}"
        return text

    def _optional(self, raw: Any, stack: tuple[str, ...], depth: int, nested: int) -> Node | bool | None:
        """A subschema that may be left out (None, or True: anything goes) or forbid everything (False)."""
        return None if raw is None or raw is True else raw if raw is False else self.node(raw, stack, depth, nested)

    def _checks(self, out: Node, schema: dict, stack: tuple[str, ...], depth: int, nested: int) -> None:
        """Every constraint except type and structure: bounds, lengths, patterns, formats, counts, subschemas."""
        checks: list[str] = [_numeric_bounds(schema)]
        if _is_number(schema.get("multipleOf")):
            checks.append(f"multiple of {quote(schema['multipleOf'])}")
        checks.append(count_range(schema.get("minLength"), schema.get("maxLength"), "chars"))
        pattern = schema.get("pattern")
        if isinstance(pattern, str):
            plain = pattern.strip() and not any(char.isspace() for char in pattern)
            checks.append(f"pattern {pattern if plain else quote(pattern)}")
        for key, word in (("format", "format"), ("contentEncoding", "encoding"), ("contentMediaType", "media type")):
            if isinstance(schema.get(key), str):
                checks.append(f"{word} {one_line(schema[key])}")
        checks.append(count_range(schema.get("minItems"), schema.get("maxItems"), "items"))
        if schema.get("uniqueItems") is True:
            checks.append("unique items")
        if "contains" in schema:
            count = count_range(schema.get("minContains"), schema.get("maxContains"), "")
            sub = self.node(schema["contains"], stack, depth, nested)
            checks.append(f"contains {_paren(sub.label)}" + (f" ({count})" if count else ""))
        checks.append(count_range(schema.get("minProperties"), schema.get("maxProperties"), "keys"))
        patterns = schema.get("patternProperties")
        if isinstance(patterns, dict):
            for key_pattern, sub in patterns.items():
                label = self.node(sub, stack, depth, nested).label
                checks.append(f"keys matching {quote(key_pattern)}: {_paren(label)}")
        if "propertyNames" in schema:
            sub = self.node(schema["propertyNames"], stack, depth, nested)
            checks.append("keys " + ", ".join([sub.label, *sub.constraints]))
        if "not" in schema:
            sub = self.node(schema["not"], stack, depth, nested)
            checks.append("never allowed" if sub.label == "any" and not sub.constraints else f"not {sub.label}")
        out.constraints += (check for check in checks if check)


_FLAGS = (("deprecated", "deprecated"), ("readOnly", "read-only"), ("writeOnly", "write-only"))


def _notes(schema: dict) -> tuple[str, ...]:
    notes = [word for key, word in _FLAGS if schema.get(key) is True]
    if isinstance(schema.get("examples"), list):
        notes.append(f"examples {quote(schema['examples'])}")
    if "example" in schema:
        notes.append(f"example {quote(schema['example'])}")
    discriminator = schema.get("discriminator")
    if isinstance(discriminator, dict):
        discriminator = discriminator.get("propertyName")
    if isinstance(discriminator, str):
        notes.append(f"discriminated by {name_text(discriminator)}")
    also = schema.get("x-also-must-match")
    if isinstance(also, list) and also and all(isinstance(item, str) for item in also):
        notes.append("also must match " + ", ".join(also))
    notes += (f"{name_text(key)} {quote(value)}" for key, value in schema.items()
              if isinstance(key, str) and key not in _HANDLED_KEYS and not key.startswith("$"))
    return tuple(notes)


def _names(value: Any) -> list[str]:
    """The strings in a `required` list, in order (none when it is not a list)."""
    return [name for name in value if isinstance(name, str)] if isinstance(value, list) else []


def _model_name(target: Any, name: str) -> str:
    """A `$ref` target's title when it has one, else the name the reference gives it."""
    title = target.get("title") if isinstance(target, dict) else None
    return title if isinstance(title, str) and title.strip() else name


def _arms(schema: dict) -> list:
    for key in ("anyOf", "oneOf"):
        arms = schema.get(key)
        if isinstance(arms, list) and arms:
            return arms
    return []
