"""`RandomPolicy` (`ors-trl eval --policy random`): evaluation without a model. Its arguments are valid for the JSON
schema they were drawn from (checked by pydantic, which wrote the schema), it plays real environments end to end, and
it is seeded: the same seed gives the same episodes whatever order they run in."""

from __future__ import annotations

import json
import random
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from ors_trl import OpenRewardSpec, RandomPolicy
from ors_trl.cli import main
from ors_trl.evaluation.policies import random_arguments
from tests.fixtures.environments import ModeInput, PlotInput, SnapshotInput

pytestmark = pytest.mark.usefixtures("no_leaked_sessions")


class Inner(BaseModel):
    name: str = Field(min_length=12, max_length=14)
    weight: float = Field(gt=0.5, lt=0.75)


class Everything(BaseModel):
    """Each keyword `random_arguments` follows, as pydantic writes it."""

    count: int = Field(ge=-20, le=-18)
    ratio: float = Field(gt=0, le=0.001)
    code: str = Field(max_length=2)
    flag: bool
    kind: Literal["a", "b"]
    fixed: Literal["only"]
    pair: tuple[int, str]
    inner: Inner  # a $ref
    inners: list[Inner] = Field(min_length=2, max_length=3)
    maybe: Inner | None = None  # anyOf with null
    either: int | str
    tags: dict[str, int] = Field(default_factory=dict)


@pytest.mark.parametrize("model", [Everything, PlotInput, ModeInput, SnapshotInput])
def test_random_arguments_are_valid_for_their_schema(model: type[BaseModel]) -> None:
    schema = model.model_json_schema()
    drawn = [random_arguments(schema, random.Random(seed)) for seed in range(100)]
    for arguments in drawn:
        model.model_validate(arguments)  # raises on any invalid value
    assert len({json.dumps(a, sort_keys=True) for a in drawn}) > 10  # random, not one fixed answer
    assert random_arguments(schema, random.Random(7)) == random_arguments(schema, random.Random(7))


def test_random_arguments_survive_hostile_schemas() -> None:
    cyclic = {"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]}
    for schema in (cyclic, {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1e400}}},
                   {"properties": {"s": {"type": "string", "minLength": 10**12}}, "required": ["s"]},
                   {"$ref": "#/nowhere"}, [], None, {"type": "object", "properties": {"x": False}, "required": ["x"]}):
        assert isinstance(random_arguments(schema, random.Random(0)), dict)


def test_random_policy_plays_an_environment_end_to_end(ref_server) -> None:
    """Every call it makes on the image environment passes the server's own validation (pydantic's; a call after the
    episode finished is refused unrun, as a model's), and two runs of a seed, concurrent, play the same episodes."""
    spec = OpenRewardSpec(ref_server.url, env_name="imageenvironment", split="test")
    try:
        runs = [spec.evaluate(RandomPolicy(seed=3), repeats=3, concurrency=c, progress=False) for c in (1, 8)]
    finally:
        spec.close()
    episodes = runs[0].episodes
    assert len(episodes) == 12 and runs[0].num_errors == 0 and runs[0].policy == "random (seed 3)"
    calls = [c for e in episodes for t in e["turns"] for c in t.get("tool_calls") or []]
    statuses = {c["status"] for c in calls}  # not_run: a call of the last turn (max_turns), as TRL's loop leaves it
    assert len(calls) > 12 and "ok" in statuses and statuses <= {"ok", "refused", "not_run"}  # none failed validation
    assert {c["error"]["reason"] for c in calls if c["status"] == "refused"} == {"episode_finished"}

    def played(report) -> list:
        return sorted(json.dumps([e["task_index"], e["reward"], [[c["name"], c["arguments"]] for t in e["turns"]
                                                                for c in t.get("tool_calls") or []]])
                      for e in report.episodes)

    assert played(runs[0]) == played(runs[1])
    assert len(set(played(runs[0]))) > 4  # the repeats of a task differ


def test_eval_policy_random_on_the_command_line(ref_server, capsys) -> None:
    assert main(["eval", ref_server.url, "--env-name", "echoenvironment", "--policy", "random", "--seed", "1",
                 "--num-tasks", "4", "--no-progress", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_episodes"] == 4 and report["num_errors"] == 0 and report["policy"] == "random (seed 1)"
    assert main(["eval", ref_server.url, "--policy", "random", "--model", "x"]) == 2
    assert "--policy random is the policy: it takes no --model or --base-url" in capsys.readouterr().err
    assert main(["eval", ref_server.url]) == 2
    assert "or --policy random (no model)" in capsys.readouterr().err
