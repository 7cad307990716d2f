"""`ors-trl report`: a page built from real episodes (two environments, two processes, training and eval logs, a
trainer state) shows each of them, loads nothing from elsewhere and opens in headless Chromium without a JavaScript
error; inputs are recognised by content, hostile text stays text, the sample is bounded, the CLI's exit codes."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tomllib
from importlib.resources import files
from pathlib import Path
from typing import Any

import pytest

from ors_trl import ConfigurationError, OpenRewardSpec, PolicyReply, ToolError, write_report
from ors_trl.cli import EXIT_ERROR, EXIT_OK, EXIT_USAGE, main
from ors_trl.report import recognise
from tests.fixtures.environments import QUIZ_SYSTEM

SRC = str(Path(__file__).resolve().parents[1] / "src")
ENV = {**os.environ, "PYTHONPATH": SRC, "OPENREWARD_DISABLE_UPDATE_CHECK": "1"}
# Text a tool output, a prompt or a name might carry; it must stay text on the page.
HOSTILE = '</script><script>document.title="pwned"</script><img src=x onerror="document.title=\'pwned\'"><!--'

# The second process: one rewarded echo episode written to its own log (so with its own run id).
SUBPROCESS = """
import sys
from ors_trl import OpenRewardSpec
url, log = sys.argv[1], sys.argv[2]
spec = OpenRewardSpec(url, env_name="echoenvironment", num_tasks=1, episode_log=log)
target = spec.run(spec.client.tasks("train"))[0]["target"]
env = spec.environment_factory()
env.reset(task_index=0)
env.echo(text=target)
spec.reward_funcs([env])  # scored as a step scores it: a training episode
spec.close()
"""


class EchoPolicy:
    """An eval policy: echoes the word the prompt asks for (misspelt for the words in `miss`, so that episode goes
    on), then answers in plain text."""

    description = "scripted-echo"

    def __init__(self, miss: set[str]) -> None:
        self.miss = miss

    async def respond(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> PolicyReply:
        if messages[-1]["role"] == "tool":
            return PolicyReply(content="Done.")
        word = re.search(r'exactly this text: "([^"]+)"', messages[-1]["content"]).group(1)
        text = word + "?" if word in self.miss else word
        return PolicyReply(content="", tool_calls=[{"id": "c0", "name": "echo", "arguments": {"text": text}}])


@pytest.fixture(autouse=True)
def _restore_logging() -> Any:
    """`main()` points the ors_trl logger at the stderr of its test (pytest's capture); put it back after."""
    logger = logging.getLogger("ors_trl")
    saved = logger.handlers[:], logger.level, logger.propagate
    yield
    logger.handlers[:], logger.level, logger.propagate = saved


class QuizPolicy:
    """An eval policy for the quiz (a system turn, a terminal tool): looks the country up, then answers in plain text
    (the terminal tool grades it); wrong on purpose for the countries in `miss`."""

    description = "scripted-quiz"

    def __init__(self, miss: set[str]) -> None:
        self.miss = miss

    async def respond(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> PolicyReply:
        last = messages[-1]
        if last["role"] == "tool":
            country, capital = re.search(r"The capital of (.+) is (.+)\.", last["content"]).groups()
            return PolicyReply(content="Atlantis" if country in self.miss else capital)
        country = re.search(r"capital of (.+)\?", last["content"]).group(1)
        return PolicyReply(content="", tool_calls=[{"id": "q0", "name": "lookup", "arguments": {"country": country}}])


class JudgePolicy:
    """An eval policy for the group-scored environment: says a sentence with the task's word."""

    description = "scripted-judge"

    async def respond(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> PolicyReply:
        if messages[-1]["role"] == "tool":  # said: done (an episode whose policy fails has no group score)
            return PolicyReply(content="Done.")
        word = re.search(r'the word "([^"]+)"', messages[-1]["content"]).group(1)
        return PolicyReply(content=f"A {word}.", tool_calls=[{"id": "j0", "name": "say",
                                                             "arguments": {"text": f"A {word} here."}}])


def _wait_pending(*specs: OpenRewardSpec) -> None:
    for spec in specs:  # finished episodes release their sessions in the background
        concurrent.futures.wait(list(spec._runtime._pending), timeout=30)


@pytest.fixture(scope="module")
def logs(ref_server, tmp_path_factory) -> dict[str, Path]:
    """Logs of real episodes against the reference server: training logs of two environments, a second process's
    log, eval outputs (echo; a quiz with a system turn and a terminal tool; group-scored repeats), and a trainer
    output folder whose log_history carries the metrics those training episodes logged."""
    tmp = tmp_path_factory.mktemp("report-logs")
    out = {name: tmp / f"{name}.jsonl" for name in ("echo", "sparse", "sub", "eval", "quiz", "judge")}
    out["trainer"] = tmp / "trainer"
    proc = subprocess.Popen([sys.executable, "-c", SUBPROCESS, ref_server.url, str(out["sub"])], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    echo = OpenRewardSpec(ref_server.url, env_name="echoenvironment", num_tasks=4, episode_log=str(out["echo"]))
    sparse = OpenRewardSpec(ref_server.url, env_name="sparseenvironment", num_tasks=2, episode_log=str(out["sparse"]))
    quiz = OpenRewardSpec(ref_server.url, env_name="quizenvironment", num_tasks=2)
    judge = OpenRewardSpec(ref_server.url, env_name="judgeenvironment", num_tasks=1)
    try:
        words = [t["target"] for t in echo.run(echo.client.tasks("train"))[:4]]
        sums = [t["a"] + t["b"] for t in sparse.run(sparse.client.tasks("train"))[:2]]
        e = [echo.environment_factory() for _ in range(4)]
        for i, env in enumerate(e):
            env.reset(task_index=i)
        e[0].echo(text=words[0])  # 1.0, finished
        e[1].echo(text="wrong")  # 0.0
        e[2].echo(text=HOSTILE)  # 0.0, and the output echoes the hostile text
        # e[3] makes no call: unscored (no_reward)
        m = [sparse.environment_factory() for _ in range(2)]
        for i, env in enumerate(m):
            env.reset(task_index=i)
        m[0].calculator(expression="1+1")  # unscored call
        m[0].submit(answer=sums[0])  # 1.0, finished
        with pytest.raises(ToolError):
            m[1].calculator(expression="import os")  # failed
        with pytest.raises(ToolError):
            m[1].submit(answer="x")  # refused (input_validation)
        _wait_pending(echo, sparse)
        logged: dict[str, float] = {}
        echo.reward_funcs(e, log_metric=logged.__setitem__)
        sparse.reward_funcs(m, log_metric=logged.__setitem__)
        echo.evaluate(EchoPolicy({words[1]}), num_tasks=2, output=str(out["eval"]), progress=False, concurrency=2)
        countries = [t["country"] for t in quiz.run(quiz.client.tasks("train"))[:2]]
        quiz.evaluate(QuizPolicy({countries[1]}), output=str(out["quiz"]), progress=False)
        judge.evaluate(JudgePolicy(), output=str(out["judge"]), repeats=2, score_groups=True, progress=False)
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
    finally:
        for spec in (echo, sparse, quiz, judge):
            spec.close()
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    history = [{"step": step, "epoch": step / 3, "loss": 0.1 / step, "reward": 0.2 * step,
                **{k: v * step if "fraction" not in k else v for k, v in logged.items()}} for step in (1, 2, 3)]
    for step in (2, 3):  # the latest checkpoint's state holds the whole log_history
        folder = out["trainer"] / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": history[:step]},
                                                              indent=2))
    return out


def _episode_data(page: str) -> list[dict[str, Any]]:
    m = re.search(r'<script type="application/json" id="episode-data">(.*?)</script>', page, re.S)
    assert m is not None
    return json.loads(m.group(1))


def assert_self_contained(page: str) -> None:
    """Nothing in the page is fetched from elsewhere: no external src/href/url()/@import, no <link>, no script src."""
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", page, re.I)
    assert not re.search(r"""url\(\s*["']?\s*(?:https?:)?//""", page, re.I)
    assert not re.search(r"@import", page, re.I)
    assert not re.search(r"<link\b", page, re.I)
    assert not re.search(r"<script\b[^>]*\bsrc\s*=", page, re.I)
    assert "default-src 'none'" in page  # and the page's CSP forbids it anyway


LOGS = ("echo", "sparse", "sub", "eval", "quiz", "judge")
ENVS = ["echoenvironment", "judgeenvironment", "quizenvironment", "sparseenvironment"]


def test_report_of_real_episodes(logs, tmp_path, no_leaked_sessions) -> None:
    out = tmp_path / "report.html"
    summary = write_report([*(logs[k] for k in LOGS), logs["trainer"]], out)
    assert summary.episodes == 4 + 2 + 1 + 2 + 2 + 2 and summary.embedded == summary.episodes
    assert summary.environments == ENVS
    # the runs: training in this process and in the subprocess (told apart by run id), and one eval per policy
    records = [json.loads(line) for key in LOGS for line in logs[key].read_text().splitlines()]
    here, sub = records[0]["run"], json.loads(logs["sub"].read_text())["run"]
    assert summary.runs == 5 and summary.run_names == [f"training · {here}", f"training · {sub}",
                                                        "eval · scripted-echo", "eval · scripted-quiz",
                                                        "eval · scripted-judge"]
    assert summary.trainer_states == 1 and summary.log_steps == 3  # checkpoint-3, not checkpoint-2
    page = out.read_text(encoding="utf-8")
    assert_self_contained(page)

    episodes = _episode_data(page)
    assert len(records) == len(episodes) == 13
    # Every episode is in the page, whole: the embedded record is the record as written.
    assert sorted(json.dumps(e["rec"], sort_keys=True) for e in episodes) == sorted(
        json.dumps(r, sort_keys=True) for r in records)
    by_source = {(e["rec"]["source"], e["env"], e["rec"]["task_index"], e["rec"].get("repeat"), e["run"])
                 for e in episodes}
    assert len(by_source) == 13
    assert {e["run"] for e in episodes} == set(summary.run_names) and len({r["run"] for r in records}) == 2
    failed = next(e for e in episodes if e["env"] == "sparseenvironment" and e["reward"] is None)
    assert failed["tags"] == ["failure: failed", "failure: refused", "unscored: no_reward"]
    outputs = [c.get("output") for e in episodes for t in e["rec"]["turns"] for c in t["tool_calls"]]
    assert HOSTILE in outputs  # the data holds it exactly...
    assert HOSTILE not in page and "<script>document" not in page and "<img src=x" not in page  # ...as text only
    quiz = [e["rec"] for e in episodes if e["env"] == "quizenvironment"]  # a system turn, a terminal tool
    assert all(r["system"] == QUIZ_SYSTEM and r["final"]["tool"] == "answer" for r in quiz)
    assert sorted(r["reward"] for r in quiz) == [0.0, 1.0] and {r["final"]["message"] for r in quiz} >= {"Atlantis"}
    assert all(isinstance(e["rec"]["group_reward"], float) for e in episodes if e["env"] == "judgeenvironment")

    # The summary and the task table: rewards, failures by reason, end and unscored reasons, latencies.
    for text in ("tool call failed: refused", "tool call failed: failed", "unscored: no_reward", "end: finished",
                 "end: no_tool_calls", "refused", "failed", "no_reward", "finished", "no_tool_calls",
                 "session open (timings.open)", "tool call (seconds)", "train #0", "train #3", "echoenvironment",
                 "sparseenvironment", "scripted-echo"):
        assert text in page or text in json.dumps(episodes), text
    assert re.search(r'<tr class=task data-env="echoenvironment" data-task="train #0">', page)
    # Curves from the trainer's log_history: TRL's reward and the env/<name>/... metrics, as inline SVG.
    assert page.count("<figure class=chart><svg") == 7  # reward, graded, calls, health, failures, latency, cost
    assert "Session-seconds per logging step" in page and "session-seconds" in page  # the cost: curve and card
    assert "TRL reward (every rollout)" in page and "echoenvironment" in page.split('id="curves"')[1]


@pytest.fixture(scope="session")
def chromium() -> str:
    """Headless Chromium (Debian's package, which `make test` installs: the Makefile's `browser` target); the
    tests that need it skip where it is missing."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        pytest.skip("chromium is not on PATH: `make browser` installs it (needs root and apt-get)")
    return found


def run_chromium(binary: str, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
           f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90)


def test_page_opens_in_chromium(logs, chromium, tmp_path, record_property) -> None:
    out = tmp_path / "report.html"
    write_report([*(logs[k] for k in LOGS), logs["trainer"]], out, title="ors-trl report: four environments")
    url = out.as_uri() + "#expand"  # the page's script opens every episode shown (so their bodies render)
    result = run_chromium(chromium, tmp_path / "profile-dom", "--dump-dom", url)
    dom = result.stdout
    assert 'data-report-ready="1"' in dom, (result.returncode, result.stderr[-3000:])  # the script ran to its end
    body = re.search(r"<body[^>]*>", dom).group(0)
    assert "data-js-error" not in body and re.search(r'<pre id="js-errors" hidden="">\s*</pre>', dom)
    assert "Uncaught" not in result.stderr, result.stderr[-3000:]
    assert dom.count('class="ep-body"') == 13  # every episode's body was rendered by the script
    for text in ("tool call: echo", "tool call: calculator", "tool call: submit", "failed: refused",
                 "failed: failed", "input_validation", "Done.", "final message → terminal tool: answer",
                 "tool call: lookup", "Atlantis", QUIZ_SYSTEM, "group reward", "unscored: no_reward"):
        assert text in dom, text
    # The hostile output is text in the rendered page: escaped, not an element, and it never ran.
    assert "&lt;img src=x onerror=" in dom and "&lt;/script&gt;&lt;script&gt;" in dom
    assert not re.search(r"<img\b", dom) and "pwned</title>" not in dom

    shot = tmp_path / "report.png"
    result = run_chromium(chromium, tmp_path / "profile-shot", f"--screenshot={shot}", "--window-size=1280,1600",
                          "--hide-scrollbars", out.as_uri())
    assert shot.is_file() and shot.stat().st_size > 10_000, result.stderr[-3000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record_property("screenshot", str(shot))
    print(f"report screenshot: {shot}")


# -- inputs -----------------------------------------------------------------------------------------------------


def write_lines(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def v2(i: int = 0, **extra: Any) -> dict[str, Any]:
    """A record in the shape `Episode.record()` writes."""
    rec = {"version": 2, "run": "host-1-1", "source": "trl", "environment": "echo", "target": "http://h:1",
           "split": "train", "task_index": i, "task_spec": None, "started_at": "2026-01-01T00:00:00+00:00",
           "system": None, "prompt": f"Say word {i}", "turns": [{"index": 0, "assistant": "", "tool_calls": [
               {"id": "c", "name": "echo", "arguments": {"text": "w"}, "remote_name": "echo", "output": "w",
                "reward": 1.0, "finished": True, "metadata": None, "seconds": 0.01}]}],
           "final": None, "rewards": [1.0], "reward": 1.0, "group_reward": None, "finished": True,
           "end_reason": "finished", "unscored": None, "tool_calls": 1, "tool_failures": 0, "error": None,
           "timings": {"generation": 0.0, "tools": 0.01, "open": 0.02, "prompt": 0.001, "total": 0.05}}
    rec.update(extra)
    return rec


def test_inputs_are_recognised_by_content(tmp_path) -> None:
    log = write_lines(tmp_path / "no-extension", [v2(0), v2(1)])
    v1 = v2(2, version=1, source="eval", repeat=0, policy="p")
    del v1["unscored"], v1["run"]
    evals = write_lines(tmp_path / "eval.out", [v1])
    legacy = write_lines(tmp_path / "old.jsonl", [{"environment": "echo", "task_index": 5, "prompt": "p", "reward": None,
                                                   "finished": False, "calls": [
        {"tool": "echo", "arguments": {"text": "a"}, "output": "a"},
        {"tool": "echo", "arguments": {"text": 1}, "error": "1 validation error", "error_kind": "refused"}]}])
    state = {"global_step": 2, "log_history": [{"step": 1, "reward": 0.5, "env/echo/reward_mean": 0.5},
                                               {"step": 2, "reward": 0.7, "env/echo/reward_mean": 0.75}]}
    (tmp_path / "out" / "checkpoint-9").mkdir(parents=True)
    (tmp_path / "out" / "checkpoint-10").mkdir()
    (tmp_path / "out" / "checkpoint-9" / "trainer_state.json").write_text(json.dumps({"log_history": []}))
    (tmp_path / "out" / "checkpoint-10" / "trainer_state.json").write_text(json.dumps(state, indent=2))
    compact = tmp_path / "state.json"
    compact.write_text(json.dumps(state))

    assert recognise(log).kind == recognise(evals).kind == recognise(legacy).kind == "episodes"
    folder = recognise(tmp_path / "out")
    assert folder.kind == "trainer_state" and folder.path.parent.name == "checkpoint-10"  # numerically latest
    assert recognise(tmp_path / "out" / "checkpoint-10" / "trainer_state.json").kind == "trainer_state"
    assert recognise(compact).kind == "trainer_state"
    (tmp_path / "out" / "trainer_state.json").write_text(json.dumps(state))
    assert recognise(tmp_path / "out").path == tmp_path / "out" / "trainer_state.json"  # the run's own, first

    summary = write_report([log, evals, legacy, tmp_path / "out", tmp_path / "out" / "trainer_state.json"],
                           tmp_path / "r.html")
    assert summary.episodes == 4 and summary.trainer_states == 1 and summary.log_steps == 2  # the folder counted once
    page = (tmp_path / "r.html").read_text()
    old = next(e for e in _episode_data(page) if e["rec"].get("task_index") == 5)
    calls = old["rec"]["turns"][0]["tool_calls"]
    assert [c["name"] for c in calls] == ["echo", "echo"] and calls[1]["error"] == {
        "kind": "refused", "message": "1 validation error"}
    assert old["tags"] == ["failure: refused", "unscored: no_reward"] and old["run"] == "old.jsonl"
    assert "<td>tool call failed: refused</td>" in page


@pytest.mark.parametrize("name, content, message", [
    ("missing.jsonl", None, "no such file or folder"),
    ("binary.bin", b"\x89PNG\r\n\x1a\n\x00\x00garbage", "not an episode log, eval output or trainer state"),
    ("other.jsonl", b'{"a": 1}\n{"b": 2}\n', "not an episode log, eval output or trainer state"),
    ("config.json", b'{\n  "model": "x"\n}\n', "not an episode log, eval output or trainer state"),
    ("empty-folder", "dir", "a folder without trainer_state.json"),
])
def test_bad_inputs_are_clear_errors(tmp_path, capsys, name, content, message) -> None:
    path = tmp_path / name
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        write_report([path], tmp_path / "r.html")
    assert main(["report", str(path), "--output", str(tmp_path / "r.html")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"ors-trl report: error: {path}" in err and message in err
    assert not (tmp_path / "r.html").exists()


def test_empty_log_and_missing_curves_are_said(tmp_path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    summary = write_report([empty], tmp_path / "a.html")
    page = (tmp_path / "a.html").read_text()
    assert summary.episodes == 0 and "No episode records were given" in page and "No trainer log given" in page
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": []}))
    write_report([write_lines(tmp_path / "e.jsonl", [v2()]), tmp_path / "trainer_state.json"], tmp_path / "b.html")
    assert "has no log_history" in (tmp_path / "b.html").read_text()


# -- escaping, the sample, the CLI ------------------------------------------------------------------------------


def test_hostile_text_stays_text(tmp_path) -> None:
    evil = HOSTILE + "\u2028\u2029 & <!-- <script"
    rec = v2(0, environment=f'"><img src=x>{evil}', run=evil, prompt=evil, system=evil, task_spec={"q": evil},
             final={"message": evil}, error={"kind": f"<b>{evil}", "message": evil}, end_reason=evil,
             unscored="error", reward=None)
    rec["turns"][0]["tool_calls"][0].update(name=evil, arguments={evil: evil}, output=evil,
                                            error={"kind": evil, "message": evil})
    rec["turns"][0]["assistant"] = evil
    nan = v2(1, reward=float("nan"), group_reward=float("inf"))  # NaN is not JSON: the page must still parse
    write_report([write_lines(tmp_path / "e.jsonl", [rec, nan])], tmp_path / "r.html", title=evil)
    page = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert_self_contained(page)
    assert "<img" not in page and "<b>" not in page and "<!--" not in page
    assert page.count("<script") == 3  # the error catcher, the JSON data, the page's script: no other
    assert page.count("</script>") == 3
    assert "\u2028" not in page.split('id="episode-data">')[1]
    data = _episode_data(page)
    assert data[0]["rec"]["turns"][0]["tool_calls"][0]["output"] == evil  # exact, nothing unescaped or lost
    assert data[0]["env"] == f'"><img src=x>{evil}' and data[0]["rec"]["task_spec"] == {"q": evil}
    assert data[1]["reward"] is None and data[1]["rec"]["reward"] == "nan" and data[1]["rec"]["group_reward"] == "inf"


def test_sample_is_bounded_deterministic_and_keeps_every_kind(tmp_path) -> None:
    records = [v2(i % 50, run=f"run-{i % 3}") for i in range(600)]
    records[123] = v2(7, reward=None, unscored="timeout", end_reason="timeout", finished=False, run="run-0")
    records[321]["turns"][0]["tool_calls"][0].update(error={"kind": "expired", "message": "gone"}, reward=None)
    records[456] = v2(8, reward=None, unscored="error", end_reason="error",
                      error={"kind": "transport", "message": "refused"}, run="run-0")
    log = write_lines(tmp_path / "e.jsonl", records)
    summary = write_report([log], tmp_path / "a.html", max_episodes=20)
    page = (tmp_path / "a.html").read_text()
    assert summary.episodes == 600 and summary.embedded == 20
    assert "Showing 20 of 600 episodes (sample; --max-episodes 20)" in page
    data = _episode_data(page)
    assert len(data) == 20
    tags = {t for e in data for t in e["tags"]}
    assert {"unscored: timeout", "failure: expired", "error: transport", "unscored: error"} <= tags
    assert {f"training · run-{i}" for i in range(3)} <= {e["run"] for e in data}
    # the per-run table still counts all 600
    runs = page.split("<table class='sortable runs'>")[1].split("</table>")[0]
    assert runs.count('<td class=num data-v="200">200</td>') == 3 and "tool call failed: expired" in page
    write_report([log], tmp_path / "b.html", max_episodes=20)
    assert _episode_data((tmp_path / "b.html").read_text()) == data  # the same sample every time
    assert write_report([log], tmp_path / "c.html", max_episodes=0).embedded == 0
    assert "Showing 0 of 600 episodes" in (tmp_path / "c.html").read_text()


def test_cli_exit_codes(tmp_path, capsys) -> None:
    log = write_lines(tmp_path / "e.jsonl", [v2(0), v2(1, reward=0.0)])
    out = tmp_path / "sub" / "r.html"
    assert main(["report", str(log), "--output", str(out), "--json", "--max-episodes", "1", "--title", "T"]) == EXIT_OK
    info = json.loads(capsys.readouterr().out)
    assert info["episodes"] == 2 and info["embedded"] == 1 and info["output"] == str(out) and out.is_file()
    assert "<title>T</title>" in out.read_text()
    assert main(["report", str(log), "-o", str(out)]) == EXIT_OK  # an existing page is replaced
    assert "Wrote" in capsys.readouterr().out
    assert main(["report", str(log), "--max-episodes", "-1"]) == EXIT_USAGE
    assert main(["report"]) == EXIT_USAGE
    assert main(["report", "--help"]) == EXIT_OK and "exit codes:" in capsys.readouterr().out
    assert main(["report", str(log), "--output", str(log / "r.html")]) == EXIT_ERROR  # a file where a folder must be
    assert "cannot write" in capsys.readouterr().err


def test_matplotlib_is_imported_only_for_curves() -> None:
    code = "import sys, ors_trl, ors_trl.cli, ors_trl.report; print('matplotlib' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


# -- inputs that used to break the page ------------------------------------------------------------------------


def deep(depth: int, leaf: Any) -> Any:
    for _ in range(depth):
        leaf = {"d": leaf}
    return leaf


def bad_inputs(tmp_path: Path) -> list[Path]:
    """A log that holds what the field sends: invalid UTF-8 in its first lines, a NaN nested deep in tool metadata,
    a lone surrogate, a record nested 3,000 deep, a cut line, foreign JSON; and trainer states with `$` in metric
    and run names (matplotlib would parse them as math)."""
    bad_utf8 = [json.dumps(v2(i)).replace('"Say word', '"Say \\u00e9 word').encode().replace(b"\\u00e9", b"\xff\xfe")
                for i in range(25)]
    deep_nan = v2(30, environment="deep")
    deep_nan["turns"][0]["tool_calls"][0]["metadata"] = deep(60, float("nan"))
    lines = [*bad_utf8, json.dumps(deep_nan).encode(),
             json.dumps(v2(31, prompt="lone \\ud800 surrogate")).encode().replace(b"\\\\ud800", b"\\ud800"),
             b'{"reward": 1, "turns": ' + b"[" * 3000 + b"]" * 3000 + b"}",
             b'{"version": 2, "turns": [', b'{"some": "other json"}', json.dumps(v2(32)).encode()]
    log = tmp_path / "field.jsonl"
    log.write_bytes(b"\n".join(lines) + b"\n")
    states = []
    for run in ("run-$a", "run-$b$"):
        (tmp_path / run).mkdir()
        state = {"log_history": [{"step": s, "reward": 0.1 * s, "env/co$^$t/reward_mean": 0.2 * s,
                                  "env/co$^$t/tool_calls_per_episode": 1.0} for s in (1, 2, 3)]}
        (tmp_path / run / "trainer_state.json").write_text(json.dumps(state))
        states.append(tmp_path / run)
    return [log, *states]


def test_report_of_field_inputs_is_always_written(tmp_path) -> None:
    inputs = bad_inputs(tmp_path)
    out = tmp_path / "field.html"
    summary = write_report(inputs, out)
    assert summary.episodes == 25 + 3 and summary.embedded == 28
    assert summary.skipped == 3 and summary.skipped_reasons == {
        "nested too deeply to read": 1, "not JSON (a cut or corrupt line)": 1, "not an episode record": 1}
    page = out.read_text(encoding="utf-8")  # strict UTF-8: nothing unencodable reached the page
    assert ("3 record(s) skipped: 1 nested too deeply to read, 1 not JSON (a cut or corrupt line), 1 not an "
            "episode record.") in page
    data = json.loads(re.search(r'id="episode-data">(.*?)</script>', page, re.S).group(1),
                      parse_constant=lambda name: pytest.fail(f"{name} in the page's JSON"))
    by_task = {e["rec"]["task_index"]: e["rec"] for e in data}
    assert by_task[0]["prompt"] == "Say \ufffd\ufffd word 0"  # the invalid UTF-8, replaced, not the whole log lost
    assert by_task[31]["prompt"] == "lone \ufffd surrogate"
    metadata = by_task[30]["turns"][0]["tool_calls"][0]["metadata"]
    for _ in range(60):
        metadata = metadata["d"]
    assert metadata == "nan"  # the NaN 65 levels down, spelled as text
    assert page.count("<figure class=chart><svg") == 2  # reward and tool calls, from both runs
    assert "run-$a: co$^$t" in page and "run-$b$: co$^$t" in page  # the labels as text, `$` and all


def test_bad_input_page_opens_in_chromium(chromium, tmp_path) -> None:
    out = tmp_path / "field.html"
    write_report(bad_inputs(tmp_path), out)
    result = run_chromium(chromium, tmp_path / "profile", "--dump-dom", out.as_uri() + "#expand")
    dom = result.stdout
    assert 'data-report-ready="1"' in dom, (result.returncode, result.stderr[-3000:])
    assert "data-js-error" not in re.search(r"<body[^>]*>", dom).group(0), dom[:3000]
    assert dom.count('class="ep-body"') == 28 and "lone \ufffd surrogate" in dom
    assert "3 record(s) skipped" in dom and "run-$b$: co$^$t" in dom


def test_one_huge_episode_does_not_hide_the_others(tmp_path) -> None:
    records = [v2(i) for i in range(6)]
    records[0]["turns"][0]["tool_calls"][0]["output"] = "x" * (13 * 2**20)  # over the page's 12 MB alone
    summary = write_report([write_lines(tmp_path / "e.jsonl", records)], tmp_path / "r.html")
    page = (tmp_path / "r.html").read_text()
    assert summary.embedded == 6 and len(page) < 14 * 2**20
    huge = next(e for e in _episode_data(page) if e["rec"]["task_index"] == 0)
    assert huge["rec"]["turns"][0]["tool_calls"][0]["output"].endswith(
        f"[... output truncated: 100000 of {13 * 2**20} characters shown ...]")
    assert "1 episode(s) too large for the 12 MB of episode bodies a page embeds are shown with every text cut" in page


# -- where the page is written ---------------------------------------------------------------------------------


def test_output_that_is_an_input_is_refused(tmp_path, capsys, monkeypatch) -> None:
    log = write_lines(tmp_path / "e.jsonl", [v2(0)])
    before = log.read_bytes()
    (tmp_path / "link.jsonl").symlink_to(log)
    os.link(log, tmp_path / "hard.jsonl")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "trainer_state.json").write_text(json.dumps({"log_history": []}))
    monkeypatch.chdir(tmp_path)
    for inputs, output in (([log], log), ([log], "link.jsonl"), (["link.jsonl"], log), ([log], "hard.jsonl"),
                           (["./sub/../e.jsonl"], "e.jsonl"), (["run"], "run/trainer_state.json")):
        (tmp_path / "sub").mkdir(exist_ok=True)
        assert main(["report", *map(str, inputs), "-o", str(output)]) == EXIT_USAGE, (inputs, output)
        err = capsys.readouterr().err
        assert "is the input" in err and "would replace it; pass another --output" in err
    assert log.read_bytes() == before and (tmp_path / "run" / "trainer_state.json").read_text() == '{"log_history": []}'
    assert main(["report", "run", str(log), "-o", "run/report.html"]) == EXIT_OK  # inside a trainer folder: fine
    assert "<html" in (tmp_path / "run" / "report.html").read_text()


def test_page_is_written_through_a_private_temporary_file(tmp_path) -> None:
    """The old temporary name (`.NAME.PID.tmp`) was predictable: a link planted there was followed."""
    log = write_lines(tmp_path / "e.jsonl", [v2(0)])
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    out = tmp_path / "r.html"
    (tmp_path / f".{out.name}.{os.getpid()}.tmp").symlink_to(victim)
    write_report([log], out)
    assert victim.read_text() == "keep me" and not out.is_symlink() and "<html" in out.read_text()
    mask = os.umask(0)
    os.umask(mask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~mask
    out.chmod(0o600)  # a page the user made private stays private when it is replaced
    write_report([log], out)
    assert out.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{out.name}.{os.getpid()}.tmp", "e.jsonl", "r.html",
                                                          "victim.txt"]  # no temporary file left behind


def test_a_key_in_the_inputs_is_not_spread(tmp_path, capsys) -> None:
    """The page shows what the records hold; it adds no copy of a key-like value elsewhere (labels, the skipped
    note, the console), and a line it skips is not quoted anywhere."""
    key = "sk-live-" + "7" * 32
    rec = v2(0)
    rec["turns"][0]["tool_calls"][0]["output"] = f"OPENREWARD_API_KEY={key}"
    log = tmp_path / "e.jsonl"
    log.write_text(json.dumps(rec) + "\n" + '{"reward": 1, "turns": [' + f'"{key}"' + ", \n" + json.dumps(v2(1)) + "\n")
    out = tmp_path / "r.html"
    assert main(["report", str(log), "-o", str(out)]) == EXIT_OK
    captured = capsys.readouterr()
    assert key not in captured.out + captured.err
    page = out.read_text()
    assert page.count(key) == 1  # in the embedded record, once, where the record has it
    assert f"OPENREWARD_API_KEY={key}" in json.dumps(_episode_data(page))
    assert "1 record(s) skipped: 1 not JSON" in page
    assert main(["report", str(log), "-o", str(out), "--json"]) == EXIT_OK
    assert key not in capsys.readouterr().out


# -- success, the page's files ----------------------------------------------------------------------------------


def task_cells(page: str) -> dict[str, list[str]]:
    """The per-task table: task -> the sort values of its number cells (one run: episodes, mean reward, graded,
    finished, success rate, tool calls / episode, tool-call failures, no tool call; several: each run's success, the
    change; then in sample)."""
    rows = re.findall(r'<tr class=task data-env="[^"]*" data-task="([^"]*)">(.*?)</tr>', page)
    return {task: re.findall(r'data-v="([^"]*)"', cells) for task, cells in rows}


def test_tasks_are_in_their_numbers_order(tmp_path) -> None:
    """`train #2` before `train #19` (not as strings: #10, #19, #2), in the table, the flips and the filters."""
    order = [19, 2, 20, 1, 10]
    before = write_lines(tmp_path / "before.jsonl", [v2(i, reward=0.0) for i in order])
    after = write_lines(tmp_path / "after.jsonl", [v2(i, reward=1.0, run="host-1-2") for i in order])
    out = tmp_path / "r.html"
    write_report([], out, labels={"before": before, "after": after})
    page = out.read_text()
    assert list(task_cells(page)) == [f"train #{i}" for i in sorted(order)]
    assert ("Flipped, solved now, not before: 5 (echo train #1, echo train #2, echo train #10, echo train #19, "
            "echo train #20)") in page
    assert "localeCompare(b, undefined, {numeric: true})" in page  # the episode browser's task filter too


def test_success_threshold_sets_what_succeeds(tmp_path, capsys) -> None:
    rewards = {0: [1.0, 0.5], 1: [0.7, None], 2: [0.2, 0.0]}  # task: [run-0's reward, run-1's]
    log = write_lines(tmp_path / "e.jsonl", [v2(i, reward=r, run=f"run-{k}") for i, rs in rewards.items()
                                             for k, r in enumerate(rs)])
    for threshold in (1.0, 0.5, 0.1):
        out = tmp_path / f"r-{threshold}.html"
        kwargs = {} if threshold == 1.0 else {"success_threshold": threshold}  # 1.0: the default
        write_report(log if threshold == 0.1 else [log], out, **kwargs)  # one input needs no list
        page = out.read_text()
        by_task = {i: [float(r is not None and r >= threshold) for r in rs] for i, rs in rewards.items()}
        assert {int(task.split("#")[1]): [float(x) for x in v[:2]] for task, v in task_cells(page).items()} == by_task
        assert f"Success: reward &ge; {threshold:g}" in page
        runs = page.split("<table class='sortable runs'>")[1].split("</table>")[0]
        for k in (0, 1):  # each run's success over its own three episodes, never the six pooled
            rate = sum(rs[k] is not None and rs[k] >= threshold for rs in rewards.values()) / 3
            assert re.search(rf"<td>training · run-{k}</td><td>echo train</td><td class=num data-v=\"3\">3</td>"
                             rf"<td class=num data-v=\"3\">3</td><td class=num data-v=\"{rate}\">", runs), threshold
    out = tmp_path / "cli.html"
    assert main(["report", str(log), "-o", str(out), "--success-threshold", "0.5"]) == EXIT_OK
    assert task_cells(out.read_text()) == task_cells((tmp_path / "r-0.5.html").read_text())
    for bad in ("half", "nan", "inf"):
        assert main(["report", str(log), "-o", str(out), "--success-threshold", bad]) == EXIT_USAGE
        assert "--success-threshold: expected a number" in capsys.readouterr().err
    with pytest.raises(ConfigurationError, match="success_threshold must be a finite number"):
        write_report([log], out, success_threshold="1")


def test_page_styles_script_and_skeleton_are_the_package_data(tmp_path) -> None:
    write_report([write_lines(tmp_path / "e.jsonl", [v2(0)])], tmp_path / "r.html")
    page = (tmp_path / "r.html").read_text()
    data = files("ors_trl.report")
    for name in ("page.css", "page.js"):
        text = data.joinpath(name).read_text(encoding="utf-8")
        assert len(text) > 1000 and text in page, name
    skeleton = [line for line in data.joinpath("page.html").read_text(encoding="utf-8").splitlines() if "$" not in line]
    assert len(skeleton) > 20 and all(line in page for line in skeleton)
    # a wheel ships them: every data file of the package folder is declared as package data
    pyproject = tomllib.loads((Path(SRC).parent / "pyproject.toml").read_text())
    declared = pyproject["tool"]["setuptools"]["package-data"]["ors_trl.report"]
    folder = Path(SRC) / "ors_trl" / "report"
    assert sorted(declared) == sorted(p.name for p in folder.iterdir() if p.is_file() and p.suffix != ".py")


def test_records_with_fields_of_the_wrong_type_are_skipped(tmp_path) -> None:
    log = write_lines(tmp_path / "e.jsonl", [{"reward": 1, "turns": 5}, v2(0),
                                             {"environment": "e", "reward": 1, "turns": [{"tool_calls": 3}]}])
    summary = write_report([log], tmp_path / "r.html")
    assert summary.episodes == 1 and summary.skipped_reasons == {"unreadable as an episode (TypeError)": 2}
    assert "2 record(s) skipped: 2 unreadable as an episode (TypeError)." in (tmp_path / "r.html").read_text()


# -- runs side by side ------------------------------------------------------------------------------------------

# Successes of the two episodes of six echo tasks, before and after: per task 0/2 -> 2/2, 0 -> 2, 1 -> 2, 2 -> 2,
# 2 -> 0, 0 -> 0 (success 0, 0, 50, 100, 100, 0% -> 100, 100, 100, 100, 0, 0%).
BEFORE = {"hello": 0, "world": 0, "trl": 1, "openreward": 2, "spec": 2, "factory": 0}
AFTER = {"hello": 2, "world": 2, "trl": 2, "openreward": 2, "spec": 0, "factory": 0}


class CountingEchoPolicy:
    """Echoes the word right in the first `right[word]` episodes of its task (whatever the order), wrong after."""

    description = "counting-echo"

    def __init__(self, right: dict[str, int]) -> None:
        self.right, self.seen = right, dict.fromkeys(right, 0)

    async def respond(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> PolicyReply:
        if messages[-1]["role"] == "tool":
            return PolicyReply(content="Done.")
        word = re.search(r'exactly this text: "([^"]+)"', messages[-1]["content"]).group(1)
        self.seen[word] += 1
        text = word if self.seen[word] <= self.right[word] else word + "?"
        return PolicyReply(content="", tool_calls=[{"id": "c", "name": "echo", "arguments": {"text": text}}])


@pytest.fixture(scope="module")
def before_after(ref_server, tmp_path_factory) -> tuple[Path, Path]:
    """Two evaluations of the same six tasks by one process and one policy name, as the demo writes them."""
    tmp = tmp_path_factory.mktemp("compare")
    spec = OpenRewardSpec(ref_server.url, env_name="echoenvironment", num_tasks=6)
    try:
        for name, right in (("eval_before.jsonl", BEFORE), ("eval_after.jsonl", AFTER)):
            spec.evaluate(CountingEchoPolicy(right), repeats=2, output=str(tmp / name), progress=False)
    finally:
        spec.close()
    return tmp / "eval_before.jsonl", tmp / "eval_after.jsonl"


def test_two_runs_compared_task_by_task(before_after, tmp_path, capsys) -> None:
    before, after = before_after
    out = tmp_path / "r.html"
    # one process, one policy: the two files cannot be told apart without names, and nothing is written
    with pytest.raises(ConfigurationError, match=r"both hold episodes of one run .* name them with --label"):
        write_report([before, after], out)
    assert main(["report", str(before), str(after), "-o", str(out)]) == EXIT_USAGE
    assert f"--label before={before} --label after={after}" in capsys.readouterr().err and not out.exists()

    assert main(["report", "--label", f"before={before}", "--label", f"after={after}", "-o", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["run_names"] == ["before", "after"] and info["episodes"] == 24 and info["skipped"] == 0
    page = out.read_text()
    # the answer first, then each run apart, the curves, and the task table (collapsed)
    assert page.index('id="headline"') < page.index('id="runs"') < page.index('id="curves"') < page.index('id="tasks"')
    headline = page.split('id="headline"')[1].split('id="runs"')[0]
    assert ("after vs before: success 41.7% → 66.7% (+25.0 points) over 6 shared task(s); paired test over tasks "
            "p = 0.625 (exact): within noise") in headline
    assert "Flipped, solved now, not before: 2 (echoenvironment train #0, echoenvironment train #1)" in headline
    assert "Flipped, solved before, not now: 1 (echoenvironment train #4)" in headline
    tasks = page.split('id="tasks"')[1].split("</section>")[0]
    assert tasks.startswith("><h2>Tasks</h2><details id=task-table><summary>Per task: 6 task(s), in their numbers")
    assert "after vs before: 3 improved, 1 worse, 2 unchanged, 0 not run by both before and after" in tasks
    # grouped by change (improved, worse, unchanged), each group in task order: before, after, change, in sample
    groups = [re.findall(r'data-task="train #(\d)">.*?data-v="([^"]*)".*?data-v="([^"]*)".*?data-v="([^"]*)"', g)
              for g in re.split(r"<h3>", tasks)[1:]]
    assert groups == [[("0", "0.0", "1.0", "1.0"), ("1", "0.0", "1.0", "1.0"), ("2", "0.5", "1.0", "0.5")],
                      [("4", "1.0", "0.0", "-1.0")], [("3", "1.0", "1.0", "0.0"), ("5", "0.0", "0.0", "0.0")]]
    runs = page.split("<table class='sortable runs'>")[1].split("</table>")[0]
    assert re.search(r"<td>before</td><td>echoenvironment train</td><td class=num data-v=\"12\">12</td><td class=num data-v=\"6\">6</td>"
                     r"<td class=num data-v=\"0.4166", runs)
    assert runs.count('<td class=num data-v="1.0">100.0%</td>') == 2  # every episode graded, in both runs
    # pass@2 of "before": tasks with 0, 0, 1, 2, 2, 0 successes of 2 -> (0 + 0 + 1 + 1 + 1 + 0) / 6
    assert 'pass@2 0.500' in runs and 'pass@2 0.667' in runs
    # a label that names no file, one file given two names, a threshold outside the rewards seen: usage errors
    for args, message in (([f"before={tmp_path / 'missing.jsonl'}"], "no such file or folder"),
                          ([f"a={before}", f"b={before}"], "is labelled twice, 'a' and 'b'")):
        fresh = tmp_path / "fresh.html"
        assert main(["report", *(x for a in args for x in ("--label", a)), "-o", str(fresh)]) == EXIT_USAGE
        assert message in capsys.readouterr().err and not fresh.exists()
    assert main(["report", "--label", "=x"]) == EXIT_USAGE and "expected NAME=FILE" in capsys.readouterr().err
    fresh = tmp_path / "fresh.html"
    assert main(["report", "--label", f"before={before}", "--label", f"after={after}", "-o", str(fresh),
                 "--success-threshold", "1.5"]) == EXIT_USAGE
    assert "outside the rewards seen (0 to 1)" in capsys.readouterr().err and not fresh.exists()


def test_one_environment_on_two_ports_is_one_name_and_compares(make_server, tmp_path) -> None:
    """The environment's own name in records, metrics and the eval report (not its server's `127.0.0.1:PORT`), so a
    run on one port compares with a run on another; the page says where each ran."""
    servers = [make_server("echo"), make_server("echo")]
    assert servers[0].url != servers[1].url
    outputs, flushed = [], []
    for when, server, right in (("before", servers[0], BEFORE), ("after", servers[1], AFTER)):
        log, out = tmp_path / f"train_{when}.jsonl", tmp_path / f"eval_{when}.jsonl"
        spec = OpenRewardSpec(server.url, num_tasks=6, episode_log=str(log))  # no env_name: the server's one
        try:
            row = {k: v for k, v in spec.train_dataset[0].items() if k != "environment"}
            env = spec.environment_factory()
            env.reset(**row)
            env.echo(text=row["target"])
            logged: dict[str, float] = {}
            assert spec.reward_funcs([env], log_metric=logged.__setitem__) == [1.0]
            flushed.append(logged)
            report = spec.evaluate(CountingEchoPolicy(right), repeats=2, output=str(out), progress=False)
        finally:
            spec.close()
        assert spec.name == report.environment == "echoenvironment"
        assert {r["environment"] for r in map(json.loads, [*log.read_text().splitlines(),
                                                           *out.read_text().splitlines()])} == {"echoenvironment"}
        assert {json.loads(line)["target"] for line in out.read_text().splitlines()} == {server.url}
        outputs.append(out)
    for metrics in flushed:
        assert metrics["env/echoenvironment/episodes"] == 1 and "env/echoenvironment/sessions_open" in metrics
        assert not [k for k in metrics if "127.0.0.1" in k]
    page = tmp_path / "r.html"
    write_report([], page, labels={"before": outputs[0], "after": outputs[1]})
    text = page.read_text()
    assert "after vs before: success 41.7% → 66.7% (+25.0 points) over 6 shared task(s)" in text
    for when, server in zip(("before", "after"), servers, strict=True):  # where each ran: the two servers differ
        assert f"<td>{when}</td><td>echoenvironment train at {server.url.split('://')[1]}</td>" in text


def test_comparison_page_opens_in_chromium(before_after, chromium, tmp_path) -> None:
    before, after = before_after
    out = tmp_path / "r.html"
    write_report([], out, labels={"before": before, "after": after})
    result = run_chromium(chromium, tmp_path / "profile", "--dump-dom", out.as_uri())
    dom = result.stdout
    assert 'data-report-ready="1"' in dom, (result.returncode, result.stderr[-3000:])
    assert "data-js-error" not in re.search(r"<body[^>]*>", dom).group(0)
    assert '<p class="headline" data-verdict="noise">after vs before: success 41.7% → 66.7%' in dom
    assert dom.count('<tr class="task" data-env="echoenvironment" data-task="train #') == 6  # the task rows
    assert '<details id="task-table"><summary>' in dom  # collapsed: the answer is on the first screen
    assert '<option value="after">after</option>' in dom and '<option value="before">before</option>' in dom
    shot = tmp_path / "first-screen.png"
    run_chromium(chromium, tmp_path / "profile-shot", f"--screenshot={shot}", "--window-size=1280,800",
                 "--hide-scrollbars", out.as_uri())
    assert shot.is_file() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"comparison screenshot: {shot}")
