"""The `ors-trl` command line: help, exit codes, `serve-echo`, the `demo` hook, staying light to import."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import ors_trl.demo
from ors_trl.cli import EXIT_ERROR, EXIT_OK, EXIT_USAGE, main
from ors_trl.testing.server import free_port

SRC = str(Path(__file__).resolve().parents[1] / "src")
ENV = {**os.environ, "PYTHONPATH": SRC, "OPENREWARD_DISABLE_UPDATE_CHECK": "1"}


@pytest.mark.parametrize("command", [[], ["inspect"], ["eval"], ["report"], ["serve-echo"]])
def test_help(command, capsys) -> None:
    with pytest.raises(SystemExit) as exc:  # argparse's own --help exit, before main's handler...
        from ors_trl.cli import build_parser

        build_parser().parse_args([*command, "--help"])
    assert exc.value.code == 0
    assert main([*command, "--help"]) == EXIT_OK  # ...which main turns into a return code
    out = capsys.readouterr().out
    assert "exit codes:" in out and "130" in out
    assert "usage: ors-trl" in out
    # the epilog names the escapes it means; it does not send ESC and U+202E to the terminal itself
    assert "(\\x1b, \\u202e)" in out and not any(c in out for c in ("\x1b", "\u202e"))


def test_python_m_help() -> None:
    result = subprocess.run([sys.executable, "-m", "ors_trl", "--help"], env=ENV, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0
    for word in ("inspect", "eval", "serve-echo", "demo", "exit codes"):
        assert word in result.stdout


def test_import_stays_light() -> None:
    code = ("import sys, ors_trl, ors_trl.cli, ors_trl.evaluation.runner, ors_trl.cli.inspect; "
            "print(json.dumps([m for m in ('torch', 'transformers', 'trl', 'datasets', 'openreward') "
            "if m in sys.modules]))")
    result = subprocess.run([sys.executable, "-c", "import json; " + code], env=ENV, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []


@pytest.mark.parametrize("argv", [
    [],
    ["frobnicate"],
    ["inspect"],
    ["inspect", "http://127.0.0.1:1", "--tasks", "x"],
    ["eval", "http://127.0.0.1:1"],  # --model is required
    ["eval", "http://127.0.0.1:1", "--model", "m", "--num-tasks", "2", "--indices", "1"],
    ["eval", "http://127.0.0.1:1", "--model", "m", "--indices", "1,x"],
    ["eval", "http://127.0.0.1:1", "--model", "m", "--concurrency", "0"],
    ["inspect", "http://127.0.0.1:1", "--difficulty", "--difficulty-filter", "min_model_params=x"],  # not a traceback
])
def test_usage_errors_exit_2(argv, capsys) -> None:
    assert main(argv) == EXIT_USAGE


def test_bad_targets(ref_server, capsys, tmp_path, monkeypatch) -> None:
    assert main(["inspect", "not a target"]) == EXIT_USAGE
    assert "neither a URL" in capsys.readouterr().err
    monkeypatch.delenv("OPENREWARD_API_KEY", raising=False)
    assert main(["inspect", "Owner/Env"]) == EXIT_USAGE
    assert "OPENREWARD_API_KEY" in capsys.readouterr().err
    # An unknown environment is a runtime error; the message lists what the server has.
    assert main(["inspect", ref_server.url, "--env-name", "nope"]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "'nope'" in err and "echoenvironment" in err and "sparseenvironment" in err
    model = tmp_path / "model"
    model.mkdir()
    args = ["eval", ref_server.url, "--env-name", "nope", "--model", str(model), "--no-progress"]
    assert main(args) == EXIT_ERROR
    assert "echoenvironment" in capsys.readouterr().err
    # A missing split is an environment error too, and names the real splits.
    assert main(["inspect", ref_server.url, "--env-name", "echoenvironment", "--split", "dev"]) == EXIT_ERROR
    assert "available splits: train, test" in capsys.readouterr().err


def test_eval_argument_checks(ref_server, capsys) -> None:
    base = ["eval", ref_server.url, "--env-name", "echoenvironment"]
    assert main([*base, "--model", "/definitely/not/a/dir"]) == EXIT_USAGE
    assert "not a local model directory" in capsys.readouterr().err
    assert main([*base, "--model", "m", "--base-url", "http://127.0.0.1:1/v1", "--resume"]) == EXIT_USAGE
    assert "--resume needs --output" in capsys.readouterr().err
    assert main([*base, "--model", "m", "--base-url", "not-a-url"]) == EXIT_USAGE
    ref_server.wait_for_stats(lambda s: s["open_sessions"] == 0, timeout=10)


def test_demo_hook(monkeypatch, capsys) -> None:
    monkeypatch.delattr(ors_trl.demo, "main", raising=False)
    assert main(["demo", "--steps", "3"]) == EXIT_ERROR
    assert "not available" in capsys.readouterr().err
    seen = []
    monkeypatch.setattr(ors_trl.demo, "main", lambda argv: seen.append(argv) or 0, raising=False)
    assert main(["demo", "--steps", "3", "--help"]) == EXIT_OK
    assert seen == [["--steps", "3", "--help"]]


def test_serve_echo_needs_openreward(monkeypatch, capsys) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "openreward" else real(name, *a))
    assert main(["serve-echo", "--port", "1"]) == EXIT_USAGE
    assert "pip install 'ors-trl[demo]'" in capsys.readouterr().err


def test_serve_echo_says_the_card_environment_needs_pillow(monkeypatch, capsys) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "PIL" else real(name, *a))
    assert main(["serve-echo", "--port", "1", "--envs", "echo,card"]) == EXIT_ERROR
    assert "cannot serve card: the card environment draws its cards with Pillow" in capsys.readouterr().err


def test_serve_echo_rejects_non_loopback(capsys) -> None:
    assert main(["serve-echo", "--port", str(free_port()), "--host", "0.0.0.0"]) == EXIT_USAGE


def test_serve_echo_serves_and_stops(capsys) -> None:
    from tests.fixtures.environments import listed_environments

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ors_trl", "serve-echo", "--port", str(port), "--envs", "echo,card"],
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert listed_environments(proc, port) == ["echoenvironment", "cardenvironment"]
        assert main(["inspect", f"http://127.0.0.1:{port}", "--json", "--tasks", "1"]) == EXIT_OK
        info = json.loads(capsys.readouterr().out)
        assert info["environment"] == "echoenvironment" and info["tasks"][0]["task"]["target"] == "hello"
        # the bundled visual environment: inspect says its prompt and `look` carry images, `say` none
        assert main(["inspect", f"http://127.0.0.1:{port}", "--env-name", "cardenvironment", "--call", "look",
                     "--call", 'say={"text": "cat"}']) == EXIT_OK
        out = capsys.readouterr().out
        assert "Images in the probed prompt (1): image/png 56x28" in out
        assert "Tool output of look({}): blocks [text, image]; images (1): image/png 56x28" in out
        assert re.search(r"Tool output of say\(.*\): blocks \[text\]; images \(0\): none", out)
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert f"http://127.0.0.1:{port}" in err
