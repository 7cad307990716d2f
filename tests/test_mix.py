"""OpenRewardMix: several environments in one run — routing, weights, per-environment tools and rewards."""

from __future__ import annotations

import inspect
from collections import Counter

import pytest

from ors_trl import ConfigurationError, OpenRewardMix, OpenRewardSpec
from ors_trl.spec import mixture_counts
from ors_trl.tasks.sampling import uniform_draws


def tools_of(cls: type) -> dict[str, object]:
    return {f.__name__: f for n, f in inspect.getmembers(cls, inspect.isfunction)
            if n not in ("reset", "get_reward") and not n.startswith("_")}


@pytest.fixture
def mix(ref_server):
    m = OpenRewardMix({
        "echo": OpenRewardSpec(ref_server.url, env_name="echoenvironment", num_tasks=4),
        "math": OpenRewardSpec(ref_server.url, env_name="sparseenvironment", num_tasks=6),
        "mixed": OpenRewardSpec(ref_server.url, env_name="mixedenvironment", num_tasks=2),
    })
    yield m
    m.close()


def test_dataset_routes_every_row(mix) -> None:
    ds = mix.train_dataset
    assert Counter(ds["environment"]) == {"echo": 4, "math": 6, "mixed": 2}
    for row in ds:
        ident = row["prompt"][0]["ors_task"]
        assert f'"env": "{row["environment"]}"' in ident
    # each environment's own task fields made it into its rows; other environments' fields are None there
    echo_rows = [r for r in ds if r["environment"] == "echo"]
    assert all(r["target"] for r in echo_rows) and all(r["a"] is None for r in echo_rows)


def test_environment_factory_is_the_dict_trl_takes(mix) -> None:
    factories = mix.environment_factory
    assert set(factories) == {"echo", "math", "mixed"}
    assert set(tools_of(factories["echo"])) == {"echo"}
    assert set(tools_of(factories["math"])) == {"calculator", "submit"}
    assert set(tools_of(factories["mixed"])) == {"answer", "submit"}


def test_same_tool_name_different_schemas_stay_separate(mix) -> None:
    from transformers.utils import get_json_schema

    math_submit = get_json_schema(tools_of(mix.environment_factory["math"])["submit"])["function"]["parameters"]
    mixed_submit = get_json_schema(tools_of(mix.environment_factory["mixed"])["submit"])["function"]["parameters"]
    assert set(math_submit["properties"]) == {"answer"} and set(mixed_submit["properties"]) == {"value"}
    ds = mix.train_dataset
    math_row = next(r for r in ds if r["environment"] == "math")
    mixed_row = next(r for r in ds if r["environment"] == "mixed")
    math_env, mixed_env = mix.environment_factory["math"](), mix.environment_factory["mixed"]()
    strip = lambda row: {k: v for k, v in row.items() if k != "environment"}  # noqa: E731 - what TRL passes
    math_env.reset(**strip(math_row))
    mixed_env.reset(**strip(mixed_row))
    assert "Incorrect" in math_env.submit(answer=-1) or "Correct" in math_env.submit(answer=-1)
    assert mixed_env.submit(value="zzz").startswith("mixed:")  # routed to its own environment's tool


def test_trl_renders_each_environments_tools_only_for_its_rows(mix, tiny_model_dir, tmp_path) -> None:
    from tests.fixtures.generation import cpu_grpo_trainer, rendered_tools

    trainer = cpu_grpo_trainer(tiny_model_dir, str(tmp_path), spec=mix)
    tools = rendered_tools(trainer)
    names = {env: sorted(t.__name__ for t in env_tools) for env, env_tools in tools.items()}
    assert names == {"echo": ["echo"], "math": ["calculator", "submit"], "mixed": ["answer", "submit"]}
    tok = trainer.processing_class
    echo_text = tok.apply_chat_template([{"role": "user", "content": "x"}], tools=tools["echo"], tokenize=False)
    assert '"echo"' in echo_text and "calculator" not in echo_text and "submit" not in echo_text


def test_rewards_come_from_each_rollouts_own_environment(mix) -> None:
    ds = mix.train_dataset
    envs, rows = [], []
    for name in ("echo", "math", "mixed"):
        row = {k: v for k, v in next(r for r in ds if r["environment"] == name).items() if k != "environment"}
        env = mix.environment_factory[name]()
        env.reset(**row)
        envs.append(env)
        rows.append(row)
    envs[0].echo(text=rows[0]["target"])  # 1.0
    envs[1].submit(answer=rows[1]["a"] + rows[1]["b"] + 1)  # 0.0
    assert mix.reward_funcs(envs) == [1.0, 0.0, None]


def test_weights_set_the_mixture() -> None:
    assert mixture_counts([10, 10], [3, 1]) == [15, 5]
    assert sum(mixture_counts([7, 5, 3], [1, 1, 1])) == 15
    assert mixture_counts([100, 1], [1, 1]) == [51, 50]  # the small env is repeated to reach its share
    rows = uniform_draws(range(4), 10, __import__("random").Random(0))
    assert Counter(rows)[0] >= 2 and len(rows) == 10 and set(rows) == {0, 1, 2, 3}


def test_weighted_dataset(ref_server) -> None:
    mix = OpenRewardMix(
        [OpenRewardSpec(ref_server.url, env_name="echoenvironment", num_tasks=8),
         OpenRewardSpec(ref_server.url, env_name="sparseenvironment", num_tasks=8)],
        weights=[3, 1],
    )
    counts = Counter(mix.train_dataset["environment"])
    assert counts == {"echoenvironment": 12, "sparseenvironment": 4}
    again = OpenRewardMix(
        [OpenRewardSpec(ref_server.url, env_name="echoenvironment", num_tasks=8),
         OpenRewardSpec(ref_server.url, env_name="sparseenvironment", num_tasks=8)],
        weights=[3, 1],
    )
    assert again.train_dataset["task_index"] == mix.train_dataset["task_index"]  # deterministic for a seed


def test_bad_mix_arguments(ref_server) -> None:
    spec = OpenRewardSpec(ref_server.url, env_name="echoenvironment")
    with pytest.raises(ConfigurationError):
        OpenRewardMix([])
    with pytest.raises(ConfigurationError):
        OpenRewardMix([spec, spec])
    with pytest.raises(ConfigurationError):
        OpenRewardMix({"a": spec}, weights={"b": 1.0})
    with pytest.raises(ConfigurationError):
        OpenRewardMix({"a": spec}, weights=[-1])
    with pytest.raises(ConfigurationError, match="finite"):  # was a ValueError (NaN to int) building the dataset
        OpenRewardMix({"a": spec, "b": OpenRewardSpec(ref_server.url, env_name="sparseenvironment")},
                      weights=[float("inf"), 1])
    with pytest.raises(ConfigurationError):
        OpenRewardMix(["not a spec"])  # type: ignore[list-item]


@pytest.mark.parametrize("mode", ["environment_factory", "rollout_func"])
def test_task_fields_named_like_trl_keywords_are_renamed_in_a_mix(colliding_server, tiny_model_dir, tmp_path,
                                                                  caplog, mode) -> None:
    """The mix's own `environment` routing column stays TRL's; the task's `environment` field (and every other name
    TRL calls with) is kept as `task_<name>`; a real GRPOTrainer step trains."""
    from test_spec import COLLIDING_REWARDS, check_user_reward_kwargs, colliding_step
    from tests.fixtures.environments import COLLIDING_FIELDS

    mix = OpenRewardMix({"colliding": OpenRewardSpec(colliding_server.url, env_name="collidingenvironment"),
                         "echo": OpenRewardSpec(colliding_server.url, env_name="echoenvironment", num_tasks=2)})
    with caplog.at_level("WARNING", logger="ors_trl"):
        dataset = mix.train_dataset
    assert sum("renamed" in r.getMessage() for r in caplog.records) == 1 and mix.dataset_notes
    assert Counter(dataset["environment"]) == {"colliding": 4, "echo": 2}
    assert dataset["task_environment"] == ["environment-" + t for t in dataset["target"][:4]] + [None, None]
    outcomes, seen = colliding_step({"train_dataset": dataset, mode: getattr(mix, mode),
                                     "reward_funcs": mix.reward_funcs}, tiny_model_dir, str(tmp_path))
    assert len(outcomes) == 4 and all(reward == COLLIDING_REWARDS[t] for t, reward in outcomes)
    assert set(COLLIDING_FIELDS).isdisjoint(set(dataset.column_names) - {"environment"})
    check_user_reward_kwargs(seen, environments=mode == "environment_factory")
    mix.close()


def test_a_split_with_no_tasks_is_an_error_not_an_empty_or_lopsided_dataset() -> None:
    """An empty split gave a spec 0 rows (TRL then trains on nothing) and took a mix's rows with it: weights 3:1 on
    (empty, 4 tasks) left 1 row of the 4, and a sampled mix dropped the environment without a word."""
    from tests.fixtures.environments import server

    with server("hollow,echo") as srv:
        def hollow(**kw):
            return OpenRewardSpec(srv.url, env_name="hollowenvironment", split="empty", **kw)

        uses = [hollow(), hollow(num_tasks=4)]
        uses += [OpenRewardMix({"hollow": hollow(**kw), "echo": OpenRewardSpec(srv.url, env_name="echoenvironment",
                                                                              num_tasks=4)}, weights={"hollow": 3, "echo": 1})
                 for kw in ({}, {"task_sampling": "adaptive"})]
        for use in uses:
            with pytest.raises(ConfigurationError, match="split 'empty' has no tasks"):
                use.train_dataset  # noqa: B018
            use.close()
