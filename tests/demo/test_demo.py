"""The demo's end-to-end path (`ors-trl demo`): real GRPO steps through OpenRewardSpec against the reference server."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("trl")


def test_a_few_grpo_steps_through_the_spec(make_server, tmp_path) -> None:
    from ors_trl.demo._main import run_demo

    server = make_server("demo")
    result = run_demo(url=server.url, steps=4, sft_steps=40, seed=0, output_dir=str(tmp_path),
                      config_overrides={"logging_steps": 1})
    logs = [h for h in result.log_history if "reward" in h]
    assert len(logs) == 4
    # the model called the environment's tool during training, and TRL saw those calls
    assert all(h["tools/call_frequency"] > 0.5 for h in logs)
    assert all(h["env/demoenvironment/tool_calls"] > 0 for h in logs)
    # rewards came back through spec.reward_funcs (TRL names the column after it) and from the environment itself
    assert all("rewards/outcome_reward/mean" in h for h in logs)
    assert all(h["env/demoenvironment/graded_fraction"] > 0.5 for h in logs)
    stats = server.stats()
    training_calls = sum(h["env/demoenvironment/tool_calls"] for h in logs)
    assert stats["tool_calls"]["demoenvironment/echo"] >= training_calls  # (the evaluations add their own calls)
    # the warm start taught the format: the held-out evaluation makes calls before any GRPO step
    assert result.before["tool_call_rate"] > 0.5
    assert set(result.to_json()) >= {"success_before", "success_after", "tool_call_rate_after",
                                     "tool_failure_rate_after", "seconds"}
    assert stats["open_sessions"] == 0  # nothing left open on the server after training and evaluation


def test_cli_json_contract(tmp_path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ors_trl", "demo", "--steps", "2", "--sft-steps", "10", "--json", "--quiet",
         "--output-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    for key in ("success_before", "success_after", "tool_call_rate_after", "tool_failure_rate_after", "seconds"):
        assert isinstance(result[key], int | float), key
    assert result["steps"] == 2
    assert "held-out success rate" in out.stdout  # the before/after table precedes the JSON line
