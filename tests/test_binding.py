"""Binding ORS tool specs to functions: naming, docstring safety, call routing, and TRL / transformers integration."""

from __future__ import annotations

import asyncio
import builtins
import inspect
import json
import logging
import os
import random
import re
import subprocess
import sys
import types
from typing import Any

import pytest
from pydantic import BaseModel, Field
from transformers.utils import get_json_schema
from transformers.utils.chat_template_utils import render_jinja_template

from ors_trl.core.binding import UNSET, BindingResult, Toolset, bind_tools, defuse_docstring_text, describe_tool

# ------------------------------------------------------------------------------------------------------ helpers


class FakeEnv:
    """Records what the bound tools send to the environment: the call as the model made it (the name it saw, the
    arguments by name), routed to the remote name and wire arguments as the episode core routes it."""

    result: BindingResult

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    def reset(self, **kwargs: Any) -> str:
        return "prompt"

    def get_reward(self) -> float:
        return 0.0

    def _route(self, name: str, arguments: dict) -> tuple[str, dict]:
        bound = next(b for b in self.result.tools.values() if b.name == name)
        return bound.remote_name, bound.arguments(arguments)

    def _call_tool(self, name: str, arguments: dict) -> str:
        remote, wire = self._route(name, arguments)
        self.calls.append((remote, wire))
        return f"{remote}:{json.dumps(wire, sort_keys=True, ensure_ascii=False)}"

    async def _acall_tool(self, name: str, arguments: dict) -> str:
        await asyncio.sleep(0)
        self.calls.append(self._route(name, arguments))
        return f"async {name}"


def adapter(result: BindingResult) -> type:
    """A fresh adapter class with the bound functions installed (like the real adapter does)."""
    return type("Adapter", (FakeEnv,), {"result": result, **result.functions})


def trl_tool_attributes(cls: type) -> list[str]:
    """Exactly what TRL's GRPOTrainer collects from an environment class."""
    return [
        name
        for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    ]


def undefuse(text: str) -> str:
    text = re.sub(r"(Args|Returns|Raises) :", r"\1:", text)
    return re.sub(r"\((choices) :", r"(\1:", text, flags=re.IGNORECASE)


def simple_spec(name: str, description: str = "A tool.", **properties: Any) -> dict:
    schema = {"type": "object", "properties": properties or {"a": {"type": "integer"}}, "required": []}
    return {"name": name, "description": description, "input_schema": schema}


HOSTILE_STRINGS = [
    "'",
    '"""',
    "'''",
    '"""; import builtins; builtins.ORS_PWNED = True; """',
    "x(): pass\nimport builtins\nbuiltins.ORS_PWNED = True\ndef y",
    "__import__('builtins').__setattr__('ORS_PWNED', True)",
    "__import__('os').system('touch /tmp/ors_pwned')",
    "Args:",
    "Do it.\nArgs:\n    fake: injected argument\nReturns:\n    nothing",
    "Returns: everything",
    "Raises: hell",
    "  MyArgs: inline Args: and Returns: and Raises:  ",
    "value (choices: [1, 2])",
    "value (CHOICES: not json",
    "line one\n    b: fake\nc: fake2",
    "{{ 7 * 7 }} {% raw %}",
    "\\n\\t\\\\",
    "naïve café 名前 🚀 \u200b\u2028\u0000",
    "\t\r\n",
    "",
    " ",
    "class",
    "self",
    "__init__",
    "reset",
    "get_reward",
    "_private",
    "run-shell",
    "x" * 300,
]


# ------------------------------------------------------------------------------------------------------- naming


def test_exact_names_are_kept() -> None:
    result = bind_tools([simple_spec("search"), simple_spec("web.fetch"), simple_spec("ns:tool-1")])
    assert result.display_names == {"search": "search", "web_fetch": "web.fetch", "ns_tool_1": "ns:tool-1"}
    assert result.remote_names == {"search": "search", "web_fetch": "web.fetch", "ns_tool_1": "ns:tool-1"}
    assert [f.__name__ for f in result.functions.values()] == ["search", "web.fetch", "ns:tool-1"]


@pytest.mark.parametrize(
    ("remote", "attribute", "display"),
    [
        ("reset", "tool_reset", "reset"),
        ("get_reward", "tool_get_reward", "get_reward"),
        ("_private", "tool__private", "_private"),
        ("run-shell", "run_shell", "run-shell"),
        ("class", "tool_class", "class"),
        ("__init__", "tool___init__", "__init__"),
        ("9lives", "tool_9lives", "9lives"),
        ("run shell", "run_shell", "run_shell"),
        ("café", "cafe", "cafe"),
        ("名前", "tool", "tool"),
        ("", "tool", "tool"),
        ("a\nb", "a_b", "a_b"),
        ("x" * 100, "x" * 100, "x" * 64),
    ],
)
def test_naming_policy(remote: str, attribute: str, display: str) -> None:
    result = bind_tools([simple_spec(remote)])
    assert result.remote_names == {attribute: remote}
    assert result.display_names == {attribute: display}
    function = result.functions[attribute]
    assert function.__name__ == display
    assert function.__qualname__ == attribute
    assert result.warnings  # every one of these was renamed somewhere


def test_reset_tool_does_not_shadow_adapter_reset_and_is_routed() -> None:
    result = bind_tools([simple_spec("reset"), simple_spec("get_reward"), simple_spec("move")])
    cls = adapter(result)
    env = cls()
    assert env.reset() == "prompt"
    assert env.get_reward() == 0.0
    assert sorted(trl_tool_attributes(cls)) == ["move", "tool_get_reward", "tool_reset"]
    # TRL keys tools by __name__: the model's "reset" call reaches the remote reset tool.
    tools = {getattr(env, name).__name__: getattr(env, name) for name in trl_tool_attributes(cls)}
    assert sorted(tools) == ["get_reward", "move", "reset"]
    assert tools["reset"](a=1) == 'reset:{"a": 1}'
    assert env.calls == [("reset", {"a": 1})]


def test_collisions_stay_reachable_with_deterministic_suffixes() -> None:
    specs = [simple_spec("run shell"), simple_spec("run_shell"), simple_spec("run-shell"), simple_spec("run_shell_2")]
    result = bind_tools(specs)
    assert result.remote_names == {
        "run_shell_3": "run shell",
        "run_shell": "run_shell",
        "run_shell_4": "run-shell",
        "run_shell_2": "run_shell_2",
    }
    assert result.display_names["run_shell_3"] == "run_shell_3"
    assert result.display_names["run_shell_4"] == "run-shell"
    displays = list(result.display_names.values())
    assert len(set(displays)) == len(displays)
    assert any("collides" in warning for warning in result.warnings)
    assert bind_tools(list(reversed(specs))).remote_names == {  # order-independent for exact names
        "run_shell_2": "run_shell_2",
        "run_shell_3": "run-shell",
        "run_shell": "run_shell",
        "run_shell_4": "run shell",
    }
    env = adapter(result)()
    for attribute, remote in result.remote_names.items():
        getattr(env, attribute)(a=1)
        assert env.calls[-1] == (remote, {"a": 1})


def test_long_names_truncate_and_deduplicate() -> None:
    specs = [simple_spec("y" * 80 + f" {i}") for i in range(3)]
    result = bind_tools(specs)
    assert list(result.display_names.values()) == ["y" * 64, "y" * 62 + "_2", "y" * 62 + "_3"]


def test_custom_reserved_and_duplicates_and_bad_specs(caplog: pytest.LogCaptureFixture) -> None:
    specs = [simple_spec("close"), simple_spec("close"), {"name": None}, 42, {"description": "no name"}]
    with caplog.at_level(logging.WARNING, logger="ors_trl.binding"):
        result = bind_tools(specs, reserved={"reset", "get_reward", "close"})
    assert result.remote_names == {"tool_close": "close"}
    assert any("duplicate tool name 'close'" in w for w in result.warnings)
    assert sum("skipped tool spec" in w for w in result.warnings) == 4
    logged = [record.getMessage() for record in caplog.records if record.name == "ors_trl.binding"]
    assert logged == result.warnings


def test_object_specs_are_accepted() -> None:
    spec = types.SimpleNamespace(name="obj", description="From an object.", input_schema={"type": "object"})
    result = bind_tools([spec])
    assert get_json_schema(result.functions["obj"])["function"]["description"] == "From an object."


# ---------------------------------------------------------------------------------------------- function shape


class Args(BaseModel):
    query: str = Field(description="What to look for")
    limit: int = Field(10, ge=1, le=100, description="How many")
    lang: str | None = None


def test_function_shape() -> None:
    spec = {"name": "search", "description": "Search the web.", "input_schema": Args.model_json_schema()}
    result = bind_tools([spec], module="my.adapters", qualname_prefix="WebEnv")
    function = result.functions["search"]
    assert inspect.isfunction(function)
    assert not inspect.iscoroutinefunction(function)
    assert function.__module__ == "my.adapters"
    assert function.__qualname__ == "WebEnv.search"
    signature = inspect.signature(function)
    assert list(signature.parameters) == ["self", "query", "limit", "lang"]
    assert signature.parameters["query"].default is inspect.Parameter.empty
    assert signature.parameters["limit"].default is UNSET
    assert signature.parameters["lang"].default is UNSET
    assert repr(UNSET) == "<unset>"
    assert function.__annotations__ == {"query": str, "limit": int, "lang": str | None, "return": str}
    assert function.__doc__ == (
        "Search the web.\n\nArgs:\n"
        "    query: What to look for\n"
        "    limit: How many. Constraints: ≥ 1 and ≤ 100. Default: 10.\n"
        "    lang: Lang. Default: null."
    )
    bound = inspect.signature(adapter(result)().search)
    assert list(bound.parameters) == ["query", "limit", "lang"]
    assert get_json_schema(function) == {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "What to look for"},
                    "limit": {"type": "integer", "description": "How many. Constraints: ≥ 1 and ≤ 100. Default: 10."},
                    "lang": {"type": "string", "nullable": True, "description": "Lang. Default: null."},
                },
                "required": ["query"],
            },
            "return": {"type": "string"},
        },
    }


def test_functions_are_distinct_objects() -> None:
    result = bind_tools([simple_spec("a"), simple_spec("b")])
    assert result.functions["a"] is not result.functions["b"]
    assert result.functions["a"].__code__ is result.functions["b"].__code__  # one generic closure, no generated code


# ---------------------------------------------------------------------------------------------------- calling


def renamed_spec() -> dict:
    return {
        "name": "weird",
        "description": "Weird argument names.",
        "input_schema": {
            "type": "object",
            "properties": {
                "class": {"type": "string"},
                "x-y": {"type": "integer"},
                "self": {"type": "boolean"},
                "opt": {"type": "integer", "default": 5},
            },
            "required": ["class", "x-y"],
        },
    }


def test_call_maps_python_and_wire_names() -> None:
    result = bind_tools([renamed_spec()])
    function = result.functions["weird"]
    assert list(inspect.signature(function).parameters) == ["self", "class_", "x_y", "self_", "opt"]
    env = adapter(result)()
    env.weird(class_="a", x_y=1)
    env.weird("a", 1, True, 7)
    env.weird(**{"class": "b", "x-y": 2, "self": False})
    env.weird(class_="c", x_y=3, self_=True, extra="passed through")
    env.weird(class_="d", x_y=4, opt=UNSET)
    env.weird()
    assert env.calls == [
        ("weird", {"class": "a", "x-y": 1}),
        ("weird", {"class": "a", "x-y": 1, "self": True, "opt": 7}),
        ("weird", {"class": "b", "x-y": 2, "self": False}),
        ("weird", {"class": "c", "x-y": 3, "self": True, "extra": "passed through"}),
        ("weird", {"class": "d", "x-y": 4}),
        ("weird", {}),  # missing required arguments are the environment's to refuse
    ]
    docs = get_json_schema(function)["function"]["parameters"]["properties"]
    assert docs["class_"]["description"] == 'Class. Wire name: "class".'
    assert docs["x_y"]["description"] == 'X-y. Wire name: "x-y".'
    with pytest.raises(TypeError, match="multiple values"):
        env.weird("a", class_="b")
    with pytest.raises(TypeError, match="multiple values"):
        env.weird(x_y=1, **{"x-y": 2})
    with pytest.raises(TypeError, match="positional"):
        env.weird(1, 2, 3, 4, 5)


def test_parameter_names_ending_a_docstring_section_are_renamed() -> None:
    """Bug: `get_json_schema` ends the Args block at the first "Returns:"/"Raises:", so a parameter named
    `expectedReturns` (or `Raises`) lost its description and TRL could not render the tool at all."""
    properties = {"a": {"type": "integer"}, "expectedReturns": {"type": "number"}, "Raises": {"type": "boolean"}}
    spec = {"name": "fin", "description": "F.", "input_schema": {"type": "object", "properties": properties}}
    toolset = Toolset([spec])
    function = toolset.binding.functions["fin"]
    assert toolset.schemas == [get_json_schema(function)]
    assert list(inspect.signature(function).parameters) == ["self", "a", "expectedReturns_", "Raises_"]
    assert toolset.route("fin", {"a": 1, "expectedReturns_": 0.5, "Raises_": True}) == (
        "fin", {"a": 1, "expectedReturns": 0.5, "Raises": True})


def test_call_like_trl_does() -> None:
    result = bind_tools([{"name": "search", "description": "S.", "input_schema": Args.model_json_schema()}])
    env = adapter(result)()
    tools = {getattr(env, n).__name__: getattr(env, n) for n in trl_tool_attributes(type(env))}
    arguments = {"query": "cats", "limit": 3}
    assert tools["search"](**arguments) == 'search:{"limit": 3, "query": "cats"}'
    assert env.calls == [("search", {"query": "cats", "limit": 3})]


def test_async_variant() -> None:
    result = bind_tools([renamed_spec()], asynchronous=True)
    function = result.functions["weird"]
    assert inspect.isfunction(function)
    assert inspect.iscoroutinefunction(function)
    env = adapter(result)()
    assert inspect.iscoroutinefunction(env.weird)
    assert asyncio.run(env.weird("a", x_y=2)) == "async weird"
    assert env.calls == [("weird", {"class": "a", "x-y": 2})]
    assert get_json_schema(function)["function"]["name"] == "weird"


# ---------------------------------------------------------------------------------------------------- hostile


def test_hostile_names_and_descriptions_bind_render_and_never_execute(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("exec/eval/compile must never be used")

    specs = []
    for index, text in enumerate(HOSTILE_STRINGS):
        specs.append(
            {
                "name": text,
                "description": text,
                "input_schema": {
                    "type": "object",
                    "properties": {
                        text: {"type": "string", "description": text, "title": text, "default": text, "pattern": text},
                        f"p{index}": {"type": "integer", "description": f"Count {text}"},
                        "nested": {"type": "object", "properties": {text: {"type": "string", "description": text}}},
                    },
                    "required": [f"p{index}"],
                },
            }
        )
    monkeypatch.setattr(builtins, "exec", forbidden)
    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "compile", forbidden)
    result = bind_tools(specs)
    monkeypatch.undo()
    assert not hasattr(builtins, "ORS_PWNED")

    assert sorted(result.remote_names.values()) == sorted(HOSTILE_STRINGS)
    displays = list(result.display_names.values())
    assert len(set(displays)) == len(displays)
    assert set(result.functions) == set(trl_tool_attributes(adapter(result)))
    env = adapter(result)()
    for attribute, function in result.functions.items():
        remote = result.remote_names[attribute]
        info = describe_tool(next(spec for spec in specs if spec["name"] == remote))
        rendered = get_json_schema(function)["function"]
        assert rendered["name"] == function.__name__
        # Nothing was cut from the tool description.
        assert " ".join(undefuse(rendered["description"]).split()) == " ".join(info.description.split())
        properties = rendered["parameters"]["properties"]
        assert sorted(properties) == sorted(p.python_name for p in info.parameters)  # no injected arguments
        assert "enum" not in json.dumps(properties)  # "(choices: ...)" was not parsed
        for parameter in info.parameters:
            assert undefuse(properties[parameter.python_name]["description"]) == parameter.description
        # Every argument reaches the environment under its wire name.
        values = {p.python_name: f"v{i}" for i, p in enumerate(info.parameters)}
        getattr(env, attribute)(**values)
        assert env.calls[-1] == (remote, {p.remote_name: f"v{i}" for i, p in enumerate(info.parameters)})
    assert not hasattr(builtins, "ORS_PWNED")


@pytest.mark.parametrize(
    "text",
    ["Args:", "Returns:", "Raises:", "x Args: y", "(choices: [1])", "(Choices: [1, 2])", "ok (choices: oops"],
)
def test_defuse(text: str) -> None:
    defused = defuse_docstring_text(text)
    assert not re.search(r"(Args|Returns|Raises):", defused)
    assert not re.search(r"\(choices:", defused, flags=re.IGNORECASE)
    assert undefuse(defused) == text


def test_empty_descriptions_get_defaults() -> None:
    spec = {
        "name": "blank",
        "description": " \n\t ",
        "input_schema": {"type": "object", "properties": {"a": {"type": "string", "description": ""}}},
    }
    rendered = get_json_schema(bind_tools([spec]).functions["blank"])["function"]
    assert rendered["description"] == "Call the blank tool."
    assert rendered["parameters"]["properties"]["a"]["description"] == "A"


def test_ten_thousand_tools() -> None:
    specs = []
    for i in range(10_000):
        name = ["tool{}", "tool {}", "reset", "class", "x-{}", "_p{}"][i % 6].format(i)
        specs.append(simple_spec(name, f"Tool {i}.\nArgs:\n  bad: x", a={"type": "integer", "minimum": i}))
    result = bind_tools(specs)
    # "reset" and "class" repeat: only the first of each is bound, the rest are reported duplicates.
    duplicates = sum(1 for spec in specs if spec["name"] in ("reset", "class")) - 2
    assert len(result.functions) == 10_000 - duplicates
    assert sum("duplicate tool name" in warning for warning in result.warnings) == duplicates
    displays = [f.__name__ for f in result.functions.values()]
    assert len(set(displays)) == len(displays)
    cls = adapter(result)
    assert sorted(trl_tool_attributes(cls)) == sorted(result.functions)
    for function in result.functions.values():
        rendered = get_json_schema(function)["function"]
        assert list(rendered["parameters"]["properties"]) == ["a"]


def _junk(rng: random.Random, depth: int = 0) -> Any:
    keys = ["type", "properties", "items", "prefixItems", "anyOf", "oneOf", "allOf", "$ref", "enum", "const",
            "required", "additionalProperties", "minimum", "maxLength", "default", "description", "title",
            "nullable", "not", "format", "discriminator", "$defs", "x-weird"]  # fmt: skip
    scalars = [None, True, False, 0, -1, 1.5, float("inf"), "", "string", "object", "array", "integer", "null",
               "#", "#/$defs/A", "#/$defs/B", "#/$defs", "#/properties/a", "#/0", "http://x", "Args:", 10**30]  # fmt: skip
    roll = rng.random()
    if depth > 4 or roll < 0.3:
        return rng.choice(scalars)
    if roll < 0.45:
        return [_junk(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    node = {rng.choice(keys): _junk(rng, depth + 1) for _ in range(rng.randint(0, 5))}
    if rng.random() < 0.3:
        node["$defs"] = {"A": _junk(rng, depth + 1), "B": {"$ref": "#/$defs/A"}}
    return node


def test_fuzzed_schemas_never_crash() -> None:
    rng = random.Random(1234)
    specs = [{"name": f"f{i}", "description": _junk(rng), "input_schema": _junk(rng)} for i in range(1500)]
    specs += [
        {"name": f"g{i}", "input_schema": {"type": "object", "properties": {"a": _junk(rng), "b": _junk(rng)},
                                           "required": _junk(rng), "$defs": {"A": _junk(rng), "B": _junk(rng)}}}
        for i in range(1500)
    ]  # fmt: skip
    result = bind_tools(specs)
    assert len(result.functions) == len(specs)
    assert not [warning for warning in result.warnings if "could not be converted" in warning]
    env = adapter(result)()
    for attribute, function in result.functions.items():
        rendered = get_json_schema(function)["function"]
        getattr(env, attribute)(**{name: 1 for name in rendered["parameters"]["properties"]})
        assert env.calls[-1][0] == result.remote_names[attribute]


# ------------------------------------------------------------------------------- rendering without transformers

#: Texts that stress `get_json_schema`'s docstring parse: tabs (expanded by column), indented lines (`inspect.getdoc`
#: strips a common margin), Unicode spaces and line breaks, section and `(choices: ...)` markers.
DOC_TEXTS = [*HOSTILE_STRINGS, "a\tb\tc", "\tlead", "x\n\ty\n\t\tz", "  in\n    more\n      most", "\u3000\u3000w\n\u3000x",
             "first\n    second (choices: [\"a\"])", "Args\t: tab", "(choices\t: [1])", "end\t", "\x1c\x1d\x1e\x1f",
             "a\u2028b\x85c", "\v\f", "a\r\nb\rc", "MyArgs: x\n\nReturns:\n  y", "x (choiceſ: [\"a\"])", "ß 名前",
             "Returns:\n    str", "x\n\nArgs:\n    y: z"]  # fmt: skip
_SCALARS = ["a", "", "x\ty", 1, 1.0, 0, 0.0, -0.0, True, False, None, 10**30, 2.5]
_KINDS = ["string", "integer", "number", "boolean", "null", "array", "object"]


def _typed(rng: random.Random, depth: int = 0) -> Any:
    """A random schema of the shapes annotations carry (scalars, enums, arrays, tuples, maps, unions, nulls)."""
    roll = rng.randrange(10) if depth < 4 else 0
    out: dict[str, Any] = {"description": rng.choice(DOC_TEXTS)} if rng.random() < 0.3 else {}
    if roll < 3:
        out["type"] = rng.choice(_KINDS[:5])
    elif roll == 3:
        out["enum"] = rng.sample(_SCALARS, rng.randint(1, 5))
    elif roll == 4:
        out["const"] = rng.choice(_SCALARS)
    elif roll == 5:
        out.update(type="array", items=_typed(rng, depth + 1))
    elif roll == 6:
        out.update(type="array", prefixItems=[_typed(rng, depth + 1) for _ in range(rng.randint(1, 3))])
    elif roll == 7:
        key = rng.choice(["additionalProperties", "properties"])
        out.update(type="object", **{key: _typed(rng, depth + 1) if key[0] == "a" else {"k": _typed(rng, depth + 1)}})
    elif roll == 8:
        out[rng.choice(["anyOf", "oneOf"])] = [_typed(rng, depth + 1) for _ in range(rng.randint(1, 4))]
    else:
        out["type"] = rng.sample(_KINDS, rng.randint(1, 3))
    if rng.random() < 0.1:
        out["nullable"] = True
    return out


def _rendering_corpus() -> list[list[dict]]:
    """Tool lists from the schema, binding and fuzz tests, seeded random ones and hostile names and descriptions."""
    from tests.fixtures.hostile_server import _deep_schema, expanding_tool
    from tests.test_schema import ANNOTATION_CASES, ROUND_TRIP_CASES, TRAVEL, Cat, Dog, Location, Node, Stop

    def tool(name: str, schema: Any, description: Any = "A tool.") -> dict:
        return {"name": name, "description": description, "input_schema": schema}

    def argument(schema: Any, required: bool = True) -> dict:
        return {"type": "object", "properties": {"v": schema}, "required": ["v"] if required else []}

    rng = random.Random(20240611)
    models = [TRAVEL, *(model.model_json_schema() for model in (Location, Stop, Node, Cat, Dog, Args))]
    schemas = [*(schema for schema, _ in ANNOTATION_CASES), *ROUND_TRIP_CASES]
    loop = {"type": "object", "properties": {"x": {"$ref": "#/$defs/A"}},
            "$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}}
    hostile = [loop, {"$ref": "#"}, [], "string", {"properties": []}, {"type": ["object", "null"]}, {"anyOf": []},
               {"allOf": [{"$ref": "#/nope"}]}, {"type": "object", "required": ["missing"], "properties": {}},
               {"type": "object", "properties": {"": {}, "a": {"additionalProperties": {"$ref": "#"}}}},
               {"type": "object", "properties": {"e": {"enum": [f"v{i}" for i in range(5000)]}}},
               {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(300)}},
               json.loads(_deep_schema(50)), json.loads(_deep_schema(400))]  # fmt: skip
    return [
        [tool(f"m{i}", model, model.get("description", "Model.")) for i, model in enumerate(models)],
        [tool(f"a{i}", argument(schema, i % 2 == 0)) for i, schema in enumerate(schemas)],
        [tool(f"h{i}", schema, f"Hostile {i}.") for i, schema in enumerate(hostile)],
        [expanding_tool(i) for i in range(12)],
        [simple_spec("search"), renamed_spec(), tool("reset", None, 'Restart.\nArgs:\n  evil: """')],
        [tool(text, {"type": "object", "properties": {text: {"type": "string", "description": text, "title": text,
                                                               "default": text, "pattern": text},
                                                        "nested": {"properties": {text: {"description": text}}}},
                     "required": [text]}, text) for text in DOC_TEXTS],
        [tool(f"d{i}", None if i % 2 else {}, text) for i, text in enumerate(DOC_TEXTS)],  # no parameters
        [tool(f"f{i}", _junk(rng), _junk(rng)) for i in range(800)],
        [tool(f"g{i}", {"type": "object", "properties": {"a": _junk(rng), "b": _junk(rng)}, "required": _junk(rng),
                        "$defs": {"A": _junk(rng), "B": _junk(rng)}}) for i in range(800)],
        [tool(f"t{i}", {"type": "object", "properties": {rng.choice(DOC_TEXTS) + str(k): _typed(rng) for k in range(4)},
                        "required": [rng.choice(DOC_TEXTS) + "0"]}, rng.choice(DOC_TEXTS)) for i in range(1500)],
    ]


def test_schemas_are_what_get_json_schema_renders() -> None:
    """`Toolset.schemas` is computed without transformers (the core must not import it; evaluation against an
    endpoint runs on a core install) and must be byte for byte what TRL renders into prompts with it."""
    seen: set[str] = set()
    tools = 0
    for specs in _rendering_corpus():
        toolset = Toolset(specs)
        expected = [get_json_schema(function) for function in toolset.binding.functions.values()]
        for got, want in zip(toolset.schemas, expected, strict=True):
            assert json.dumps(got) == json.dumps(want)
        seen.update(re.findall(r'"(\w+)": ', json.dumps(expected)))
        tools += len(expected)
    # The corpus reaches every shape of annotation and docstring the binding makes.
    assert {"enum", "anyOf", "nullable", "items", "prefixItems", "additionalProperties", "return"} <= seen
    assert tools > 3000


# ------------------------------------------------------------------------------------------- chat templates

TEMPLATE = (
    "{%- if tools %}{%- for tool in tools %}{{ tool | tojson }}\n{% endfor %}{%- endif %}"
    "{%- for message in messages %}<|{{ message.role }}|>{{ message.content }}\n{% endfor %}"
)


def test_chat_template_renders_bound_tools() -> None:
    specs = [
        {"name": "search", "description": "Search.", "input_schema": Args.model_json_schema()},
        renamed_spec(),
        {"name": "reset", "description": 'Restart.\nArgs:\n  evil: """', "input_schema": None},
    ]
    result = bind_tools(specs)
    env = adapter(result)()
    methods = [getattr(env, name) for name in trl_tool_attributes(type(env))]
    rendered, _ = render_jinja_template([[{"role": "user", "content": "hi"}]], tools=methods, chat_template=TEMPLATE)
    lines = rendered[0].strip().split("\n")
    schemas = [json.loads(line) for line in lines[:-1]]
    assert schemas == [get_json_schema(method) for method in methods]
    assert sorted(schema["function"]["name"] for schema in schemas) == ["reset", "search", "weird"]
    assert lines[-1] == "<|user|>hi"


def test_internal_error_falls_back_to_pass_through(monkeypatch: pytest.MonkeyPatch) -> None:
    import ors_trl.core.binding as binding

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("bug")

    monkeypatch.setattr(binding, "describe_tool", broken)
    result = bind_tools([simple_spec("t")])
    assert any("could not be converted (RuntimeError)" in warning for warning in result.warnings)
    env = adapter(result)()
    assert get_json_schema(result.functions["t"])["function"]["parameters"] == {"type": "object", "properties": {}}
    env.t(anything=1)
    assert env.calls == [("t", {"anything": 1})]


# --------------------------------------------------------------------------------------------------- determinism

_SIGNATURES = """
import inspect, json, sys
sys.modules["transformers"] = None  # a core install: schemas are rendered without it
from ors_trl.core.binding import Toolset
ghosts = {"type": "object", "required": ["alpha", "beta", "gamma", "delta", "epsilon"]}
arms = {"anyOf": [{"type": "object", "properties": {"x": {}}, "required": [*"zyxwvu"]},
                  {"type": "object", "properties": {"y": {}}, "required": [*"uvwxyz"]}]}
toolset = Toolset([{"name": "ghosts", "input_schema": ghosts}, {"name": "arms", "input_schema": arms}])
json.dump([[str(inspect.signature(f)) for f in toolset.binding.functions.values()], toolset.schemas], sys.stdout)
"""


def test_signatures_and_schemas_do_not_depend_on_the_hash_seed() -> None:
    """Bug: parameters required but missing from `properties` came in set order (PYTHONHASHSEED), so two training
    processes built different signatures and prompts for one tool. Now `required`'s order is kept."""
    outputs = {subprocess.run([sys.executable, "-c", _SIGNATURES], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2", "3")}
    assert len(outputs) == 1
    signatures, schemas = json.loads(outputs.pop())
    assert signatures[0] == "(self, alpha: Any, beta: Any, gamma: Any, delta: Any, epsilon: Any) -> str"
    # Properties first, then what both arms require, in the first arm's order.
    assert signatures[1] == "(self, x: Any, y: Any, z: Any, w: Any, v: Any, u: Any) -> str"
    assert schemas[0]["function"]["parameters"]["required"] == ["alpha", "beta", "gamma", "delta", "epsilon"]
