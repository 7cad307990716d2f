"""The demo's end-to-end paths (`ors-trl demo`): real GRPO steps through OpenRewardSpec against the reference server.

The look task (the default): the rules come as a system turn, the answer only from the `look()` tool, and the model's
plain final message is graded by the environment's terminal tool. The echo task (`--task echo`): the word is in the
prompt and the model calls `echo(text=...)`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("trl")

from ors_trl.demo import _task
from ors_trl.testing import ReferenceServer

LOOK = "lookenvironment"


@pytest.fixture(scope="module")
def look_server() -> Iterator[ReferenceServer]:
    """A private server with the look environment only, so its counters are this module's alone."""
    from ors_trl.demo._environments import LookEnvironment

    with ReferenceServer([LookEnvironment]) as server:
        yield server


def test_look_tasks_hide_the_word_from_the_prompt() -> None:
    """Only look() tells the word: the conversation is the same whatever is hidden, and held-out phrasings are new."""
    train, test, blind = (_task.look_tasks(s) for s in ("train", "test", "blind"))
    for tasks in (train, test):
        assert all(t["word"] not in _task.look_prompt(t).split("one of:")[0] for t in tasks)
        assert all(t["word"] in t["reply"] and t["shown"] == t["word"] for t in tasks)
        questions = {w: {t["question"] for t in tasks if t["word"] == w} for w in _task.TARGETS}
        assert len({frozenset(q) for q in questions.values()}) == 1  # same questions for every hidden word
    assert not {t["reply"] for t in test} & {t["reply"] for t in train}
    # blind: every (question, decoy sentence) occurs once with each hidden word, so any policy scores exactly 1/6
    by_view: dict[tuple[str, str], list[str]] = {}
    for t in blind:
        by_view.setdefault((t["question"], t["reply"]), []).append(t["word"])
    assert all(sorted(words) == sorted(_task.TARGETS) for words in by_view.values())
    assert _task.grade(test[0], f' "{test[0]["word"].title()}." ')[0] == 1.0
    assert _task.grade(test[0], "I think it is " + test[0]["word"])[0] == 0.0


def test_look_grpo_through_the_spec(look_server, tmp_path) -> None:
    """A few GRPO steps on the look task, graded by the terminal tool; the evaluation and the report follow."""
    from ors_trl.demo._main import run_demo

    before_stats = look_server.stats()
    result = run_demo(task="look", url=look_server.url, steps=3, sft_steps=40, seed=0, output_dir=str(tmp_path),
                      report=True, config_overrides={"logging_steps": 1})
    logs = [h for h in result.log_history if "reward" in h]
    assert len(logs) == 3
    # the model called look() in training, and TRL saw those calls
    assert all(h["tools/call_frequency"] > 0.5 for h in logs)
    assert all(h[f"env/{LOOK}/tool_calls"] > 0 for h in logs)
    # rewards came back through spec.reward_funcs (TRL names the column after it), graded by the environment
    assert all("rewards/outcome_reward/mean" in h for h in logs)
    assert all(h[f"env/{LOOK}/graded_fraction"] > 0.5 for h in logs)

    # ... and the grading was the terminal tool's: its server-side counter grew by at least the graded episodes
    stats = look_server.stats()
    grew = {k: stats["tool_calls"].get(k, 0) - before_stats["tool_calls"].get(k, 0) for k in stats["tool_calls"]}
    assert result.episode_log is not None
    records = [json.loads(line) for line in Path(result.episode_log).read_text(encoding="utf-8").splitlines()]
    training = [r for r in records if r["source"] == "trl"]
    assert len(training) == 3 * 64
    graded = [r for r in training if r["reward"] is not None]
    assert len(graded) > 0.5 * len(training)
    for r in graded:  # a graded episode's reward is the terminal tool's, given for the model's final message
        assert r["final"]["tool"] == _task.ANSWER_TOOL and r["final"]["reward"] == r["reward"] in (0.0, 1.0)
        assert r["final"]["metadata"]["given"] == _task.normalise_answer(r["final"]["message"])
        assert r["system"] == _task.LOOK_SYSTEM  # the conversation's system turn reached the episode
    assert grew[f"{LOOK}/answer"] >= len(graded)
    assert grew[f"{LOOK}/look"] >= sum(r["tool_calls"] for r in training)

    # the warm start taught the format: look, then answer (two turns), before any GRPO step
    assert result.before["look_rate"] > 0.5 and result.before["turns"] > 1.5
    assert result.before["answered_rate"] > 0.5
    # (that the evaluation builds the turn after look() with TRL's very ids is tests/test_turns.py's to show)
    # blind variant: a greedy policy gives one answer per (question, decoy) view, so at most 1/6 can be right
    assert result.blind is not None and result.blind["success_rate"] <= 1 / 6 + 1e-9
    out = result.to_json()
    assert set(out) >= {"success_before", "success_after", "tool_call_rate_after", "tool_failure_rate_after",
                        "seconds", "steps", "seed", "look_rate_before", "look_rate_after", "turns_after",
                        "blind_success_after", "no_look_success_after"}
    assert "looked before answering" in result.table() and "blind-variant success" in result.table()
    if result.report is not None:  # ors_trl.report is there: the page covers the training episodes
        page = Path(result.report).read_text(encoding="utf-8")
        assert "<html" in page.lower() and LOOK in page
        # the page opens with after against before, over the same held-out tasks, as the table's success rates;
        # then a row per run, training apart, before the curves and the (collapsed) task table
        headline, first = page.split('id="runs"')[0], page.split('id="curves"')[0]
        before, after = result.before["success_rate"], result.after["success_rate"]
        assert f"after vs before: success {before:.1%} → {after:.1%}" in headline.split('id="headline"')[1]
        assert "<td>before</td>" in first and "<td>after</td>" in first and "<td>training</td>" in first
    assert (tmp_path / "trainer_state.json").exists()
    look_server.wait_for_stats(lambda s: s["open_sessions"] == 0, timeout=10)  # nothing left open


def test_look_through_the_rollout_engine(look_server, tmp_path) -> None:
    """`--rollout-func`: the same task through spec.rollout_func (the system turn stays a system message)."""
    from ors_trl.demo._main import run_demo

    result = run_demo(task="look", url=look_server.url, steps=1, sft_steps=30, seed=1, output_dir=str(tmp_path),
                      rollout_func=True, blind=False, config_overrides={"logging_steps": 1})
    logs = [h for h in result.log_history if "reward" in h]
    assert len(logs) == 1 and logs[0][f"env/{LOOK}/tool_calls"] > 0
    assert logs[0][f"env/{LOOK}/graded_fraction"] > 0.5
    assert result.before["look_rate"] > 0.5
    look_server.wait_for_stats(lambda s: s["open_sessions"] == 0, timeout=10)


def test_cli_echo_json_contract(tmp_path) -> None:
    """`ors-trl demo --task echo`: the original demo, and its JSON line."""
    out = subprocess.run(
        [sys.executable, "-m", "ors_trl", "demo", "--task", "echo", "--steps", "2", "--sft-steps", "10", "--json",
         "--quiet", "--no-report", "--output-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    for key in ("success_before", "success_after", "tool_call_rate_after", "tool_failure_rate_after", "seconds"):
        assert isinstance(result[key], int | float), key
    assert result["steps"] == 2 and result["task"] == "echo"
    assert "look_rate_after" not in result
    assert "held-out success rate" in out.stdout  # the before/after table precedes the JSON line


def test_rerun_into_a_folder_replaces_the_previous_run_and_says_so(tmp_path) -> None:
    """A previous run's episode log, evaluations, trainer state and report are replaced (the report covers this run
    only), and the demo names them on stderr, even with --quiet; other files in the folder are left alone."""
    from ors_trl.demo._main import RUN_FILES

    for name in RUN_FILES:
        (tmp_path / name).write_text('{"stale": true}\n')
    (tmp_path / "notes.txt").write_text("mine")
    out = subprocess.run(
        [sys.executable, "-m", "ors_trl", "demo", "--task", "echo", "--steps", "1", "--sft-steps", "5", "--quiet",
         "--output-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert (f"ors-trl demo: {tmp_path} holds a previous run's {', '.join(RUN_FILES)}; this run replaces them"
            in out.stderr)
    for name in RUN_FILES:
        assert "stale" not in (tmp_path / name).read_text(encoding="utf-8"), name
    assert (tmp_path / "notes.txt").read_text() == "mine"
    records = [json.loads(line) for line in (tmp_path / "episodes.jsonl").read_text().splitlines()]
    assert records and {r["source"] for r in records} == {"trl"}


def test_progress_lines_escape_the_environments_text(capsys) -> None:
    from ors_trl.demo._main import _say_to

    _say_to(False)("environment title\u202eenv\x1b]0;pwned\x07: tools ['peek\x1b[2J']")
    err = capsys.readouterr().err
    assert "environment title\\u202eenv\\x1b]0;pwned\\x07: tools ['peek\\x1b[2J']" in err
    assert not any(c in err for c in ("\x1b", "\x07", "\u202e"))


def test_demo_on_the_mixed_pool_with_adaptive_sampling(look_server, tmp_path) -> None:
    """`ors-trl demo --pool mixed --task-sampling adaptive --eval-every N`: GRPO draws the mixed pool's tasks
    adaptively (every task once first), and the held-out curve is measured as training goes."""
    from ors_trl.demo._main import run_demo

    result = run_demo(task="look", url=look_server.url, steps=2, sft_steps=5, seed=0, output_dir=str(tmp_path),
                      report=True, blind=False, pool="mixed", task_sampling="adaptive", eval_every=1,
                      config_overrides={"logging_steps": 1, "per_device_train_batch_size": 16})
    assert (result.pool, result.task_sampling) == ("mixed", "adaptive")
    assert [(p["step"], p["episodes"]) for p in result.curve] == [(1, 16), (2, 32)]
    assert all(0.0 <= p["success"] <= 1.0 for p in result.curve)
    records = [json.loads(line) for line in Path(result.episode_log).read_text(encoding="utf-8").splitlines()]
    tasks = [r["task_index"] for r in records if r["source"] == "trl" and r["split"] == "mixed"]
    assert len(tasks) == 2 * 16 and len(set(tasks)) == 4  # 2 groups of 8 a step, unseen tasks first: 4 distinct
    logged = [h for h in result.log_history if any(k.startswith("curriculum/") for k in h)]
    assert len(logged) == 2 and result.to_json()["task_sampling"] == "adaptive"
    assert "episodes to 0.8 held out" in result.table()
