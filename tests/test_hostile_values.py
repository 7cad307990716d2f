"""Hostile but valid answers (issue "Survive the field, round 2"): numbers and booleans TRL cannot take as sent,
tool schemas whose `$ref`s expand, answers whose decoding costs many times their size, and task lists that would
build a dense table or fields nested deeper than Arrow holds.

Each test serves the answer from a real server (the seeded hostile server, or a `FaultProxy` rule in front of the
reference server) and failed on the code before its fix. Costs are counted (characters, work units, traced bytes),
never timed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest

from ors_trl import OpenRewardSpec, ProtocolError, Timeouts
from ors_trl.protocol.types import MAX_REWARD
from ors_trl.testing.faults import Fault, FaultProxy, Reply, SSEReply
from tests.fixtures.hostile_server import ENV, HostileServer
from tests.test_fuzz import RETRY, TIMEOUTS, _in_session, run_client

#: For tests about what a large answer becomes, not about stalls: the fuzz's tight request timeout (0.5 s) can expire
#: on a busy 2-core machine while a valid multi-megabyte answer is read.
ROOMY = Timeouts(request=30.0, stream_idle=30.0, tool_call=60.0)

# --------------------------------------------------------------------------------------------------
# 1. Numbers and booleans
# --------------------------------------------------------------------------------------------------


def _result(route: str, reward: str = "1.0", finished: str | None = "true") -> str:
    """A `/call` or `/score_group` result with `reward` and `finished` written as raw JSON text."""
    if route == "/score_group":
        return f'{{"scores": [{{"reward": {reward}, "metadata": {{"huge": 1e300}}}}]}}'
    flag = "" if finished is None else f', "finished": {finished}'
    return f'{{"ok": true, "output": {{"blocks": [], "reward": {reward}{flag}, "metadata": {{"huge": 1e300}}}}}}'


def _answered(route: str, result: str) -> Any:
    """What the client makes of `result` answered on `route` (a session opened on a proxy that knows nothing else)."""
    with FaultProxy(None) as proxy:
        proxy.add(SSEReply([("task_id", "sid-1")]), path="/create_session", times=None)
        proxy.add(SSEReply([("task_id", "t"), ("end", result)]), path=route, times=None)
        proxy.add(Reply(json.dumps([ENV])), path="/list_environments", times=None)
        proxy.add(Reply("{}"), times=None)
        return run_client(proxy.url, lambda c: _in_session(c, route.strip("/")))


@pytest.mark.parametrize("route", ["/call", "/score_group"])
@pytest.mark.parametrize("reward,match", [
    ("1e300", "past the"), ("-1e300", "past the"), ("3.5e38", "past the"), ("1e20", "past the"),
    ("9007199254740994", "past the"), ('"0.5"', "string reward"), ('"\\uff11"', "string reward"),
    ('" 1_0 "', "string reward"), ('"1e2"', "string reward"), ('"NaN"', "string reward"),
])
def test_a_reward_float32_cannot_hold_or_sent_as_a_string_is_a_protocol_error(route, reward, match) -> None:
    """Bug: 1e300 was a finite float64, accepted, and `inf` in TRL's float32 reward tensor (a group's advantages NaN);
    a reward sent as a string was parsed with `float()` (Unicode digits, underscores and padding accepted)."""
    with pytest.raises(ProtocolError, match=match):
        _answered(route, _result(route, reward))


@pytest.mark.parametrize("route", ["/call", "/score_group"])
@pytest.mark.parametrize("reward,expected", [("9007199254740992", float(2**53)), ("-1e15", -1e15), ("0.5", 0.5),
                                             ("3", 3.0)])
def test_a_reward_within_the_bound_is_kept_exactly(route, reward, expected) -> None:
    answer = _answered(route, _result(route, reward))
    got = answer[0].reward if route == "/score_group" else answer.reward
    assert got == expected
    metadata = answer[0].metadata if route == "/score_group" else answer.metadata
    assert metadata == {"huge": 1e300}  # metadata numbers are not rewards: kept as sent


def test_rewards_within_the_bound_give_finite_advantages_in_float32() -> None:
    """Why `MAX_REWARD` is 2**53: TRL sums, squares and divides rewards in float32 (`nanstd`); at the bound a whole
    batch of them still gives finite advantages, while 1e300 (a finite float64) is `inf` there and NaN after."""
    torch = pytest.importorskip("torch")
    from trl.trainer.utils import nanstd

    def advantages(values: list[float]) -> Any:
        rewards = torch.tensor(values, dtype=torch.float32)
        return (rewards - torch.nanmean(rewards)) / (nanstd(rewards) + 1e-4)

    assert torch.isfinite(advantages([MAX_REWARD, -MAX_REWARD] * 512)).all()
    assert torch.isnan(advantages([1e300, 0.0, 1.0, 0.0])).any()


@pytest.mark.parametrize("finished", ['"false"', '"no"', '"0"', '"true"', "0", "1", "[]", "{}"])
def test_finished_that_is_not_a_json_boolean_is_a_protocol_error(finished) -> None:
    """Bug: `finished: "false"` (or "no", "0") was `bool("false")`, True: the episode ended."""
    with pytest.raises(ProtocolError, match=r"'finished' is .* not a JSON boolean"):
        _answered("/call", _result("/call", finished=finished))


@pytest.mark.parametrize("finished,expected", [("true", True), ("false", False), ("null", False), (None, False)])
def test_finished_as_a_json_boolean_or_left_out_is_read_as_sent(finished, expected) -> None:
    assert _answered("/call", _result("/call", finished=finished)).finished is expected


def test_a_reward_past_the_bound_through_trl_s_loop_scores_the_rollout_none_counted(ref_server) -> None:
    """Through the adapter and the reward functions, as TRL calls them: the call fails as a protocol error, the
    rollout is scored None (TRL leaves it out of the group's baseline) and counted, never a reward of 1e300."""
    with FaultProxy(ref_server.url) as proxy:
        spec = OpenRewardSpec(proxy.url, env_name="echoenvironment", num_tasks=1, retry=RETRY, timeouts=TIMEOUTS)
        try:
            env = spec.environment_factory()
            env.reset(**spec.train_dataset[0])
            proxy.add(SSEReply([("task_id", "t"), ("end", _result("/call", "1e300"))]), path="/call", times=1)
            with pytest.raises(ProtocolError, match="past the"):
                env.echo(text="hello")
            metrics: dict[str, float] = {}
            assert spec.reward_funcs(environments=[env], log_metric=metrics.__setitem__) == [None]
            assert metrics["env/echoenvironment/failures/protocol"] == 1.0
        finally:
            spec.close()


# --------------------------------------------------------------------------------------------------
# 2. Schemas that expand
# --------------------------------------------------------------------------------------------------


def _bound(tools: list[Any]) -> tuple[Any, int, int]:
    """Bind `tools` as training does; (the toolset, characters of JSON received, characters TRL renders)."""
    from ors_trl.core.binding import Toolset
    from ors_trl.protocol.text import json_size

    toolset = Toolset(tools)
    return toolset, json_size([t.to_json() for t in tools], 1 << 62), len(json.dumps(toolset.schemas))


def test_tool_schemas_whose_refs_expand_cost_a_small_multiple_of_the_json_received() -> None:
    """Bug: a dozen 2 KB tools whose `$ref`s expand (each definition a union of the next, a list and a map of it) took
    12 s to bind and rendered 24 KB of tools as 8 MB of schema (x325) in every prompt: the work bound was per tool
    (100,000 units each), and nothing bounded what expansion copied. Now the whole list has one budget: expansion
    copies at most 4x the JSON received + 64 KiB, the rest is typed by its target's top-level type, counted and
    said, and what TRL renders is a small multiple of what was received."""
    from ors_trl.core.jsonschema import EXPANSION_FACTOR, EXPANSION_FLOOR

    with HostileServer(seed=3, only=frozenset({"valid"})) as hostile:
        hostile.force("schemas_expanding", path="/tools")
        listed = run_client(hostile.url, lambda c: c.tools())
    toolset, received, rendered = _bound(listed.tools)
    assert len(listed.tools) == 12 and received < 32_000
    assert rendered <= (EXPANSION_FACTOR + 2) * received + EXPANSION_FLOOR, (rendered, received)  # was 8 MB
    budget = toolset.binding.budget
    assert budget.expanded <= EXPANSION_FACTOR * received + EXPANSION_FLOOR
    assert budget.work_spent <= (1 + EXPANSION_FACTOR) * received + EXPANSION_FLOOR
    assert budget.refs_cut > 0
    assert any(f"{budget.refs_cut} $ref expansion(s) left unexpanded" in w for w in toolset.binding.warnings)
    # Every tool is still bound with all its parameters; a reference left unexpanded says so to the model.
    assert all(len(schema["function"]["parameters"]["properties"]) == 4 for schema in toolset.schemas)
    assert "not expanded" in json.dumps(toolset.schemas)


def test_the_expansion_budget_is_the_tool_list_s_not_each_tool_s() -> None:
    """Twice the tools, twice the budget (not twelve per-tool budgets): rendering grows with what was received, and
    one expanding tool cannot spend the others' share (a small tool after it still expands its own reference)."""
    from ors_trl.protocol.types import ToolSpec
    from tests.fixtures.hostile_server import expanding_tool

    plain = {"name": "plain", "input_schema": {"type": "object", "$defs": {"P": {"type": "object", "properties": {
        "x": {"type": "integer", "description": "The x."}}}}, "properties": {"p": {"$ref": "#/$defs/P"}}}}
    for count in (6, 12, 24):
        tools = [ToolSpec.from_json(expanding_tool(i)) for i in range(count)] + [ToolSpec.from_json(plain)]
        toolset, received, rendered = _bound(tools)
        assert rendered <= 6 * received + 64 * 1024, (count, rendered, received)
        assert "x (integer): The x" in toolset.binding.functions["plain"].__doc__


# --------------------------------------------------------------------------------------------------
# 3. Memory per answer
# --------------------------------------------------------------------------------------------------


@dataclass(repr=False)
class _Streamed(Fault, name="streamed_sse"):
    """An event stream encoded before the measurement and sent in 64 KiB chunks: the in-process fake server then holds
    no copy of a large answer while the client decodes it (tracemalloc counts every thread of the process, and
    `SSEReply` builds several copies of its events as it sends them, more of them alive at once on a busy machine)."""

    body: bytes

    async def handle(self, ex: Any) -> None:
        await ex.start_stream(200)
        for start in range(0, len(self.body), 1 << 16):
            await ex.chunk(self.body[start:start + (1 << 16)])
        await ex.end()


def _decoded_with_peak(result: str) -> tuple[Any, Any]:
    """(The ToolResult or the error, the traced peak) of a `/call` answered `result`, decoded as training does."""
    from tests.test_fuzz import Peak

    lines = "".join(f"data: {line}\n" for line in result.split("\n"))
    body = f"event: task_id\ndata: t\n\nevent: end\n{lines}\n".encode()
    with FaultProxy(None) as proxy:
        proxy.add(SSEReply([("task_id", "sid-1")]), path="/create_session", times=None)
        proxy.add(_Streamed(body), path="/call", times=None)
        proxy.add(Reply(json.dumps([ENV])), path="/list_environments", times=None)
        proxy.add(Reply("{}"), times=None)
        with Peak() as peak:
            try:
                answer = run_client(proxy.url, lambda c: _in_session(c, "call"),
                                    timeouts=ROOMY)
            except ProtocolError as exc:
                answer = exc
    return answer, peak


@pytest.mark.parametrize("shape", ["blocks", "lists", "dicts", "strings"])
def test_an_answer_that_would_cost_many_times_its_size_to_decode_is_refused_before_it_is(shape) -> None:
    """Bug: a `/call` answer under the 64 MiB cap cost 18-27x its size while decoded (40 MB of tiny blocks or of
    metadata: +0.7-1.1 GB), and the cap is per call. Now what decoding would build is estimated from the text first
    (containers, keys, strings: `_transport.DECODE_BYTES_PER_CHAR`), and an answer past it is a protocol error that
    costs only its buffers."""
    from tests.fixtures.hostile_server import dense_result

    result = dense_result(shape)
    answer, peak = _decoded_with_peak(result)
    assert isinstance(answer, ProtocolError) and "would take about" in str(answer), answer
    assert peak.traced < 5 * len(result), (peak.traced / len(result), shape)


@pytest.mark.parametrize("shape,pad", [("blocks", 14), ("dicts", 17), ("keys", 0), ("digits", 0)])
def test_an_answer_within_the_decode_bound_costs_a_small_multiple_of_its_size(shape, pad) -> None:
    """Just inside the bound (the same shapes, a little sparser), and dense digits (small ints cost only a slot):
    decoded whole, at most the bound's 8 bytes per character plus the buffers of reading it (measured: 3.8-9.1x)."""
    from ors_trl.protocol.transport import DECODE_BYTES_PER_CHAR
    from tests.fixtures.hostile_server import dense_result

    result = dense_result(shape, pad=pad)
    answer, peak = _decoded_with_peak(result)
    assert not isinstance(answer, Exception), answer
    assert len(answer.blocks if shape == "blocks" else answer.metadata["dense"]) > 200_000
    assert peak.traced < (DECODE_BYTES_PER_CHAR + 3) * len(result), (peak.traced / len(result), shape)


# --------------------------------------------------------------------------------------------------
# 3 (tasks) and 7. Task lists that would build a dense table, task fields nested deeper than Arrow holds
# --------------------------------------------------------------------------------------------------


def _dataset(variant: str) -> tuple[Any, int, list[str]]:
    """`OpenRewardSpec(url).train_dataset` of a hostile server whose task routes all answer `variant`: (the dataset,
    the traced peak of building it, what it logged)."""
    import logging
    import tracemalloc

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("ors_trl").addHandler(handler)
    with HostileServer(seed=6, only=frozenset({"valid"})) as hostile:
        for route in ("/num_tasks", "/task_range", "/tasks", "/task"):
            hostile.force(variant, path=route, times=100)
        spec = OpenRewardSpec(hostile.url, retry=RETRY, timeouts=ROOMY)
        tracemalloc.start()
        try:
            dataset = spec.train_dataset
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
            spec.close()
            logging.getLogger("ors_trl").removeHandler(handler)
    return dataset, peak, records


def test_tasks_that_each_carry_their_own_field_build_no_dense_table_and_lose_nothing() -> None:
    """Bug: 6,000 tasks (69 KB) each with a field of its own built a 6,000 x 6,002 table (+1.9 GB), and a nested key
    of its own makes Arrow's struct the same table. Now a field fewer than 1 task in 16 has goes, with the others like
    it, into one JSON text column `task_extra` (said in a log line), and a field whose objects' keys differ from task
    to task is JSON text: the table has a cell per field value, and every value is still there."""
    from ors_trl.tasks.selection import EXTRA_COLUMN, SPARSE_FIELD
    from tests.fixtures.hostile_server import SPARSE_TASKS, sparse_task

    dataset, peak, logged = _dataset("tasks_sparse")
    assert len(dataset) == SPARSE_TASKS
    assert sorted(dataset.column_names) == sorted(["prompt", "task_index", "id", "n", "meta", EXTRA_COLUMN])
    values = SPARSE_TASKS * len(sparse_task(0))  # field values received (a nested object counted once)
    assert len(dataset) * len(dataset.column_names) <= SPARSE_FIELD * values  # was 3,000 x 3,004 plus the struct's
    for i, row in enumerate(dataset):
        assert row["id"] == f"sparse-{i}" and row["n"] == i
        assert json.loads(row[EXTRA_COLUMN]) == {f"only_{i}": i} and json.loads(row["meta"]) == {f"key_{i}": i}
    assert peak < 64 << 20, peak >> 20
    assert any(f"{SPARSE_TASKS} task field(s) that fewer than 1 in {SPARSE_FIELD} tasks have" in line
               and EXTRA_COLUMN in line for line in logged), logged
    assert any("'meta' has objects whose keys differ from task to task; stored as JSON text" in line
               for line in logged)


def test_task_fields_nested_deeper_than_arrow_holds_are_stored_as_json_text() -> None:
    """Bug: a task field nested 64 levels deep was an untyped ArrowInvalid out of `train_dataset`, 500 levels an
    untyped RecursionError: one task stopped training before step 0. Past `MAX_FIELD_DEPTH` (16) levels, measured
    without recursion, the field is JSON text (written without recursion where the encoder's own would not reach)."""
    from ors_trl.tasks.selection import MAX_FIELD_DEPTH
    from tests.fixtures.hostile_server import DEEP_FIELDS, deep_task

    dataset, _, logged = _dataset("tasks_deep")
    tasks = [json.loads(deep_task(i)) for i in range(len(dataset))]
    assert dataset["id"] == [task["id"] for task in tasks] and dataset["plain"] == [[1, 2], None, None, None]
    for field in DEEP_FIELDS:
        assert [None if text is None else json.loads(text) for text in dataset[field]] == [t.get(field) for t in tasks]
        assert any(f"'{field}' has values nested more than {MAX_FIELD_DEPTH} levels deep; stored as JSON text" in line
                   for line in logged), logged


@pytest.mark.parametrize("levels", [16, 17, 63, 64])
def test_a_task_field_at_or_past_the_depth_bound_builds_a_dataset(levels) -> None:
    """At the bound a field keeps its Arrow type; one level past it, and at Arrow's own limit, it is JSON text."""
    from datasets import Dataset

    from ors_trl.tasks.selection import MAX_FIELD_DEPTH, task_columns

    value: Any = "x"
    for level in range(levels):
        value = [value] if level % 2 else {"a": value}
    columns, _ = task_columns([{"f": value}, {"f": None}])
    dataset = Dataset.from_dict(columns)
    kept = dataset[0]["f"]
    assert (kept == value) if levels <= MAX_FIELD_DEPTH else (json.loads(kept) == value)


def test_json_text_writes_what_the_encoder_cannot_reach() -> None:
    import sys

    from ors_trl.tasks.selection import json_text

    value: Any = {"b": 1, "a": [True, None, 1.5, "s"]}
    assert json_text(value) == json.dumps(value, sort_keys=True)
    for _ in range(sys.getrecursionlimit() + 100):
        value = [{"k": value, "e": []}]
    text = json_text(value)
    assert text.startswith('[{"e": [], "k": [{"e": [], "k": ') and text.endswith('}]' * 3)
    assert text.count("[") == text.count("]") and text.count("{") == text.count("}")
