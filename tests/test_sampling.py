"""Task selection (`ors_trl.tasks.sampling`, `_stream`, `_difficulty`): which tasks a run spends its episodes on.

The samplers on their own first (their rules, seeded and deterministic), then a spec's and a mix's stream, then real
`GRPOTrainer` runs on CPU against the reference server with the look environment's pool of mixed difficulty
(`ors_trl.demo._task.pool_tasks("kinds")`: free tasks any answer solves, locked ones none does, coin tasks half
the answers do, look tasks the answer `look()` shows does), under a scripted model.
"""

from __future__ import annotations

import inspect
import json
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from ors_trl import (
    AdaptiveSampler,
    ConfigurationError,
    OpenRewardMix,
    OpenRewardSpec,
    PlatformDifficulty,
    UniformSampler,
)
from ors_trl.demo import _task
from ors_trl.tasks.sampling import uniform_draws
from ors_trl.testing import ReferenceServer

KINDS = {t["id"]: t["kind"] for t in _task.pool_tasks("kinds")}
KIND_OF = [t["kind"] for t in _task.pool_tasks("kinds")]  # by task index


# -- the samplers ---------------------------------------------------------------------------------------------------


def simulate(sampler, kinds: list[str], groups: int, size: int = 4, seed: int = 0) -> list[bool]:
    """Draw `groups` groups of `size` rollouts from `sampler`, scored as their task's kind scores a random answer;
    one update per group, as the curriculum makes; return whether each group had zero reward spread."""
    rng = random.Random(seed)
    score = {"always": lambda: 1.0, "never": lambda: 0.0, "coin": lambda: float(rng.random() < 0.5)}
    flat = []
    for _ in range(groups):
        task = sampler.draw()
        rewards = [score[kinds[task]]() for _ in range(size)]
        sampler.update(task, rewards)
        flat.append(max(rewards) == min(rewards))
    return flat


def test_adaptive_sampling_leaves_all_equal_tasks_on_a_third_each_pool() -> None:
    """The target the design names: on a pool of a third each of always-solved, never-solved and coin-flip tasks,
    uniform sampling gives >= 0.6 zero-spread groups; adaptive <= 0.25 after a warm-up of one pass, and >= 2x the
    informative groups per episode."""
    kinds = ["always"] * 30 + ["never"] * 30 + ["coin"] * 30
    tasks = list(range(len(kinds)))
    uniform = simulate(UniformSampler(tasks, seed=1), kinds, 900)
    adaptive = simulate(AdaptiveSampler(tasks, seed=1), kinds, 900)
    warm = len(tasks)
    uniform_flat = sum(uniform[warm:]) / len(uniform[warm:])
    adaptive_flat = sum(adaptive[warm:]) / len(adaptive[warm:])
    assert uniform_flat >= 0.6, uniform_flat
    assert adaptive_flat <= 0.25, adaptive_flat
    assert (1 - adaptive_flat) >= 2 * (1 - uniform_flat)
    # the warm-up is one pass: every task drawn once before any is drawn twice
    sampler = AdaptiveSampler(tasks, seed=3)
    simulate(sampler, kinds, warm)
    drawn = sampler.state_dict()["drawn"]
    assert sorted(int(t) for t in drawn) == tasks and set(drawn.values()) == {1}


def test_adaptive_sampling_re_probes_a_task_that_becomes_learnable() -> None:
    """A never-solved task is down-weighted, not dropped: when it starts to succeed sometimes it comes back."""
    sampler = AdaptiveSampler(range(10), seed=0, flat_weight=0.05)
    learnable = [False] * 10
    draws_of_0 = {"before": 0, "after": 0}
    rng = random.Random(0)
    for step in range(4000):
        if step == 1000:
            learnable[0] = True  # task 0 becomes learnable: half its attempts succeed
        task = sampler.draw()
        if task == 0:
            draws_of_0["before" if step < 1000 else "after"] += 1
        if task == 0 and learnable[0]:
            rewards = [float(rng.random() < 0.5) for _ in range(4)]
        else:
            rewards = [1.0 if task % 2 else 0.0] * 4 if task else [0.0] * 4
        sampler.update(task, rewards)
    assert sampler.pool_sizes() == {"unseen": 0, "mixed": 1, "solved": 5, "unsolved": 4}
    # before: one flat task among ten, drawn about 1/10 of the time; after: the only mixed one, most of the draws
    assert draws_of_0["before"] / 1000 < 0.2
    assert draws_of_0["after"] / 3000 > 0.5


def test_one_all_equal_group_is_weak_evidence_for_a_task_solved_sometimes() -> None:
    """A task a policy solves now and then (here 15% of attempts: a group of 8 all fails a quarter of the time) is
    not starved by one unlucky group: suspects whose next group disagreed keep being drawn about as often as the
    rest; where suspects are always confirmed (never-solved tasks), they fall to `flat_weight`."""
    def run(pass_rates: list[float], draws: int = 3000) -> list[int]:
        sampler, rng = AdaptiveSampler(range(len(pass_rates)), seed=5), random.Random(5)
        counts = [0] * len(pass_rates)
        for _ in range(draws):
            task = sampler.draw()
            counts[task] += 1
            sampler.update(task, [float(rng.random() < pass_rates[task]) for _ in range(8)])
        return counts

    hard = run([0.15] * 20)
    assert min(hard) > 0.3 * (sum(hard) / len(hard))  # no task starved
    never = run([0.0] * 10 + [0.5] * 10)
    assert sum(never[:10]) / sum(never) < 0.1  # the never-solved tasks: re-probes only


def test_a_task_that_was_solved_sometimes_is_not_starved_with_the_never_solved_ones() -> None:
    """A task whose groups once disagreed and now all fail (a policy that drifted away from it: a word the demo's
    model stopped answering) is what the policy has left to learn: it keeps `lapsed_weight` (1: drawn about as
    often as a task whose groups disagree), where the never-solved tasks fall to the floor."""
    kinds = ["never"] * 40 + ["always"] * 40 + ["coin"] * 30 + ["lapsed"] * 6
    sampler, rng = AdaptiveSampler(range(len(kinds)), seed=2), random.Random(2)
    counts = Counter()
    for step in range(4000):
        task = sampler.draw()
        kind = kinds[task]
        # a lapsed task: a coin flip for the first 600 groups, then 1 attempt in 40 succeeds
        rate = {"never": 0.0, "always": 1.0, "coin": 0.5, "lapsed": 0.5 if step < 600 else 0.025}[kind]
        sampler.update(task, [float(rng.random() < rate) for _ in range(8)])
        if step >= 1000:
            counts[kind] += 1
    per_task = {kind: counts[kind] / kinds.count(kind) for kind in ("never", "lapsed", "coin")}
    # judged with the never-solved tasks (the rule before): 2.5x and 0.06
    assert per_task["lapsed"] > 20 * per_task["never"], per_task
    assert per_task["lapsed"] > 0.5 * per_task["coin"], per_task
    assert sampler.pool_sizes()["unsolved"] >= 40  # the lapsed tasks count as unsolved in the metrics


def test_unscored_rewards_are_no_failures() -> None:
    sampler = AdaptiveSampler([0, 1], seed=0)
    sampler.update(0, [None, None])
    assert sampler.pool_sizes()["unseen"] == 2  # a group with no score teaches nothing
    sampler.update(0, [1.0, None, 1.0])
    assert sampler.pool_sizes()["solved"] == 1 and sampler.pass_rate(0) == 1.0
    sampler.update(1, [None, 0.0])
    assert sampler.pass_rate(1) == 0.0 and sampler.pool_sizes()["unsolved"] == 1
    sampler.update(7, [1.0])  # not one of its tasks: ignored
    assert sum(sampler.pool_sizes().values()) == 2


def test_sampler_state_round_trips_and_continues_the_same_draws() -> None:
    kinds = ["always", "never", "coin"] * 5
    first = AdaptiveSampler(range(15), seed=4)
    simulate(first, kinds, 40)
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint keeps is JSON
    second = AdaptiveSampler(range(15), seed=999)
    second.load_state_dict(state)
    assert [first.draw() for _ in range(50)] == [second.draw() for _ in range(50)]
    uniform = UniformSampler(range(7), seed=2)
    [uniform.draw() for _ in range(10)]
    copy = UniformSampler(range(7))
    copy.load_state_dict(json.loads(json.dumps(uniform.state_dict())))
    assert [uniform.draw() for _ in range(20)] == [copy.draw() for _ in range(20)]
    one_pass = UniformSampler(range(7), seed=5)
    assert sorted(one_pass.draw() for _ in range(7)) == list(range(7))  # every task once per pass
    draws = uniform_draws(range(4), 10, random.Random(0))  # the one uniform choice (the sampler's, a mix's rows)
    assert len(draws) == 10 and sorted(draws[:4]) == sorted(draws[4:8]) == [0, 1, 2, 3] and len(set(draws[8:])) == 2


def test_sampler_arguments_are_checked() -> None:
    for bad in ({"flat_weight": 0}, {"flat_weight": 2}, {"window": 0}, {"lapsed_weight": -1}, {"suspect_weight": True}):
        with pytest.raises(ConfigurationError):
            AdaptiveSampler(range(3), **bad)
    with pytest.raises(ConfigurationError, match="no tasks"):
        AdaptiveSampler().draw()


# -- a spec's and a mix's stream ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def look_server() -> Iterator[ReferenceServer]:
    """The look environment (the demo's), with its pools of mixed difficulty, on a server of this module's own."""
    from ors_trl.demo._environments import LookEnvironment

    with ReferenceServer([LookEnvironment]) as server:
        yield server


class Recording:
    """A custom sampler (the documented protocol: draw and update) that draws round robin and keeps what it saw."""

    def __init__(self) -> None:
        self.tasks: list[int] = []
        self.drawn: list[int] = []
        self.updates: list[tuple[int, list]] = []

    def bind(self, tasks):
        self.tasks = list(tasks)

    def draw(self) -> int:
        self.drawn.append(self.tasks[len(self.drawn) % len(self.tasks)])
        return self.drawn[-1]

    def update(self, task, rewards) -> None:
        self.updates.append((task, list(rewards)))


def test_a_sampled_spec_streams_rows_its_sampler_draws(look_server) -> None:
    from datasets import IterableDataset

    recording = Recording()
    spec = OpenRewardSpec(look_server.url, split="kinds", indices=[4, 5, 6, 7], task_sampling=recording)
    stream = spec.train_dataset
    assert isinstance(stream, IterableDataset)
    assert recording.tasks == [4, 5, 6, 7]
    rows = iter(stream)
    seen = [next(rows) for _ in range(6)]
    assert [r["task_index"] for r in seen] == [4, 5, 6, 7, 4, 5] == recording.drawn  # drawn as read, not ahead
    assert [r["kind"] for r in seen[:4]] == [KIND_OF[i] for i in (4, 5, 6, 7)]  # the task's fields come along
    assert stream.shuffle(seed=0) is stream  # TRL's buffered shuffle would draw 1,000 rows before any reward
    # a consumer that needs a map-style dataset is told what to do
    for use in (len, lambda s: s[0]):
        with pytest.raises(ConfigurationError, match="max_steps") as err:
            use(stream)
        assert isinstance(err.value, TypeError)
    assert spec.callbacks[-1].source is stream.source  # what AsyncGRPOTrainer needs passed
    spec.close()


def test_task_sampling_is_checked(look_server) -> None:
    for bad in ("curriculum", 3, object()):
        with pytest.raises(ConfigurationError, match="task_sampling"):
            OpenRewardSpec(look_server.url, task_sampling=bad)
    assert isinstance(OpenRewardSpec(look_server.url, split="kinds").train_dataset.__len__(), int)  # uniform: TRL's


def test_a_mix_keeps_its_weights_and_samples_each_environment_its_way(look_server) -> None:
    adaptive = OpenRewardSpec(look_server.url, split="kinds", indices=list(range(8)), task_sampling="adaptive")
    uniform = OpenRewardSpec(look_server.url, split="mixed", indices=[0, 1, 2])
    mix = OpenRewardMix({"kinds": adaptive, "mixed": uniform}, weights={"kinds": 3, "mixed": 1}, seed=0)
    rows = iter(mix.train_dataset)
    seen = [next(rows) for _ in range(400)]
    share = Counter(r["environment"] for r in seen)["kinds"] / len(seen)
    assert 0.7 < share < 0.8  # the mixture weights: 3:1
    uniform_draws = [r["task_index"] for r in seen if r["environment"] == "mixed"]
    for k in range(0, len(uniform_draws) - 2, 3):  # the uniform spec: whole passes over its tasks
        assert sorted(uniform_draws[k:k + 3]) == [0, 1, 2]
    kinds_draws = [r["task_index"] for r in seen if r["environment"] == "kinds"]
    assert sorted(kinds_draws[:8]) == list(range(8))  # the adaptive one: every unseen task first
    assert mix.callbacks[-1].source is mix.train_dataset.source
    mix.close()


# -- static selection ----------------------------------------------------------------------------------------------


class ScriptedPolicy:
    """An evaluation policy for the look environment: look, then answer `answer(tool output)`."""

    def __init__(self, answer) -> None:
        self.answer = answer

    async def respond(self, messages, tools):
        from ors_trl import PolicyReply

        if not any(m["role"] == "tool" for m in messages):
            return PolicyReply(tool_calls=[{"id": "c0", "name": "look", "arguments": {}}])
        return PolicyReply(content=self.answer(str(messages[-1]["content"])))


def test_difficulty_keeps_the_tasks_an_evaluation_found_in_range(look_server, tmp_path, caplog) -> None:
    """`ors-trl eval --repeats N --output` file -> `difficulty=(low, high)`: free (1.0) and locked (0.0) tasks go,
    tasks with no data stay; an episode log works the same; the distribution is said."""
    rng = random.Random(0)

    def answer(reply: str) -> str:  # the word look() shows half the time, else a guess
        shown = [w for w in _task.TARGETS if w in reply]
        return shown[0] if shown and rng.random() < 0.5 else rng.choice(_task.TARGETS)

    probe = OpenRewardSpec(look_server.url, split="kinds", indices=list(range(8)))
    out = tmp_path / "probe.jsonl"
    probe.evaluate(ScriptedPolicy(answer), repeats=4, output=str(out))
    probe.close()
    means: dict[int, list[float]] = {}
    for line in out.read_text().splitlines():
        record = json.loads(line)
        means.setdefault(record["task_index"], []).append(record["reward"])
    in_range = [i for i in range(8) if 0.01 <= sum(means[i]) / len(means[i]) <= 0.99]
    assert not {i for i in in_range if KIND_OF[i] in ("free", "locked")} and in_range
    spec = OpenRewardSpec(look_server.url, split="kinds", num_tasks=12, difficulty=(0.01, 0.99), difficulty_from=out)
    with caplog.at_level("WARNING", logger="ors_trl"):
        kept = list(spec.train_dataset["task_index"])
    assert kept == [*in_range, 8, 9, 10, 11]
    assert set(range(8, 12)) <= set(kept)  # no data: kept
    assert "keeps" in caplog.text and "4 of them with no data" in caplog.text
    # a mapping works as well, and a range that keeps nothing is an error at once, not an empty dataset
    only_free = OpenRewardSpec(look_server.url, split="kinds", indices=[1, 5], difficulty=(0.9, 1.0),
                               difficulty_from={1: 1.0, 5: 1.0})
    assert list(only_free.train_dataset["task_index"]) == [1, 5]
    nothing = OpenRewardSpec(look_server.url, split="kinds", indices=[2, 6], difficulty=(0.5, 1.0),
                             difficulty_from={2: 0.0, 6: 0.0})
    with pytest.raises(ConfigurationError, match="keeps none"):
        _ = nothing.train_dataset


def test_difficulty_input_is_checked(look_server, tmp_path) -> None:
    url = look_server.url
    for bad in ((0.9, 0.1), (0, float("nan")), "easy", (1,)):
        with pytest.raises(ConfigurationError, match="difficulty must"):
            OpenRewardSpec(url, difficulty=bad, difficulty_from={0: 1.0})
    with pytest.raises(ConfigurationError, match=r"pass difficulty=.*too"):
        OpenRewardSpec(url, difficulty_from={0: 1.0})
    for source in (None, "platform", PlatformDifficulty(model_name="m")):  # a self-hosted server has no platform data
        with pytest.raises(ConfigurationError, match=r"self-hosted.*eval --repeats"):
            OpenRewardSpec(url, difficulty=(0, 1), difficulty_from=source)
    text = tmp_path / "notes.txt"
    text.write_text("not an episode\n")
    with pytest.raises(ConfigurationError, match="holds no episode record"):
        OpenRewardSpec(url, difficulty=(0, 1), difficulty_from=text)
    with pytest.raises(ConfigurationError, match="not a file"):
        OpenRewardSpec(url, difficulty=(0, 1), difficulty_from=tmp_path / "missing.jsonl")
    with pytest.raises(ConfigurationError, match="training_stage"):
        PlatformDifficulty(training_stage="pretraining")


# -- with GRPOTrainer ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def look_model_dir(look_server, tmp_path_factory) -> str:
    """The harness's tiny random model, its tokenizer trained on the look environment's conversation and tool."""
    from tests.fixtures.generation import build_tiny_model

    spec = OpenRewardSpec(look_server.url, split="kinds", indices=[0])
    tools = [f for n, f in inspect.getmembers(spec.environment_factory, inspect.isfunction) if n == "look"]
    tasks = _task.pool_tasks("kinds")[:8]
    spec.close()
    return build_tiny_model(tmp_path_factory.mktemp("look-model"), tools, _task.look_prompt,
                            lambda task, rng: ("look", {}, task["reply"]), tasks=tasks)


def train(spec, model_dir: str, out: Path, answer, *, steps: int, resume: str | None = None, **config):
    """`steps` GRPO steps (2 groups of 4 rollouts each) under the scripted look model answering `answer(reply,
    position, step)`; returns the trainer and the task of every rollout, per step."""
    from tests.fixtures.generation import (
        cpu_grpo_trainer,
        look_generation,
        replace_generation,
        trl_tokenizer,
        wrap_generate_and_score,
    )

    trainer = cpu_grpo_trainer(model_dir, str(out), spec=spec, batch=8, generations=4, turns=2,
                               config={"max_steps": steps, **config})
    replace_generation(trainer, look_generation(trl_tokenizer(trainer),
                                                lambda reply, pos: answer(reply, pos, trainer.state.global_step)))
    trained: dict[int, list[int]] = {}

    def watch(real, inputs):
        trained[trainer.state.global_step + 1] = [row["task_index"] for row in inputs]
        return real(inputs)

    wrap_generate_and_score(trainer, watch)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, trained


def test_adaptive_training_leaves_all_equal_tasks_and_comes_back_to_one_that_changes(look_server, look_model_dir,
                                                                                     tmp_path) -> None:
    """A real GRPOTrainer on TRL's own loop: after one pass (the warm-up) the draws leave the free and locked tasks;
    a look task never solved at first is re-probed once its answers start to differ, and comes back."""
    sampler = AdaptiveSampler(flat_weight=0.4)  # its floor (0.05) re-probes often enough for a short test
    spec = OpenRewardSpec(look_server.url, split="kinds", indices=list(range(8)), task_sampling=sampler,
                          unscored_reward=0.0)

    def answer(reply: str, position: int, step: int) -> str:
        shown = [w for w in _task.TARGETS if w in reply]
        if shown and (step < 12 or position % 2):  # look tasks: never right at first, then half the time
            return next(w for w in _task.TARGETS if w != shown[0])
        return shown[0] if shown else _task.TARGETS[position % 6]  # a coin task: answers that differ

    trainer, trained = train(spec, look_model_dir, tmp_path, answer, steps=32)
    groups = {step: tasks[::4] for step, tasks in trained.items()}  # each drawn task is a group of 4 rollouts
    assert sorted(t for s in (1, 2, 3, 4) for t in groups[s]) == list(range(8))  # the warm-up: every task once
    phase1 = [t for s in range(5, 13) for t in groups[s]]
    flat_share = sum(KIND_OF[t] in ("free", "locked") for t in phase1) / len(phase1)
    assert flat_share < 0.5, phase1  # uniform would give 0.5; the free and locked groups teach nothing
    late = [t for s in range(23, 33) for t in groups[s]]
    looks = [t for t in range(8) if KIND_OF[t] == "look"]
    assert sum(t in looks for t in late) / len(late) > sum(t in looks for t in phase1) / len(phase1), (phase1, late)
    assert sampler.pool_sizes()["mixed"] >= 3  # the coin tasks and the look task(s) that came back
    assert any(sampler.pass_rate(t) not in (0.0, None) for t in looks)
    logged = [e for e in trainer.state.log_history if any(k.startswith("curriculum/") for k in e)]
    name = next(k for k in logged[0] if k.startswith("curriculum/")).split("/")[1]
    assert len(logged) == 32 and logged[-1][f"curriculum/{name}/unseen"] == 0
    zero = [e[f"curriculum/{name}/zero_std_fraction"] for e in logged]
    assert zero == [e["frac_reward_zero_std"] for e in logged]  # the same groups TRL saw
    # the report draws the pools over training
    from ors_trl import write_report

    trainer.state.save_to_json(str(tmp_path / "trainer_state.json"))
    write_report([str(tmp_path / "trainer_state.json")], str(tmp_path / "report.html"))
    page = (tmp_path / "report.html").read_text()
    assert "Task sampling: tasks per pool" in page and f"{name} unseen" in page and "zero reward spread" in page
    spec.close()


def test_a_resumed_run_continues_the_same_draws(look_server, look_model_dir, tmp_path) -> None:
    """Checkpoint at step 3, resume there: steps 4-6 train on the very tasks the uninterrupted run trained on."""

    def answer(reply: str, position: int, step: int) -> str:  # deterministic per task and position
        shown = [w for w in _task.TARGETS if w in reply]
        return shown[0] if shown and position % 2 == 0 else _task.TARGETS[position % 6]

    def spec() -> OpenRewardSpec:
        return OpenRewardSpec(look_server.url, split="kinds", num_tasks=24, task_sampling="adaptive")

    config = {"save_strategy": "steps", "save_steps": 3, "seed": 7}
    first = spec()
    _, whole = train(first, look_model_dir, tmp_path / "a", answer, steps=6, **config)
    saved = json.loads((tmp_path / "a" / "checkpoint-3" / "trainer_state.json").read_text())
    state = saved["stateful_callbacks"]["ors_trl.task_sampling"]
    assert state["consumed"] == 3 * 2 and state["pending"]  # 2 draws a step trained on; the next ones drawn ahead
    first.close()
    second = spec()
    _, resumed = train(second, look_model_dir, tmp_path / "b", answer, steps=6,
                       resume=str(tmp_path / "a" / "checkpoint-3"), **config)
    assert sorted(resumed) == [4, 5, 6]
    assert {s: whole[s] for s in (4, 5, 6)} == resumed
    assert second.curriculum.sampler.state_dict()["history"] == first.curriculum.sampler.state_dict()["history"]
    second.close()


def test_the_platforms_difficulty_selects_tasks_and_inspect_shows_it(look_server, tmp_path, monkeypatch,
                                                                     capsys) -> None:
    """A catalog environment's per-task difficulty from the platform's API (a loopback stand-in answering the
    `task-difficulty` route, in front of the reference server), filtered by model and stage; `inspect --difficulty`
    shows its distribution, and reads an eval output the same way."""
    from ors_trl.cli import EXIT_ERROR, EXIT_OK, EXIT_USAGE, main
    from ors_trl.testing import FaultProxy
    from ors_trl.testing.faults import Reply

    key = "sk-difficulty-test"
    rows = [{"task_index": i, "avg_reward": mean, "min_reward": 0.0, "max_reward": 1.0, "num_rollouts": 8,
             "response_chars": {}, "split": "kinds", "variant": None}
            for i, mean in ((0, 0.5), (1, 1.0), (2, 0.0), (3, 0.25))]
    rows.append({**rows[0], "task_index": 5, "avg_reward": 0.0, "split": "train"})  # another split: not these tasks
    with FaultProxy(look_server.url) as platform:
        platform.add(Reply(json.dumps({"tasks": rows})), path="/task-difficulty", method="GET", times=None)
        monkeypatch.setenv("OPENREWARD_URL", platform.url)
        monkeypatch.setenv("OPENREWARD_API_KEY", key)
        spec = OpenRewardSpec("acme/look", env_name="lookenvironment", split="kinds", num_tasks=8,
                              difficulty=(0.2, 0.8),
                              difficulty_from=PlatformDifficulty(model_name="tiny", training_stage="rl"))
        assert list(spec.train_dataset["task_index"]) == [0, 3, 4, 5, 6, 7]  # 1 (1.0) and 2 (0.0) out; no data: kept
        (asked,) = [r for r in platform.requests if r.path.endswith("/task-difficulty")]
        assert asked.path == "/v1/environments/acme/look/task-difficulty" and asked.headers["x-api-key"] == key
        assert all(part in asked.target for part in ("split=kinds", "model_name=tiny", "training_stage=rl"))
        spec.close()
        target = ["inspect", "acme/look", "--env-name", "lookenvironment", "--split", "kinds", "--no-probe"]
        assert main([*target, "--difficulty", "--difficulty-filter", "model_name=tiny", "--json"]) == EXIT_OK
        shown = json.loads(capsys.readouterr().out)["difficulty"]
        assert (shown["with_data"], shown["tasks"], sum(b["tasks"] for b in shown["bins"])) == (4, 120, 4)
        assert shown["mean"] == pytest.approx(0.4375) and "model_name=tiny" in shown["source"]
        assert main([*target, "--difficulty"]) == EXIT_OK
        text = capsys.readouterr().out
        assert "4 of 120 tasks have data" in text and "[0.00, 0.10)       1  #" in text and key not in text
        assert main([*target, "--difficulty-filter", "model_name=x"]) == EXIT_USAGE  # a filter needs --difficulty
        assert main([*target, "--difficulty", "--difficulty-filter", "size=1"]) == EXIT_USAGE
    # a self-hosted server has no platform data: the error says to pass a file; a file works
    capsys.readouterr()
    assert main(["inspect", look_server.url, "--split", "kinds", "--no-probe", "--difficulty"]) in (EXIT_USAGE,
                                                                                                   EXIT_ERROR)
    assert "eval --output" in capsys.readouterr().err
    probe = OpenRewardSpec(look_server.url, split="kinds", indices=[0, 1, 2])
    out = tmp_path / "probe.jsonl"
    probe.evaluate(ScriptedPolicy(lambda reply: "apple"), repeats=2, output=str(out))
    probe.close()
    assert main(["inspect", look_server.url, "--split", "kinds", "--no-probe", "--difficulty", str(out), "--json"]) \
        == EXIT_OK
    shown = json.loads(capsys.readouterr().out)["difficulty"]
    assert (shown["with_data"], shown["episodes"]) == (3, 6)


def test_a_stream_looked_at_before_training_still_reaches_the_trainer(look_server, look_model_dir, tmp_path) -> None:
    """Reading a row to look at it (no trainer yet) used up the stream's one bind: the trainer then never logged or
    checkpointed the sampler (nor synced it across processes)."""
    spec = OpenRewardSpec(look_server.url, split="kinds", indices=list(range(8)), task_sampling="adaptive")
    assert next(iter(spec.train_dataset))["task_index"] in range(8)
    trainer, _ = train(spec, look_model_dir, tmp_path, lambda reply, pos, step: "x", steps=2)
    assert sum(any(k.startswith("curriculum/") for k in e) for e in trainer.state.log_history) == 2
    spec.close()


def test_a_sampler_drawing_a_task_outside_the_selection_is_told_so(look_server) -> None:
    """A custom sampler's draw that is not one of the spec's tasks was a bare `KeyError: (None, 99)` from inside the
    datasets generator."""
    recording = Recording()
    recording.draw = lambda: 99  # type: ignore[method-assign]
    spec = OpenRewardSpec(look_server.url, split="kinds", indices=[4, 5], task_sampling=recording)
    with pytest.raises(ConfigurationError, match=r"drew task 99, which is not one of the 2 tasks selected"):
        next(iter(spec.train_dataset))
    spec.close()


def test_a_second_trainer_on_the_same_stream_updates_and_logs_its_samplers(look_server, look_model_dir,
                                                                           tmp_path) -> None:
    """The stream bound to its first trainer for good: a second `GRPOTrainer` on the same spec (a notebook's re-run)
    logged no `curriculum/...` and kept no sampler state in its checkpoints."""
    spec = OpenRewardSpec(look_server.url, split="kinds", indices=list(range(8)), task_sampling="adaptive")
    answer = lambda reply, pos, step: "x"  # noqa: E731
    train(spec, look_model_dir, tmp_path / "a", answer, steps=1)
    trainer, trained = train(spec, look_model_dir, tmp_path / "b", answer, steps=2, save_strategy="steps",
                             save_steps=1)
    assert sum(any(k.startswith("curriculum/") for k in e) for e in trainer.state.log_history) == 2
    saved = json.loads((tmp_path / "b" / "checkpoint-1" / "trainer_state.json").read_text())
    pending = saved["stateful_callbacks"]["ors_trl.task_sampling"]["pending"]
    assert [task for _, task in pending][:2] == trained[2][::4]  # what a resume replays: this run's, not the first's
    spec.close()
