"""Evaluation during training and tool-call health, with a real `GRPOTrainer` on CPU against the reference server.

The trainer's generation is scripted (`replace_generation`), so what the model replies, and so every
number logged, is known: the held-out pass@k at each evaluation, the tool-call health of each training step, and
the warning when a step's episodes stop calling tools.
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from typing import Any

import pytest

from ors_trl import OpenRewardSpec, write_report
from ors_trl.core.stats import wilson
from tests.fixtures.generation import cpu_grpo_trainer, replace_generation, tool_call_text

pytest.importorskip("trl")
ECHO = "echoenvironment"
pytestmark = pytest.mark.usefixtures("no_leaked_sessions")


def scripted(trainer: Any, reply: Any) -> Any:
    """A generation backend answering each prompt with `reply(word, prompt_text)`, then "Done." after a tool result."""
    tok = trainer.processing_class

    def generate(prompt_ids: list[list[int]], *args: Any, **kwargs: Any) -> tuple[list[list[int]], None]:
        out = []
        for ids in prompt_ids:
            text = tok.decode(ids)
            word = re.findall(r'exactly this text: "(\w+)"', text)[-1]
            body = "Done." if "<tool_response>" in text.rsplit("exactly this text", 1)[-1] else reply(word, text)
            out.append(tok.encode(body + "<|im_end|>", add_special_tokens=False))
        return out, None

    return generate


@pytest.mark.parametrize("mode", ["environment_factory", "rollout_func"])
def test_eval_callback_logs_held_out_pass_at_k(ref_server, tiny_model_dir, tmp_path, mode) -> None:
    """Three held-out tasks, two episodes each, before the first step and after it: "orbit" is echoed right in one
    episode of two, "meadow" in both, "cipher" in neither, so pass@1 = (1/2 + 1 + 0) / 3 and pass@2 = 2/3 each time.
    The numbers go to log_history beside GRPO's own (which keep their step's values), the episodes to the episode
    log as evaluation, and the report draws the curve."""
    log = tmp_path / "episodes.jsonl"
    spec = OpenRewardSpec(ref_server.url, env_name=ECHO, num_tasks=2, episode_log=str(log))
    callback = spec.eval_callback(tasks=3, split="test", every=1, repeats=2)
    trainer = cpu_grpo_trainer(tiny_model_dir, str(tmp_path / "out"), batch=2, generations=2, turns=1,
                               completion_length=48, train_dataset=spec.train_dataset, reward_funcs=spec.reward_funcs,
                               callbacks=[callback],
                               **{mode: spec.environment_factory if mode == "environment_factory" else spec.rollout_func})
    calls: Counter[str] = Counter()

    def reply(word: str, text: str) -> str:
        calls[word] += 1
        right = {"orbit": calls[word] % 2 == 1, "meadow": True, "cipher": False}.get(word, True)  # training: right
        return tool_call_text("echo", {"text": word if right else "nope"})

    replace_generation(trainer, scripted(trainer, reply))
    trainer.train()
    spec.close()

    history = trainer.state.log_history
    evals = [h for h in history if f"eval/{ECHO}/pass@1" in h]
    assert [h["step"] for h in evals] == [0, 1] and [h["step"] for h in callback.history] == [0, 1]
    lo, hi = wilson(0.5, 3)
    for h in evals:
        assert h[f"eval/{ECHO}/pass@1"] == pytest.approx(0.5) and h[f"eval/{ECHO}/pass@2"] == pytest.approx(2 / 3)
        assert (h[f"eval/{ECHO}/pass@1_low"], h[f"eval/{ECHO}/pass@1_high"]) == pytest.approx((lo, hi))
        assert h[f"eval/{ECHO}/episodes"] == 6 and h[f"eval/{ECHO}/no_tool_call_fraction"] == 0.0
        assert "loss" not in h and "reward" not in h  # GRPO's own metrics were not folded in...
    (train,) = [h for h in history if "reward" in h]
    assert train["reward"] == 1.0 and train[f"env/{ECHO}/episodes"] == 2  # ...and the evaluation is not in them
    assert calls["orbit"] == calls["meadow"] == calls["cipher"] == 4

    records = [json.loads(line) for line in log.read_text().splitlines()]
    held = [r for r in records if r["source"] == "eval"]
    assert Counter(r["step"] for r in held) == {0: 6, 1: 6}
    assert {r["split"] for r in held} == {"test"} and {r["policy"] for r in held} == {"the model in training"}
    assert len([r for r in records if r["source"] != "eval"]) == 2

    trainer.state.save_to_json(str(tmp_path / "trainer_state.json"))
    page = tmp_path / "report.html"
    summary = write_report([log, tmp_path / "trainer_state.json"], page)
    html = page.read_text()
    assert "Held-out pass@k during training" in html and f"{ECHO} pass@2" in html
    assert {"step 0", "step 1"} <= {name.split(" · ")[-1] for name in summary.run_names}


@pytest.mark.parametrize("mode", ["environment_factory", "rollout_func"])
def test_tool_call_health_is_logged_and_a_drop_in_calls_is_warned(ref_server, tiny_model_dir, tmp_path, caplog,
                                                                  mode) -> None:
    """Step 1: every reply is a good call. Step 2: every reply is tool-call markup whose JSON is cut, which TRL's
    parser turns into no call: the step logs it as unparsed turns and episodes without a call, and the log warns (TRL's
    loop: found by `Episode.replay`; the engine: by the turn rule). Each step also logs what its sessions cost."""
    spec = OpenRewardSpec(ref_server.url, env_name=ECHO, num_tasks=2)
    trainer = cpu_grpo_trainer(tiny_model_dir, str(tmp_path), batch=2, generations=2, turns=1, completion_length=48,
                               train_dataset=spec.train_dataset, reward_funcs=spec.reward_funcs,
                               **{mode: spec.environment_factory if mode == "environment_factory" else spec.rollout_func})
    trainer.args.max_steps = 2

    def reply(word: str, text: str) -> str:
        if trainer.state.global_step == 0:
            return tool_call_text("echo", {"text": word})
        return '<tool_call>\n{"name": "echo", "arguments": {"text": "' + word + '"}\n</tool_call>'

    replace_generation(trainer, scripted(trainer, reply))
    with caplog.at_level(logging.WARNING, logger="ors_trl"):
        trainer.train()
    spec.close()
    first, second = [h for h in trainer.state.log_history if "reward" in h]
    assert first[f"env/{ECHO}/no_tool_call_fraction"] == 0.0 and first[f"env/{ECHO}/unparsed_turn_fraction"] == 0.0
    assert second[f"env/{ECHO}/no_tool_call_fraction"] == 1.0 and second[f"env/{ECHO}/unparsed_turn_fraction"] == 1.0
    assert second[f"env/{ECHO}/malformed_calls"] == 0.0
    # session cost: step 1's episodes are scored, step 2's (no call) are not. A session is billed at its episode's
    # reward, and what it lives on after (or, on TRL's loop, an open a reset did not wait for) in the next window:
    # the last one is the spec's own after it closed every session.
    rest = spec.metrics.flush()
    assert first[f"env/{ECHO}/sessions_opened"] == 2 and first[f"env/{ECHO}/session_seconds"] > 0
    assert first[f"env/{ECHO}/session_seconds_unscored"] == 0.0
    windows = (first, second, rest)
    assert sum(w.get(f"env/{ECHO}/sessions_opened", 0.0) for w in windows) == 4
    unscored = sum(w.get(f"env/{ECHO}/session_seconds_unscored", 0.0) for w in windows)
    assert 0 < unscored < sum(w.get(f"env/{ECHO}/session_seconds", 0.0) for w in windows)
    warned = [r.getMessage() for r in caplog.records if "made no tool call" in r.getMessage()]
    assert warned == [f"{ECHO}: 100% of this step's 2 episode(s) made no tool call (it was under 50% before); 2 of 2 "
                      "model turn(s) held tool-call markup that parsed to no call, 0 call(s) had malformed arguments. "
                      "The model may have stopped calling tools, or its calls no longer parse."]


def test_eval_callback_checks_its_arguments(ref_server) -> None:
    from ors_trl import ConfigurationError

    spec = OpenRewardSpec(ref_server.url, env_name=ECHO, num_tasks=2)
    for bad in ({"every": 0}, {"repeats": 0}, {"every": True}):
        with pytest.raises(ConfigurationError, match="must be an int >= 1"):
            spec.eval_callback(tasks=2, **bad)
    callback = spec.eval_callback(tasks=[1, 3], split="test", every=5)
    assert [json.loads(p[-1]["ors_task"])["index"] for p in callback.prompts] == [1, 3]
    assert repr(callback) == f"EvalCallback('{ECHO}', tasks=2, every=5)"
    spec.close()
    callback.runtime.close_all()
