"""What a new user sees when something goes wrong: one line `ors-trl COMMAND: error: ...` with a documented exit code
(a missing extra 2, an environment failure 1, Ctrl-C 130), a traceback only with --debug; a core-only install
(no extras) whose `inspect` and `eval --base-url` work and whose other entry points name their extra; `--help`
without control characters; keywords as flags on the command line and as keywords in Python."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tomllib
import unicodedata
from pathlib import Path

import pytest

from ors_trl.cli import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, build_parser, main
from ors_trl.testing.server import free_port

ROOT = Path(__file__).resolve().parents[1]
SRC = str(ROOT / "src")
ECHO = "echoenvironment"
#: Bounds every subprocess (the demo one trains a tiny model for a step on 2 shared cores).
LIMIT_S = 300


def _controls(text: str) -> list[str]:
    return [hex(ord(c)) for c in text if c != "\n" and unicodedata.category(c) in ("Cc", "Cf")]


def _commands() -> list[str]:
    import argparse

    parser = build_parser()
    return list(next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices)


@pytest.mark.parametrize("command", [[], *([c] for c in _commands())])
def test_every_help_writes_no_control_character(command, capsys) -> None:
    assert main([*command, "--help"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "usage: ors-trl" in out
    assert _controls(out) == []


def _run(*argv: str, env: dict[str, str] | None = None, cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": SRC, "OPENREWARD_DISABLE_UPDATE_CHECK": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "ors_trl", *argv], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=LIMIT_S)


def _one_line(err: str, command: str) -> str:
    """The error line, checked to be the only line and without a traceback."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ors-trl {command}: error: "), err[-3000:]
    return lines[0]


def test_a_wrong_port_and_a_missing_split_are_one_line(ref_server, tmp_path) -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    out = _run("inspect", closed, "--retries", "0")
    assert out.returncode == EXIT_ERROR
    assert "cannot connect" in _one_line(out.stderr, "inspect")
    policy = ["--base-url", f"{closed}/v1", "--model", "m", "--no-progress"]
    out = _run("eval", closed, "--retries", "0", *policy)
    assert out.returncode == EXIT_ERROR
    assert "cannot connect" in _one_line(out.stderr, "eval")
    out = _run("eval", ref_server.url, "--env-name", ECHO, "--split", "dev", *policy, cwd=str(tmp_path))
    assert out.returncode == EXIT_ERROR
    assert "available splits: train, test" in _one_line(out.stderr, "eval")


def test_the_demo_on_a_wrong_port_is_one_line(capsys) -> None:
    assert main(["demo", "--env", f"http://127.0.0.1:{free_port()}", "--quiet"]) == EXIT_ERROR
    assert "cannot connect" in _one_line(capsys.readouterr().err, "demo")


def test_an_unexpected_error_is_one_line_and_debug_shows_the_traceback(monkeypatch, capsys) -> None:
    import ors_trl.cli.inspect

    def broken(*args, **kwargs):
        raise RuntimeError("boom\non two lines")

    monkeypatch.setattr(ors_trl.cli.inspect, "inspect_target", broken)
    assert main(["inspect", "http://127.0.0.1:1"]) == EXIT_ERROR
    line = _one_line(capsys.readouterr().err, "inspect")
    assert line == ("ors-trl inspect: error: RuntimeError: boom on two lines (--debug or ORS_TRL_DEBUG=1 shows the "
                    "traceback)")
    for argv, env in ((["--debug", "inspect"], "0"), (["inspect", "--debug"], "0"), (["inspect"], "1")):
        monkeypatch.setenv("ORS_TRL_DEBUG", env)
        assert main([*argv, "http://127.0.0.1:1"]) == EXIT_ERROR
        err = capsys.readouterr().err
        assert "Traceback (most recent call last)" in err and "RuntimeError: boom" in err
        assert err.strip().splitlines()[-1] == "ors-trl inspect: error: RuntimeError: boom on two lines"


def test_the_demo_takes_debug_too(monkeypatch, capsys) -> None:
    import ors_trl.demo

    seen = []

    def broken(argv):
        seen.append(argv)
        raise RuntimeError("boom")

    monkeypatch.setattr(ors_trl.demo, "main", broken)
    monkeypatch.delenv("ORS_TRL_DEBUG", raising=False)
    assert main(["demo", "--steps", "1"]) == EXIT_ERROR
    assert "Traceback" not in capsys.readouterr().err
    assert main(["demo", "--debug", "--steps", "1"]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.strip().endswith("RuntimeError: boom")
    assert seen == [["--steps", "1"], ["--steps", "1"]]  # --debug is the command line's, not the demo's


def test_errors_name_flags_on_the_command_line(ref_server, tmp_path, capsys) -> None:
    """The evaluation's own message says `resume=True` in Python; the command line says `--resume`."""
    out = tmp_path / "episodes.jsonl"
    out.write_text("{}\n")
    args = ["eval", ref_server.url, "--env-name", ECHO, "--base-url", "http://127.0.0.1:9/v1", "--model", "m",
            "--output", str(out), "--no-progress"]
    assert main(args) == EXIT_USAGE
    line = _one_line(capsys.readouterr().err, "eval")
    assert "pass --resume to continue it or --overwrite" in line and "=True" not in line
    assert main(["eval", ref_server.url, "--env-name", "nope", *args[4:-3], "--no-progress"]) == EXIT_ERROR
    line = _one_line(capsys.readouterr().err, "eval")
    assert "as --env-name" in line and "env_name=" not in line
    assert main(["inspect", ref_server.url, "--no-probe", "--tasks", "0"]) == EXIT_OK  # the server hosts several
    err = capsys.readouterr().err
    assert "Pass --env-name to choose" in err and "env_name=" not in err
    from ors_trl.cli import _as_flags

    eval_parser = build_parser()._subparsers._group_actions[0].choices["eval"]
    assert _as_flags("pass num_tasks=N or indices=[...]; api_key= and difficulty_from= stay, as does x=3",
                     eval_parser) == "pass --num-tasks N or --indices LIST; api_key= and difficulty_from= stay, as does x=3"
    from ors_trl import ConfigurationError, OpenRewardSpec

    with pytest.raises(ConfigurationError, match=r"pass resume=True"):
        OpenRewardSpec(ref_server.url, env_name=ECHO).evaluate(object(), output=str(out))


def test_no_progress_hides_the_task_fetch_bar_of_scattered_indices(ref_server, capsys) -> None:
    from tests.test_eval import FakeOpenAI

    endpoint = FakeOpenAI().start()
    try:
        for flags, shown in (([], True), (["--no-progress"], False)):
            assert main(["eval", ref_server.url, "--env-name", "slowenvironment", "--indices", "0,20,40,60,80,100",
                         "--base-url", endpoint.url, "--model", "m", *flags]) == EXIT_OK
            assert ("tasks from slowenvironment" in capsys.readouterr().err) is shown
    finally:
        endpoint.stop()


def test_a_mistyped_keyword_names_the_closest_one() -> None:
    from ors_trl import ConfigurationError, OpenAIPolicy, OpenRewardMix, OpenRewardSpec

    with pytest.raises(ConfigurationError, match=r"OpenRewardSpec\(\): unknown keyword 'num_task' \(did you mean "
                                                 r"'num_tasks'\?\)$") as caught:
        OpenRewardSpec("http://127.0.0.1:1", num_task=4)
    assert isinstance(caught.value, TypeError)  # what Python's own would be
    with pytest.raises(TypeError, match=r"OpenRewardMix\(\): unknown keyword 'weight' \(did you mean 'weights'\?\)"):
        OpenRewardMix([], weight=[1.0])
    with pytest.raises(TypeError, match=r"unknown keyword 'zzz'; the keywords are: api_key, "):
        OpenAIPolicy("http://127.0.0.1:1/v1", "m", zzz=1)


def test_trls_unscored_rollout_warning_is_one_line_pointing_at_unscored_reward(tiny_model_dir, ref_server, tmp_path,
                                                                                caplog, monkeypatch) -> None:
    """An untrained model calls no tool: the echo environment scores nothing, and TRL warns with the whole prompt and
    completion for each such rollout at every step. With ors-trl's reward functions it is one line of ours, once."""
    import logging

    from ors_trl import OpenRewardSpec
    from ors_trl.trl import rewards
    from tests.fixtures.generation import cpu_grpo_trainer

    caplog.set_level(logging.WARNING)
    # Earlier tests may have quieted these loggers (`main()`, a server's logging config): hear them whatever they did.
    for logger in (logging.getLogger("ors_trl"), *map(logging.getLogger, rewards._TRL_LOGGERS)):
        for name, value in (("propagate", True), ("disabled", False), ("level", logging.WARNING)):
            monkeypatch.setattr(logger, name, value)
    rewards._say_unscored.cache_clear()
    spec = OpenRewardSpec(ref_server.url, env_name=ECHO, num_tasks=2)
    try:
        trainer = cpu_grpo_trainer(tiny_model_dir, str(tmp_path), batch=2, generations=2, turns=1,
                                   completion_length=8, spec=spec, config={"max_steps": 2})
        trainer.train()
    finally:
        spec.close()
    assert not [r for r in caplog.records if "All reward functions returned None" in r.getMessage()]
    ours = {id(r): r.getMessage() for r in caplog.records if "unscored_reward=0.0" in r.getMessage()}  # log calls
    assert len(ours) == 1 and "\n" not in next(iter(ours.values()))


@pytest.mark.slow
def test_ctrl_c_during_grpo_is_one_line_and_leaves_no_orphan(tmp_path) -> None:
    """A real SIGINT at the demo's first GRPO step: exit 130, one line, no traceback; the demo's own loopback server
    is gone with its sessions, and `ors-trl cleanup` there finds nothing to keep (exit 0)."""
    code = ("import os, signal, sys, time, trl\n"
            "def step(*args, **kwargs):\n"
            "    signal.raise_signal(signal.SIGINT)\n"
            "    time.sleep(60)\n"
            "trl.GRPOTrainer.training_step = step\n"
            "from ors_trl.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    env = {**os.environ, "PYTHONPATH": SRC, "OPENREWARD_DISABLE_UPDATE_CHECK": "1"}
    out = subprocess.run([sys.executable, "-c", code, "demo", "--task", "echo", "--steps", "3", "--sft-steps", "1",
                          "--quiet", "--no-report", "--output-dir", str(tmp_path / "out")],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=LIMIT_S)
    assert out.returncode == EXIT_INTERRUPTED, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == "ors-trl demo: interrupted", out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "KeyboardInterrupt" not in out.stderr
    cleanup = _run("cleanup", "--json", cwd=str(tmp_path))
    assert cleanup.returncode == EXIT_OK, cleanup.stderr
    assert json.loads(cleanup.stdout)["failed"] == 0
    left = list((tmp_path / ".ors-trl" / "sessions").glob("*"))
    assert left == []


def test_serve_echo_log_level_error_logs_no_request(tmp_path) -> None:
    from tests.fixtures.environments import listed_environments

    port = free_port()
    env = {**os.environ, "PYTHONPATH": SRC, "OPENREWARD_DISABLE_UPDATE_CHECK": "1"}
    env.pop("OPENREWARD_LOG_LEVEL", None)
    proc = subprocess.Popen([sys.executable, "-m", "ors_trl", "serve-echo", "--port", str(port), "--log-level", "error"],
                            env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert listed_environments(proc, port) == [ECHO]
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_OK, err
    assert "request_handled" not in out + err and "info" not in (out + err).lower()


# -- a core-only install -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def core_venv(tmp_path_factory) -> Path:
    """A virtual environment holding ors-trl (editable) and only its core requirements (pyproject.toml's
    `dependencies`): no torch, transformers, TRL, datasets, openreward, matplotlib or Pillow. Built once."""
    venv = tmp_path_factory.mktemp("core") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=LIMIT_S)
    core = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                          "--no-deps", "-e", str(ROOT)], capture_output=True, text=True, timeout=LIMIT_S)
    if pip.returncode == 0:
        pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                              "--disable-pip-version-check", *core], capture_output=True, text=True, timeout=LIMIT_S)
    if pip.returncode != 0:  # no package index and no wheel cache: nothing to build the venv from
        pytest.skip(f"cannot build a core-only virtual environment: {pip.stderr.strip()[-500:]}")
    return venv


def _core(venv: Path, *argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(cwd), "OPENREWARD_DISABLE_UPDATE_CHECK": "1"}
    return subprocess.run([str(venv / "bin" / argv[0]), *argv[1:]], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=LIMIT_S)


def test_a_core_install_inspects_evaluates_and_names_the_extras(core_venv, ref_server, tmp_path) -> None:
    from tests.test_eval import FakeOpenAI

    installed = _core(core_venv, "python", "-c", "import importlib.util as u; print([m for m in ('torch', "
                      "'transformers', 'trl', 'datasets', 'openreward', 'matplotlib', 'PIL') if u.find_spec(m)])",
                      cwd=tmp_path)
    assert installed.stdout.strip() == "[]", installed.stderr
    out = _core(core_venv, "ors-trl", "inspect", ref_server.url, "--env-name", ECHO, "--tasks", "1", cwd=tmp_path)
    assert out.returncode == EXIT_OK, out.stderr
    assert "echo" in out.stdout and out.stderr == ""
    endpoint = FakeOpenAI().start()
    try:
        out = _core(core_venv, "ors-trl", "eval", ref_server.url, "--env-name", ECHO, "--base-url", endpoint.url,
                    "--model", "m", "--num-tasks", "2", "--json", "--no-progress", cwd=tmp_path)
    finally:
        endpoint.stop()
    assert out.returncode == EXIT_OK, out.stderr
    report = json.loads(out.stdout)
    assert report["num_episodes"] == 2 and report["num_errors"] == 0 and report["mean_reward"] == 1.0
    assert out.stderr == ""  # no "TRL ? is not a version ..." warning, no import error
    (tmp_path / "model").mkdir()
    for argv, extra in ((["demo"], "demo"), (["demo", "--env", ref_server.url], "demo"), (["report", "x"], "report"),
                        (["eval", ref_server.url, "--model", str(tmp_path / "model")], "trl"),
                        (["serve-echo", "--port", "1"], "demo")):
        out = _core(core_venv, "ors-trl", *argv, cwd=tmp_path)
        assert out.returncode == EXIT_USAGE, (argv, out.stderr)
        assert f"pip install 'ors-trl[{extra}]'" in _one_line(out.stderr, argv[0]), argv
    # in Python: what needs TRL says which extra, never "TRL None is installed"
    code = ("import logging, sys; logging.basicConfig()\n"
            "from ors_trl import MissingExtraError, OpenRewardSpec\n"
            f"spec = OpenRewardSpec({ref_server.url!r}, env_name={ECHO!r}, num_tasks=2)\n"
            "for name in ('train_dataset', 'rollout_func'):\n"
            "    try:\n"
            "        getattr(spec, name)\n"
            "    except MissingExtraError as exc:\n"
            "        print(name, exc.extra, exc)\n"
            "spec.close()\n")
    out = _core(core_venv, "python", "-c", code, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("train_dataset trl spec.train_dataset needs datasets") and lines[0].endswith(
        "pip install 'ors-trl[trl]'")
    assert lines[1].startswith("rollout_func trl spec.rollout_func needs torch, transformers, trl")
    assert "TRL" not in out.stderr
