"""Environment metrics and episode records, checked against what the test environments actually did."""

from __future__ import annotations

import concurrent.futures
import json

import pytest

from ors_trl import OpenRewardMix, OpenRewardSpec, ToolError
from ors_trl.core.metrics import EnvMetrics, _percentile
from ors_trl.core.records import RecordWriter


def strip(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "environment"}


def test_metric_values_match_what_the_environments_did(ref_server, tmp_path) -> None:
    log = tmp_path / "episodes.jsonl"
    mix = OpenRewardMix({
        "echo": OpenRewardSpec(ref_server.url, env_name="echoenvironment", num_tasks=4),
        "math": OpenRewardSpec(ref_server.url, env_name="sparseenvironment", num_tasks=2),
    }, episode_log=str(log))
    ds = mix.train_dataset
    echo_rows = [strip(r) for r in ds if r["environment"] == "echo"]
    math_rows = [strip(r) for r in ds if r["environment"] == "math"]
    mix.metrics.flush()  # start from a clean window (discovery sessions were recorded as opens)

    echo = [mix.environment_factory["echo"]() for _ in range(4)]
    for env, row in zip(echo, echo_rows, strict=True):
        env.reset(**row)
    echo[0].echo(text=echo_rows[0]["target"])  # 1.0, finished
    echo[1].echo(text=echo_rows[1]["target"])  # 1.0, finished
    echo[2].echo(text="wrong")  # 0.0
    # echo[3] makes no call: not graded

    math = [mix.environment_factory["math"]() for _ in range(2)]
    for env, row in zip(math, math_rows, strict=True):
        env.reset(**row)
    math[0].calculator(expression="1+1")  # unscored
    math[0].submit(answer=math_rows[0]["a"] + math_rows[0]["b"])  # 1.0, finished
    with pytest.raises(ToolError):
        math[1].calculator(expression="import os")  # the tool raises: "failed"
    with pytest.raises(ToolError):
        math[1].submit(answer="x")  # refused: input_validation

    # finished episodes release their sessions right away (in the background): let those closes land
    for spec in mix.specs.values():
        concurrent.futures.wait(list(spec._runtime._pending), timeout=30)
    logged: dict[str, float] = {}
    rewards = mix.reward_funcs(echo + math, log_metric=lambda name, value: logged.__setitem__(name, value))
    assert rewards == [1.0, 1.0, 0.0, None, 1.0, None]

    assert logged["env/echo/episodes"] == 4
    assert logged["env/echo/reward_mean"] == pytest.approx(2 / 3)
    assert logged["env/echo/graded_fraction"] == pytest.approx(3 / 4)
    assert logged["env/echo/finished_fraction"] == pytest.approx(2 / 4)
    assert logged["env/echo/tool_calls_per_episode"] == pytest.approx(3 / 4)
    assert logged["env/echo/failures/refused"] == 0 and logged["env/echo/failures/failed"] == 0
    assert logged["env/math/episodes"] == 2
    assert logged["env/math/reward_mean"] == 1.0
    assert logged["env/math/graded_fraction"] == 0.5
    assert logged["env/math/tool_calls_per_episode"] == 2.0
    assert logged["env/math/failures/failed"] == 1
    assert logged["env/math/failures/refused"] == 1
    for env in ("echo", "math"):
        assert logged[f"env/{env}/session_open_s/p50"] > 0
        assert logged[f"env/{env}/session_open_s/p95"] >= logged[f"env/{env}/session_open_s/p50"]
        assert logged[f"env/{env}/tool_call_s/p95"] >= logged[f"env/{env}/tool_call_s/p50"] > 0
    # still open: the two unfinished echo episodes and the unfinished math one
    assert logged["env/echo/sessions_open"] == 2 and logged["env/math/sessions_open"] == 1
    # over all environments
    assert logged["env/episodes"] == 6
    assert logged["env/reward_mean"] == pytest.approx(3 / 4)
    assert logged["env/graded_fraction"] == pytest.approx(4 / 6)

    # nothing is counted twice: a second flush without new activity reports no episodes
    again: dict[str, float] = {}
    mix.reward_funcs(echo + math, log_metric=lambda name, value: again.__setitem__(name, value))
    assert "env/echo/episodes" not in again

    # episode records: one line per episode, with what happened
    mix.close()
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(lines) == 6
    assert all(r["version"] == 3 and r["source"] == "trl" for r in lines)
    first = next(r for r in lines if r["environment"] == "echo" and r["task_index"] == echo_rows[0]["task_index"])
    assert first["reward"] == 1.0 and first["finished"] is True and first["end_reason"] == "finished"
    (call,) = [c for t in first["turns"] for c in t["tool_calls"]]
    assert call["name"] == call["remote_name"] == "echo" and call["arguments"] == {"text": echo_rows[0]["target"]}
    assert call["reward"] == 1.0 and call["metadata"] == {"target_length": len(echo_rows[0]["target"])}
    assert echo_rows[0]["target"] in first["prompt"]
    failed = next(r for r in lines if r["environment"] == "math" and r["reward"] is None)
    assert [c["error"]["kind"] for t in failed["turns"] for c in t["tool_calls"]] == ["failed", "refused"]
    assert failed["unscored"] == "no_reward"
    unscored = next(r for r in lines if r["environment"] == "echo" and r["tool_calls"] == 0)
    assert unscored["reward"] is None and unscored["unscored"] == "no_reward"


def test_record_writer_is_bounded(tmp_path) -> None:
    rec = RecordWriter(tmp_path / "e.jsonl", max_bytes=900, max_text=50)
    for i in range(20):
        rec.write({"environment": "x", "task_index": i, "prompt": "p" * 500,
                   "turns": [{"assistant": "a" * 500, "tool_calls": [{"output": "o" * 500}]}]})
    text = (tmp_path / "e.jsonl").read_text()
    assert len(text.encode()) <= 900
    assert rec.written >= 1 and rec.dropped == 20 - rec.written
    first = json.loads(text.splitlines()[0])
    assert len(first["prompt"]) < 120 and "50 of 500 characters shown" in first["prompt"]
    turn = first["turns"][0]
    assert "50 of 500" in turn["assistant"] and "50 of 500" in turn["tool_calls"][0]["output"]


def test_percentiles_and_window_reset() -> None:
    assert _percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    m = EnvMetrics()
    m._count("a", "call_latency", 0.1, calls=1)
    m._count("a", "call_latency", 0.3, "expired", calls=1)
    m._record_episode("a", {"reward": None, "finished": False, "tool_calls": 2, "unscored": "cut_off"})
    out = m.flush()
    assert out["env/a/failures/expired"] == 1 and out["env/a/graded_fraction"] == 0
    assert out["env/a/unscored/cut_off"] == 1 and out["env/a/unscored/no_reward"] == 0
    assert out["env/a/tool_call_s/p50"] == pytest.approx(0.2)
    assert m.flush() == {}


def test_terminal_tool_calls_are_counted_apart_from_the_models_tool_calls(ref_server) -> None:
    """QuizEnvironment grades the final message with a hidden terminal tool: four episodes where the model called
    nothing are 0 tool calls (as tool_calls_per_episode says) and 4 terminal calls; one lookup is 1 tool call."""
    spec = OpenRewardSpec(ref_server.url, env_name="quizenvironment")
    rows = list(spec.train_dataset)
    spec.metrics.flush()
    envs = [spec.environment_factory() for _ in rows]
    for env, row in zip(envs, rows, strict=True):
        env.reset(**row)
    envs[0].lookup(country=rows[0]["country"])
    logged: dict[str, float] = {}
    finals = [[{"role": "assistant", "content": row["capital"]}] for row in rows]
    rewards = spec.reward_funcs(environments=envs, completions=finals, log_metric=logged.__setitem__)
    assert rewards == [1.0] * 4  # graded by the terminal tool
    name = "env/quizenvironment"
    assert logged[f"{name}/tool_calls"] == 1 == logged[f"{name}/tool_calls_per_episode"] * logged[f"{name}/episodes"]
    assert logged[f"{name}/terminal_calls"] == 4
    assert logged[f"{name}/terminal_call_s/p95"] >= logged[f"{name}/terminal_call_s/p50"] > 0
    assert logged[f"{name}/tool_call_s/p50"] == logged[f"{name}/tool_call_s/p95"]  # the one lookup, alone
    spec.close()


def test_terminal_calls_only_make_no_tool_call_metrics() -> None:
    m = EnvMetrics()
    for _ in range(8):
        m._count("q", "terminal_latency", 0.2, terminal_calls=1)
        m._record_episode("q", {"reward": 1.0, "finished": True, "tool_calls": 0})
    m._count("q", "terminal_latency", 0.4, "timeout", terminal_calls=1)
    out = m.flush()
    assert "env/q/tool_calls" not in out and "env/q/tool_call_s/p50" not in out
    assert out["env/q/tool_calls_per_episode"] == 0 and out["env/q/terminal_calls"] == 9
    assert out["env/q/terminal_call_s/p50"] == pytest.approx(0.2) and out["env/q/failures/timeout"] == 1


def test_an_episode_opened_before_training_is_not_a_training_episode(ref_server, tiny_model_dir, tmp_path) -> None:
    """Bug: a user opens an episode to look at a prompt (`env = spec.environment_factory(); env.reset(task_index=0)`),
    then trains: its session open was logged in step 1, and the episode itself (closed at step 1's end) in step 2,
    as a training episode never graded (graded_fraction 0.8 for 4 rollouts all scored 1.0). Now it is a `manual`
    episode: out of every step's metrics, written with its own source."""
    pytest.importorskip("trl")
    import re

    from tests.fixtures.generation import cpu_grpo_trainer, replace_generation, tool_call_text

    log = tmp_path / "episodes.jsonl"
    spec = OpenRewardSpec(ref_server.url, env_name="echoenvironment", num_tasks=2, episode_log=str(log))
    env = spec.environment_factory()
    assert "exactly this text" in env.reset(task_index=0)  # a look at a prompt, left open
    trainer = cpu_grpo_trainer(tiny_model_dir, str(tmp_path / "out"), batch=4, generations=2, turns=1,
                               completion_length=64, spec=spec, config={"max_steps": 2})
    tok = trainer.processing_class

    def generate(prompt_ids, *args, **kwargs):  # echo the target, then close
        return [tok.encode(("Done." if "<tool_response>" in (text := tok.decode(ids)) else tool_call_text(
            "echo", {"text": re.findall(r'exactly this text: "(\w+)"', text)[0]})) + "<|im_end|>",
            add_special_tokens=False) for ids in prompt_ids], None

    replace_generation(trainer, generate)
    trainer.train()
    spec.close()
    steps = [entry for entry in trainer.state.log_history if "env/echoenvironment/episodes" in entry]
    name = "env/echoenvironment/"
    assert [(s[name + "sessions_opened"], s[name + "episodes"], s[name + "graded_fraction"]) for s in steps] == [
        (4, 4, 1.0), (4, 4, 1.0)]
    sources = [r["source"] for r in map(json.loads, log.read_text().splitlines())]
    assert sorted(sources) == ["manual"] + ["trl"] * 8
    assert env.episode.source == "manual" and env.episode.record()["task_index"] == 0


def test_episodes_that_never_opened_are_not_episodes_without_a_tool_call(ref_server, tiny_model_dir, tmp_path) -> None:
    """Every session is refused at `/create` (a fault proxy, after tool discovery): the step's episodes and the
    held-out evaluation's never opened. They are the environment's failure, counted as open failures, not as
    episodes in which the model made no tool call (no_tool_call_fraction 0, not 1)."""
    pytest.importorskip("trl")
    from ors_trl.testing.faults import FaultProxy, Status
    from tests.fixtures.generation import cpu_grpo_trainer, replace_generation

    with FaultProxy(ref_server.url) as proxy:
        spec = OpenRewardSpec(proxy.url, env_name="echoenvironment", num_tasks=2)
        callback = spec.eval_callback(tasks=2, split="test", every=1)
        trainer = cpu_grpo_trainer(tiny_model_dir, str(tmp_path), batch=2, generations=2, turns=1,
                                   completion_length=32, spec=spec, callbacks=[callback])
        tok = trainer.processing_class
        replace_generation(trainer, lambda prompt_ids, *a, **k: (
            [tok.encode("Done.<|im_end|>", add_special_tokens=False) for _ in prompt_ids], None))
        proxy.add(Status(400), path="/create", times=None)
        trainer.train()
        spec.close()
        refused = proxy.count("/create", fault="status")
    name = "echoenvironment"
    (step,) = [h for h in trainer.state.log_history if "reward" in h]
    assert step[f"env/{name}/episodes"] == 2 and step[f"env/{name}/session_open_failures"] == 2
    assert step[f"env/{name}/no_tool_call_fraction"] == 0.0 and step[f"env/{name}/graded_fraction"] == 0.0
    evals = [h for h in trainer.state.log_history if f"eval/{name}/episodes" in h]
    assert [h[f"eval/{name}/no_tool_call_fraction"] for h in evals] == [0.0, 0.0]
    assert refused == 2 + 2 * 2  # the step's 2 episodes, the evaluation's 2 at step 0 and at step 1
