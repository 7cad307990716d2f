"""A new user's first hour without a model hub: the tiny model saved locally (`save_tiny_model`, `ors-trl demo
--save-model`), trained by `GRPOTrainer` on CPU and evaluated by `ors-trl eval --model DIR`, against TRL's echo
environment served locally (`TrlEchoEnvironment`: a `train` split only)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

pytest.importorskip("trl")

from ors_trl.testing import ReferenceServer
from tests.fixtures.environments import TrlEchoEnvironment


@pytest.fixture(scope="module")
def trl_echo() -> Iterator[ReferenceServer]:
    """TRL's echo environment alone (its wire key is `echoenvironment`; one split, `train`, of four tasks)."""
    with ReferenceServer([TrlEchoEnvironment]) as server:
        yield server


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from ors_trl.demo import save_tiny_model

    path = tmp_path_factory.mktemp("models") / "tiny-model"
    assert save_tiny_model(path) == str(path)
    return str(path)


def test_saved_tiny_model_trains_with_grpo_on_cpu(tiny_model, trl_echo, tmp_path) -> None:
    """The README's quick start, CPU variant: `GRPOTrainer(model=DIR)` with `GRPOConfig(use_cpu=True)`, two steps."""
    from trl import GRPOConfig, GRPOTrainer

    from ors_trl import OpenRewardSpec

    spec = OpenRewardSpec(trl_echo.url)
    try:
        trainer = GRPOTrainer(
            model=tiny_model, train_dataset=spec.train_dataset, reward_funcs=spec.reward_funcs,
            environment_factory=spec.environment_factory,
            args=GRPOConfig(output_dir=str(tmp_path), use_cpu=True, max_steps=2, per_device_train_batch_size=4,
                            num_generations=2, max_completion_length=32, logging_steps=1, report_to="none",
                            save_strategy="no"))
        trainer.train()
    finally:
        spec.close()
    assert trainer.state.global_step == 2
    assert len([h for h in trainer.state.log_history if "reward" in h]) == 2
    trl_echo.wait_for_stats(lambda s: s["open_sessions"] == 0, timeout=10)


def test_saved_tiny_model_is_what_eval_and_local_policy_load(tiny_model, trl_echo, tmp_path) -> None:
    from ors_trl import LocalPolicy

    policy = LocalPolicy.from_pretrained(tiny_model, device="cpu")
    assert policy.rendering.parse_error is None  # TRL parses its tool calls
    out = tmp_path / "eval.jsonl"
    run = subprocess.run([sys.executable, "-m", "ors_trl", "eval", trl_echo.url, "--model", tiny_model,
                          "--max-new-tokens", "16", "--max-turns", "2", "--no-progress", "--output", str(out),
                          "--json"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert report["num_episodes"] == 4 and report["num_errors"] == 0
    assert len(out.read_text(encoding="utf-8").splitlines()) == 4


def test_demo_on_an_environment_with_only_a_train_split(trl_echo, tmp_path) -> None:
    """`ors-trl demo --env URL` on TRL's echo environment: no `test` split, so the last of its four `train` tasks is
    held out, never trained on, and the run says so; `save_model` saves the trained model where eval loads it."""
    from ors_trl import LocalPolicy
    from ors_trl.demo._main import run_demo

    said: list[str] = []
    result = run_demo(env=trl_echo.url, steps=1, seed=0, output_dir=str(tmp_path), report=True, say=said.append,
                      save_model=str(tmp_path / "model"),
                      config_overrides={"per_device_train_batch_size": 4, "num_generations": 2, "logging_steps": 1})
    assert result.heldout == "the last 1 of the 4 'train' tasks, held out of training (splits: train)"
    assert f"environment has no 'test' split: {result.heldout}" in said
    assert result.before["n"] == result.after["n"] == 1
    records = [json.loads(line) for line in (tmp_path / "episodes.jsonl").read_text(encoding="utf-8").splitlines()]
    assert sum(r["source"] == "trl" for r in records) == 4  # one step: 2 prompts x 2 generations
    assert {r["task_index"] for r in records} <= {0, 1, 2}  # the held-out task is never opened for training
    evaluated = [json.loads(line) for line in (tmp_path / "eval_after.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [(r["split"], r["task_index"]) for r in evaluated] == [("train", 3)]
    assert result.to_json()["saved_model"] == str(tmp_path / "model")
    assert LocalPolicy.from_pretrained(tmp_path / "model", device="cpu").rendering.parse_error is None
    trl_echo.wait_for_stats(lambda s: s["open_sessions"] == 0, timeout=10)


def test_demo_steps_0_saves_the_untrained_tiny_model(tmp_path) -> None:
    """`ors-trl demo --steps 0 --save-model DIR`: the command-line `save_tiny_model` (no server, no training)."""
    run = subprocess.run([sys.executable, "-m", "ors_trl", "demo", "--steps", "0", "--save-model", str(tmp_path / "m")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout == f"model: {tmp_path / 'm'} (untrained)\n"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (tmp_path / "m").iterdir()}
    refused = subprocess.run([sys.executable, "-m", "ors_trl", "demo", "--steps", "0"], capture_output=True, text=True,
                             timeout=300)
    assert refused.returncode == 2 and "--steps must be at least 1 (0 only with --save-model" in refused.stderr
    (tmp_path / "file").write_text("mine")
    refused = subprocess.run([sys.executable, "-m", "ors_trl", "demo", "--save-model", str(tmp_path / "file")],
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "is a file; give a folder" in refused.stderr  # before any work
    assert (tmp_path / "file").read_text() == "mine"
