"""The record writer and reader (`ors_trl.core.records`): whatever a record holds (lone surrogates, values nested
thousands deep, NaN, things that are not JSON), the writer writes valid JSON and the rest of the record, counts
what it cannot write and says why once; the reader skips, counts and names what is not a record. Through the
training episode log and `spec.evaluate(output=)` against the reference server too."""

from __future__ import annotations

import copy
import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from ors_trl import ConfigurationError, OpenRewardSpec, PolicyReply, write_report
from ors_trl.core.records import MAX_DEPTH, RECORD_VERSION, RecordWriter, read_records, upgrade

pytestmark = pytest.mark.usefixtures("no_leaked_sessions")


def strict_lines(path: Path) -> list[dict[str, Any]]:
    """Every line as strict JSON (NaN and Infinity refused), from strict UTF-8."""
    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in path.read_bytes().decode("utf-8").splitlines()
            if line.strip()]


def nested(depth: int, leaf: Any) -> Any:
    value = leaf
    for i in range(depth):
        value = {"k": value} if i % 2 else [value]
    return value


def depth_of(value: Any) -> int:
    depth = 0
    while isinstance(value, dict | list) and value:
        value = value["k"] if isinstance(value, dict) else value[0]
        depth += 1
    return depth


class Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no text for you")


def test_writer_writes_every_record_whole_and_valid(tmp_path) -> None:
    loop: list[Any] = ["again"]
    loop.append(loop)
    record = {
        "environment": "e\ud800nv", "prompt": "lone \udfff surrogate", "task_index": 0,
        "reward": float("nan"), "group_reward": float("inf"),
        "turns": [{"assistant": "ok", "tool_calls": [{"name": "t", "arguments": {"x\ud83d": 1},
                                                       "metadata": nested(3000, "bottom")}]}],
        "odd": {"set": {1}, "bytes": b"\x00\xff", "object": Unprintable(), "loop": loop, "big": 10 ** 5000,
                7: "int key"},
    }
    writer = RecordWriter(tmp_path / "e.jsonl")
    writer.write(record)
    writer.write({"environment": "next", "task_index": 1})
    assert (writer.written, writer.dropped) == (2, 0)
    first, second = strict_lines(tmp_path / "e.jsonl")
    assert second == {"environment": "next", "task_index": 1}
    assert first["environment"] == "e\ufffdnv" and first["prompt"] == "lone \ufffd surrogate"
    assert (first["reward"], first["group_reward"]) == ("nan", "inf")
    call = first["turns"][0]["tool_calls"][0]
    assert call["arguments"] == {"x\ufffd": 1} and call["name"] == "t"
    # cut at MAX_DEPTH levels from the record (record > turns > turn > tool_calls > call > metadata ...), marked
    bottom = call["metadata"]
    for _ in range(MAX_DEPTH - 5):
        bottom = bottom["k"] if isinstance(bottom, dict) else bottom[0]
    assert bottom == f"[... nested deeper than {MAX_DEPTH} levels: not recorded ...]"
    assert depth_of(call["metadata"]) == MAX_DEPTH - 5
    odd = first["odd"]
    assert odd["set"] == "{1}" and odd["bytes"] == repr(b"\x00\xff") and odd["object"] == "<Unprintable>"
    assert odd["loop"] == ["again", "[... a value containing itself: not recorded ...]"]
    assert odd["big"].startswith("[... an integer of") and odd["7"] == "int key"
    assert record["prompt"] == "lone \udfff surrogate"  # the caller's record is left as it was


def test_writer_counts_what_it_cannot_write_and_says_why_once(tmp_path, caplog) -> None:
    path = tmp_path / "e.jsonl"
    writer = RecordWriter(path, max_bytes=200)
    caplog.set_level(logging.WARNING, logger="ors_trl")
    writer.write({"n": 0})
    for i in range(3):
        writer.write({"n": i, "text": "x" * 300})  # over the size bound
    path.unlink()
    path.mkdir()  # the file cannot be opened any more
    for i in range(2):
        writer.write({"n": i})
    path.rmdir()
    writer.write({"n": "after"})
    assert (writer.written, writer.dropped) == (2, 5)
    assert writer.drop_reasons == Counter({"the file reached its 200-byte limit": 3,
                                           "the file could not be written: Is a directory": 2})
    warnings = [r.getMessage() for r in caplog.records if "was not written" in r.getMessage()]
    assert len(warnings) == 2 and "200-byte limit" in warnings[0] and "Is a directory" in warnings[1]
    assert [r["n"] for r in read_records(path)] == ["after"]
    assert "dropped=5" in repr(writer)


def test_reader_skips_counts_and_names_what_is_not_a_record(tmp_path, caplog) -> None:
    path = tmp_path / "e.jsonl"
    lines = [
        json.dumps({"n": 1}).encode(),
        b'{"n": 2, "text": "bad \xff\xfe utf-8"}',
        b'{"n": 3, "text": "lone \\ud800 escape", "\\udc00key": 1}',
        b'{"n": 4, "cut',
        b"[" * 3000 + b"]" * 3000,
        b"[1, 2]",
        b"",
        json.dumps({"n": 5}).encode(),
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    skipped: Counter[str] = Counter()
    caplog.set_level(logging.WARNING, logger="ors_trl")
    records = list(read_records(path, skipped))
    assert [r["n"] for r in records] == [1, 2, 3, 5]
    assert records[1]["text"] == "bad \ufffd\ufffd utf-8"
    assert records[2] == {"n": 3, "text": "lone \ufffd escape", "\ufffdkey": 1}
    assert skipped == Counter({"not JSON (a cut or corrupt line)": 1, "nested too deeply to read": 1,
                               "not a JSON object": 1})
    assert "skipped 3 unreadable line(s)" in caplog.text


def test_reader_never_fails_on_fields_of_the_wrong_type(tmp_path) -> None:
    """Upgrading an old record leaves a field of the wrong type as it is: one such line cannot end the read."""
    odd = [{"n": 1, "turns": 5}, {"n": 2, "turns": True}, {"n": 3, "turns": [4, {"tool_calls": 3}]},
           {"n": 4, "version": 2, "turns": [{"tool_calls": [{"name": "t"}, "x"]}]}]
    path = tmp_path / "e.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in odd))
    records = list(read_records(path))
    assert records[:3] == odd[:3]
    assert records[3]["turns"][0]["tool_calls"] == [{"name": "t", "status": "ok"}, "x"]


def test_upgrade_reads_every_version_in_the_current_shape() -> None:
    """Version 1 (one flat `calls` list) becomes one turn whose calls have their status; version 2 calls gain their
    status (eval's `{"skipped": ...}` entries, calls after `finished`, become `not_run`); version 3 is left as is."""
    v1 = {"version": 1, "reward": 1.0, "calls": [
        {"tool": "echo", "arguments": {"text": "a"}, "output": "a", "reward": 1.0, "finished": True},
        {"tool": "echo", "arguments": {"txt": "a"}, "error": "bad arguments", "error_kind": "refused"},
        {"tool": "echo", "arguments": {"text": "b"}, "error": "connection reset", "error_kind": "transport"},
        "not a call",
    ]}
    up = upgrade(copy.deepcopy(v1))
    assert "calls" not in up and up["reward"] == 1.0
    assert up["turns"] == [{"index": 0, "assistant": None, "tool_calls": [
        {"name": "echo", "arguments": {"text": "a"}, "output": "a", "reward": 1.0, "finished": True, "status": "ok"},
        {"name": "echo", "arguments": {"txt": "a"}, "error": {"kind": "refused", "message": "bad arguments"},
         "status": "refused"},
        {"name": "echo", "arguments": {"text": "b"}, "error": {"kind": "transport", "message": "connection reset"},
         "status": "failed"},
    ]}]
    assert (up["tool_calls"], up["tool_failures"]) == (3, 2)

    v2 = {"version": 2, "end_reason": "finished", "turns": [
        {"index": 0, "assistant": None, "tool_calls": [
            {"name": "echo", "arguments": {"text": "a"}, "output": "a", "reward": 1.0, "finished": True},
            {"name": "echo", "arguments": {"text": "again"}, "skipped": "the episode has finished"},
        ]},
        {"index": 1, "assistant": None, "tool_calls": [
            {"name": "nope", "arguments": {}, "error": {"kind": "refused", "message": "Tool nope not found."}},
            {"name": "echo", "arguments": {"text": "b"}, "error": {"kind": "timeout", "message": "slow"}},
        ]},
        {"index": 2, "assistant": "Done.", "tool_calls": []},
    ]}
    up = upgrade(copy.deepcopy(v2))
    assert [[c["status"] for c in t["tool_calls"]] for t in up["turns"]] == [["ok", "not_run"], ["refused", "failed"], []]
    assert up["turns"][0]["tool_calls"][1]["skipped"] == "the episode has finished"  # nothing else changes
    assert {k: v for k, v in up.items() if k != "turns"} == {k: v for k, v in v2.items() if k != "turns"}

    v3 = {"version": RECORD_VERSION, "source": "eval", "end_reason": "finished", "unscored": None, "turns": [
        {"index": 0, "assistant": None, "tool_calls": [
            {"name": "echo", "arguments": {"text": "a"}, "status": "ok", "output": "a"},
            {"name": "echo", "arguments": {"text": "again"}, "status": "refused",
             "error": {"kind": "refused", "message": "finished", "reason": "episode_finished"}},
            {"name": "echo", "arguments": {"text": "c"}, "status": "not_run"},
        ]},
    ]}
    assert upgrade(copy.deepcopy(v3)) == v3


def test_training_episode_log_keeps_a_record_with_a_lone_surrogate(ref_server, tmp_path) -> None:
    """The adapter's record reaches the log (it used to be dropped silently in the background)."""
    log = tmp_path / "episodes.jsonl"
    spec = OpenRewardSpec(ref_server.url, env_name="echoenvironment", num_tasks=1, episode_log=str(log))
    env = spec.environment_factory()
    env.reset(task_index=0)
    with pytest.raises(Exception):  # noqa: B017 -- the server cannot encode it either: a tool failure, recorded
        env.echo(text="bad \ud800 text")
    spec.close()
    (record,) = strict_lines(log)
    call = record["turns"][0]["tool_calls"][0]
    assert call["arguments"] == {"text": "bad \ufffd text"} and call["error"]["kind"] == "failed"
    assert spec._runtime.recorder.dropped == 0


class HostileModel:
    """An eval policy whose text and usage are what a broken model server may give: a lone surrogate, usage
    nested 3,000 deep with a NaN at the bottom."""

    description = "hostile-model"

    async def respond(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> PolicyReply:
        return PolicyReply(content="answer \ud800 here", usage=nested(3000, float("nan")))


def test_eval_output_keeps_hostile_model_text_and_reports_it(ref_server, tmp_path) -> None:
    out = tmp_path / "eval.jsonl"
    spec = OpenRewardSpec(ref_server.url, env_name="echoenvironment")
    report = spec.evaluate(HostileModel(), num_tasks=2, output=str(out), progress=False)
    assert report.num_episodes == 2
    records = strict_lines(out)
    assert sorted(r["task_index"] for r in records) == [0, 1]
    turn = records[0]["turns"][0]
    assert turn["assistant"] == "answer \ufffd here" and depth_of(turn["usage"]) == MAX_DEPTH - 3
    assert records[0]["final"] == {"message": "answer \ufffd here"}
    summary = write_report([out], tmp_path / "r.html")
    assert summary.episodes == 2 and summary.skipped == 0


def test_a_task_spec_nested_as_deeply_as_a_log_line_reads_gets_a_label_and_a_report(tmp_path) -> None:
    """A foreign log's task spec nested as deeply as the reader takes (past what the JSON encoder recurses through
    further down the stack): the one task label names it instead of raising, and the report counts the episode."""
    from ors_trl.protocol.text import show_json

    log, summary = tmp_path / "foreign.jsonl", None
    for depth in range(1000, 700, -5):  # the deepest the report reads: the bound depends on the stack
        log.write_text(f'{{"environment": "e", "split": "test", "task_spec": {"[" * depth + "]" * depth}, '
                       '"reward": 1.0}\n')
        try:
            summary = write_report([log], tmp_path / "r.html")
        except ConfigurationError:  # not read at all: no episode records
            continue
        break
    assert summary is not None and summary.episodes == 1 and summary.skipped == 0
    assert show_json(nested(5000, 0)) == "<dict>"
