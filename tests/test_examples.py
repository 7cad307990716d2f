"""The scripts under `examples/` run as a user would run them: one GRPO step each, tiny local model.

Each runs in its own interpreter against private reference servers; the catalog example reaches a
loopback server through `OPENREWARD_URL` (the platform override) with a dummy key. What is checked is
what the scripts promise: the run finishes, sessions were opened for every rollout and all closed,
environment metrics reach the trainer's log, and episode logs are written where the script says.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
RUN_LIMIT_S = 240  # liveness bound for one subprocess, not a performance threshold


def _run(script: str, args: list[str], cwd: Path, extra_env: dict[str, str] | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENREWARD_") or k.endswith("UPDATE_CHECK")}
    env.update({"OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1", **(extra_env or {}),
                "PYTHONPATH": os.pathsep.join([str(EXAMPLES.parent / "src"), env.get("PYTHONPATH", "")])})  # this tree's
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=RUN_LIMIT_S)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script} failed:\n{out[-6000:]}"
    return out


def _logged_keys(out: str) -> set[str]:
    """Keys of the dicts the trainer printed at each log (`logging_steps=1`)."""
    keys: set[str] = set()
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("{'loss'") and line.endswith("}"):
            keys |= set(ast.literal_eval(line))
    return keys


def _one_step(model: str, out_dir: Path) -> list[str]:
    return ["--model", model, "--max-steps", "1", "--max-completion-length", "64", "--num-tasks", "4",
            "--output-dir", str(out_dir)]


def test_train_url_example(make_server, tiny_model_dir, tmp_path) -> None:
    server = make_server(envs="demo")
    out = _run("train_url.py", [server.url, *_one_step(tiny_model_dir, tmp_path / "out")], cwd=tmp_path)
    stats = server.stats()
    assert stats["setups"] >= 8  # one session per rollout (8 = the default per-device batch) + the tool probe
    assert stats["open_sessions"] == 0
    assert any(k.startswith("env/") and k.endswith("/episodes") for k in _logged_keys(out)), out[-3000:]


def test_train_catalog_example(make_server, tiny_model_dir, tmp_path) -> None:
    server = make_server(envs="demo")
    platform = {"OPENREWARD_URL": server.url, "OPENREWARD_API_KEY": "sk-example-dummy"}
    out = _run("train_catalog.py", ["acme/demo", *_one_step(tiny_model_dir, tmp_path / "out")], cwd=tmp_path,
               extra_env=platform)
    assert server.stats()["open_sessions"] == 0
    episodes = [json.loads(line) for line in (tmp_path / "episodes.jsonl").read_text().splitlines()]
    assert len(episodes) == 8  # num_generations=8 rollouts of one task in the one step
    assert len({ep["task_index"] for ep in episodes}) == 1
    assert "sk-example-dummy" not in out and "sk-example-dummy" not in (tmp_path / "episodes.jsonl").read_text()


def test_train_mix_example(make_server, tiny_model_dir, tmp_path) -> None:
    demo, sparse = make_server(envs="demo"), make_server(envs="sparse")
    args = [demo.url, sparse.url, "--weights", "0.5", "0.5", *_one_step(tiny_model_dir, tmp_path / "out")]
    out = _run("train_mix.py", args, cwd=tmp_path)
    assert demo.stats()["open_sessions"] == 0 and sparse.stats()["open_sessions"] == 0
    episodes = [json.loads(line) for line in (tmp_path / "episodes.jsonl").read_text().splitlines()]
    assert len(episodes) == 8
    (name,) = {ep["environment"] for ep in episodes}  # one task per step: its 8 rollouts share one environment
    assert any(k.startswith(f"env/{name}/") for k in _logged_keys(out)), out[-3000:]


def test_train_agent_example(make_server, tiny_model_dir, tmp_path) -> None:
    import pytest

    pytest.importorskip("agents")  # the `harness` extra
    server = make_server(envs="echo")
    args = [server.url, "--env-name", "echoenvironment", "--eval-tasks", "2"]
    out = _run("train_agent.py", [*args, *_one_step(tiny_model_dir, tmp_path / "out")], cwd=tmp_path)
    stats = server.stats()
    assert stats["setups"] >= 2 + 8 and stats["open_sessions"] == 0  # the eval's episodes, then the step's rollouts
    assert "mean reward" in out  # the evaluation's summary
    assert "env/echoenvironment/episodes" in _logged_keys(out), out[-3000:]
