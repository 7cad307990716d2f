"""Normalise a tool's input schema (untrusted JSON Schema) into a small tree of `Node`: the only reader of raw schemas.
It resolves local `$ref`s (cycles cut), merges `allOf`, bounds all a hostile schema could blow up (`Budget`) and never
`repr()`s foreign objects (`quote` writes JSON). `ors_trl.core.schema` renders the tree.
"""

from __future__ import annotations

import json
import operator
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from ..protocol.text import json_size
from ..protocol.text import one_line as _one_line

__all__ = [
    "EXPANSION_FACTOR", "EXPANSION_FLOOR", "MISSING", "Budget", "Node", "Normaliser", "as_text", "count_range",
    "is_scalar", "name_text", "one_line", "quote", "single_line",
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


@dataclass(frozen=True, slots=True)
class Node:
    """One schema, normalised; `const`, `enum`, `default` and `also` hold raw JSON values (`quote` them, never
    `repr()`). Structure (arms, items, fields, extra) is left out when a scalar `const`/`enum` pins the value."""

    cut: str | None = None  # why it was not expanded: "recursive Name", "unresolved reference …", "…" past a limit
    types: tuple[str, ...] = ()  # type names, object/array inferred if absent or malformed; a cut: its target's
    const: Any = MISSING
    enum: tuple[Any, ...] | None = None
    arms: tuple[Node, ...] = ()  # the anyOf/oneOf alternatives an untyped node consists of
    also: tuple[Any, ...] = ()  # raw alternatives of a typed (or const/enum) node, which merely also apply
    nullable: bool = False
    model: str | None = None  # the name of the $ref target
    title: str = ""
    description: str = ""  # the node's own (property-level) description
    model_description: str = ""  # the $ref target's description
    default: Any = MISSING
    prefix: tuple[Node, ...] | None = None  # tuple items
    items: Node | bool | None = None  # every item (after `prefix`); False: none allowed
    fields: tuple[tuple[str, Node], ...] | None = None  # None: no property named or required, or a const/enum given
    fields_cut: bool = False  # more fields exist than were expanded
    required: tuple[str, ...] = ()
    keyed: bool = False  # properties, patternProperties or required are given: the annotation is a plain dict
    extra: Node | bool | None = None  # additionalProperties; False: no other keys
    checks: tuple[str | tuple[str, str, Node], ...] = ()  # constraints in order; (word, text, node) on a subschema
    notes: tuple[str, ...] = ()


_ELIDED = Node(cut="…")


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
        self.text_left = 0  # characters of field text a description can still list (see _field_text)
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

    def parameter(self, raw: Any, stack: tuple[str, ...], text: int, depth: int = 0) -> Node:
        """One argument's schema, expanding no more object fields than `text` characters can list."""
        self.text_left = text
        return self.node(raw, stack, depth, depth)

    def arguments(self, text: int, input_text: int) -> tuple[list[tuple[str, Node]], dict[str, None], list]:
        """The root as a tool's input: (wire name, node) per argument, the required ones (schema order: no set), and
        sentences about the input (text, or `(text, node)`); `text`/`input_text`: field text for each."""
        if self.root in (None, {}, True):
            return [], {}, []
        root = self.deref(self.root, ())
        if root.cut:
            return [], {}, [f"Input: {root.cut}"]
        schema = root.schema
        properties = schema.get("properties")
        required = dict.fromkeys(_names(schema.get("required")))
        sentences: list[str | tuple[str, Node]] = []
        if isinstance(properties, dict):
            properties = {name: sub for name, sub in properties.items() if isinstance(name, str)}
        else:
            properties, arms, kind = {}, _arms(schema), schema.get("type")
            if arms and kind in (None, "object"):
                # Alternative argument sets: offer every argument; required = required in every alternative.
                sets, common = [], None
                for arm in arms:
                    view = self.deref(arm, root.stack)
                    arm_properties = view.schema.get("properties")
                    arm_required = dict.fromkeys(_names(view.schema.get("required")))
                    if isinstance(arm_properties, dict):
                        names = [name for name in arm_properties if isinstance(name, str)]
                        for name in names:
                            properties.setdefault(name, arm_properties[name])
                        sets.append(", ".join(f"{name_text(n)}{'' if n in arm_required else '?'}" for n in names))
                    common = arm_required if common is None else dict.fromkeys(n for n in common if n in arm_required)
                required = common or {}
                if sets:
                    sentences.append("Accepts one of these argument sets (? = optional): "
                                     + " | ".join(f"({s})" for s in sets))
            elif kind not in (None, "object"):
                self.note(f"input schema is not an object (type {quote(kind, 40)}); arguments are passed through")
                sentences.append(("Input: ", self.parameter(schema, (), input_text)))
        for name in required:
            properties.setdefault(name, {})
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict) and extra:
            sentences.append(("Extra arguments allowed: ", self.parameter(extra, root.stack, input_text, 1)))
        if description := one_line(root.description or root.model_description):
            sentences.append(f"Input: {description}")
        if count := count_range(schema.get("minProperties"), schema.get("maxProperties"), "arguments"):
            sentences.append(f"Input constraints: {count}")
        return [(wire, self.parameter(sub, root.stack, text)) for wire, sub in properties.items()], required, sentences

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
        return _View(merged, stack, model, model_description, description)

    def _merge_all_of(self, schema: dict, arms: list, stack: tuple[str, ...]) -> dict:
        """Merge `allOf` arms into one schema: properties are united, other keywords first-come."""
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
                    for name, sub in value.items():
                        properties.setdefault(name, sub)
                elif key == "required" and isinstance(value, list):
                    known = set(required)
                    required += dict.fromkeys(name for name in value if isinstance(name, str) and name not in known)
                elif key in ("title", "description"):
                    continue
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
        """Normalise one schema; `depth` counts enclosing containers and fields, `nested` alternatives too."""
        if nested > _MAX_DEPTH:
            self.note("schema nested too deeply: inner part typed Any")
            return _ELIDED
        if not self.tick():
            return _ELIDED
        view = self.deref(raw, stack)
        schema, stack = view.schema, view.stack
        arms = _arms(schema)
        enum = schema.get("enum")
        self.tick(len(schema) + len(arms) + (len(enum) if isinstance(enum, list) else 0))
        title = schema.get("title") if view.model is None else raw.get("title") if isinstance(raw, dict) else None
        about = dict(model=view.model, description=view.description, model_description=view.model_description)
        about.update(title=one_line(title) if isinstance(title, str) else "", default=schema.get("default", MISSING))
        if view.cut:  # typed by what its target is at the top: its type, or an object when it has properties
            target = view.target if isinstance(view.target, dict) else {}
            kind = target.get("type")
            kind = "object" if kind is None and "properties" in target else kind
            return Node(cut=view.cut, types=(kind,) if isinstance(kind, str) else (), **about)
        kind = schema.get("type")
        names = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else None
        if names is not None:
            types = tuple(dict.fromkeys(name for name in names if isinstance(name, str)))
        else:  # no (valid) type: inferred from the keywords
            types = tuple([name for name, keys in _SHAPES if any(key in schema for key in keys)][:1])
        const = schema.get("const", MISSING)
        pinned = is_scalar(const) or (isinstance(enum, list) and enum and all(is_scalar(value) for value in enum))
        structure: dict[str, Any] = {}
        if not pinned and kind is None and arms:
            structure["arms"] = tuple(self.node(arm, stack, depth, nested + 1) for arm in arms)
        elif not pinned:
            for name in types:
                if name == "array":
                    structure.update(self._array(schema, stack, depth + 1, nested + 1))
                elif name == "object":
                    described = "const" not in schema and not isinstance(enum, list)  # else fields go unlisted
                    structure.update(self._object(schema, stack, depth, nested + 1, described))
        also = tuple(arms) if arms and (kind is not None or "const" in schema or "enum" in schema) else ()
        return Node(types=types, const=const, enum=tuple(enum) if isinstance(enum, list) else None, also=also,
                    nullable=schema.get("nullable") is True, checks=self._checks(schema, stack, depth + 1, nested + 1),
                    notes=_notes(schema), **about, **structure)

    def _array(self, schema: dict, stack: tuple[str, ...], depth: int, nested: int) -> dict[str, Any]:
        prefix, items = schema.get("prefixItems"), schema.get("items")
        if not isinstance(prefix, list):  # a list of items: draft 4-2019 tuple form (pydantic v1)
            prefix, items = (items, None) if isinstance(items, list) else (None, items)
        return {"prefix": None if prefix is None else tuple(self.node(part, stack, depth, nested) for part in prefix),
                "items": self._optional(items, stack, depth, nested)}

    def _object(self, schema: dict, stack: tuple[str, ...], depth: int, nested: int, described: bool) -> dict:
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = tuple(_names(schema.get("required")))
        keyed = bool(properties or schema.get("patternProperties") or schema.get("required"))
        out: dict[str, Any] = {"required": required, "keyed": keyed}
        if (properties or required) and described:
            fields: list[tuple[str, Node]] = []
            cut = depth >= _MAX_FIELD_DEPTH
            if cut:
                self.note("object nesting too deep: inner fields elided")
            for name, sub in () if cut else properties.items():
                if isinstance(name, str):
                    if self.text_left <= 0:  # the description has no room for more fields
                        cut = True
                        break
                    fields.append((name, self.node(sub, stack, depth + 1, nested)))
                    self.text_left -= _field_text(name, fields[-1][1])  # after its subfields, as they are listed
            out.update(fields=tuple(fields), fields_cut=cut)
        extra = schema.get("additionalProperties")
        out["extra"] = self._optional(extra if isinstance(extra, dict | bool) else None, stack, depth + 1, nested)
        return out

    def _optional(self, raw: Any, stack: tuple[str, ...], depth: int, nested: int) -> Node | bool | None:
        """A subschema that may be left out (None, or True: anything goes) or forbid everything (False)."""
        return None if raw is None or raw is True else raw if raw is False else self.node(raw, stack, depth, nested)

    def _checks(self, schema: dict, stack: tuple[str, ...], depth: int, nested: int) -> tuple:
        """Every constraint except type and structure: bounds, lengths, patterns, formats, counts, subschemas."""
        checks: list[Any] = [_numeric_bounds(schema)]
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
            checks.append(("contains", count, self.node(schema["contains"], stack, depth, nested)))
        checks.append(count_range(schema.get("minProperties"), schema.get("maxProperties"), "keys"))
        patterns = schema.get("patternProperties")
        if isinstance(patterns, dict):
            for key_pattern, sub in patterns.items():
                checks.append(("keys matching", quote(key_pattern), self.node(sub, stack, depth, nested)))
        for key, word in (("propertyNames", "keys"), ("not", "not")):
            if key in schema:
                checks.append((word, "", self.node(schema[key], stack, depth, nested)))
        return tuple(check for check in checks if check)


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


def _field_text(name: str, node: Node) -> int:
    """The least text a description spends on listing a field, `name (label): description`, subfields apart."""
    description = max(len(one_line(text).rstrip(".")) for text in (node.description, node.model_description))
    return min(len(name), _SNIPPET) + 4 + (description + 2 if description else 0)


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
