"""The package's shape, checked: the layers and their import rules (ARCHITECTURE.md), no import cycles, TRL internals
behind one seam, only the transport builds a request, a light core import, every name TRL calls with kept free of
task fields, and every option read off the runtime one that the spec has."""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "ors_trl"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every ors_trl module `name` imports, at module level or inside functions."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - max(node.level - 1, 0)] if node.level else []
            target = ".".join([*base, *([node.module] if node.module else [])]) if node.level else node.module or ""
            out |= {f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m in modules and m != name}


#: The layers, bottom to top (ARCHITECTURE.md): a module imports only its own layer and those below it.
LAYERS = ("protocol", "core", "tasks", "trl", "evaluation", "harness", "surface")
#: Third-party packages a layer must never import: the core and the protocol know neither TRL nor torch (the openreward
#: SDK is the protocol's, for the platform's rollout upload alone); the tasks layer knows datasets, not TRL.
_TRAINING = {"torch", "trl", "transformers", "accelerate"}
FORBIDDEN = {"protocol": _TRAINING | {"datasets"}, "core": _TRAINING | {"datasets", "openreward"},
             "tasks": _TRAINING | {"openreward"}}
#: HTTP client libraries: only the transport uses one (the test kit's servers and proxies aside); a server built on
#: `aiohttp.web` alone (an endpoint on loopback) builds no request.
HTTP = {"aiohttp", "httpx", "requests", "urllib3", "http.client"}


def _http_clients(imported: set[str]) -> list[str]:
    """The HTTP client imports among `imported` (`from aiohttp import web` alone is a server, not a client)."""
    server = {t for t in imported if t == "aiohttp.web" or t.startswith("aiohttp.web.")}
    clients = [t for t in imported if (t.split(".")[0] in HTTP or t in HTTP) and t not in server]
    return [] if server and set(clients) <= {"aiohttp"} else clients


def layer(module: str) -> str:
    """The layer of a module by its path: its folder, or the surface (spec, mix, cli, report, demo, testing)."""
    parts = module.split(".")
    if parts[1:2] == ["_version"]:
        return "protocol"
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "surface"


def _all_imports(path: Path) -> set[str]:
    """Every module a file imports, by its absolute name (relative imports resolved), at any depth of the code."""
    name = ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]) if node.level else ""
            target = ".".join(p for p in (base, node.module or "") if p)
            out |= {target} | {f"{target}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def layer_violations(modules: dict[str, set[str]]) -> list[str]:
    """What breaks the layer rules in `modules` (module name -> what it imports): an import of a layer above, a
    third-party package a layer must not know, an HTTP client outside the transport."""
    rank = {name: i for i, name in enumerate(LAYERS)}
    out = []
    for module, imported in sorted(modules.items()):
        mine = layer(module)
        for target in sorted(imported):
            top = target.split(".")[0]
            if top == "ors_trl" and target.count(".") and rank[layer(target)] > rank[mine]:
                out.append(f"{module} ({mine}) imports {target} ({layer(target)})")
            if top in FORBIDDEN.get(mine, ()):
                out.append(f"{module} ({mine}) imports {target}")
            if target in _http_clients(imported) and module != "ors_trl.protocol.transport" \
                    and not module.startswith("ors_trl.testing"):
                out.append(f"{module} builds HTTP requests ({target}): only ors_trl.protocol.transport may")
    return out


def test_every_module_keeps_to_its_layer() -> None:
    modules = {".".join(p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__"): _all_imports(p)
               for p in PACKAGE.rglob("*.py")}
    assert {layer(m) for m in modules} == set(LAYERS)
    assert layer_violations(modules) == []


def test_the_layer_rules_catch_what_they_forbid() -> None:
    """The check itself can fail: a core module importing the TRL layer or transformers, the protocol importing
    the core, an HTTP client outside the transport, each a violation; the same imports the right way round none."""
    bad = {"ors_trl.core.episode": {"ors_trl.trl.backend", "transformers"},
           "ors_trl.protocol.client": {"ors_trl.core.records", "aiohttp"},
           "ors_trl.evaluation.policies": {"httpx"}}
    assert layer_violations(bad) == [
        "ors_trl.core.episode (core) imports ors_trl.trl.backend (trl)",
        "ors_trl.core.episode (core) imports transformers",
        "ors_trl.evaluation.policies builds HTTP requests (httpx): only ors_trl.protocol.transport may",
        "ors_trl.protocol.client builds HTTP requests (aiohttp): only ors_trl.protocol.transport may",
        "ors_trl.protocol.client (protocol) imports ors_trl.core.records (core)"]
    good = {"ors_trl.trl.engine": {"ors_trl.core.episode", "transformers"}, "ors_trl.protocol.transport": {"aiohttp"},
            "ors_trl.spec": {"ors_trl.evaluation.runner", "datasets"},
            "ors_trl.evaluation.endpoint": {"aiohttp", "aiohttp.web"}}  # a server on loopback builds no request
    assert layer_violations(good) == []


def test_no_import_cycles() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                pytest.fail("import cycle: " + " -> ".join([*path[path.index(nxt):], nxt]))
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


#: TRL's private names ors-trl reads (GRPOTrainer's methods and loop state), and those only the tests reach.
TRL_INTERNALS = (r"_generate_single_turn|_get_tool_suffix_ids|_tool_call_loop|_sync_tool_dicts|f_locals|"
                 r"sys\._getframe|\._tokenizer\b|_log_metric\b|_generate_and_score_completions")
TEST_TRL_INTERNALS = (TRL_INTERNALS + r"|_env_tools\b|\._logs\b|\._metrics\[|_last_loaded_step\b|_get_train_sampler"
                      r"|\._process\b|_flash_attn\b")


def test_trl_internals_live_in_one_module() -> None:
    internals = re.compile(TRL_INTERNALS)
    users = sorted(str(p.relative_to(SRC)) for p in PACKAGE.rglob("*.py") if internals.search(p.read_text()))
    assert users == ["ors_trl/trl/backend.py"], users


def test_tests_reach_trl_internals_through_one_fixture() -> None:
    """The suite and the benchmarks name TRL's privates only in the harness (tests/fixtures/generation.py), so a TRL
    release that renames one is fixed there alone."""
    internals = re.compile(TEST_TRL_INTERNALS)
    root = SRC.parent
    files = [p for folder in ("tests", "benchmarks") for p in (root / folder).rglob("*.py") if p != Path(__file__)]
    users = sorted(str(p.relative_to(root)) for p in files if internals.search(p.read_text()))
    assert users == ["tests/fixtures/generation.py"], users


def test_core_import_is_light() -> None:
    code = ("import sys, ors_trl; "
            "print(' '.join(m for m in ('torch', 'trl', 'transformers', 'datasets', 'openreward', 'PIL') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == ""


# -- the names TRL calls with ---------------------------------------------------------------------------

_ROW_NAMES = {"x", "row", "example"}  # what TRL's loops call a dataset row


def _strings(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.List | ast.Set | ast.Tuple):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def _is_row(node: ast.AST) -> bool:
    return ((isinstance(node, ast.Name) and node.id in _ROW_NAMES)
            or (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "inputs"))


def _is_reward_kwargs(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "reward_kwargs") or (
        isinstance(node, ast.Attribute) and node.attr == "reward_kwargs")


def trl_keywords(source: str) -> set[str]:
    """The names a TRL trainer module passes to reward functions itself (`f(prompts=..., **reward_kwargs)`,
    `reward_kwargs["trainer_state"] = ...`) or reads from, tests in, or leaves out of a dataset row."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            if any(k.arg is None and _is_reward_kwargs(k.value) for k in node.keywords):
                out |= {k.arg for k in node.keywords if k.arg}
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr == "get" and _is_row(func.value) and node.args:
                out |= set(_strings(node.args[0]))
        elif isinstance(node, ast.Subscript) and (_is_reward_kwargs(node.value) or _is_row(node.value)):
            out |= set(_strings(node.slice))
        elif isinstance(node, ast.ListComp | ast.SetComp | ast.DictComp | ast.GeneratorExp):
            for gen in node.generators:
                it = gen.iter
                if isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) and it.func.attr == "items":
                    it = it.func.value
                if _is_row(it):  # `{k: v for k, v in row.items() if k != "environment"}`
                    out |= {s for cond in gen.ifs for cmp in ast.walk(cond) if isinstance(cmp, ast.Compare)
                            for c in cmp.comparators for s in _strings(c)}
        elif isinstance(node, ast.Compare) and any(_is_row(c) for c in node.comparators):  # `"images" in inputs[0]`
            out |= set(_strings(node.left))
    return out


def test_every_name_trl_calls_with_is_reserved_for_task_fields() -> None:
    """A task field named like a keyword TRL passes (or a column it reads) is renamed, not passed twice: fails when a
    TRL release starts passing a name that `RESERVED_COLUMNS` does not cover."""
    pytest.importorskip("trl")
    import importlib.util

    from ors_trl.tasks.selection import RESERVED_COLUMNS
    from ors_trl.trl.adapter import OpenRewardEnvironment
    from ors_trl.trl.backend import TRL_KEYWORDS, async_grpo
    from ors_trl.trl.rewards import group_reward, outcome_reward

    found: set[str] = set()
    spec = importlib.util.find_spec("trl.trainer.grpo_trainer")
    assert spec is not None and spec.origin is not None
    async_trainer = async_grpo()  # its rollout worker, wherever the installed TRL keeps it
    assert async_trainer is not None and async_trainer.worker_module.__file__ is not None
    for origin in (spec.origin, async_trainer.worker_module.__file__):
        found |= trl_keywords(Path(origin).read_text())
    assert {"prompts", "completions", "trainer_state", "log_metric", "environments", "image"} <= found  # still parses
    assert found <= TRL_KEYWORDS, sorted(found - TRL_KEYWORDS)
    own = {name for f in (OpenRewardEnvironment.reset, outcome_reward, group_reward)
           for name, p in inspect.signature(f).parameters.items() if p.kind is not p.VAR_KEYWORD}
    assert TRL_KEYWORDS | own <= RESERVED_COLUMNS, sorted((TRL_KEYWORDS | own) - RESERVED_COLUMNS)


#: What only the turn rule decides: why an episode ends on its own, and why a call is refused locally.
TURN_DECISIONS = {"no_tool_calls", "max_turns", "episode_finished", "max_tool_calls"}


def _code_strings(path: Path) -> set[str]:
    """The string constants of a module's code (docstrings and the values a `Literal[...]` type names left out)."""
    tree = ast.parse(path.read_text())
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    docs |= {id(c) for node in ast.walk(tree) if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name)
             and node.value.id == "Literal" for c in ast.walk(node.slice)}
    return {node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs}


def test_only_the_core_decides_a_turn() -> None:
    """Drivers generate, schedule and say what the model replied (`Episode.reply`); they may stop an episode only
    for what the core cannot see (a token budget: `length`, `context_length`; a deadline). Which calls run, what a
    call after `finished` or past the cap is, and when a reply ends the episode are written in `_episode.py` alone."""
    deciders = sorted(str(p.relative_to(SRC)) for p in PACKAGE.rglob("*.py")
                      if _code_strings(p) & TURN_DECISIONS)
    assert deciders == ["ors_trl/core/episode.py"], deciders


def test_one_rollout_loop() -> None:
    """Every driver that generates (the engine, evaluation, the eval callback through the engine) plays its episodes
    with `core/rollout.py`'s `play` (or `play_task`, which replays a voided episode): it alone hands a model reply to the turn rule (`episode.reply(...)`); TRL's own
    loop replays its transcript through the same rule instead (`Episode.replay`)."""
    callers = sorted(str(p.relative_to(SRC)) for p in PACKAGE.rglob("*.py") for node in ast.walk(ast.parse(p.read_text()))
                     if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "reply"
                     and isinstance(node.func.value, ast.Name) and node.func.value.id in ("ep", "episode"))
    assert callers == ["ors_trl/core/rollout.py"], callers
    players = sorted(str(p.relative_to(SRC)) for p in PACKAGE.rglob("*.py")
                     if {"ors_trl.core.rollout.play", "ors_trl.core.rollout.play_task"} & set(_all_imports(p)))
    # the harness driver: TRL's async worker's rollouts (`Harness.rollout_worker`), one episode each
    assert players == ["ors_trl/evaluation/runner.py", "ors_trl/harness/driver.py", "ors_trl/trl/engine.py"], players


def option_reads(source: str) -> set[str]:
    """The keys read off a spec's options (`rt.options["..."]`, `self._options.get("...")`) in `source`."""
    keys = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Subscript):
            owner, key = node.value, node.slice
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args:
            owner, key = node.func.value, node.args[0]
        else:
            continue
        if isinstance(owner, ast.Attribute) and owner.attr in ("options", "_options") and isinstance(key, ast.Constant):
            keys.add(key.value)
    return keys


def test_every_option_read_is_an_option_of_the_spec() -> None:
    """The runtime keeps the spec's options as one read-only mapping (`EnvironmentRuntime.options`): a mistyped key
    would be a KeyError only when that line runs, so every key read anywhere is checked against the signature here."""
    from ors_trl import OpenRewardSpec

    known = set(inspect.signature(OpenRewardSpec).parameters)
    read = {key: path.name for path in sorted((SRC / "ors_trl").rglob("*.py")) for key in option_reads(path.read_text())}
    assert len(read) >= 20  # the scan finds the readers (the runtime, the engine, the adapter, credit, the spec)
    assert {key: where for key, where in read.items() if key not in known} == {}
    assert option_reads('rt.options["max_turn"]; x = self._options.get("retries"); other["split"]') == {
        "max_turn", "retries"}  # a mistyped read is caught; a dict that is not the options is not read
