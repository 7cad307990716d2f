"""`ors-trl inspect`: everything about an environment a user should see before training on it (`inspect_target`).

The probe session calls no tool unless asked (a call can have effects). The text escapes the server's control and
format characters and keeps names on one line: an environment cannot rewrite the listing a user reads before training.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from ..core.binding import Toolset
from ..protocol.client import AsyncClient
from ..protocol.errors import ConfigurationError, NotFoundError, ORSError
from ..protocol.loop import get_loop
from ..protocol.text import escape_controls, one_line, repair, show_json
from ..protocol.transport import RetryPolicy, Timeouts
from ..protocol.types import Block, ImageBlock, Message, ToolSpec, block_text, image_blocks

__all__ = ["collect", "describe_binding", "inspect_target", "model_text", "render_text"]

_TASK_TEXT = 240
_MODEL_TEXT = 4000  # characters of a prompt or tool output shown as text (--json has them whole)


async def collect(target: str, *, env_name: str | None = None, split: str | None = None, tasks: int = 3,
                  probe: bool = True, probe_index: int = 0, api_key: str | None = None,
                  timeouts: Timeouts | None = None, retry: RetryPolicy | None = None,
                  calls: Sequence[tuple[str, dict[str, Any]]] = (), toolset: str | None = None,
                  toolset_fallback: bool = False, env_overrides: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Query the server (leaving no session open): `inspect_target`'s result but the binding part, its arguments."""
    async with AsyncClient(target, env_name=env_name, api_key=api_key, timeouts=timeouts, retry=retry,
                           toolset=toolset, toolset_fallback=toolset_fallback, env_overrides=env_overrides) as client:
        info: dict[str, Any] = {"target": client.target.name, "kind": client.target.kind, "environments": None,
                                "toolset": toolset, "toolset_refused": None,
                                "env_overrides": sorted(env_overrides or {})}
        if client.target.is_url:
            with contextlib.suppress(NotFoundError):
                info["environments"] = await client.list_environments()
        info["environment"] = await client.environment()
        splits = await client.splits()
        counts = await asyncio.gather(*(client.num_tasks(s.name) for s in splits), return_exceptions=True)
        info["splits"] = [{"name": s.name, "type": s.type, "num_tasks": n if isinstance(n, int) else None}
                          for s, n in zip(splits, counts, strict=True)]
        names = [s.name for s in splits]
        if split is None:
            split = "train" if "train" in names or not names else names[0]
        info["split"] = split
        total = await client.num_tasks(split)
        shown = min(max(tasks, 0), total)
        rows = await client.task_range(split, 0, shown) if shown else []
        info["tasks"] = [{"index": i, "task": task} for i, task in enumerate(rows)]
        shared = await client.tools()
        info.update(shared_tools=[t.to_json() for t in shared.tools], terminal_tool=_terminal(shared.terminal_tool),
                    supports_score_group=shared.supports_score_group,
                    message_block_types=list(shared.message_block_types or ["text", "image"]),
                    messages=shared.message_block_types is not None, conversation=None, prompt_images=None,
                    tool_outputs=[])
        task_tools: dict[str, Any] = {"probed": False, "index": None, "tools": [], "error": None}
        if probe and 0 <= probe_index < total:
            task_tools.update(probed=True, index=probe_index)
            try:
                async with await client.open_session(split=split, index=probe_index) as session:
                    listed = await session.tools()
                    conversation = (await session.messages() if info["messages"] else
                                    [Message("user", await session.prompt())])
                    info["conversation"] = [{"role": m.role, "blocks": [b.type for b in m.blocks],
                                             "text": model_text(m.blocks)} for m in conversation]
                    info["prompt_images"] = [_image(b, m.role) for m in conversation for b in image_blocks(m.blocks)]
                    for name, arguments in calls:
                        info["tool_outputs"].append(await _call(session, name, arguments))
                known = {t.name for t in shared.tools}
                task_tools["tools"] = [t.to_json() for t in listed.tools if t.name not in known]
                if info["terminal_tool"] is None and listed.terminal_tool is not None:
                    info["terminal_tool"] = _terminal(listed.terminal_tool)
            except ConfigurationError:
                raise
            except ORSError as exc:
                task_tools["error"] = f"{type(exc).__name__}: {exc}"
        elif probe:
            task_tools["error"] = f"task index {probe_index} is out of range (split {split!r} has {total} tasks)"
        if toolset is not None and client.toolset is None:  # refused, and toolset_fallback: probed without it
            info["toolset"], info["toolset_refused"] = None, toolset
        info["task_tools"] = task_tools
    return info


def _image(block: ImageBlock, role: str | None = None) -> dict[str, Any]:
    info = block.info()
    return {"role": role, "mime_type": info.mime_type, "width": info.width, "height": info.height,
            "bytes": info.bytes, "sha256": info.sha256, "error": info.error}


async def _call(session: Any, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """One tool called in the probe session: what its output holds, or why it failed."""
    out: dict[str, Any] = {"tool": name, "arguments": arguments}
    try:
        result = await session.call(name, arguments)
    except ORSError as exc:
        return {**out, "error": f"{type(exc).__name__}: {exc}"}
    images = [_image(b) for b in image_blocks(result.blocks)]
    return {**out, "blocks": [b.type for b in result.blocks], "images": images, "text": model_text(result.blocks),
            "reward": result.reward, "finished": result.finished, "metadata": result.metadata}


def model_text(blocks: Sequence[Block]) -> str:
    """The text a model reads for `blocks` (`block_text`), each image a numbered placeholder saying what it is:
    `[image 1: 64x64 png]`, or why a model is not shown it."""
    out, n = [], 0
    for block in blocks:
        if not isinstance(block, ImageBlock):
            out.append(block_text(block))
            continue
        n, info = n + 1, block.info()
        kind = info.mime_type.rpartition("/")[2] or info.mime_type
        shown = f"{info.width}x{info.height} {kind}" if info.error is None else f"{kind}, not shown: {info.error}"
        out.append(f"[image {n}: {one_line(shown)}]")
    return "\n".join(out)


def _terminal(tool: Any) -> dict[str, Any] | None:
    return None if tool is None else {"name": tool.name, "arg": tool.arg, "description": tool.description}


def _signature(function: Any) -> str:
    signature = inspect.signature(function)
    params = list(signature.parameters.values())[1:]  # drop `self`: the model never sees it
    return f"{function.__name__}{signature.replace(parameters=params)}"


def describe_binding(specs: list[dict[str, Any]]) -> dict[str, Any]:
    """Bind `specs` as training does and describe the result: signatures, rendered schemas, warnings."""
    binding_logger = logging.getLogger("ors_trl.binding")
    level = binding_logger.level
    binding_logger.setLevel(logging.ERROR)  # the warnings are part of the output; do not print them twice
    try:
        binding = Toolset([ToolSpec.from_json(s) for s in specs]).binding
    finally:
        binding_logger.setLevel(level)
    tools = [{"name": bound.name, "remote_name": bound.remote_name, "attribute": bound.attribute,
              "signature": _signature(bound.function), "schema": bound.schema()} for bound in binding.tools.values()]
    return {"schemas_rendered": True, "note": None, "tools": tools, "warnings": list(binding.warnings)}


@functools.wraps(collect, assigned=())  # its signature is `collect`'s: one list of parameters, documented here
def inspect_target(target: str, **options: Any) -> dict[str, Any]:
    """`ors-trl inspect`'s JSON-able result (`render_text` shows it): the server's environments, splits, a few tasks,
    shared and task-specific tools (one probe session, closed again), what it supports, the probed prompt's images and
    what `calls` answered (`collect`); then what the model sees after binding (`describe_binding`): signatures, JSON
    schemas (exactly `transformers.utils.get_json_schema`'s) and binding warnings.

    Args:
        target (`str`):
            A catalog name or the URL of a self-hosted server.
        env_name (`str`, *optional*):
            Which environment on a server hosting several.
        split (`str`, *optional*):
            The split whose tasks are shown and probed (`"train"` when it exists, else the first split).
        tasks (`int`, *optional*, defaults to `3`):
            How many of its first tasks to show.
        probe (`bool`, *optional*, defaults to `True`):
            Open one probe session to read the task-specific tools and the conversation (closed again).
        probe_index (`int`, *optional*, defaults to `0`):
            The task the probe session runs.
        api_key (`str`, *optional*):
            The OpenReward key, as for `AsyncClient`.
        timeouts (`Timeouts`, *optional*):
            Bounds every request, as for any client.
        retry (`RetryPolicy`, *optional*):
            Retries of transient failures, as for any client.
        calls (`Sequence[tuple[str, dict[str, Any]]]`, *optional*, defaults to `()`):
            `(tool, arguments)` to call in the probe session, in order (`tool_outputs` says what each answered).
        toolset (`str`, *optional*):
            A platform toolset for the probe session, whose tools are listed with the task's.
        toolset_fallback (`bool`, *optional*, defaults to `False`):
            When the server refuses `toolset`, probe without it (`toolset_refused` names it) instead of raising.
        env_overrides (`Mapping[str, str]`, *optional*):
            The probe session's environment variables (only their names are in the result).

    Raises:
        ConfigurationError: the server refused `toolset` (without `toolset_fallback`).
    """
    info = get_loop().run(collect(target, **options))
    info["binding"] = describe_binding(info["shared_tools"] + info["task_tools"]["tools"])
    return info


def _clip(text: str) -> str:
    """A model-facing text for the terminal: at most `_MODEL_TEXT` characters, then how many more; '(empty)'."""
    if not text:
        return "(empty)"
    more = len(text) - _MODEL_TEXT
    return text if more <= 0 else f"{text[:_MODEL_TEXT]}\n... ({more} more characters; --json has them all)"


def _indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line for line in text.split("\n"))  # other separators: escaped, not broken at


def _one(value: Any) -> str:  # a server-given value as one line (the whole text is escaped at the end)
    return one_line(str(value))


def _images_text(images: list[dict[str, Any]]) -> str:
    return "; ".join(f"{_one(i['mime_type'])} {i['width']}x{i['height']}, {i['bytes']} bytes"
                     + (f" (not shown to a model: {_one(i['error'])})" if i.get("error") else "") for i in images)


def _tool_text(tool: dict[str, Any]) -> str:
    schema = tool.get("input_schema")
    shown = " null" if schema is None else "\n" + _indent(json.dumps(schema, indent=2, ensure_ascii=False), " " * 8)
    description = _one(tool.get("description") or "(no description)")[:300]
    return f"  {_one(tool['name'])}: {description}\n      input_schema:{shown}"


def render_text(info: dict[str, Any]) -> str:
    """The inspection as readable text for a terminal (control characters escaped; see the module docstring)."""
    out: list[str] = []

    def add(*lines: str) -> None:
        out.extend(lines)

    add(f"Target: {info['target']} ({'self-hosted server' if info['kind'] == 'url' else 'OpenReward catalog'})")
    envs = info.get("environments")
    if envs is not None:
        marked = [_one(e) + (" *" if e == info.get("environment") else "") for e in envs]
        add(f"Environments ({len(envs)}): {', '.join(marked)}")
        if len(envs) > 1:
            add("  (* = inspected below; pick another with --env-name)")
    add("", f"Environment: {_one(info.get('environment') or '(server default)')}", "Splits:")
    width = max([len(_one(s["name"])) for s in info["splits"]] + [1])
    for s in info["splits"]:
        count = "?" if s["num_tasks"] is None else str(s["num_tasks"])
        add(f"  {_one(s['name']):<{width}}  type={_one(s['type']):<8} {count:>7} tasks")
    total = next((s["num_tasks"] for s in info["splits"] if s["name"] == info["split"]), None)
    add("", f"Tasks of split {info['split']!r} (first {len(info['tasks'])} of {total if total is not None else '?'}):")
    if not info["tasks"]:
        add("  (none shown)")
    for row in info["tasks"]:
        task = row["task"]
        fields = ", ".join(sorted(map(_one, task))) if isinstance(task, dict) else type(task).__name__
        add(f"  [{row['index']}] fields: {fields}", f"      {show_json(task, _TASK_TEXT)}")
    add("", f"Shared tools ({len(info['shared_tools'])}):", *map(_tool_text, info["shared_tools"]), "")
    tt = info["task_tools"]
    if not tt["probed"]:
        add("Task-specific tools: not probed" + (f" ({_one(tt['error'])})" if tt.get("error") else ""))
    elif tt.get("error"):
        add(f"Task-specific tools: the probe session for task {tt['index']} failed: {_one(tt['error'])}")
    else:
        toolset = f", with toolset {_one(info['toolset'])!r}" if info.get("toolset") else ""
        if info.get("toolset_refused"):
            toolset = f", without toolset {_one(info['toolset_refused'])!r}: the server refused it"
        add(f"Task-specific tools (from a session for task {tt['index']}{toolset}; other tasks may differ) "
            f"({len(tt['tools'])}):", *(map(_tool_text, tt["tools"]) if tt["tools"] else ["  (none)"]))
    add("")
    terminal = info.get("terminal_tool")
    if terminal:
        arg = f"its argument {terminal['arg']!r}" if terminal.get("arg") else "no argument"
        add(f"Terminal tool: {_one(terminal['name'])} (hidden from the model; gets the model's final plain message "
            f"as {arg}): {_one(terminal.get('description') or '')[:300]}")
    else:
        add("Terminal tool: none (rewards come from the tools the model calls)")
    add(f"Group scoring (/score_group): {'supported' if info.get('supports_score_group') else 'not supported'}")
    messages = "yes" if info.get("messages") else ("no: this server answers /prompt only (an older server, or another "
                                                   "ORS implementation); prompts come from /prompt")
    types = ", ".join(map(_one, info.get("message_block_types") or []))
    add(f"Conversations (/messages): {messages}; block types {types}")
    if info.get("conversation") is not None:
        roles = ", ".join(f"{_one(m['role'])} [{', '.join(map(_one, m['blocks']))}]" for m in info["conversation"])
        add(f"First probed task's conversation: {roles}",
            f"The prompt the model reads (task {tt['index']}; images as placeholders):")
        for m in info["conversation"]:
            add(f"  {_one(m['role'])}:", _indent(_clip(m.get("text", "")), " " * 4))
    if info.get("prompt_images") is not None:
        shown = info["prompt_images"]
        add(f"Images in the probed prompt ({len(shown)}): {_images_text(shown) or 'none'}")
    for called in info.get("tool_outputs") or []:
        what = f"{_one(called['tool'])}({show_json(called['arguments'], 200)})"
        if called.get("error"):
            add(f"Tool output of {what}: failed: {_one(called['error'])}")
        else:
            add(f"Tool output of {what}: blocks [{', '.join(map(_one, called['blocks']))}]; images "
                f"({len(called['images'])}): {_images_text(called['images']) or 'none'}",
                f"  reward {'none (not scored)' if called['reward'] is None else called['reward']}; finished "
                f"{'yes' if called['finished'] else 'no'}; metadata "
                f"{'none' if called['metadata'] is None else show_json(called['metadata'], 300)}",
                "  text:", _indent(_clip(called["text"]), " " * 4))
    if info.get("prompt_images") is not None or info.get("tool_outputs"):
        add("  Images reach a model as image parts (a vision-language model's processor takes them); "
            'OpenRewardSpec(images="placeholder") shows the text [image: <media type>] instead.'
            + ("" if info.get("tool_outputs") else " A tool's output is known only once it runs: "
               "--call NAME[=JSON] calls one in the probe session."))
    binding = info.get("binding")
    if binding is not None:
        add("", f"The tools as the model gets them, after binding ({len(binding['tools'])} tools: the Python "
            "signature, then the schema rendered into its prompt; `<unset>` = not sent, the environment's default "
            "applies):")
        for tool in binding["tools"]:
            where = f"remote tool {tool['remote_name']!r}"
            if tool["attribute"] != tool["name"]:
                where += f", adapter attribute {tool['attribute']!r}"
            add(f"  {_one(tool['signature'])}    [{_one(where)}]")
            add(_indent(json.dumps(tool["schema"], indent=2, ensure_ascii=False), " " * 6))
        warnings = binding["warnings"]
        add("", f"Binding warnings ({len(warnings)}):" if warnings else "Binding warnings: none",
            *(f"  - {_one(w)}" for w in warnings))
    difficulty = info.get("difficulty")
    if difficulty is not None:
        add("", f"Task difficulty of split {_one(difficulty['split'])!r} from {_one(difficulty['source'])}: "
            f"{difficulty['with_data']} of {difficulty['tasks']} tasks have data ({difficulty['episodes']} episodes)"
            + (f", mean reward {difficulty['mean']:.3f}" if difficulty["mean"] is not None else "") + ".")
        if difficulty["bins"]:
            add("  mean reward        tasks")
            widest = max(b["tasks"] for b in difficulty["bins"]) or 1
            for i, b in enumerate(difficulty["bins"]):
                closing = "]" if i == len(difficulty["bins"]) - 1 else ")"
                bar = "#" * round(30 * b["tasks"] / widest)
                add(f"  [{b['low']:.2f}, {b['high']:.2f}{closing}  {b['tasks']:6d}  {bar}")
            add("  Keep a range with OpenRewardSpec(..., difficulty=(low, high), difficulty_from=...): tasks with no "
                "data are kept.")
    return escape_controls(repair("\n".join(out)))
