"""OpenRewardSpec against the reference server: the documented TRL behaviours, one by one."""

from __future__ import annotations

import inspect
import json
import pickle

import pytest

from ors_trl import ConfigurationError, MissingAPIKeyError, OpenRewardSpec, ToolRefusedError
from ors_trl.spec import task_columns
from ors_trl.testing.server import free_port
from tests.fixtures.environments import COLLIDING_FIELDS, PROBE_DISTINCT, PROBE_TASKS, PROBE_VARIANTS


def tools_of(cls: type) -> list[str]:
    """What TRL collects: public functions other than reset/get_reward."""
    return sorted(
        n for n, _ in inspect.getmembers(cls, inspect.isfunction)
        if n not in ("reset", "get_reward") and not n.startswith("_")
    )


def count_requests(spec: OpenRewardSpec) -> list[tuple[str, str]]:
    seen: list[tuple[str, str]] = []
    spec.client._transport.on_request = lambda m, p: seen.append((m, p))
    return seen


def test_signature_matches_trl() -> None:
    trl_spec = pytest.importorskip("trl.experimental.openreward").OpenRewardSpec
    ours = inspect.signature(OpenRewardSpec).parameters
    for name, param in inspect.signature(trl_spec).parameters.items():
        assert name in ours, name
        assert ours[name].default == param.default, name
        assert ours[name].kind == param.kind, name


def test_argument_errors_are_raised_at_construction(monkeypatch) -> None:
    with pytest.raises(ConfigurationError, match="num_tasks or indices"):
        OpenRewardSpec("http://127.0.0.1:1", num_tasks=2, indices=[0])
    with pytest.raises(ValueError):  # ConfigurationError is a ValueError, like TRL's
        OpenRewardSpec("http://127.0.0.1:1", num_tasks=0)
    with pytest.raises(ConfigurationError):
        OpenRewardSpec("http://127.0.0.1:1", indices=[-1])
    with pytest.raises(ConfigurationError):
        OpenRewardSpec("not a target")
    monkeypatch.delenv("OPENREWARD_API_KEY", raising=False)
    with pytest.raises(MissingAPIKeyError, match="OPENREWARD_API_KEY"):
        OpenRewardSpec("Eigent/SETA")


@pytest.mark.parametrize(("name", "bad", "need"), [
    ("max_output_chars", 0, "an int >= 1 or None"),
    ("max_output_chars", 100.0, "an int >= 1 or None"),  # a float cannot cut a text: refused here, not mid-rollout
    ("max_concurrent_tool_calls", True, "an int >= 1"),
    ("episode_timeout", 0, "a number > 0 or None"),
    ("episode_timeout", float("nan"), "a number > 0 or None"),
    ("gather_window", -1.0, "a number >= 0 or None"),
    ("max_tool_calls", 1.5, "an int >= 0 or None"),
    ("success_threshold", float("inf"), "a finite number"),
])
def test_numeric_options_say_what_they_must_be(name: str, bad: object, need: str) -> None:
    """One check for every numeric option of a spec (and a mix): a `ConfigurationError` at construction naming the
    option, what it must be and what it got."""
    import re

    from ors_trl import OpenRewardMix

    with pytest.raises(ConfigurationError, match=re.escape(f"{name} must be {need}, got {bad!r}")):
        OpenRewardSpec("http://127.0.0.1:1", **{name: bad})
    if name == "gather_window":
        with pytest.raises(ConfigurationError, match=re.escape(f"gather_window must be {need}, got {bad!r}")):
            OpenRewardMix([OpenRewardSpec("http://127.0.0.1:1")], gather_window=bad)


def test_construction_is_lazy(ref_server) -> None:
    before = ref_server.stats()["requests"]
    spec = OpenRewardSpec(ref_server.url, env_name="echoenvironment", num_tasks=3)
    assert ref_server.stats()["requests"] == before  # constructing sent nothing
    _ = spec.environment_factory
    assert ref_server.stats()["requests"] > before  # first use does (the counter counts this spec's requests)
    # Nothing listens here: constructing must not even try.
    OpenRewardSpec(f"http://127.0.0.1:{free_port()}", num_tasks=3)


def test_dataset_with_num_tasks(ref_server) -> None:
    spec = OpenRewardSpec(ref_server.url, env_name="echoenvironment", num_tasks=5)
    seen = count_requests(spec)
    ds = spec.train_dataset
    assert len(ds) == 5
    assert ds["task_index"] == [0, 1, 2, 3, 4]
    assert ds[0]["prompt"][0]["role"] == "user" and ds[0]["prompt"][0]["content"] == ""
    fetches = [p for m, p in seen if p.endswith(("/task", "/task_range", "/tasks"))]
    assert fetches == ["/echoenvironment/task_range"]  # one request for the tasks, not one per task
    assert ds[2]["target"] == spec.run(spec.client.task("train", 2))["target"]


def test_num_tasks_larger_than_split_is_capped(ref_server) -> None:
    spec = OpenRewardSpec(ref_server.url, env_name="echoenvironment", num_tasks=1000)
    assert len(spec.train_dataset) == 16


def test_dataset_with_indices_keeps_order_and_duplicates(ref_server) -> None:
    spec = OpenRewardSpec(ref_server.url, env_name="echoenvironment", indices=[7, 2, 3, 7, 15], split="train")
    seen = count_requests(spec)
    ds = spec.train_dataset
    assert ds["task_index"] == [7, 2, 3, 7, 15]
    all_tasks = spec.run(spec.client.tasks("train"))
    assert ds["target"] == [all_tasks[i]["target"] for i in [7, 2, 3, 7, 15]]
    assert len([p for _, p in seen if p.endswith("/task_range")]) <= 2


def test_out_of_range_indices_fail_on_first_use(ref_server) -> None:
    spec = OpenRewardSpec(ref_server.url, env_name="echoenvironment", indices=[0, 99])
    with pytest.raises(ConfigurationError, match=r"\[99\].*0\.\.15"):
        spec.train_dataset  # noqa: B018


def test_whole_split_and_no_metadata(ref_server) -> None:
    spec = OpenRewardSpec(ref_server.url, env_name="echoenvironment", split="test", include_metadata=False)
    ds = spec.train_dataset
    assert set(ds.column_names) == {"prompt", "task_index"}
    assert len(ds) == 8


def test_heterogeneous_task_fields_do_not_crash(ref_server) -> None:
    spec = OpenRewardSpec(ref_server.url, env_name="mixedenvironment")
    ds = spec.train_dataset
    tasks = spec.run(spec.client.tasks("train"))
    assert ds["task_index"] == list(range(len(tasks)))  # the task's own "task_index" field did not win
    assert all(p[0]["content"] == "" for p in ds["prompt"])  # nor its "prompt" field
    assert "task_spec" not in ds.column_names
    assert ds["task_task_index"] == [t["task_index"] for t in tasks]  # the task's own field, renamed, kept
    # answer mixes int and str: stored as JSON text, which round-trips to the task's value
    assert [json.loads(v) for v in ds["answer"]] == [t["answer"] for t in tasks]
    assert any("answer" in note for note in spec.dataset_notes)
    assert ds["id"] == [t["id"] for t in tasks]


def test_task_columns_unit() -> None:
    cols, notes = task_columns([{"a": 1, "b": {"x": 1}}, {"a": "s", "b": {"y": [1]}}, {"c": None}])
    assert cols["a"] == ["1", '"s"', None]
    assert cols["c"] == [None, None, None]
    assert "b" in cols
    assert notes


def test_task_fields_named_like_trl_keywords_keep_their_data_under_a_free_name() -> None:
    tasks = [{"self": 1, "task_self": 2, "prompts": "p", "ors_reward": 0.5, "environment": "e", "image": "i", "x": 3}]
    cols, notes = task_columns(tasks)
    assert cols == {"task_task_self": [1], "task_self": [2], "task_prompts": ["p"], "task_ors_reward": [0.5],
                    "task_environment": ["e"], "task_image": ["i"], "x": [3]}  # `task_self` was taken: prefixed again
    assert notes == ["task fields renamed in the dataset (TRL or ors-trl passes these names itself, or Arrow cannot "
                     "store them): environment -> task_environment, image -> task_image, ors_reward -> "
                     "task_ors_reward, prompts -> task_prompts, self -> task_task_self"]


def test_a_nul_in_a_task_field_name_or_nested_key_loses_nothing() -> None:
    """Bug (the fuzz run, terminal escapes in task fields): Arrow cuts a name at a NUL, so a field named `a\\x00b`
    failed to build the dataset (an untyped CastError out of `train_dataset`), and a nested key `k\\x00` lost its
    value silently. The name gets U+FFFD (prefixed when that is taken); nested NUL keys keep the value as JSON."""
    from datasets import Dataset

    tasks = [{"a\x00b": 1, "a\ufffdb": 2, "n": {"k\x00": 3}, "id\x00": "x"}, {"a\x00b": 4, "n": {"k": 5}}]
    cols, notes = task_columns(tasks)
    rows = Dataset.from_dict(cols).to_list()
    assert rows == [{"task_a\ufffdb": 1, "a\ufffdb": 2, "n": '{"k\\u0000": 3}', "id\ufffd": "x"},
                    {"task_a\ufffdb": 4, "a\ufffdb": None, "n": '{"k": 5}', "id\ufffd": None}]
    assert json.loads(rows[0]["n"]) == {"k\x00": 3}
    assert "'a\\x00b' -> 'task_a\ufffdb'" in notes[0] and "'id\\x00' -> 'id\ufffd'" in notes[0]
    assert notes[1:] == ["task field 'n' has keys with a NUL in them; stored as JSON text"]


def test_environment_factory_binds_exactly_the_tools(ref_server) -> None:
    spec = OpenRewardSpec(ref_server.url, env_name="sparseenvironment", num_tasks=2)
    env_cls = spec.environment_factory
    assert tools_of(env_cls) == ["calculator", "submit"]
    env = env_cls()
    assert env is not env_cls()  # a fresh adapter per call


def test_reset_and_tool_state(ref_server) -> None:
    spec = OpenRewardSpec(ref_server.url, env_name="sparseenvironment", num_tasks=3)
    row = spec.train_dataset[1]
    env = spec.environment_factory()
    prompt = env.reset(**row)
    assert str(row["a"]) in prompt and str(row["b"]) in prompt
    assert (env.reward, env.rewards, env.finished) == (None, [], False)
    out = env.calculator(expression=f"{row['a']} + {row['b']}")
    assert out.strip().endswith(str(row["a"] + row["b"]))
    assert env.rewards == [None] and env.reward is None
    out = env.submit(answer=row["a"] + row["b"])
    assert env.rewards == [None, 1.0] and env.reward == 1.0 and env.finished
    assert env.last_output == out
    assert isinstance(env.metadata, list) and len(env.metadata) == 2
    # a later refused call does not erase the earlier score, and is recorded as None
    with pytest.raises(ToolRefusedError, match="episode_finished"):
        env.calculator(expression="1+1")
    assert env.rewards == [None, 1.0, None] and env.reward == 1.0
    # reset starts a new episode
    env.reset(**spec.train_dataset[0])
    assert (env.reward, env.rewards, env.metadata, env.finished) == (None, [], [], False)
    spec.close()


def test_zero_and_negative_rewards_are_real(ref_server) -> None:
    spec = OpenRewardSpec(ref_server.url, env_name="hostileenvironment", indices=[0])
    env = spec.environment_factory()
    env.reset(**spec.train_dataset[0])
    getter = next(f for n, f in inspect.getmembers(type(env), inspect.isfunction) if f.__name__ == "get_reward")
    getter(env)
    assert env.reward == -1.0
    assert spec.reward_funcs([env]) == [-1.0]
    env.reset(**spec.train_dataset[0])
    assert spec.reward_funcs([env]) == [None]  # nothing scored is None, not 0.0
    spec.close()


def test_reward_funcs_is_picklable_and_outcome_only(ref_server) -> None:
    spec = OpenRewardSpec(ref_server.url, env_name="echoenvironment", num_tasks=2)
    fn = pickle.loads(pickle.dumps(spec.reward_funcs))
    envs = [spec.environment_factory() for _ in range(3)]
    rows = spec.train_dataset
    for env in envs:
        env.reset(**rows[0])
    envs[0].echo(text=rows[0]["target"])
    envs[1].echo(text="wrong")
    assert fn(envs) == [1.0, 0.0, None]
    spec.close()


def test_tool_failure_is_counted_the_way_trl_counts_it(ref_server) -> None:
    """Replays TRL's tool loop: a raising tool is a failure and the model sees {'error': message}."""
    spec = OpenRewardSpec(ref_server.url, env_name="sparseenvironment", num_tasks=1)
    env = spec.environment_factory()
    env.reset(**spec.train_dataset[0])
    tool_dict = {f.__name__: getattr(env, n) for n, f in inspect.getmembers(type(env), inspect.isfunction)
                 if n not in ("reset", "get_reward") and not n.startswith("_")}
    failures, results = 0, []
    for name, args in [("calculator", {"expression": "import os"}), ("calculator", {"expression": "2*3"}),
                       ("submit", {"answer": "not a number"})]:
        try:
            results.append(tool_dict[name](**args))
        except Exception as e:
            failures += 1
            results.append({"error": str(e)})
    assert failures == 2
    assert "calculator" in results[0]["error"] and "raised" in results[0]["error"]
    assert results[1].strip().endswith("6")
    assert "input_validation" in results[2]["error"]
    assert env.rewards == [None, None, None] and env.metadata[0] is None
    spec.close()


def test_task_specific_tools_are_discovered_and_probes_closed(ref_server) -> None:
    before = ref_server.stats()["open_sessions"]
    spec = OpenRewardSpec(ref_server.url, env_name="tasktoolsenvironment", indices=[0, 1])
    assert tools_of(spec.environment_factory) == ["look", "open_door", "open_window"]
    assert ref_server.stats()["open_sessions"] == before
    only0 = OpenRewardSpec(ref_server.url, env_name="tasktoolsenvironment", num_tasks=3)
    assert tools_of(only0.environment_factory) == ["look", "open_door"]  # probes task 0 only
    chosen = OpenRewardSpec(ref_server.url, env_name="tasktoolsenvironment", task_tools_discovery_index=1)
    assert tools_of(chosen.environment_factory) == ["look", "open_window"]
    shared = OpenRewardSpec(ref_server.url, env_name="tasktoolsenvironment", discover_task_tools=False)
    assert tools_of(shared.environment_factory) == ["look"]
    assert ref_server.stats()["open_sessions"] == before


def test_failed_probes_fall_back_to_shared_tools(ref_server, monkeypatch, caplog) -> None:
    spec = OpenRewardSpec(ref_server.url, env_name="tasktoolsenvironment", indices=[0, 1])

    async def broken(**kwargs):
        raise ToolRefusedError("probe failed on purpose")

    monkeypatch.setattr(spec.client, "open_session", broken)
    assert tools_of(spec.environment_factory) == ["look"]
    assert "binding shared tools only" in caplog.text


def test_sessions_are_closed_on_reset_and_close(ref_server) -> None:
    spec = OpenRewardSpec(ref_server.url, env_name="echoenvironment", num_tasks=4)
    base = ref_server.stats()["open_sessions"]
    envs = [spec.environment_factory() for _ in range(4)]
    for i, env in enumerate(envs):
        env.reset(**spec.train_dataset[i])
        env.echo(text="x")  # waits for the session, so it is open now
    assert ref_server.stats()["open_sessions"] == base + 4
    for i, env in enumerate(envs):
        env.reset(**spec.train_dataset[(i + 1) % 4])
        env.echo(text="x")
    ref_server.wait_for_stats(lambda s: s["open_sessions"] == base + 4)
    spec.close()
    assert ref_server.stats()["open_sessions"] == base


def test_resets_of_one_task_wait_once(make_server) -> None:
    server = make_server("slow", env={"ORS_TEST_SETUP_DELAY": "0.6"})
    spec = OpenRewardSpec(server.url, num_tasks=2)
    rows = spec.train_dataset
    envs = [spec.environment_factory() for _ in range(8)]
    prompts = [env.reset(**rows[i // 4]) for i, env in enumerate(envs)]  # 4 rollouts per task, like GRPO
    assert spec._runtime.cached_resets == 6  # only the first reset of each task waited for its session
    assert prompts[0] == prompts[3] and prompts[4] == prompts[7]
    for env in envs:
        env.work(step=0)  # the first tool call waits for its background session
    stats = server.stats()
    assert stats["open_sessions"] == 8
    assert stats["peak_in_flight"]["slowenvironment/setup"] >= 3  # background opens overlapped
    spec.close()
    assert server.stats()["open_sessions"] == 0


def test_cache_prompts_off_waits_every_time(make_server) -> None:
    server = make_server("slow", env={"ORS_TEST_SETUP_DELAY": "0.3"})
    spec = OpenRewardSpec(server.url, num_tasks=1, cache_prompts=False)
    envs = [spec.environment_factory() for _ in range(3)]
    for env in envs:
        env.reset(**spec.train_dataset[0])
    assert spec._runtime.cached_resets == 0
    assert server.stats()["peak_in_flight"]["slowenvironment/setup"] == 1  # one after another
    spec.close()


def test_reset_survives_an_environment_failure(ref_server) -> None:
    spec = OpenRewardSpec(ref_server.url, env_name="echoenvironment", num_tasks=2)
    env = spec.environment_factory()
    text = env.reset(task_index=500)  # not in the split: the server refuses to create it
    assert "failed to start" in text and env.error
    shown = env.echo(text="x")  # the model reads that its episode is over; nothing is sent, nothing counted
    assert "not run" in shown and "this episode is over" in shown
    assert env.reward is None and env.rewards == [] and env.episode.tool_failures == 0
    env.reset(**spec.train_dataset[0])  # the next reset works
    assert env.error is None
    spec.close()


def test_catalog_mode_forwards_the_key_as_a_secret(ref_server, monkeypatch) -> None:
    monkeypatch.setenv("OPENREWARD_URL", ref_server.url)
    monkeypatch.setenv("OPENREWARD_API_KEY", "sk-catalog")
    spec = OpenRewardSpec("acme/schema", env_name="schemaenvironment", indices=[3])
    env = spec.environment_factory()
    env.reset(**spec.train_dataset[0])
    # the environment got the key: its echo comes back masked (issue 22), and only a known secret is masked
    assert json.loads(env.status())["secrets"] == {"api_key": "***"}
    explicit = OpenRewardSpec("acme/schema", env_name="schemaenvironment", indices=[3], secrets={"x": "1"})
    env2 = explicit.environment_factory()
    env2.reset(**explicit.train_dataset[0])
    assert json.loads(env2.status())["secrets"] == {"x": "1"}
    spec.close()
    explicit.close()


def test_url_mode_sends_no_key_secret(ref_server, monkeypatch) -> None:
    monkeypatch.setenv("OPENREWARD_API_KEY", "sk-should-not-leave")
    spec = OpenRewardSpec(ref_server.url, env_name="schemaenvironment", indices=[3])
    env = spec.environment_factory()
    env.reset(**spec.train_dataset[0])
    assert json.loads(env.status())["secrets"] == {}
    headers = spec.client._transport.headers(ref_server.url)
    assert "X-API-Key" not in headers
    spec.close()


def test_unscored_reward_option(ref_server) -> None:
    from trl.trainer.utils import get_callable_name

    spec = OpenRewardSpec(ref_server.url, env_name="echoenvironment", num_tasks=2, unscored_reward=0.0)
    fn = pickle.loads(pickle.dumps(spec.reward_funcs))
    assert get_callable_name(fn) == "outcome_reward"  # TRL logs it under the same name
    envs = [spec.environment_factory() for _ in range(2)]
    for env in envs:
        env.reset(**spec.train_dataset[0])
    envs[0].echo(text=spec.train_dataset[0]["target"])
    assert fn(envs) == [1.0, 0.0]  # the rollout that never called a tool counts as 0.0, on request
    assert fn(ors_reward=[None, 0.5, float("nan")]) == [0.0, 0.5, 0.0]  # the engine's column, too
    assert OpenRewardSpec(ref_server.url, num_tasks=1).reward_funcs(ors_reward=[None]) == [None]  # default
    spec.close()


def test_grpo_trainer_collects_and_renders_the_environments_schemas(ref_server, tiny_model_dir, tmp_path) -> None:
    """Builds a real GRPOTrainer from the three properties and checks the tools TRL collects and renders."""
    from transformers.utils import get_json_schema

    from test_schema import _resolve, canon_env, canon_gjs, collect_facts
    from tests.fixtures.generation import cpu_grpo_trainer, rendered_tools

    spec = OpenRewardSpec(ref_server.url, env_name="schemaenvironment", num_tasks=4)
    trainer = cpu_grpo_trainer(tiny_model_dir, str(tmp_path), batch=2, spec=spec)
    tokenizer = trainer.processing_class
    tools = {t.__name__: t for t in rendered_tools(trainer)[None]}
    served = {t.name: t.input_schema for t in spec.tool_specs}
    assert set(tools) == set(served) == {"place_order", "plot", "set_mode", "status"}
    for name, method in tools.items():
        rendered = get_json_schema(method)["function"]["parameters"]
        schema = served[name] or {}
        root, _ = _resolve(schema, schema)
        properties = root.get("properties") or {}
        assert set(rendered["properties"]) == set(properties), name
        assert set(rendered.get("required", [])) == set(root.get("required", [])), name
        for prop, got in rendered["properties"].items():
            assert canon_gjs(got) == canon_env(properties[prop], schema), (name, prop)
            for fact in collect_facts(properties[prop], schema):
                assert fact in got["description"], (name, prop, fact)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tools=list(tools.values()), tokenize=False)
    assert '"place_order"' in text and "Point object fields" in text and '"prefixItems"' in text
    spec.close()


def test_calls_started_ahead_that_trl_does_not_ask_for_are_recorded_not_lost(make_server, caplog, tmp_path) -> None:
    """batch_tool_calls safety net: if TRL asks for something other than the calls started ahead of it (a turn
    cut short), those calls are recorded in order first, then the asked-for call runs as usual."""
    from ors_trl.core.episode import ToolCall
    from ors_trl.trl.adapter import _Ahead, _run_chain

    def _start_ahead(batch):  # what the adapter does at the first call of a turn of TRL's loop
        for env, calls in batch:
            chain = [_Ahead(ToolCall(name, arguments)) for name, arguments in calls]
            env._ahead.extend(chain)
            env._runtime.submit(_run_chain(env.episode, chain))

    server = make_server("slow", env={"ORS_TEST_STEPS": "2"})
    log = tmp_path / "episodes.jsonl"
    spec = OpenRewardSpec(server.url, num_tasks=1, episode_log=str(log))
    env = spec.environment_factory()
    env.reset(**spec.train_dataset[0])
    _start_ahead([(env, [("work", {"step": 0}), ("work", {"step": 1})])])
    with caplog.at_level("WARNING", logger="ors_trl"), pytest.raises(ToolRefusedError):
        env.work(step=5)  # not what was started: work(0) and work(1) are recorded, then work(5) meets a finished episode
    assert "not the call started ahead" in caplog.text
    assert [m["step"] if m else None for m in env.metadata] == [0, 1, None]
    assert env.reward == 1.0 and env.finished and env.tool_calls == 3
    assert server.stats()["tool_calls"]["slowenvironment/work"] == 2  # each ran once; work(5) never left the client
    env.reset(**spec.train_dataset[0])
    _start_ahead([(env, [("work", {"step": 0})])])  # started, never asked for: the next reset records it first
    env.reset(**spec.train_dataset[0])
    assert server.stats()["tool_calls"]["slowenvironment/work"] == 3
    spec.close()
    assert server.stats()["open_sessions"] == 0
    assert sorted(json.loads(line)["tool_calls"] for line in log.read_text().splitlines()) == [0, 1, 3]


# -- task fields named like the keywords TRL calls with ------------------------------------------------------


def colliding_step(trainer_kwargs: dict, model_dir: str, output_dir: str) -> tuple[list, list]:
    """One real GRPOTrainer step (TRL's loop or the engine, per `trainer_kwargs`) with scripted tool calls; returns
    (target, outcome reward) per rollout and the keyword arguments a user's reward function got."""
    from tests.fixtures.generation import cpu_grpo_trainer, echo_generation, replace_generation, trl_tokenizer

    outcomes: list = []
    seen: list = []
    score = trainer_kwargs.pop("reward_funcs")

    def outcome(**kwargs):
        rewards = score(**kwargs)
        outcomes.extend(zip(kwargs["target"], rewards, strict=True))
        return rewards

    def user_reward(**kwargs):
        seen.append(kwargs)
        return [None] * len(kwargs["completions"])

    trainer = cpu_grpo_trainer(model_dir, output_dir, batch=4, generations=2, turns=2, completion_length=96,
                               reward_funcs=[outcome, user_reward], **trainer_kwargs)
    replace_generation(trainer, echo_generation(trl_tokenizer(trainer)))
    trainer.train()
    assert trainer.state.global_step == 1
    return outcomes, seen


#: What the scripted model earns per target (tests.fixtures.generation.echo_generation): "world" calls an unknown tool.
COLLIDING_REWARDS = {"hello": 1.0, "delta": 1.0, "token": 1.0, "world": None}


def check_user_reward_kwargs(seen: list, *, environments: bool) -> None:
    """The user's reward function saw TRL's own keywords and every colliding task field under `task_<name>`."""
    from transformers import TrainerState

    (kwargs,) = seen
    routed = kwargs.get("environment") or ["colliding"] * len(kwargs["target"])  # a mix's rows say whose they are
    rows = [i for i, env in enumerate(routed) if env == "colliding"]
    assert rows
    for name in COLLIDING_FIELDS:
        got = [kwargs[f"task_{name}"][i] for i in rows]
        assert got == [0.5 if name == "ors_reward" else f"{name}-{kwargs['target'][i]}" for i in rows], name
    assert isinstance(kwargs["trainer_state"], TrainerState) and callable(kwargs["log_metric"])
    assert all(isinstance(c, list) for c in kwargs["completions"]) and kwargs["prompts"]
    assert ("environments" in kwargs) is environments
    if environments:
        assert all(type(e).__name__.startswith("OpenRewardEnvironment") for e in kwargs["environments"])


@pytest.mark.parametrize("mode", ["environment_factory", "rollout_func"])
def test_task_fields_named_like_trl_keywords_are_renamed_and_a_real_step_trains(colliding_server, tiny_model_dir,
                                                                                 tmp_path, caplog, mode) -> None:
    """`self`, `prompts`, `completions`, ... as task fields made TRL raise TypeError (a keyword given twice)."""
    spec = OpenRewardSpec(colliding_server.url, env_name="collidingenvironment")
    before = colliding_server.stats()["open_sessions"]
    with caplog.at_level("WARNING", logger="ors_trl"):
        dataset = spec.train_dataset
    renamed = [r.getMessage() for r in caplog.records if "renamed" in r.getMessage()]
    assert len(renamed) == 1 and all(f"{f} -> task_{f}" in renamed[0] for f in COLLIDING_FIELDS)  # said once
    assert set(COLLIDING_FIELDS).isdisjoint(dataset.column_names)
    outcomes, seen = colliding_step({"train_dataset": dataset, mode: getattr(spec, mode),
                                     "reward_funcs": spec.reward_funcs}, tiny_model_dir, str(tmp_path))
    assert len(outcomes) == 4 and all(reward == COLLIDING_REWARDS[t] for t, reward in outcomes)
    check_user_reward_kwargs(seen, environments=mode == "environment_factory")
    colliding_server.wait_for_stats(lambda s: s["open_sessions"] == before, timeout=30)  # closed at the end of training
    spec.close()


# -- tool discovery --------------------------------------------------------------------------------------------


def test_tool_discovery_is_bounded_and_probes_each_distinct_task_once(make_server) -> None:
    """48 indices (twice each) of 40 distinct tasks: at most PROBE_CONCURRENCY probe sessions at once, one probe per
    distinct task, and every listed task's tools bound (TRL's union)."""
    from ors_trl.spec import PROBE_CONCURRENCY

    server = make_server("probe")
    indices = [*range(PROBE_TASKS), *range(PROBE_TASKS)]
    spec = OpenRewardSpec(server.url, indices=indices)
    assert tools_of(spec.environment_factory) == ["look", *(f"variant_{k}" for k in range(PROBE_VARIANTS))]
    stats = server.stats()
    assert stats["setups"] == PROBE_DISTINCT  # one session per distinct task
    assert 1 < stats["peak_sessions"] <= PROBE_CONCURRENCY == 4
    assert stats["open_sessions"] == 0
    assert len(spec.train_dataset) == len(indices)  # the dataset keeps every listed index
