"""Drop-in parity with `trl.experimental.openreward`: the cases of TRL's own test file for its module.

TRL's `tests/experimental/test_openreward.py` exercises `OpenRewardSpec` against its echo environment
(`tests/experimental/_openreward_echo_env.py`). The cases below are ours, written to the same behaviour,
against `TrlEchoEnvironment` (the same tasks, tools and answers, under TRL's key `echoenvironment`) on the
reference server. The bodies are TRL's but for the import line, except:

- `test_construction_is_lazy`: TRL's reads its own private attributes; ours asks the server that construction
  sent no request;
- `test_factory_produces_isolated_sessions`: TRL's file asserts `env_b.reward == 0.0` for a rollout that called
  nothing, which TRL 1.16's own adapter does not satisfy either (its reward starts as None: unscored, never 0.0);
  ours asserts None.

Then: an unverified TRL version (the fallback that lets ors-trl install beside a newer TRL).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterator

import pytest

from ors_trl import OpenRewardSpec, ToolRefusedError, UsageError
from ors_trl.testing import ReferenceServer
from tests.fixtures.environments import TrlEchoEnvironment


@pytest.fixture(scope="module")
def echo_server() -> Iterator[ReferenceServer]:
    with ReferenceServer([TrlEchoEnvironment]) as server:
        yield server


@pytest.fixture
def echo_env_url(echo_server: ReferenceServer) -> Iterator[str]:
    """The server's URL; after the test, no session may be left open on it (each case closes what it opened)."""
    yield echo_server.url
    try:
        echo_server.wait_for_stats(lambda s: s["open_sessions"] == 0, timeout=10)
    except TimeoutError:
        left = echo_server.close_sessions()
        pytest.fail(f"{len(left)} session(s) left open", pytrace=False)


class TestOpenRewardSpec:
    """TRL's cases for the public `OpenRewardSpec` surface, against a real ORS server."""

    def test_construction_is_lazy(self, echo_server, echo_env_url):
        # Construction must not perform any HTTP: the dataset and the factory are built on first access.
        before = echo_server.stats()["requests"]
        spec = OpenRewardSpec(echo_env_url, env_name="echoenvironment", num_tasks=2)
        assert echo_server.stats()["requests"] == before
        assert len(spec.train_dataset) == 2
        assert echo_server.stats()["requests"] > before  # the counter does see the spec's requests

    def test_train_dataset_derives_from_env(self, echo_env_url):
        spec = OpenRewardSpec(echo_env_url, env_name="echoenvironment", num_tasks=2)
        ds = spec.train_dataset
        assert len(ds) == 2
        assert "prompt" in ds.column_names
        assert "task_index" in ds.column_names
        assert "target" in ds.column_names  # task fields become columns (include_metadata=True)
        assert ds[0]["task_index"] == 0
        assert ds[0]["target"] == "hello"
        assert ds[1]["target"] == "world"

    def test_train_dataset_with_indices(self, echo_env_url):
        spec = OpenRewardSpec(echo_env_url, env_name="echoenvironment", indices=[0, 2])
        assert [row["target"] for row in spec.train_dataset] == ["hello", "trl"]

    def test_num_tasks_and_indices_are_mutually_exclusive(self, echo_env_url):
        with pytest.raises(ValueError):
            OpenRewardSpec(echo_env_url, env_name="echoenvironment", num_tasks=2, indices=[0])

    def test_environment_factory_returns_rollout_env_with_bound_tools(self, echo_env_url):
        spec = OpenRewardSpec(echo_env_url, env_name="echoenvironment", num_tasks=2)
        env = spec.environment_factory()
        assert callable(env.echo)  # shared tools (/tools) and task tools (/task_tools) are both bound
        annotations = env.echo.__annotations__
        assert annotations["text"] is str
        assert annotations["return"] is str
        assert callable(env.hint)

    def test_discover_task_tools_false_skips_task_scoped_binding(self, echo_env_url):
        spec = OpenRewardSpec(echo_env_url, env_name="echoenvironment", num_tasks=1, discover_task_tools=False)
        env = spec.environment_factory()
        assert callable(env.echo)
        assert not hasattr(env, "hint")

    def test_reset_returns_prompt_and_opens_session(self, echo_env_url):
        spec = OpenRewardSpec(echo_env_url, env_name="echoenvironment", num_tasks=1)
        env = spec.environment_factory()
        prompt = env.reset(**spec.train_dataset[0])
        assert "echo" in prompt and "hello" in prompt
        env._close()

    def test_correct_echo_returns_match_with_reward_and_finished(self, echo_env_url):
        spec = OpenRewardSpec(echo_env_url, env_name="echoenvironment", num_tasks=1)
        env = spec.environment_factory()
        env.reset(**spec.train_dataset[0])
        out = env.echo(text="hello")
        assert "match" in out
        assert env.reward == 1.0
        assert env.finished is True
        env._close()

    def test_wrong_echo_returns_no_match_with_zero_reward(self, echo_env_url):
        spec = OpenRewardSpec(echo_env_url, env_name="echoenvironment", num_tasks=1)
        env = spec.environment_factory()
        env.reset(**spec.train_dataset[0])
        out = env.echo(text="goodbye")
        assert "no match" in out
        assert env.reward == 0.0
        assert env.finished is False
        env._close()

    def test_reward_func_reads_last_non_null_per_environment(self, echo_env_url):
        spec = OpenRewardSpec(echo_env_url, env_name="echoenvironment", num_tasks=2)
        env_a, env_b = spec.environment_factory(), spec.environment_factory()
        env_a.reset(**spec.train_dataset[0])
        env_b.reset(**spec.train_dataset[1])
        env_a.echo(text="hello")  # match: 1.0
        env_b.echo(text="oops")  # no match: 0.0
        assert spec.reward_funcs(environments=[env_a, env_b]) == [1.0, 0.0]
        env_a._close()
        env_b._close()

    def test_factory_produces_isolated_sessions(self, echo_env_url):
        spec = OpenRewardSpec(echo_env_url, env_name="echoenvironment", num_tasks=2)
        env_a, env_b = spec.environment_factory(), spec.environment_factory()
        env_a.reset(**spec.train_dataset[0])
        env_b.reset(**spec.train_dataset[1])
        env_a.echo(text="hello")
        assert env_a.reward == 1.0
        assert env_b.reward is None  # untouched: nothing scored it (TRL's own adapter says None too)
        env_a._close()
        env_b._close()

    def test_metadata_does_not_overwrite_reserved_columns(self, echo_env_url):
        spec = OpenRewardSpec(echo_env_url, env_name="echoenvironment", num_tasks=1)
        ds = spec.train_dataset
        assert isinstance(ds[0]["prompt"], list)  # the chat-format prompt, not a task field
        assert ds[0]["prompt"][0]["role"] == "user"
        assert isinstance(ds[0]["task_index"], int)

    def test_task_tools_discovery_index_probes_single_task(self, echo_env_url):
        spec = OpenRewardSpec(echo_env_url, env_name="echoenvironment", num_tasks=4, task_tools_discovery_index=0)
        env = spec.environment_factory()
        assert callable(env.echo)
        assert callable(env.hint)
        assert len(spec.train_dataset) == 4  # discovery probed one task; the dataset has all four
        env._close()

    def test_task_tools_discovery_index_with_indices(self, echo_env_url):
        spec = OpenRewardSpec(echo_env_url, env_name="echoenvironment", indices=[0, 1, 2, 3],
                              task_tools_discovery_index=2)
        env = spec.environment_factory()
        assert callable(env.hint)
        assert len(spec.train_dataset) == 4
        env._close()

    def test_two_specs_get_isolated_rollout_subclasses(self, echo_env_url):
        spec_a = OpenRewardSpec(echo_env_url, env_name="echoenvironment", num_tasks=1)
        spec_b = OpenRewardSpec(echo_env_url, env_name="echoenvironment", num_tasks=1)
        env_a, env_b = spec_a.environment_factory(), spec_b.environment_factory()
        assert type(env_a) is not type(env_b)
        assert callable(env_a.echo) and callable(env_b.echo)
        env_a._close()
        env_b._close()


# -- close(): what `_close()` is ------------------------------------------------------------------------


def test_close_frees_the_session_now_and_records_the_episode_once(echo_server, echo_env_url, tmp_path) -> None:
    log = tmp_path / "episodes.jsonl"
    spec = OpenRewardSpec(echo_env_url, env_name="echoenvironment", num_tasks=2, episode_log=str(log))
    env = spec.environment_factory()
    assert "close" not in dict(inspect.getmembers(type(env), inspect.isfunction))  # TRL offers no `close` tool
    env.reset(**spec.train_dataset[1])
    env.echo(text="nope")
    assert echo_server.stats()["open_sessions"] == 1
    env.close()
    assert echo_server.stats()["open_sessions"] == 0  # deleted on the server before close() returned
    env.close()
    env._close()  # idempotent, under either name
    assert env.reward == 0.0 and env.tool_calls == 1  # the episode's state stays readable
    (record,) = map(json.loads, log.read_text().splitlines())  # recorded once, as a release records it
    assert record["tool_calls"] == 1 and record["reward"] == 0.0
    # no trainer drove it, no reward function read it: a manual episode, not in the training metrics
    assert record["source"] == "manual" and "env/echoenvironment/episodes" not in spec.metrics.flush()
    calls = echo_server.stats()["tool_calls"]["echoenvironment/echo"]
    with pytest.raises(ToolRefusedError):  # the episode is over: refused here, never sent
        env.echo(text="world")
    assert echo_server.stats()["tool_calls"]["echoenvironment/echo"] == calls
    spec.close()


# -- an unverified TRL: ors-trl installs beside a newer TRL and falls back to TRL's public behaviour ------------


@pytest.fixture
def unverified_trl(monkeypatch) -> Iterator[str]:
    """Make the installed TRL look like a release `_trl.VERIFIED` does not list (nothing is installed)."""
    from ors_trl.trl import backend as _trl

    monkeypatch.setattr(_trl, "trl_version", lambda: "99.0.0")
    monkeypatch.delenv(_trl.TRUST_ENV, raising=False)
    _trl.verified.cache_clear()
    yield "99.0.0"
    monkeypatch.undo()
    _trl.verified.cache_clear()


def test_an_unverified_trl_trains_through_environment_factory_and_refuses_the_engine_early(
        unverified_trl, ref_server, tiny_model_dir, tmp_path, caplog) -> None:
    from tests.fixtures.generation import cpu_grpo_trainer, echo_generation, replace_generation, trl_tokenizer

    spec = OpenRewardSpec(ref_server.url, env_name="echoenvironment", num_tasks=4)
    before = ref_server.stats()["open_sessions"]
    outcomes: list = []

    def outcome(**kwargs):
        rewards = spec.reward_funcs(**kwargs)
        outcomes.extend(zip(kwargs["target"], rewards, strict=True))
        return rewards

    with caplog.at_level("WARNING", logger="ors_trl"):
        with pytest.raises(UsageError, match=r"verified for TRL 1\.16 only, and TRL 99\.0\.0 is installed"):
            spec.rollout_func  # noqa: B018 - fails on access, before any session or trainer
        trainer = cpu_grpo_trainer(tiny_model_dir, str(tmp_path), batch=4, generations=2, turns=2,
                                   completion_length=96, train_dataset=spec.train_dataset,
                                   environment_factory=spec.environment_factory, reward_funcs=[outcome],
                                   callbacks=spec.callbacks)
        replace_generation(trainer, echo_generation(trl_tokenizer(trainer)))
        trainer.train()
    assert trainer.state.global_step == 1
    # tests.fixtures.generation.echo_generation: a-m targets right at once, later ones after a wrong try, "world" never
    expected = {"hello": 1.0, "world": None, "trl": 1.0, "openreward": 1.0}
    assert len(outcomes) == 4 and all(reward == expected[t] for t, reward in outcomes)
    assert spec._runtime.calls_ahead == 0  # TRL's loop state was not read: one call at a time
    warnings = [r.getMessage() for r in caplog.records if "not a version ors-trl was verified" in r.getMessage()]
    assert len(warnings) == 1 and "<1.17" not in warnings[0] and "1.16" in warnings[0]
    ref_server.wait_for_stats(lambda s: s["open_sessions"] == before, timeout=30)  # spec.callbacks closed them
    spec.close()
