"""Bind ORS tool specs to real Python functions that TRL's GRPOTrainer can collect, render and call.

TRL reads tools through `get_json_schema` (type hints and docstrings only): each argument gets the annotation that
turns back into its schema (`hint_schema`) and a one-line description of all else it says (fields, bounds, defaults).
Each tool is a generic closure (no generated source: a hostile name never runs as code); names that are not sane
display names or public unreserved identifiers (`reset` -> `tool_reset`) are sanitized, with a warning.
"""

from __future__ import annotations

import inspect
import keyword
import logging
import re
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from types import FunctionType
from typing import Any, Literal, Union, get_args, get_origin

from ..protocol.errors import ToolRefusedError
from ..protocol.text import ascii_fold, json_size, show_name
from . import jsonschema
from .jsonschema import MISSING, Budget, Node, Normaliser, as_text, one_line, quote, sentence, single_line

__all__ = [
    "DEFAULT_MAX_PARAM_DESCRIPTION", "DEFAULT_MAX_SCHEMA_NODES", "DEFAULT_MAX_TOOL_DESCRIPTION", "DEFAULT_RESERVED",
    "TRUNCATION_MARK", "UNSET", "BindingResult", "BoundTool", "ParameterInfo", "ToolInfo", "Toolset", "bind_tools",
    "defuse_docstring_text", "describe_tool", "hint_schema", "python_parameter_names", "tool_field", "unique_name",
]  # fmt: skip

logger = logging.getLogger("ors_trl.binding")

#: A parameter description longer than this is cut and marked with `TRUNCATION_MARK`.
DEFAULT_MAX_PARAM_DESCRIPTION = 2_000
#: A tool description longer than this is cut and marked with `TRUNCATION_MARK`.
DEFAULT_MAX_TOOL_DESCRIPTION = 8_000
#: Work units per tool (see `ors_trl.core.jsonschema.Budget`; a pydantic model uses a few hundred).
DEFAULT_MAX_SCHEMA_NODES = 100_000
TRUNCATION_MARK = " …[truncated]"

_INPUT_TEXT = DEFAULT_MAX_PARAM_DESCRIPTION * 2  # characters of field text worth producing for the tool description
_NONE = type(None)
_JSON_TYPES: dict[Any, str] = {list: "array", dict: "object"} | {v: k for k, v in jsonschema.PRIMITIVES.items()}


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
        f"Title: {title}" if title and title != base and not jsonschema.auto_title(title, wire) else "",
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
    `"totalReturns"` -> `"totalReturns_"`, `""` -> `"arg"`) and suffixed `_2`, `_3`... so none equals another
    property's wire or Python name."""
    taken = {*wire_names, "self"}
    return {name: name if _is_safe_parameter_name(name) else unique_name(_sanitize_parameter_name(name), taken)
            for name in dict.fromkeys(wire_names)}


def unique_name(base: str, taken: set[str], *, limit: int | None = None, avoid: frozenset[str] = frozenset()) -> str:
    """`base`, else the first free `base_2`, `base_3`... (cut to `limit`) not in `taken`/`avoid`; added to `taken`."""
    candidate, index = base, 2
    while candidate in taken or candidate in avoid:
        suffix = f"_{index}"
        stem = base if limit is None else base[: limit - len(suffix)]
        candidate, index = f"{stem}{suffix}", index + 1
    taken.add(candidate)
    return candidate


#: `get_json_schema` ends a docstring's Args block at the first "Returns:"/"Raises:", even in `totalReturns: ...`.
_DOC_SECTION_ENDS = ("Returns", "Raises")


def _is_safe_parameter_name(name: str) -> bool:
    return (name.isidentifier() and re.fullmatch(r"\w+", name) is not None and not keyword.iskeyword(name)
            and unicodedata.normalize("NFKC", name) == name and name != "self"
            and not (name.startswith("__") and name.endswith("__")) and not name.endswith(_DOC_SECTION_ENDS))


def _sanitize_parameter_name(name: str) -> str:
    text = re.sub(r"[^A-Za-z0-9_]", "_", ascii_fold(name))
    if name.startswith("__") and name.endswith("__") and len(name) > 4:
        text = text.strip("_") + "_"
    if not text.strip("_"):
        return "arg"
    if text[0].isdigit():
        text = "arg_" + text
    if keyword.iskeyword(text) or text == "self" or text.endswith(_DOC_SECTION_ENDS):
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


#: Attribute names a tool may never take on the adapter class (TRL treats them specially).
DEFAULT_RESERVED: frozenset[str] = frozenset({"reset", "get_reward", "close"})
_DISPLAY_NAME_RE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_MAX_DISPLAY_NAME = 64
_MAX_ATTRIBUTE = 100  # sanitized attribute names are cut to this length
_MAX_LOGGED_WARNINGS = 50
_DOC_SECTION_RE = re.compile(r"(Args|Returns|Raises):")
_CHOICES_RE = re.compile(r"\((choices):", re.IGNORECASE)


#: Default of optional parameters: an argument left at it is not sent, so the environment's default applies.
UNSET: Any = type("_Unset", (), {"__slots__": (), "__repr__": lambda _: "<unset>", "__reduce__": lambda _: "UNSET"})()


@dataclass(eq=False)
class BoundTool:
    """One bound tool: its attribute, the `name` the model sees, the remote name, and its argument mapping."""

    attribute: str
    name: str
    remote_name: str
    info: ToolInfo
    function: FunctionType = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.order = tuple(p.remote_name for p in self.info.parameters)
        self.to_wire = {name: p.remote_name for p in self.info.parameters for name in (p.remote_name, p.python_name)}

    def named(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """The call's arguments by name: positional ones under their wire names, then the keywords unchanged."""
        if len(args) > len(self.order):
            raise TypeError(f"{self.name}() takes {len(self.order)} positional argument(s) but {len(args)} were given")
        out = dict(zip(self.order, args, strict=False))
        for key, value in kwargs.items():
            if key in out:
                raise TypeError(f"{self.name}() got multiple values for argument {key!r}")
            out[key] = value
        return out

    def arguments(self, kwargs: dict) -> dict[str, Any]:
        """Named arguments (Python or wire names) as wire arguments, without those left at `UNSET`."""
        out: dict[str, Any] = {}
        for key, value in kwargs.items():
            if value is UNSET:
                continue
            wire = self.to_wire.get(key, key)
            if wire in out:
                raise TypeError(f"{self.name}() got multiple values for argument {wire!r}")
            out[wire] = value
        return out

    def schema(self) -> dict[str, Any]:
        """`get_json_schema(self.function)` without transformers: the (defused) docstring read back as its parser
        reads it, annotations by `hint_schema`."""
        description, _, block = inspect.getdoc(self.function).partition("\n\nArgs:\n")  # type: ignore[union-attr]
        texts = [line.split(": ", 1)[1] for line in block.split("\n")] if block else []
        properties = {p.python_name: {**hint_schema(p.annotation), "description": text}
                      for p, text in zip(self.info.parameters, texts, strict=True)}
        parameters: dict[str, Any] = {"type": "object", "properties": properties}
        if required := [p.python_name for p in self.info.parameters if p.required]:
            parameters["required"] = required
        return {"type": "function", "function": {"name": self.name, "description": description,
                                                 "parameters": parameters, "return": {"type": "string"}}}


@dataclass
class BindingResult:
    """The functions to set on an adapter class, by attribute name, and what was renamed, skipped or simplified."""

    functions: dict[str, FunctionType] = field(default_factory=dict)
    remote_names: dict[str, str] = field(default_factory=dict)
    display_names: dict[str, str] = field(default_factory=dict)  # the `__name__` the model sees
    tools: dict[str, BoundTool] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    budget: Budget = field(default_factory=lambda: Budget(0))  # what the list's schemas cost (see `Budget`)


def defuse_docstring_text(text: str) -> str:
    """Neutralize the markers `get_json_schema`'s docstring regexes react to: `Args:`/`Returns:`/`Raises:` would end
    a block early (-> `Args :`), a trailing `(choices: ...)` would be JSON-parsed into an enum (-> `(choices :`)."""
    return _CHOICES_RE.sub(r"(\1 :", _DOC_SECTION_RE.sub(r"\1 :", text))


def _display_base(remote: str) -> str:
    text = re.sub(r"[^A-Za-z0-9_.:-]+", "_", ascii_fold(remote[: _MAX_DISPLAY_NAME * 4])).strip("_")
    return text[:_MAX_DISPLAY_NAME] or "tool"


def _is_exact_attribute(remote: str, reserved: frozenset[str]) -> bool:
    return (remote.isascii() and remote.isidentifier() and not keyword.iskeyword(remote)
            and not remote.startswith("_") and remote not in reserved)


def _attribute_base(remote: str, reserved: frozenset[str]) -> str:
    text = re.sub(r"[^A-Za-z0-9_]", "_", ascii_fold(remote[: _MAX_ATTRIBUTE * 4]))[:_MAX_ATTRIBUTE] or "tool"
    while text[0].isdigit() or text.startswith("_") or keyword.iskeyword(text) or text in reserved:
        text = "tool_" + text
    return text


def _docstring(info: ToolInfo) -> str:
    description = defuse_docstring_text(info.description).strip() or "Call this tool."
    if not info.parameters:
        return description
    lines = [description, "", "Args:"]
    for parameter in info.parameters:
        text = defuse_docstring_text(single_line(parameter.description)) or "The argument."
        lines.append(f"    {parameter.python_name}: {text}")
    return "\n".join(lines)


def bind_tools(tool_specs: Iterable[Any], *, reserved: Iterable[str] = DEFAULT_RESERVED, asynchronous: bool = False,
               module: str | None = None, qualname_prefix: str | None = None) -> BindingResult:
    """One function per ORS tool spec, calling `self._call_tool(name, arguments)` (awaiting `self._acall_tool` when
    `asynchronous`); `reserved`: attribute names tools must not take; one schema `Budget` for the list. Never raises
    for odd specs: renames, skips and simplifications are warnings (`BindingResult.warnings`, logged)."""
    reserved_set = frozenset([reserved] if isinstance(reserved, str) else reserved)
    result = BindingResult()
    warnings = result.warnings

    # 1. Valid, distinct specs.
    entries: dict[str, Any] = {}  # remote name -> spec
    for index, spec in enumerate(tool_specs):
        remote = tool_field(spec, "name")
        if not isinstance(remote, str):
            warnings.append(f"skipped tool spec #{index}: its name is not a string")
            continue
        if remote in entries:
            warnings.append(f"skipped tool spec #{index}: duplicate tool name {show_name(remote)}")
            continue
        entries[remote] = spec

    # 2. Names: exact names are claimed first, sanitized ones get deterministic suffixes.
    display_taken = {remote for remote in entries if _DISPLAY_NAME_RE.fullmatch(remote)}
    attribute_taken = {remote for remote in entries if _is_exact_attribute(remote, reserved_set)}
    names: list[tuple[str, str]] = []
    for remote in entries:
        if _DISPLAY_NAME_RE.fullmatch(remote):
            display = remote
        else:
            display = unique_name(_display_base(remote), display_taken, limit=_MAX_DISPLAY_NAME)
            warnings.append(f"tool {show_name(remote)}: not a valid tool name for models, shown to the model as "
                            f"{show_name(display)}")
        if _is_exact_attribute(remote, reserved_set):
            attribute = remote
        else:
            base = _attribute_base(remote, reserved_set)
            attribute = unique_name(base, attribute_taken, avoid=reserved_set)
            why = "is reserved" if remote in reserved_set else "is not a public Python identifier"
            suffix = f" (deduplicated from {show_name(base)})" if attribute != base else ""
            warnings.append(f"tool {show_name(remote)}: name {why}; bound as attribute {show_name(attribute)}{suffix}")
        if display != remote and display != _display_base(remote):
            warnings.append(f"tool {show_name(remote)}: display name collides with another tool, using "
                            f"{show_name(display)}")
        names.append((display, attribute))

    # 3. Functions, within one schema budget for the whole list.
    budget = result.budget = Budget(sum(json_size(tool_field(s, "input_schema"), 1 << 62) for s in entries.values()))
    for (remote, spec), (display, attribute) in zip(entries.items(), names, strict=True):
        try:
            info = describe_tool(spec, budget=budget)
        except Exception as error:  # a bug must not take the whole environment down; the tool stays callable
            warnings.append(f"tool {show_name(remote)}: input schema could not be converted ({type(error).__name__}); "
                            "bound without parameters, arguments are passed through")
            info = ToolInfo(remote, f"Call the {one_line(remote) or 'unnamed'} tool.", ())
        warnings.extend(f"tool {show_name(remote)}: parameter {show_name(p.remote_name)} is exposed as "
                        f"{show_name(p.python_name)}" for p in info.parameters if p.python_name != p.remote_name)
        warnings.extend(f"tool {show_name(remote)}: {note}" for note in info.notes)
        bound = result.tools[attribute] = BoundTool(attribute, display, remote, info)
        result.functions[attribute] = _build_function(bound, asynchronous, module, qualname_prefix)
        result.remote_names[attribute] = remote
        result.display_names[attribute] = display

    if budget.refs_cut:
        warnings.append(f"the tools' input schemas expand past {jsonschema.EXPANSION_FACTOR}x their {budget.received} "
                        f"characters of JSON + {jsonschema.EXPANSION_FLOOR >> 10} KiB: {budget.refs_cut} $ref "
                        "expansion(s) left unexpanded")
    for message in warnings[:_MAX_LOGGED_WARNINGS]:
        logger.warning("%s", message)
    if len(warnings) > _MAX_LOGGED_WARNINGS:
        logger.warning("... and %d more tool binding warnings", len(warnings) - _MAX_LOGGED_WARNINGS)
    return result


def _build_function(bound: BoundTool, asynchronous: bool, module: str | None, qualname_prefix: str | None
                    ) -> FunctionType:
    """A generic closure (receiver positional-only: any argument name fits) handing the adapter the call."""
    display, named, info = bound.name, bound.named, bound.info
    if asynchronous:

        async def _tool(_ors_self: Any, /, *args: Any, **kwargs: Any) -> Any:
            return await _ors_self._acall_tool(display, named(args, kwargs))

    else:

        def _tool(_ors_self: Any, /, *args: Any, **kwargs: Any) -> Any:
            return _ors_self._call_tool(display, named(args, kwargs))

    function: FunctionType = _tool
    function.__name__ = display
    function.__qualname__ = f"{qualname_prefix}.{bound.attribute}" if qualname_prefix else bound.attribute
    function.__module__ = module if module is not None else __name__
    function.__doc__ = _docstring(info)
    function.__annotations__ = {**{p.python_name: p.annotation for p in info.parameters}, "return": str}
    kind, empty = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.empty
    params = [inspect.Parameter("self", kind)]
    params += (inspect.Parameter(p.python_name, kind, annotation=p.annotation, default=empty if p.required else UNSET)
               for p in info.parameters)
    function.__signature__ = inspect.Signature(params, return_annotation=str)  # type: ignore[attr-defined]
    bound.function = function
    return function


class Toolset:
    """One environment's tools as the model sees them: bound functions, schemas and the one router (`route`), so no
    two drivers can disagree; options as `bind_tools`. The `@terminal` tool (`terminal`) is never bound."""

    def __init__(self, specs: Iterable[Any], *, terminal: Any = None, asynchronous: bool = False,
                 module: str | None = None, qualname_prefix: str = "OpenRewardEnvironment",
                 reserved: frozenset[str] = DEFAULT_RESERVED) -> None:
        self.specs = list(specs)
        self.terminal = terminal
        self.binding = bind_tools([s.to_json() if hasattr(s, "to_json") else s for s in self.specs],
                                  reserved=reserved | DEFAULT_RESERVED, asynchronous=asynchronous, module=module,
                                  qualname_prefix=qualname_prefix)
        self.by_name = {bound.name: bound for bound in self.binding.tools.values()}

    def __repr__(self) -> str:
        terminal = f", terminal={self.terminal.name!r}" if self.terminal is not None else ""
        return f"Toolset({sorted(self.by_name)}{terminal})"

    @cached_property
    def schemas(self) -> list[dict[str, Any]]:
        """The JSON schemas TRL renders for these tools (see `BoundTool.schema`), computed once."""
        return [bound.schema() for bound in self.binding.tools.values()]

    def route(self, name: str, arguments: Any) -> tuple[str, dict[str, Any]]:
        """The remote name and wire arguments of a call, else `ToolRefusedError` with TRL's message for it."""
        bound = self.by_name.get(name)
        if bound is None:
            raise ToolRefusedError(f"Tool {name} not found.", tool=name, reason="not_found")
        if not isinstance(arguments, dict):  # TRL calls `tool(**arguments)`: Python's own message
            raise ToolRefusedError(f"{bound.function.__qualname__}() argument after ** must be a mapping, not "
                                   f"{type(arguments).__name__}", tool=name, reason="input_validation")
        try:
            return bound.remote_name, bound.arguments({str(k): v for k, v in arguments.items()})
        except TypeError as exc:
            raise ToolRefusedError(str(exc), tool=name, reason="input_validation") from None

    def install(self, cls: type) -> type:
        """Set every bound function on `cls` (an adapter class), replacing same-named attributes; returns `cls`."""
        for attribute, function in self.binding.functions.items():
            setattr(cls, attribute, function)
        return cls
