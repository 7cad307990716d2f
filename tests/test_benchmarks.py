"""Every script under `benchmarks/` still starts: `--help` answers, and every name it imports from ors-trl or the
test fixtures, also inside functions, still exists.

No benchmark runs in the suite (they measure; they do not assert), so a rename in the package could break one
unnoticed until someone measured again. All scripts are checked in one child interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py"))
RUN_LIMIT_S = 300  # liveness bound for the one interpreter, not a performance threshold

# Runs in a child interpreter: {script: {"help": exit status, "usage": bool, "missing": [...], "error": str}}.
_CHECK = r"""
import ast, contextlib, importlib, io, json, runpy, sys, traceback
out = {}
for path in sys.argv[1:]:
    entry = out.setdefault(path.rsplit("/", 1)[-1], {"help": None, "usage": False, "missing": [], "error": ""})
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] in ("ors_trl", "tests"):
            try:
                module = importlib.import_module(node.module)
            except Exception as exc:
                entry["missing"].append(f"{node.module} ({type(exc).__name__}: {exc})")
                continue
            for alias in node.names:
                if hasattr(module, alias.name):
                    continue
                try:
                    importlib.import_module(f"{node.module}.{alias.name}")
                except ImportError:
                    entry["missing"].append(f"{node.module}.{alias.name}")
    sys.argv = [path, "--help"]
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            runpy.run_path(path, run_name="__main__")
        entry["help"] = 0
    except SystemExit as exc:
        entry["help"] = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        entry["error"] = traceback.format_exc()[-3000:]
    entry["usage"] = "usage:" in buffer.getvalue()
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def checked() -> dict[str, dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _CHECK, *(str(ROOT / "benchmarks" / s) for s in SCRIPTS)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_LIMIT_S)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"the checking interpreter failed:\n{(proc.stdout + proc.stderr)[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def test_every_benchmark_is_checked(checked: dict[str, dict]) -> None:
    assert len(SCRIPTS) >= 9 and set(checked) == set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_starts(checked: dict[str, dict], script: str) -> None:
    entry = checked[script]
    assert not entry["missing"], f"{script} imports names that no longer exist: {entry['missing']}"
    assert not entry["error"], f"{script} --help crashed:\n{entry['error']}"
    assert entry["help"] == 0 and entry["usage"], f"{script} --help did not print its usage (exit {entry['help']})"
