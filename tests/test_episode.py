"""The episode core's newer ORS surface, through every driver: terminal tools, conversations, group scores.

Against the reference server: `QuizEnvironment` (a system turn, graded by a terminal tool on the final message),
`SwitchEnvironment` (a terminal tool without an argument), `JudgeEnvironment` (`/score_group`), and an older-shape
server (the same reference server behind a proxy that answers `/tools` without the new fields and has no
`/messages`).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import re

import pytest

from ors_trl import ConfigurationError, OpenRewardMix, OpenRewardSpec, PolicyReply
from ors_trl.protocol.errors import ORSError
from ors_trl.testing.faults import Delay, FaultProxy, Reply, Status
from tests.fixtures.environments import CAPITALS, QUIZ_SYSTEM
from tests.fixtures.generation import (
    cpu_grpo_trainer,
    generate_and_score,
    logged_rewards,
    replace_generation,
    tool_call_text,
)

pytestmark = pytest.mark.usefixtures("no_leaked_sessions")

QUIZ, SWITCH, JUDGE = "quizenvironment", "switchenvironment", "judgeenvironment"


def call(name: str, **arguments) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                                                                "function": {"name": name, "arguments": arguments}}]}


def said(text: str) -> dict:
    return {"role": "assistant", "content": text}


def tool(text: str) -> dict:
    return {"role": "tool", "name": "t", "content": text}


def count(server, key: str) -> int:
    return server.stats()["tool_calls"].get(key, 0)


# ---------------------------------------------------------------------------------------------------------
# Terminal tools on the environment_factory path (graded in spec.reward_funcs)


def test_terminal_tool_grades_the_final_message(ref_server) -> None:
    spec = OpenRewardSpec(ref_server.url, env_name=QUIZ)
    assert spec.terminal_tool is not None and spec.terminal_tool.name == "answer" and spec.terminal_tool.arg == "answer"
    assert sorted(spec.binding.display_names.values()) == ["lookup"]  # the model is never offered the terminal tool
    rows = spec.train_dataset
    envs = [spec.environment_factory() for _ in range(4)]
    for env, row in zip(envs, rows, strict=True):
        assert env.reset(**row).startswith(QUIZ_SYSTEM)  # TRL's loop gets the system turn as text, every word
    for env, row in zip(envs[:3], list(rows)[:3], strict=True):
        env.lookup(country=row["country"])
    capitals = [row["capital"] for row in rows]
    completions = [
        [call("lookup", country="x"), tool("..."), said(f"{capitals[0]}.")],  # right
        [call("lookup", country="x"), tool("..."), said("Atlantis")],  # wrong
        [call("lookup", country="x"), tool("..."), call("lookup", country="y")],  # the turn limit: that call not run
        [said(capitals[3])],  # right, without looking
    ]
    before = count(ref_server, f"{QUIZ}/answer")
    logged: dict[str, float] = {}
    rewards = spec.reward_funcs(envs, completions=completions, log_metric=logged.__setitem__)
    assert rewards == [1.0, 0.0, None, 1.0]
    assert count(ref_server, f"{QUIZ}/answer") - before == 3  # the cut-off rollout never reached it
    assert [env.finished for env in envs] == [True, True, False, True]
    assert logged[f"env/{QUIZ}/unscored/cut_off"] == 1 and logged[f"env/{QUIZ}/graded_fraction"] == 0.75
    record = envs[1].episode.record()
    assert record["final"]["message"] == "Atlantis" and record["final"]["reward"] == 0.0
    assert record["final"]["metadata"] == {"expected": capitals[1], "given": "Atlantis"}
    assert record["system"] == QUIZ_SYSTEM and record["turns"][0]["tool_calls"][0]["name"] == "lookup"
    cut = envs[2].episode.record()
    assert cut["end_reason"] == "max_turns" and cut["turns"][1]["tool_calls"][0]["status"] == "not_run"
    assert cut["tool_calls"] == 1  # the call TRL did not run is not counted
    assert spec.reward_funcs(envs, completions=completions) == [1.0, 0.0, None, 1.0]  # settled once, not twice
    assert count(ref_server, f"{QUIZ}/answer") - before == 3
    spec.close()


def test_terminal_tool_without_an_argument(ref_server) -> None:
    spec = OpenRewardSpec(ref_server.url, env_name=SWITCH)
    assert spec.terminal_tool is not None and spec.terminal_tool.arg is None
    envs = [spec.environment_factory() for _ in range(2)]
    for env in envs:
        env.reset(**spec.train_dataset[0])
    envs[0].flip()
    rewards = spec.reward_funcs(envs, completions=[[call("flip"), tool("on"), said("done")], [said("done")]])
    assert rewards == [1.0, 0.0]
    assert envs[0].episode.record()["final"]["tool"] == "check"
    spec.close()


# ---------------------------------------------------------------------------------------------------------
# Group scores


def test_group_scores_are_index_aligned_one_call_per_group(ref_server) -> None:
    spec = OpenRewardSpec(ref_server.url, env_name=JUDGE, score_groups=True)
    group_reward = spec.group_reward_func
    rows = spec.train_dataset
    words = list(rows["word"])
    # two groups of three, interleaved in the batch as a shuffled GRPO batch may be
    plan = [(0, "the {w} runs"), (1, "a {w}"), (0, "a {w}"), (1, "nothing"), (0, "none"), (1, "the long {w} here")]
    envs = [spec.environment_factory() for _ in plan]
    completions = []
    for env, (task, text) in zip(envs, plan, strict=True):
        env.reset(**rows[task])
        sentence = text.format(w=words[task])
        env.say(text=sentence)
        completions.append([call("say", text=sentence), tool(sentence), said(sentence)])
    before = count(ref_server, f"{JUDGE}/score_group")
    logged: dict[str, float] = {}
    scores = group_reward(envs, completions=completions, log_metric=logged.__setitem__)
    assert scores == [0.5, 1.0, 1.0, 0.0, 0.0, 0.5]
    assert count(ref_server, f"{JUDGE}/score_group") - before == 2
    assert logged[f"env/{JUDGE}/groups_scored"] == 2 and logged[f"env/{JUDGE}/group_failures"] == 0
    assert spec.reward_funcs(envs, completions=completions) == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]  # pointwise, apart
    assert envs[0].episode.record()["group_reward"] == 0.5
    spec.close()


def test_group_scoring_needs_support_and_asking(ref_server) -> None:
    with pytest.raises(ConfigurationError, match="score_groups=True"):
        OpenRewardSpec(ref_server.url, env_name=JUDGE).group_reward_func  # noqa: B018
    with pytest.raises(ConfigurationError, match="does not support group scoring"):
        OpenRewardSpec(ref_server.url, env_name="echoenvironment", score_groups=True).group_reward_func  # noqa: B018
    mix = OpenRewardMix({"judge": OpenRewardSpec(ref_server.url, env_name=JUDGE, score_groups=True),
                         "echo": OpenRewardSpec(ref_server.url, env_name="echoenvironment")})
    assert callable(mix.group_reward_func)
    mix.close()


# ---------------------------------------------------------------------------------------------------------
# Older servers


def _old_shape(proxy: FaultProxy, server, env: str) -> None:
    """Make `proxy` look like a server from before SDK 0.1.157: no new /tools fields, no /messages."""
    import urllib.request

    with urllib.request.urlopen(f"{server.url}/{env}/tools", timeout=10) as resp:
        listed = json.loads(resp.read())
    old = {"tools": listed["tools"]}
    proxy.add(Reply(json.dumps(old)), path="/tools", times=None)
    proxy.add(Reply(json.dumps(old)), path="/task_tools", times=None)
    proxy.add(Status(404, "Not Found"), path="/messages", times=None)


def test_an_older_server_is_used_as_before(ref_server) -> None:
    with FaultProxy(ref_server.url) as proxy:
        _old_shape(proxy, ref_server, "echoenvironment")
        spec = OpenRewardSpec(proxy.url, env_name="echoenvironment", num_tasks=2)
        assert spec.terminal_tool is None
        with pytest.raises(ConfigurationError, match="does not support"):
            OpenRewardSpec(proxy.url, env_name="echoenvironment", score_groups=True).group_reward_func  # noqa: B018
        envs = [spec.environment_factory() for _ in range(2)]
        for env, row in zip(envs, spec.train_dataset, strict=True):
            assert row["target"] in env.reset(**row)
            env.echo(text=row["target"])
        assert spec.reward_funcs(envs, completions=[[said("done")]] * 2) == [1.0, 1.0]
        assert proxy.count("/messages") == 0 and proxy.count("/prompt") == 2  # never asked for what it lacks
        spec.close()


def test_a_missing_messages_route_is_probed_once(ref_server, caplog) -> None:
    with FaultProxy(ref_server.url) as proxy:
        proxy.add(Status(404, "Not Found"), path="/messages", times=None)
        spec = OpenRewardSpec(proxy.url, env_name=QUIZ, num_tasks=3)
        envs = [spec.environment_factory() for _ in range(3)]
        with caplog.at_level("WARNING", logger="ors_trl"):
            prompts = [env.reset(**row) for env, row in zip(envs, spec.train_dataset, strict=True)]
        assert proxy.count("/messages") == 1 and proxy.count("/prompt") == 3
        assert all(QUIZ_SYSTEM in p and "capital of" in p for p in prompts)  # the server's flattening, kept whole
        assert "advertises /messages but has no such route" in caplog.text
        spec.close()


# ---------------------------------------------------------------------------------------------------------
# The engine and eval: the system turn is a system message; terminal tools grade there too


def _quiz_generation(trainer):
    """Turn 1: look the country up (no tool for odd-numbered tasks: answer at once). Turn 2: the right capital
    for France and Kenya, a wrong one otherwise; Japan keeps calling `lookup` (cut off by the turn limit)."""
    tok = trainer.processing_class
    capital = dict(CAPITALS)

    def generate(prompt_ids, *args, **kwargs):
        out = []
        for ids in prompt_ids:
            text = tok.decode(ids)
            country = re.findall(r"capital of (\w+)\?", text)[0]
            if country == "Japan" or "<tool_response>" not in text:
                body = tool_call_text("lookup", {"country": country})
            else:
                body = capital[country] if country in ("France", "Kenya") else "Atlantis"
            out.append(tok.encode(body + "<|im_end|>", add_special_tokens=False))
        return out, None

    return generate


def _trainer(model_dir, spec, mode: str, tmp_path):
    trainer = cpu_grpo_trainer(model_dir, str(tmp_path / mode), batch=8, turns=2, completion_length=160, spec=spec,
                               mode=mode)
    replace_generation(trainer, _quiz_generation(trainer))
    return trainer


@pytest.mark.parametrize("mode", ["env", "engine"])
def test_grpo_trainer_on_a_terminal_graded_environment(tiny_model_dir, ref_server, tmp_path, mode) -> None:
    """A real GRPOTrainer step, through TRL's own loop and through the engine: the terminal tool's rewards reach
    TRL (France, Kenya right; Peru wrong; Japan cut off: None), and no session is left open."""
    pytest.importorskip("trl")
    spec = OpenRewardSpec(ref_server.url, env_name=QUIZ)
    trainer = _trainer(tiny_model_dir, spec, mode, tmp_path)
    rows = [copy.deepcopy(spec.train_dataset[i]) for i in range(4) for _ in range(2)]
    before = count(ref_server, f"{QUIZ}/answer")
    out = generate_and_score(trainer, rows)
    rewards = logged_rewards(trainer, 8)["outcome_reward"]
    expected = {"France": 1.0, "Japan": None, "Kenya": 1.0, "Peru": 0.0}
    assert rewards == [expected[row["country"]] for row in rows]
    assert count(ref_server, f"{QUIZ}/answer") - before == 6  # Japan's rollouts never answered
    prompt = trainer.processing_class.decode(out["prompt_ids"][0][out["prompt_mask"][0].bool()])
    if mode == "engine":  # a real system message; TRL's own loop can only append text to the user turn
        assert prompt.startswith(f"<|im_start|>system\n{QUIZ_SYSTEM}")
        assert spec.rollout_func.last_episodes[0].record()["end_reason"] == "finished"
    else:
        assert f"<|im_start|>user\n{QUIZ_SYSTEM}\n\nWhat is the capital" in prompt
    spec.close()
    assert ref_server.stats()["open_sessions"] == 0


@pytest.mark.parametrize("policy", ["partial", "drop"])
def test_a_voided_rollout_gets_no_group_score(ref_server, policy) -> None:
    """Decision 15 holds for group scores: a rollout whose environment failed (a 500 on its call) has no group reward,
    and with `failed_groups="drop"` its whole group has none, as it has no outcome reward (TRL sums the two: the
    voided rollout, or the dropped group, trained on its group score)."""
    with FaultProxy(ref_server.url) as proxy:
        proxy.add(Status(500, "sandbox crashed"), path="/call")  # the first rollout's call
        spec = OpenRewardSpec(proxy.url, env_name=JUDGE, score_groups=True, failed_groups=policy)
        try:
            envs = [spec.environment_factory() for _ in range(3)]
            word = spec.train_dataset[0]["word"]
            for env in envs:
                env.reset(**spec.train_dataset[0])
                with contextlib.suppress(ORSError):
                    env.say(text=f"the {word}")
            completions = [[call("say", text=f"the {word}"), tool("..."), said("done")]] * 3
            rewards = spec.reward_funcs(envs, completions=completions)
            groups = spec.group_reward_func(envs, completions=completions)
        finally:
            spec.close()
    assert envs[0].episode.broken and rewards[0] is None and groups[0] is None
    if policy == "drop":
        assert rewards == groups == [None] * 3
    else:
        assert rewards[1:] == [1.0, 1.0] and None not in groups[1:]


def test_a_voided_rollout_is_no_candidate_of_its_group(ref_server) -> None:
    """The judge compares the rollouts that count: a voided one (its sandbox failed) is not sent to `/score_group`, so
    its partial transcript cannot change the others' scores (here it was the shortest answer: the valid one got 0.5)."""
    with FaultProxy(ref_server.url) as proxy:
        proxy.add(Status(500, "sandbox crashed"), path="/call")  # the first rollout's call
        spec = OpenRewardSpec(proxy.url, env_name=JUDGE, score_groups=True)
        try:
            envs = [spec.environment_factory() for _ in range(2)]
            word = spec.train_dataset[0]["word"]
            finals = [f"a {word}", f"the long {word}"]
            for env, final in zip(envs, finals, strict=True):
                env.reset(**spec.train_dataset[0])
                with contextlib.suppress(ORSError):
                    env.say(text=final)
            completions = [[call("say", text=final), tool("..."), said(final)] for final in finals]
            groups = spec.group_reward_func(envs, completions=completions)
            (body,) = [r.json() for r in proxy.requests if r.path.endswith("/score_group")]
        finally:
            spec.close()
    assert envs[0].episode.broken and groups == [None, 1.0] and len(body["candidates"]) == 1


def test_a_parallel_call_after_the_episode_finished_does_not_void_it(ref_server) -> None:
    """Two calls of one reply run at once (`async_tools`): the first finishes the episode, which frees its session;
    the second then meets a session that no longer exists. The episode finished with its reward: that 404 is no
    environment failure (it was unscored `error`)."""
    with FaultProxy(ref_server.url) as proxy:  # the second call reaches the server after the first freed the session
        proxy.add(Delay(2), path="/call", when=lambda seen: "later" in seen.json()["input"]["text"])
        spec = OpenRewardSpec(proxy.url, env_name=JUDGE, async_tools=True)
        try:
            env = spec.environment_factory()
            env.reset(**spec.train_dataset[0])
            said_ = [f"a {spec.train_dataset[0]['word']}", "later"]

            async def both():
                return await asyncio.gather(*(env.say(text=t) for t in said_), return_exceptions=True)

            results = asyncio.run(both())
            reply = {**call("say"), "tool_calls": [c for t in said_ for c in call("say", text=t)["tool_calls"]]}
            rewards = spec.reward_funcs([env], completions=[[reply, tool("."), tool("."), said("done")]])
        finally:
            spec.close()
    assert results[0] == said_[0] and isinstance(results[1], ORSError)  # the second did fail
    assert rewards == [1.0] and env.episode.end_reason == "finished" and env.episode.unscored is None


def test_eval_sees_the_system_turn_and_the_terminal_grade(ref_server) -> None:
    seen: list[list[dict]] = []

    class Quizzer:
        async def respond(self, messages, tools):
            seen.append(messages)
            country = re.findall(r"capital of (\w+)\?", messages[1]["content"])[0]
            if len(messages) == 2:
                return PolicyReply(tool_calls=[{"id": None, "name": "lookup", "arguments": {"country": country}}])
            return PolicyReply(content=messages[-1]["content"].split(" is ")[-1])  # "Paris." from the tool

    spec = OpenRewardSpec(ref_server.url, env_name=QUIZ)
    report = spec.evaluate(Quizzer(), progress=False)
    assert report.mean_reward == 1.0 and report.coverage == 1.0 and report.end_reasons == {"finished": 4}
    assert seen[0][0] == {"role": "system", "content": QUIZ_SYSTEM} and seen[0][1]["role"] == "user"
    assert report.episodes[0]["final"]["tool"] == "answer" and report.episodes[0]["system"] == QUIZ_SYSTEM


@pytest.mark.parametrize("retries", [0, 1])
def test_a_terminal_grade_the_environment_fails_is_an_error(ref_server, retries) -> None:
    """Decision 15 holds for the terminal tool too: the server failing the grade (a 500, a crashed sandbox) ends the
    episode unscored `error`, an error evaluation counts and `episode_retries` replays; not `no_reward`."""

    class Quizzer:
        async def respond(self, messages, tools):
            if len(messages) == 2:
                country = re.findall(r"capital of (\w+)\?", messages[1]["content"])[0]
                return PolicyReply(tool_calls=[{"name": "lookup", "arguments": {"country": country}}])
            return PolicyReply(content=messages[-1]["content"].split(" is ")[-1])

    with FaultProxy(ref_server.url) as proxy:
        proxy.add(Status(500, "sandbox crashed"), path="/call", when=lambda seen: seen.json()["name"] == "answer")
        spec = OpenRewardSpec(proxy.url, env_name=QUIZ, num_tasks=2, episode_retries=retries)
        try:
            report = spec.evaluate(Quizzer(), progress=False, concurrency=1)
        finally:
            spec.close()
    if retries:
        assert report.episode_retries == 1 and [e["reward"] for e in report.episodes] == [1.0, 1.0]
    else:
        failed = report.episodes[0]
        assert (failed["end_reason"], failed["unscored"], failed["reward"]) == ("error", "error", None)
        assert failed["final"]["error"]["kind"] != "refused" and report.num_errors == 1


def test_eval_reports_group_scores(ref_server) -> None:
    class Sayer:
        async def respond(self, messages, tools):
            word = re.findall(r'word "(\w+)"', messages[0]["content"])[0]
            return PolicyReply(content=f"the {word} again")

    spec = OpenRewardSpec(ref_server.url, env_name=JUDGE, score_groups=True)
    before = count(ref_server, f"{JUDGE}/score_group")
    report = spec.evaluate(Sayer(), num_tasks=2, repeats=2, score_groups=True, progress=False)
    assert count(ref_server, f"{JUDGE}/score_group") - before == 2  # one per task (its repeats are the group)
    assert all(e["group_reward"] is not None for e in report.episodes) and report.mean_group_reward is not None


def test_a_group_score_sees_the_final_message_once(ref_server) -> None:
    """The transcript `/score_group` judges holds the model's final plain reply once (it was sent twice: as the last
    turn and again as the final message), so a judge counting or comparing replies sees the rollout as played."""

    class Sayer:
        async def respond(self, messages, tools):
            if messages[-1]["role"] == "tool":
                return PolicyReply(content="All said.")
            word = re.findall(r'word "(\w+)"', messages[0]["content"])[0]
            return PolicyReply(tool_calls=[{"name": "say", "arguments": {"text": f"the {word}"}}])

    with FaultProxy(ref_server.url) as proxy:
        spec = OpenRewardSpec(proxy.url, env_name=JUDGE, score_groups=True)
        try:
            spec.evaluate(Sayer(), num_tasks=1, repeats=2, score_groups=True, progress=False)
        finally:
            spec.close()
        (body,) = [r.json() for r in proxy.requests if r.path.endswith("/score_group")]
    for candidate in body["candidates"]:
        assert [m["role"] for m in candidate["messages"]] == ["user", "assistant", "user", "assistant"]
        assert candidate["messages"][-1]["blocks"] == [{"type": "text", "text": "All said."}]


def test_engine_scores_groups_and_trl_logs_them(tiny_model_dir, ref_server, tmp_path) -> None:
    """Through `rollout_func`: both reward functions reach TRL, the group score once per GRPO group."""
    spec = OpenRewardSpec(ref_server.url, env_name=JUDGE, score_groups=True)
    trainer = cpu_grpo_trainer(tiny_model_dir, str(tmp_path), turns=1, completion_length=320, spec=spec, mode="engine",
                               reward_funcs=[spec.reward_funcs, spec.group_reward_func])
    tok = trainer.processing_class
    replies = iter(["the {w} flows", "a much longer sentence about the {w}", "nothing", "a {w}"])

    def generate(prompt_ids, *args, **kwargs):  # say(sentence), then the same sentence as the final message
        out = []
        for ids in prompt_ids:
            text = tok.decode(ids)
            if "<tool_response>" in text:
                body = re.findall(r'"text": "([^"]*)"', text)[-1]
            else:
                word = re.findall(r'word "(\w+)"', text)[0]
                body = tool_call_text("say", {"text": next(replies).format(w=word)})
            out.append(tok.encode(body + "<|im_end|>", add_special_tokens=False))
        return out, None

    replace_generation(trainer, generate)
    rows = [copy.deepcopy(spec.train_dataset[i]) for i in (0, 1) for _ in range(2)]
    before = count(ref_server, f"{JUDGE}/score_group")
    generate_and_score(trainer, rows)
    logs = logged_rewards(trainer, 4)
    assert logs["outcome_reward"] == [1.0, 1.0, 0.0, 1.0]
    assert logs["group_reward"] == [1.0, 0.5, 0.0, 1.0]
    assert count(ref_server, f"{JUDGE}/score_group") - before == 2
    spec.close()


def test_terminal_tools_in_a_mix(ref_server) -> None:
    mix = OpenRewardMix({"quiz": OpenRewardSpec(ref_server.url, env_name=QUIZ, num_tasks=1),
                         "echo": OpenRewardSpec(ref_server.url, env_name="echoenvironment", num_tasks=1)})
    rows = {row["environment"]: {k: v for k, v in row.items() if k != "environment"} for row in mix.train_dataset}
    quiz, echo = mix.environment_factory["quiz"](), mix.environment_factory["echo"]()
    quiz.reset(**rows["quiz"])
    echo.reset(**rows["echo"])
    echo.echo(text=rows["echo"]["target"])
    rewards = mix.reward_funcs([quiz, echo], completions=[[said(rows["quiz"]["capital"])], [said("Done.")]])
    assert rewards == [1.0, 1.0]  # the quiz by its terminal tool; echo, which has none, by its own call
    assert quiz.episode.record()["final"]["tool"] == "answer" and echo.episode.record()["final"] == {"message": "Done."}
    mix.close()
