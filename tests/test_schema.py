"""JSON Schema -> annotations + descriptions: ``get_json_schema`` must reproduce the environment's schema.

Schemas come from real pydantic models; the comparison uses a small normalizer written here (independent of
``ors_trl.core``) that treats ``anyOf[..., null]`` and ``nullable: true``, ``const`` and one-value ``enum``, and
type lists and ``anyOf`` of plain types as equivalent.
"""

from __future__ import annotations

import enum
import json
import typing
from typing import Annotated, Any, Literal, Optional

import pytest
from pydantic import BaseModel, Field
from transformers.utils import get_json_schema

from ors_trl.core.binding import TRUNCATION_MARK, ParameterInfo, bind_tools, describe_tool, python_parameter_names
from ors_trl.core.jsonschema import Budget
from ors_trl.protocol.text import json_size

# ------------------------------------------------------------------------------------------------------- models


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


class Location(BaseModel):
    """A place on Earth."""

    city: str = Field(description="City name")
    days: int = Field(3, ge=1, le=14, description="Nights to stay")
    zip_code: str | None = Field(None, pattern=r"^\d{5}$", title="Postal code")


class Stop(BaseModel):
    name: str = Field(min_length=1, max_length=40)
    minutes: float = Field(gt=0, lt=600, multiple_of=0.5)


class Node(BaseModel):
    """A tree node."""

    value: int
    children: list[Node] = Field(default_factory=list)


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: int = Field(9, ge=0, le=9)


class Dog(BaseModel):
    kind: Literal["dog"]
    good: bool = True


class TravelArgs(BaseModel):
    destination: Location = Field(description="Where to go")
    origin: Location | None = Field(None, description="Where from")
    stops: list[Stop] = Field(default_factory=list, max_length=5, description="Stops on the way")
    mode: Literal["car", "train", "plane"] = "car"
    color: Color = Color.RED
    budget: float | None = Field(None, ge=0, description="Max spend")
    seats: int = Field(1, ge=1, le=9)
    tags: list[str] = Field(default_factory=list, max_length=3, json_schema_extra={"uniqueItems": True})
    scores: dict[str, int] = Field(default_factory=dict)
    pair: tuple[int, str] = (0, "a")
    key: int | str = Field(description="Either an id or a name")
    code: Annotated[str, Field(pattern=r"^[A-Z]{3}$", description="IATA code")] = "JFK"
    tree: Node | None = None
    pet: Cat | Dog = Field(discriminator="kind", description="Who comes along")
    when: str = Field("2024-01-01", json_schema_extra={"format": "date"})
    nested: list[list[int]] = Field(default_factory=list)
    maybe_list: list[int] | None = None


TRAVEL = TravelArgs.model_json_schema()

# ---------------------------------------------------------------------------------------------- normalizer


def _resolve(node: Any, root: dict, seen: tuple = ()) -> tuple[dict, tuple]:
    """Follow $ref and one-element allOf, merging sibling keywords (outer wins)."""
    outer: dict = {}
    while isinstance(node, dict):
        if "$ref" in node:
            ref = node["$ref"]
            outer = {**{k: v for k, v in node.items() if k != "$ref"}, **outer}
            if ref in seen:
                return {"x-recursive": ref, **outer}, seen
            seen = (*seen, ref)
            target: Any = root
            for part in ref[2:].split("/"):
                target = target[part]
            node = target
        elif isinstance(node.get("allOf"), list) and len(node["allOf"]) == 1:
            outer = {**{k: v for k, v in node.items() if k != "allOf"}, **outer}
            node = node["allOf"][0]
        else:
            return {**node, **outer}, seen
    return ({} if node in (True, None) else {"not": {}}), seen


def canon_env(node: Any, root: dict, seen: tuple = ()) -> tuple[frozenset, bool]:
    """(set of non-null alternatives, nullable) for an environment schema."""
    schema, seen = _resolve(node, root, seen)
    if "x-recursive" in schema:
        return frozenset({("object", None)}), False
    if "const" in schema:
        return frozenset({("enum", frozenset({json.dumps(schema["const"])}))}), False
    if "enum" in schema:
        return frozenset({("enum", frozenset(json.dumps(v) for v in schema["enum"]))}), False
    arms = schema.get("anyOf") or schema.get("oneOf")
    kinds = schema.get("type")
    if arms:
        options = [canon_env(arm, root, seen) for arm in arms]
    elif isinstance(kinds, list):
        options = [canon_env({**schema, "type": kind}, root, seen) for kind in kinds]
    else:
        if kinds is None and "properties" in schema:
            kinds = "object"
        if kinds is None:
            return frozenset({("any",)}), False
        if kinds == "null":
            return frozenset(), True
        if kinds == "array":
            prefix = schema.get("prefixItems")
            if prefix is not None and len(prefix) >= 2:
                return frozenset({("tuple", tuple(canon_env(p, root, seen) for p in prefix))}), False
            if prefix is not None and len(prefix) == 1:
                return frozenset({("array", canon_env(prefix[0], root, seen))}), False
            items = schema.get("items")
            return frozenset({("array", None if items is None else canon_env(items, root, seen))}), False
        if kinds == "object":
            extra = schema.get("additionalProperties")
            if schema.get("properties") or not isinstance(extra, dict):
                return frozenset({("object", None)}), False
            return frozenset({("object", canon_env(extra, root, seen))}), False
        return frozenset({(kinds,)}), False
    alternatives: set = set()
    nullable = False
    for option, option_nullable in options:
        alternatives |= option
        nullable = nullable or option_nullable
    if ("any",) in alternatives:
        return frozenset({("any",)}), False
    return frozenset(alternatives), nullable


def canon_gjs(schema: dict) -> tuple[frozenset, bool]:
    """The same normal form for what get_json_schema produced."""
    nullable = bool(schema.get("nullable"))
    if "enum" in schema:
        return frozenset({("enum", frozenset(json.dumps(v) for v in schema["enum"]))}), nullable
    if "anyOf" in schema:
        alternatives: set = set()
        for arm in schema["anyOf"]:
            option, option_nullable = canon_gjs(arm)
            alternatives |= option
            nullable = nullable or option_nullable
        return frozenset(alternatives), nullable
    kinds = schema.get("type")
    if kinds is None:
        return frozenset({("any",)}), False
    alternatives = set()
    for kind in kinds if isinstance(kinds, list) else [kinds]:
        if kind == "null":
            nullable = True
        elif kind == "array":
            if "prefixItems" in schema:
                alternatives.add(("tuple", tuple(canon_gjs(p) for p in schema["prefixItems"])))
            else:
                alternatives.add(("array", canon_gjs(schema["items"]) if "items" in schema else None))
        elif kind == "object":
            extra = schema.get("additionalProperties")
            alternatives.add(("object", canon_gjs(extra) if isinstance(extra, dict) else None))
        else:
            alternatives.add((kind,))
    return frozenset(alternatives), nullable


def collect_facts(node: Any, root: dict, seen: tuple = (), depth: int = 0) -> list[str]:
    """Every nested field name, bound, default, pattern, format, model title and description a schema states."""
    schema, seen = _resolve(node, root, seen)
    if "x-recursive" in schema or depth > 6:
        return []
    facts: list[str] = []
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength",
                "maxLength", "maxItems", "format", "pattern"):  # fmt: skip
        if key in schema:
            facts.append(str(schema[key]) if isinstance(schema[key], str) else json.dumps(schema[key]))
    if "minItems" in schema and schema["minItems"] > 0:
        facts.append(json.dumps(schema["minItems"]))
    if schema.get("uniqueItems"):
        facts.append("unique")
    for arm in schema.get("anyOf") or schema.get("oneOf") or []:
        facts += collect_facts(arm, root, seen, depth)
    if isinstance(schema.get("items"), dict):
        facts += collect_facts(schema["items"], root, seen, depth + 1)
    for item in schema.get("prefixItems") or []:
        facts += collect_facts(item, root, seen, depth + 1)
    if isinstance(schema.get("additionalProperties"), dict):
        facts += collect_facts(schema["additionalProperties"], root, seen, depth + 1)
    properties = schema.get("properties") or {}
    if properties and isinstance(schema.get("title"), str):
        facts.append(schema["title"])
    for name, sub in properties.items():
        facts.append(name)
        sub_schema, _ = _resolve(sub, root, seen)
        if "default" in sub_schema:
            facts.append(json.dumps(sub_schema["default"]))
        if isinstance(sub_schema.get("description"), str):
            facts.append(" ".join(sub_schema["description"].split()).rstrip("."))
        facts += collect_facts(sub, root, seen, depth + 1)
    return facts


def assert_reproduces(spec: dict) -> dict:
    """Bind ``spec`` and check get_json_schema's output against the environment schema property by property."""
    result = bind_tools([spec])
    (function,) = result.functions.values()
    rendered = get_json_schema(function)["function"]
    schema = spec.get("input_schema") or {}
    root_schema, _ = _resolve(schema, schema)
    properties = root_schema.get("properties") or {}
    info = describe_tool(spec)
    wire_of = {p.python_name: p.remote_name for p in info.parameters}
    got = rendered["parameters"]["properties"]
    assert {wire_of[name] for name in got} == set(properties)
    assert {wire_of[name] for name in rendered["parameters"].get("required", [])} == set(
        root_schema.get("required", [])
    )
    for python_name, rendered_property in got.items():
        wire = wire_of[python_name]
        expected = canon_env(properties[wire], schema)
        assert canon_gjs(rendered_property) == expected, (wire, rendered_property, properties[wire])
        description = rendered_property["description"]
        assert "\n" not in description
        for fact in collect_facts(properties[wire], schema):
            assert fact in description, (wire, fact, description)
        wire_schema, _ = _resolve(properties[wire], schema)
        if "default" in wire_schema:
            assert f"Default: {json.dumps(wire_schema['default'], ensure_ascii=False)}" in description
        if isinstance(wire_schema.get("description"), str):
            assert " ".join(wire_schema["description"].split()) in description
    return rendered


def parameter(schema: Any) -> ParameterInfo:
    """The one parameter, `value`, of a tool whose input has the property `{"value": schema}`."""
    return describe_tool({"name": "t", "input_schema": {"type": "object", "properties": {"value": schema}}}).parameters[0]


# ------------------------------------------------------------------------------------------------------- tests


def test_travel_model_reproduced_property_by_property() -> None:
    rendered = assert_reproduces({"name": "travel", "description": "Plan a trip.", "input_schema": TRAVEL})
    properties = rendered["parameters"]["properties"]
    assert rendered["name"] == "travel"
    assert rendered["description"] == "Plan a trip."
    # Spot checks of the exact structural output.
    assert properties["destination"]["type"] == "object"
    assert properties["origin"] == {**properties["origin"], "type": "object", "nullable": True}
    assert properties["stops"]["items"] == {"type": "object"}
    assert properties["mode"]["enum"] == ["car", "train", "plane"]
    assert properties["color"]["enum"] == ["red", "green"]
    assert properties["pair"]["prefixItems"] == [{"type": "integer"}, {"type": "string"}]
    assert properties["scores"]["additionalProperties"] == {"type": "integer"}
    assert sorted(properties["key"]["type"]) == ["integer", "string"]
    assert properties["nested"]["items"] == {"type": "array", "items": {"type": "integer"}}
    assert properties["maybe_list"] == {**properties["maybe_list"], "type": "array", "nullable": True}
    assert rendered["parameters"]["required"] == ["destination", "key", "pet"]


def test_nested_model_description_format() -> None:
    info = describe_tool({"name": "t", "description": "d", "input_schema": TRAVEL})
    by_name = {p.remote_name: p for p in info.parameters}
    destination = by_name["destination"].description
    assert destination == (
        "Where to go. A place on Earth. Location object fields: city (string, required): City name; "
        "days (integer, ≥ 1 and ≤ 14, default 3): Nights to stay; "
        'zip_code (string | null, pattern ^\\d{5}$, default null, title "Postal code").'
    )
    origin = by_name["origin"].description
    assert origin.startswith("Where from. A place on Earth. Location object fields: city (string, required)")
    assert origin.endswith("Default: null.")
    stops = by_name["stops"].description
    assert "≤ 5 items" in stops
    assert (
        "Item (Stop object) fields: name (string, required, 1–40 chars); minutes (number, required, > 0 and < 600"
        in stops
    )
    assert "multiple of 0.5" in stops
    pet = by_name["pet"].description
    assert 'Cat object: kind ("cat", required); lives (integer, ≥ 0 and ≤ 9, default 9)' in pet
    assert 'Dog object: kind ("dog", required); good (boolean, default true)' in pet
    assert "discriminated by kind" in pet
    assert by_name["budget"].description == "Max spend. Constraints: ≥ 0. Default: null."
    assert by_name["when"].description == 'When. Constraints: format date. Default: "2024-01-01".'
    assert by_name["pair"].description == 'Pair. Constraints: exactly 2 items. Default: [0, "a"].'


def test_recursive_model_is_cut_and_described() -> None:
    info = describe_tool({"name": "t", "description": "d", "input_schema": Node.model_json_schema()})
    by_name = {p.remote_name: p for p in info.parameters}
    assert by_name["children"].annotation == list[dict]
    assert "recursive Node" in by_name["children"].description
    assert any("recursive" in note for note in info.notes)

    class Holder(BaseModel):
        root: Node
        other: Node | None = None

    rendered = assert_reproduces({"name": "h", "description": "d", "input_schema": Holder.model_json_schema()})
    assert "children (array of recursive Node" in rendered["parameters"]["properties"]["root"]["description"]


def test_mutually_recursive_and_self_referencing_refs_terminate() -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/A"}, "loop": {"$ref": "#/$defs/Loop"}, "me": {"$ref": "#"}},
        "$defs": {
            "A": {"type": "object", "properties": {"b": {"$ref": "#/$defs/B"}}},
            "B": {"type": "array", "items": {"$ref": "#/$defs/A"}},
            "Loop": {"$ref": "#/$defs/Loop"},
        },
    }
    budget = Budget(json_size(schema, 1 << 62))
    info = describe_tool({"name": "t", "description": "d", "input_schema": schema}, budget=budget)
    assert budget.work_spent <= budget.work  # bounded work, however the references loop (no wall clock: load varies)
    by_name = {p.remote_name: p for p in info.parameters}
    assert by_name["a"].annotation is dict
    assert "b (array of recursive A)" in by_name["a"].description
    assert by_name["loop"].annotation is Any
    assert "recursive Loop" in by_name["loop"].description
    assert by_name["me"].annotation is dict
    get_json_schema(bind_tools([{"name": "t", "input_schema": schema}]).functions["t"])


def test_recursive_type_alias_through_unions() -> None:
    # JSON = None | bool | int | str | list[JSON] | dict[str, JSON]
    schema = {
        "type": "object",
        "properties": {"doc": {"$ref": "#/$defs/Json"}},
        "required": ["doc"],
        "$defs": {
            "Json": {
                "anyOf": [
                    {"type": "null"},
                    {"type": "integer"},
                    {"type": "array", "items": {"$ref": "#/$defs/Json"}},
                    {"type": "object", "additionalProperties": {"$ref": "#/$defs/Json"}},
                ]
            }
        },
    }
    (parameter,) = describe_tool({"name": "t", "input_schema": schema}).parameters
    assert parameter.annotation == Optional[int | list[Any] | dict[str, Any]]  # noqa: UP045
    assert "recursive Json" in parameter.description


def test_model_referenced_twice_is_expanded_each_time() -> None:
    class Two(BaseModel):
        a: Location
        b: list[Location]

    schema = Two.model_json_schema()
    assert list(schema["$defs"]) == ["Location"]
    info = describe_tool({"name": "t", "input_schema": schema})
    for parameter in info.parameters:
        assert "city (string, required): City name" in parameter.description
    assert info.notes == ()
    assert_reproduces({"name": "two", "input_schema": schema})


def test_pydantic_v1_definitions_and_allof_wrapper() -> None:
    schema = {
        "type": "object",
        "properties": {
            "where": {"allOf": [{"$ref": "#/definitions/Loc"}], "description": "Where to go", "default": None},
            "items": {"type": "array", "items": [{"type": "integer"}, {"type": "string"}]},
        },
        "required": ["items"],
        "definitions": {
            "Loc": {"title": "Loc", "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
        },
    }
    info = describe_tool({"name": "t", "input_schema": schema})
    by_name = {p.remote_name: p for p in info.parameters}
    assert by_name["where"].annotation is dict
    assert by_name["where"].description == "Where to go. Loc object fields: city (string, required). Default: null."
    assert by_name["items"].annotation == tuple[int, str]


ANNOTATION_CASES = [
    ({"type": "string"}, str),
    ({"type": "integer"}, int),
    ({"type": "number"}, float),
    ({"type": "boolean"}, bool),
    ({"type": "null"}, type(None)),
    ({}, Any),
    (True, Any),
    ({"type": "array"}, list),
    ({"type": "array", "items": {"type": "string"}}, list[str]),
    ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]}, tuple[int, str]),
    ({"type": "array", "prefixItems": [{"type": "integer"}]}, list[int]),
    ({"type": "object"}, dict),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, dict[str, int]),
    ({"type": "object", "additionalProperties": True}, dict),
    ({"type": "object", "properties": {"a": {"type": "string"}}}, dict),
    ({"enum": ["a", "b"]}, Literal["a", "b"]),
    ({"enum": [1, "a", None, True]}, Literal[1, "a", None, True]),
    ({"const": 3}, Literal[3]),
    ({"enum": [[1], {"a": 1}], "type": "array"}, list),
    ({"enum": [{"a": 1}]}, Any),
    ({"type": ["string", "null"]}, Optional[str]),  # noqa: UP045
    ({"type": ["string", "integer"]}, typing.Union[str, int]),  # noqa: UP007
    ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, typing.Union[int, str]),  # noqa: UP007
    ({"oneOf": [{"type": "integer"}, {"type": "null"}]}, Optional[int]),  # noqa: UP045
    ({"anyOf": [{"type": "integer"}, {}]}, Any),
    ({"type": "string", "nullable": True}, Optional[str]),  # noqa: UP045
    ({"allOf": [{"type": "integer"}], "minimum": 1}, int),
    ({"$ref": "#/nowhere"}, Any),
    ({"$ref": "https://example.com/schema.json"}, Any),
    ({"type": "wat"}, Any),
    ("garbage", Any),
    ({"items": {"type": "integer"}}, list[int]),
    ({"properties": {"a": {}}}, dict),
]


@pytest.mark.parametrize(("schema", "annotation"), ANNOTATION_CASES)
def test_annotation_mapping(schema: Any, annotation: Any) -> None:
    assert parameter(schema).annotation == annotation


ROUND_TRIP_CASES = [
    {"type": "array", "items": {"anyOf": [{"type": "integer"}, {"type": "array", "items": {"type": "string"}}]}},
    {"type": "array", "prefixItems": [{"enum": ["x", "y"]}, {"type": ["number", "null"]}], "maxItems": 2},
    {"type": "object", "additionalProperties": {"type": "array", "items": {"type": "boolean"}}},
    {"anyOf": [{"const": "auto"}, {"type": "integer", "minimum": 0}, {"type": "null"}]},
    {"anyOf": [{"type": "array", "items": {"type": "integer"}}, {"type": "string"}]},
]


def test_annotation_mapping_round_trips_through_get_json_schema() -> None:
    for index, schema in enumerate(ROUND_TRIP_CASES):
        spec = {
            "name": f"c{index}",
            "input_schema": {"type": "object", "properties": {"v": schema}, "required": ["v"]},
        }
        assert_reproduces(spec)


def test_constraints_are_described() -> None:
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "exclusiveMinimum": 0, "maximum": 10, "multipleOf": 2},
            "old": {"type": "number", "minimum": 1, "exclusiveMinimum": True},
            "s": {"type": "string", "minLength": 2, "maxLength": 2, "format": "email", "pattern": "a b"},
            "arr": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1, "uniqueItems": True},
            "m": {"type": "object", "additionalProperties": {"type": "string", "maxLength": 3}, "maxProperties": 4},
            "x": {"type": "string", "deprecated": True, "examples": ["a"], "x-unit": "cm", "$comment": "internal"},
            "strict": {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
            "enumish": {"enum": [[1, 2], {"k": "v"}], "description": "Odd values"},
            "nothing": False,
        },
    }
    info = describe_tool({"name": "t", "input_schema": schema})
    text = {p.remote_name: p.description for p in info.parameters}
    assert text["n"] == "N. Constraints: > 0 and ≤ 10, multiple of 2."
    assert text["old"] == "Old. Constraints: > 1."
    assert text["s"] == 'S. Constraints: exactly 2 chars, pattern "a b", format email.'
    assert text["arr"] == "Arr. Constraints: each item ≥ 0, ≥ 1 items, unique items."
    assert text["m"] == "M. Constraints: each value ≤ 3 chars, ≤ 4 keys."
    assert text["x"] == 'X. Notes: deprecated; examples ["a"]; x-unit "cm".'
    assert text["strict"] == "Strict. Constraints: no other keys. Object fields: a (integer)."
    assert text["enumish"] == 'Odd values. Type: one of [1, 2], {"k": "v"}.'
    assert text["nothing"] == "Nothing. Constraints: never allowed."


def test_parameter_descriptions_and_defaults() -> None:
    schema = {
        "type": "object",
        "properties": {
            "q": {"type": "string", "description": "  Search\n\n   query\t text  "},
            "limit": {"type": "integer", "default": 10, "title": "Result limit"},
            "lang": {"type": "string", "title": "Lang"},
            "blank": {"type": "string", "description": "   "},
        },
        "required": ["q"],
    }
    info = describe_tool({"name": "search", "description": "", "input_schema": schema})
    assert info.description == "Call the search tool."
    text = {p.remote_name: p.description for p in info.parameters}
    assert text == {
        "q": "Search query text",
        "limit": "Result limit. Default: 10.",
        "lang": "Lang",
        "blank": "Blank",
    }
    assert [p.required for p in info.parameters] == [True, False, False, False]


def test_required_parameters_come_first_and_keep_order() -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "integer"}},
        "required": ["c", "a"],
    }
    info = describe_tool({"name": "t", "input_schema": schema})
    assert [(p.remote_name, p.required) for p in info.parameters] == [("a", True), ("c", True), ("b", False)]


@pytest.mark.parametrize("input_schema", [None, {}, {"type": "object"}, {"type": "object", "properties": {}}])
def test_tools_without_arguments(input_schema: Any) -> None:
    info = describe_tool({"name": "ping", "description": "Ping.", "input_schema": input_schema})
    assert info.parameters == ()
    assert info.notes == ()
    rendered = assert_reproduces({"name": "ping", "description": "Ping.", "input_schema": input_schema})
    assert rendered["parameters"] == {"type": "object", "properties": {}}


def test_required_without_property_and_root_extras() -> None:
    schema = {
        "type": "object",
        "description": "Input model.",
        "properties": {"a": {"type": "integer"}},
        "required": ["a", "ghost"],
        "additionalProperties": {"type": "string"},
    }
    info = describe_tool({"name": "t", "description": "Tool.", "input_schema": schema})
    by_name = {p.remote_name: p for p in info.parameters}
    assert by_name["ghost"].required and by_name["ghost"].annotation is Any
    assert info.description == "Tool.\n\nExtra arguments allowed: string. Input: Input model."


def test_root_ref_and_root_alternatives() -> None:
    wrapped = {"$ref": "#/$defs/Args", "$defs": {"Args": Location.model_json_schema()}}
    info = describe_tool({"name": "t", "input_schema": wrapped})
    assert [p.remote_name for p in info.parameters] == ["city", "days", "zip_code"]
    alternatives = {
        "oneOf": [
            {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]},
            {"type": "object", "properties": {"name": {"type": "string"}, "id": {}}, "required": ["name"]},
        ]
    }
    info = describe_tool({"name": "t", "description": "Find.", "input_schema": alternatives})
    assert [(p.remote_name, p.required) for p in info.parameters] == [("id", False), ("name", False)]
    assert "(id) | (name, id?)" in info.description


class Circle(BaseModel):
    kind: Literal["circle"]
    radius: float


class Square(BaseModel):
    kind: Literal["square"]
    side: float = Field(description="Edge length.")


def test_root_alternatives_sharing_a_property_offer_every_alternatives_values() -> None:
    """Bug: a property in several argument sets took the first set's schema, so a pydantic discriminated union's
    `kind` rendered as `enum: ["circle"]` and the model was told "square" was never allowed."""
    from pydantic import TypeAdapter

    schema = TypeAdapter(Annotated[Circle | Square, Field(discriminator="kind")]).json_schema()
    (result,) = bind_tools([{"name": "draw", "input_schema": schema}]).functions.values()
    properties = get_json_schema(result)["function"]["parameters"]["properties"]
    assert properties["kind"]["anyOf"] == [{"type": "string", "enum": ["circle"]}, {"type": "string", "enum": ["square"]}]
    assert properties["side"] == {"type": "number", "description": "Edge length."}
    shared = {"oneOf": [{"properties": {"q": {"type": "string"}, "a": {"type": "integer"}}},
                        {"properties": {"q": {"type": "string"}, "b": {"type": "integer"}}}]}
    (query, *_) = describe_tool({"name": "t", "input_schema": shared}).parameters
    assert (query.remote_name, query.annotation) == ("q", str)  # one schema in every set: kept as it is


def test_all_of_arms_refining_one_property_keep_every_constraint() -> None:
    """Bug: `allOf` arms constraining the same property kept the first arm's schema only, so a refinement's `enum`
    (or bound) was dropped and the model was told any string would do."""
    schema = {"allOf": [
        {"type": "object", "properties": {"mode": {"type": "string", "description": "Colour mode."}}},
        {"properties": {"mode": {"enum": ["rgb", "cmyk"]}, "level": {"type": "integer", "maximum": 9}}},
        {"properties": {"level": {"minimum": 1}}, "required": ["mode"]},
    ]}  # fmt: skip
    mode, level = describe_tool({"name": "t", "input_schema": schema}).parameters
    assert (mode.remote_name, mode.annotation, mode.required) == ("mode", Literal["rgb", "cmyk"], True)
    assert mode.description == "Colour mode."
    assert level.description == "Level. Constraints: ≥ 1 and ≤ 9."


def test_all_of_arms_written_inline_keep_their_description() -> None:
    """Bug: a property `allOf` of inline arms (zod's `.and()`, OpenAPI composition) lost the description an arm
    carried: the model read "P" instead of the environment's text."""
    schema = {"type": "object", "properties": {"p": {"allOf": [
        {"type": "string", "description": "The p value."}, {"maxLength": 3, "description": "Short."}]}}}  # fmt: skip
    (p,) = describe_tool({"name": "t", "input_schema": schema}).parameters
    assert (p.annotation, p.description) == (str, "The p value. Constraints: ≤ 3 chars.")


def test_input_level_constraints_beside_properties_are_described() -> None:
    """Bug: the input's own `oneOf`/`anyOf` beside its properties ("give url or path") and keywords it does not
    read (`dependentRequired`) were dropped, though a property's are described: the model could not know them."""
    schema = {"type": "object", "properties": {"url": {"type": "string"}, "path": {"type": "string"}},
              "oneOf": [{"required": ["url"]}, {"required": ["path"]}], "dependentRequired": {"url": ["path"]}}
    info = describe_tool({"name": "fetch", "description": "Fetch.", "input_schema": schema})
    assert info.description == ('Fetch.\n\nInput notes: also matches one of: {"required": ["url"]}, '
                                '{"required": ["path"]}; dependentRequired {"url": ["path"]}.')
    assert "notes" not in describe_tool({"name": "t", "input_schema": TravelArgs.model_json_schema()}).description


def test_non_object_input_schema_is_reported() -> None:
    info = describe_tool({"name": "t", "input_schema": {"type": "string"}})
    assert info.parameters == ()
    assert any("not an object" in note for note in info.notes)


def test_python_parameter_names() -> None:
    names = python_parameter_names(
        ["class", "x-y", "x_y", "self", "__init__", "1st", "", "ok", "名前", "class_", "e\u0301"]
    )
    assert names == {
        "class": "class__2",
        "x-y": "x_y_2",
        "x_y": "x_y",
        "self": "self_",
        "__init__": "init_",
        "1st": "arg_1st",
        "": "arg",
        "ok": "ok",
        "名前": "名前",
        "class_": "class_",
        "e\u0301": "e",
    }
    assert len(set(names.values())) == len(names)
    assert python_parameter_names(["class"]) == {"class": "class_"}


def test_description_is_capped_with_a_marker() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string", "description": "word " * 5000}}}
    info = describe_tool({"name": "t", "input_schema": schema}, max_param_description=2000)
    (parameter,) = info.parameters
    assert len(parameter.description) <= 2000
    assert parameter.description.endswith(TRUNCATION_MARK)
    assert any("truncated" in note for note in info.notes)
    long_tool = describe_tool({"name": "t", "description": "x" * 100_000, "input_schema": None})
    assert len(long_tool.description) <= 8000 and long_tool.description.endswith(TRUNCATION_MARK)


def test_huge_and_deep_schemas_are_bounded() -> None:
    # A diamond of references doubles at every level: 2**40 paths if expanded naively.
    defs = {
        f"D{i}": {
            "type": "object",
            "properties": {"l": {"$ref": f"#/$defs/D{i + 1}"}, "r": {"$ref": f"#/$defs/D{i + 1}"}},
        }
        for i in range(40)
    }
    defs["D40"] = {"type": "integer"}
    schema = {"type": "object", "properties": {"x": {"$ref": "#/$defs/D0"}}, "$defs": defs}
    deep: dict = {"type": "integer"}
    for _ in range(500):
        deep = {"type": "array", "items": deep}
    schema["properties"]["deep"] = deep
    schema["properties"]["wide"] = {
        "type": "object",
        "properties": {f"f{i}": {"type": "integer"} for i in range(5000)},
    }
    info = describe_tool({"name": "t", "input_schema": schema})
    bound = bind_tools([{"name": "t", "input_schema": schema}])
    get_json_schema(bound.functions["t"])
    assert bound.budget.work_spent <= bound.budget.work  # bounded work (no wall clock: load varies)
    for parameter in info.parameters:
        assert len(parameter.description) <= 2000


def test_a_parameter_description() -> None:
    assert parameter({"type": "integer", "minimum": 1, "default": 2, "description": "Count"}).description == (
        "Count. Constraints: ≥ 1. Default: 2."
    )


def test_a_bound_names_no_variable_that_could_be_another_field() -> None:
    """`y (integer, required, 0 ≤ x ≤ 9)` read as a bound on the field x; the bound now stands on its own."""
    point = {"type": "object", "properties": {"x": {"type": "integer"},
                                              "y": {"type": "integer", "minimum": 0, "exclusiveMaximum": 10}},
             "required": ["x", "y"]}
    text = parameter({"type": "object", "properties": {"p": point}, "required": ["p"]}).description
    assert "x (integer, required); y (integer, required, ≥ 0 and < 10)" in text
    args = {p.remote_name: p.description for p in describe_tool({"name": "t", "input_schema": point}).parameters}
    assert args["y"] == "Y. Constraints: ≥ 0 and < 10."


def test_quoted_values_keep_their_spacing_on_one_line() -> None:
    schema = {
        "type": "object",
        "properties": {
            "s": {"type": "string", "default": "a  b\tc\nd", "pattern": "^x  y$", "description": "Two\n\nlines"},
            "u": {"type": "string", "default": "p\u2028q\x85r"},
        },
    }
    text = {p.remote_name: p.description for p in describe_tool({"name": "t", "input_schema": schema}).parameters}
    assert text["s"] == 'Two lines. Constraints: pattern "^x  y$". Default: "a  b\\tc\\nd".'
    assert text["u"] == 'U. Default: "p\\u2028q\\u0085r".'
    assert json.loads(text["u"].split("Default: ")[1][:-1]) == "p\u2028q\x85r"
    rendered = get_json_schema(bind_tools([{"name": "t", "input_schema": schema}]).functions["t"])
    assert rendered["function"]["parameters"]["properties"]["s"]["description"] == text["s"]


def test_hostile_sizes_are_bounded() -> None:
    big_enum = list(range(10_000))
    defs = {
        f"D{i}": {
            "type": "object",
            "description": "d" * 1_000_000,
            "properties": {
                "l": {"$ref": f"#/$defs/D{i + 1}"},
                "r": {"$ref": f"#/$defs/D{i + 1}"},
                "e": {"enum": big_enum, "default": list(range(100_000))},
            },
        }
        for i in range(40)
    }
    defs["D40"] = {"type": "array", "items": {"anyOf": [{"$ref": "#/$defs/D40"}, {"enum": big_enum}]}}
    specs = [
        {
            "name": "diamond",
            "input_schema": {
                "type": "object",
                "properties": {"x": {"$ref": "#/$defs/D0"}, "y": {"type": "array", "items": {"$ref": "#/$defs/D40"}}},
                "$defs": defs,
            },
        },
        {"name": "required", "input_schema": {"type": "object", "required": [f"r{i}" for i in range(20_000)]}},
        {
            "name": "alternatives",
            "input_schema": {
                "type": "object",
                "properties": {"w": {"anyOf": [{"type": "integer", "minimum": i} for i in range(100_000)]}},
            },
        },
        {"name": "long", "input_schema": {"type": "object", "properties": {"n" * 100_000: {"default": "v" * 10**7}}}},
    ]
    result = bind_tools(specs)
    for function in result.functions.values():
        get_json_schema(function)
    assert result.budget.work_spent <= result.budget.work  # bounded work (no wall clock: load varies)
    for tool in result.tools.values():
        for parameter in tool.info.parameters:
            assert len(parameter.description) <= 2000
    assert any("schema too large" in warning for warning in result.warnings)
    assert len(result.tools["required"].info.parameters) == 20_000
