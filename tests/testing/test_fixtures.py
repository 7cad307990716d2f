"""Tests of the test fixtures: the reference environments and the server launcher.

They speak ORS by hand (urllib, aiohttp) rather than through any client, so a client bug cannot
hide a fixture bug.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zlib
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from ors_trl.demo import _task as _demo_task
from ors_trl.demo._environments import EchoEnvironment
from ors_trl.testing import ReferenceServer, ServerStartError, free_port
from tests.fixtures.environments import SSE_CHUNK_SIZE, long_text, png_bytes

ALL_KEYS = [
    "echoenvironment",
    "tasktoolsenvironment",
    "imageenvironment",
    "longoutputenvironment",
    "schemaenvironment",
    "sparseenvironment",
    "slowenvironment",
    "mixedenvironment",
    "hostileenvironment",
    "demoenvironment",
    "quizenvironment",
    "switchenvironment",
    "judgeenvironment",
    "heavytailenvironment",
    "chaosenvironment",
]
# key -> (shared tool names, train size, test size)
CATALOG = {
    "echoenvironment": ({"echo"}, 16, 8),
    "tasktoolsenvironment": ({"look"}, 6, 3),
    "imageenvironment": ({"snapshot"}, 8, 4),
    "longoutputenvironment": ({"dump"}, 4, 2),
    "schemaenvironment": ({"place_order", "plot", "set_mode", "status"}, 8, 4),
    "sparseenvironment": ({"calculator", "submit"}, 32, 8),
    "slowenvironment": ({"work", "sleep"}, 256, 64),
    "mixedenvironment": ({"answer", "submit"}, 6, 3),
    "hostileenvironment": ({"reset", "get_reward", "_private", "keywords", "tree", "deep", "run-shell", "class"}, 2, 2),
    "demoenvironment": ({"echo"}, len(_demo_task.train_tasks()), len(_demo_task.heldout_tasks())),
    "quizenvironment": ({"lookup"}, 4, 2),  # `answer` is its terminal tool: not listed
    "switchenvironment": ({"flip"}, 4, 4),  # likewise `check`
    "judgeenvironment": ({"say"}, 4, 2),
    "heavytailenvironment": ({"work"}, 256, 64),
    "chaosenvironment": ({"work"}, 512, 64),
}


# --------------------------------------------------------------------------------------------------
# A minimal hand-written ORS wire client
# --------------------------------------------------------------------------------------------------


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def http(
    server: ReferenceServer,
    method: str,
    path: str,
    body: Any = None,
    sid: str | None = None,
    headers: dict[str, str] | None = None,
) -> Reply:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if sid is not None:
        req.add_header("X-Session-ID", sid)
    for name, value in (headers or {}).items():
        req.add_header(name, value)
    try:
        with _OPENER.open(req, timeout=30) as resp:
            return Reply(resp.status, dict(resp.headers.items()), resp.read())
    except urllib.error.HTTPError as err:
        return Reply(err.code, dict(err.headers.items()), err.read())


def parse_sse(raw: bytes) -> list[tuple[str, str]]:
    """Events per the SSE spec: lines end at CRLF/LF/CR only; strip exactly one space after the colon."""
    events: list[tuple[str, str]] = []
    event, data = "", []
    for line in re.split(r"\r\n|\r|\n", raw.decode("utf-8")):
        if not line:
            if data or event:
                events.append((event or "message", "\n".join(data)))
            event, data = "", []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "event":
            event = value
        elif field == "data":
            data.append(value)
    return events


def open_session(
    server: ReferenceServer, env: str, split: str = "train", index: int = 0, secrets: dict[str, str] | None = None
) -> str:
    reply = http(server, "POST", "/create_session", {})
    assert reply.status == 200, reply.body
    events = parse_sse(reply.body)
    assert events[0][0] == "task_id" and events[-1][0] == "end", events
    sid = events[0][1]
    headers = {}
    if secrets:
        payload = {name: {"value": value, "allowed_domains": []} for name, value in secrets.items()}
        headers["X-Secrets"] = base64.b64encode(json.dumps(payload).encode()).decode()
    reply = http(server, "POST", "/create", {"env_name": env, "split": split, "index": index}, sid, headers)
    assert reply.status == 200 and reply.json() == {"sid": sid}, reply.body
    return sid


def call_events(server: ReferenceServer, env: str, sid: str, name: str, tool_input: dict[str, Any]) -> list:
    reply = http(server, "POST", f"/{env}/call", {"name": name, "input": tool_input}, sid)
    assert reply.status == 200, reply.body
    assert reply.headers.get("content-type", "").startswith("text/event-stream")
    return parse_sse(reply.body)


def call(server: ReferenceServer, env: str, sid: str, name: str, tool_input: dict[str, Any]) -> dict[str, Any]:
    """Run a tool; the parsed result (``{"ok": ..., ...}``), asserting the stream's shape."""
    events = call_events(server, env, sid, name, tool_input)
    assert events[0][0] == "task_id", events
    assert events[-1][0] == "end", events
    assert all(kind == "chunk" for kind, _ in events[1:-1]), [kind for kind, _ in events]
    return json.loads("".join(data for _, data in events[1:]))


def tool_count(server: ReferenceServer, key: str) -> int:
    return server.stats()["tool_calls"].get(key, 0)


# --------------------------------------------------------------------------------------------------
# Launcher basics
# --------------------------------------------------------------------------------------------------


def test_import_is_cheap() -> None:
    code = (
        "import sys, ors_trl.testing, ors_trl.testing.server\n"
        "heavy = [m for m in ('openreward', 'fastapi', 'uvicorn') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_free_port_is_bindable_loopback_only() -> None:
    import socket

    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
    with pytest.raises(ValueError):
        free_port("0.0.0.0")
    with pytest.raises(ValueError):
        ReferenceServer([EchoEnvironment], host="0.0.0.0")


def test_environments_are_classes_or_import_paths() -> None:
    with pytest.raises(ValueError, match="module:Class"):
        ReferenceServer("echo")
    with pytest.raises(ValueError, match="not __main__"):
        ReferenceServer([type("Local", (), {"__module__": "__main__"})])
    server = ReferenceServer([EchoEnvironment, "tests.fixtures.environments:SparseEnvironment"])
    assert server.envs == ["ors_trl.demo._environments:EchoEnvironment", "tests.fixtures.environments:SparseEnvironment"]


def test_start_failure_reports_server_output() -> None:
    server = ReferenceServer("no_such_module:NoSuchEnv", startup_timeout=30)
    started = time.monotonic()
    with pytest.raises(ServerStartError, match=r"cannot load the environments.*no_such_module"):
        server.start()
    assert time.monotonic() - started < 30
    assert not server.running
    server.close()


def test_log_file_is_removed_without_close() -> None:
    """A script that stops its server but never closes it (or just exits) leaves no log in the temp folder."""
    script = (
        "import sys\n"
        "from ors_trl.testing import ReferenceServer\n"
        "stopped = ReferenceServer(['ors_trl.demo._environments:EchoEnvironment']).start()\n"
        "stopped.stop()\n"
        "running = ReferenceServer(['ors_trl.demo._environments:EchoEnvironment']).start()\n"
        "print(stopped.log_path, running.log_path, flush=True)\n"
        "import os; assert os.path.exists(stopped.log_path) and os.path.exists(running.log_path)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    paths = done.stdout.split()
    assert len(paths) == 2
    assert [p for p in paths if os.path.exists(p)] == []


def test_list_environments_shows_every_env(ref_server: ReferenceServer) -> None:
    reply = http(ref_server, "GET", "/list_environments")
    assert reply.status == 200
    assert reply.json() == ALL_KEYS
    assert http(ref_server, "GET", "/health").json() == {"status": "ok"}
    stats = ref_server.stats()
    assert stats["pid"] == ref_server.pid
    assert stats["environments"] == ALL_KEYS
    assert stats["idle_timeout"] is None


def test_test_routes_bypass_the_default_env_redirect(ref_server: ReferenceServer) -> None:
    reply = http(ref_server, "GET", "/splits")
    assert reply.status == 308
    assert reply.headers["location"] == "/echoenvironment/splits"
    assert http(ref_server, "GET", "/_test/nope").status == 404
    assert http(ref_server, "GET", "/_test/stats").status == 200


@pytest.mark.parametrize("key", ALL_KEYS)
def test_catalog_endpoints(ref_server: ReferenceServer, key: str) -> None:
    tools, n_train, n_test = CATALOG[key]
    splits = http(ref_server, "GET", f"/{key}/splits").json()
    assert splits == [{"name": "train", "type": "train"}, {"name": "test", "type": "test"}]
    listed = http(ref_server, "GET", f"/{key}/tools").json()
    assert {t["name"] for t in listed["tools"]} == tools
    assert all(t["description"] for t in listed["tools"])
    assert http(ref_server, "POST", f"/{key}/num_tasks", {"split": "train"}).json() == {"num_tasks": n_train}
    assert http(ref_server, "POST", f"/{key}/num_tasks", {"split": "test"}).json() == {"num_tasks": n_test}
    tasks = http(ref_server, "POST", f"/{key}/tasks", {"split": "train"}).json()["tasks"]
    assert len(tasks) == n_train
    assert len({t["id"] for t in tasks}) == n_train
    task = http(ref_server, "POST", f"/{key}/task", {"split": "test", "index": n_test - 1}).json()
    assert task["task"]["id"]
    assert http(ref_server, "POST", f"/{key}/task", {"split": "test", "index": n_test}).status == 400
    assert http(ref_server, "POST", f"/{key}/num_tasks", {"split": "validation"}).status == 400


@pytest.mark.parametrize("key", ALL_KEYS)
def test_every_environment_serves_a_session(ref_server: ReferenceServer, key: str) -> None:
    sid = open_session(ref_server, key, "test", 0)
    try:
        prompt = http(ref_server, "GET", f"/{key}/prompt", sid=sid)
        assert prompt.status == 200
        blocks = prompt.json()
        assert blocks and blocks[0]["type"] == "text" and blocks[0]["text"]
        assert http(ref_server, "POST", "/ping", sid=sid).json() == {"status": "ok"}
    finally:
        assert http(ref_server, "POST", "/delete", sid=sid).status == 200
    assert http(ref_server, "POST", "/ping", sid=sid).status == 404


# --------------------------------------------------------------------------------------------------
# A whole session by hand, with the counters
# --------------------------------------------------------------------------------------------------


def test_session_lifecycle_by_hand(make_server: Any) -> None:
    server = make_server(envs="echo")
    env = "echoenvironment"
    before = server.stats()
    assert (before["open_sessions"], before["setups"], before["teardowns"]) == (0, 0, 0)

    sid = open_session(server, env, "train", 3)
    task = http(server, "POST", f"/{env}/task", {"split": "train", "index": 3}).json()["task"]
    assert task == {"id": "echo-3", "target": "openreward"}

    prompt = http(server, "GET", f"/{env}/prompt", sid=sid).json()
    assert prompt == [{"type": "text", "text": prompt[0]["text"], "detail": None}]
    assert '"openreward"' in prompt[0]["text"]
    tools = http(server, "GET", f"/{env}/task_tools", sid=sid).json()["tools"]
    assert [t["name"] for t in tools] == ["echo"]
    assert tools[0]["input_schema"]["properties"]["text"]["description"]

    stats = server.wait_for_stats(lambda s: s["setups"] == 1)
    assert stats["open_sessions"] == 1 and stats["sessions"] == [sid]

    wrong = call(server, env, sid, "echo", {"text": "openrewar"})
    assert wrong["ok"] is True
    assert wrong["output"] == {
        "blocks": [{"type": "text", "text": "openrewar", "detail": None}],
        "metadata": {"target_length": 10},
        "reward": 0.0,
        "finished": False,
    }
    assert tool_count(server, f"{env}/echo") == 1

    right = call(server, env, sid, "echo", {"text": "openreward"})["output"]
    assert (right["reward"], right["finished"]) == (1.0, True)
    assert tool_count(server, f"{env}/echo") == 2

    # After finished=True the server refuses without running the tool.
    refused = call(server, env, sid, "echo", {"text": "openreward"})
    assert refused["ok"] is False and refused["reason"] == "episode_finished"
    missing = call(server, env, sid, "nope", {})
    assert missing["ok"] is False
    assert tool_count(server, f"{env}/echo") == 2

    assert http(server, "POST", "/delete", sid=sid).json() == {"sid": sid}
    stats = server.stats()
    assert (stats["open_sessions"], stats["setups"], stats["teardowns"]) == (0, 1, 1)
    assert http(server, "POST", "/delete", sid=sid).status == 200  # idempotent
    assert server.stats()["teardowns"] == 1
    gone = http(server, "GET", f"/{env}/prompt", sid=sid)
    assert gone.status == 404 and gone.json() == {"detail": "Active environment not found"}


# --------------------------------------------------------------------------------------------------
# Environments
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("index", "advertised"), [(0, ["open_door"]), (1, ["open_window"]), (2, ["open_door", "open_window"])]
)
def test_task_tools_differ_per_task(ref_server: ReferenceServer, index: int, advertised: list[str]) -> None:
    env = "tasktoolsenvironment"
    shared = http(ref_server, "GET", f"/{env}/tools").json()["tools"]
    assert [t["name"] for t in shared] == ["look"]
    task = http(ref_server, "POST", f"/{env}/task", {"split": "train", "index": index}).json()["task"]
    sid = open_session(ref_server, env, "train", index)
    try:
        tools = http(ref_server, "GET", f"/{env}/task_tools", sid=sid).json()["tools"]
        assert [t["name"] for t in tools] == ["look", *advertised]
        by_name = {t["name"]: t for t in tools}
        if "open_door" in by_name:
            assert by_name["open_door"]["input_schema"]["properties"]["code"]["pattern"] == r"^\d{4}$"
        if "open_window" in by_name:
            assert by_name["open_window"]["input_schema"]["properties"]["side"]["enum"] == ["left", "right"]

        # A tool this task did not advertise runs (the server does not enforce) but scores 0.
        other = {"open_door", "open_window"} - set(advertised)
        for name in other:
            out = call(ref_server, env, sid, name, {"code": "0000"} if name == "open_door" else {"side": "left"})
            assert out["output"]["reward"] == 0.0 and out["output"]["finished"] is False

        goal = advertised[-1]
        args = {"code": task["code"]} if goal == "open_door" else {"side": task["side"]}
        out = call(ref_server, env, sid, goal, args)["output"]
        assert (out["reward"], out["finished"]) == (1.0, True)
    finally:
        http(ref_server, "POST", "/delete", sid=sid)


def _read_png(data: bytes) -> tuple[int, int, bytes]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, width, height, idat = 8, 0, 0, b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        tag, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(tag + body) & 0xFFFFFFFF
        if tag == b"IHDR":
            width, height = struct.unpack(">II", body[:8])
        elif tag == b"IDAT":
            idat += body
        pos += 12 + length
    return width, height, zlib.decompress(idat)


def test_image_environment(ref_server: ReferenceServer) -> None:
    env = "imageenvironment"
    task = http(ref_server, "POST", f"/{env}/task", {"split": "train", "index": 2}).json()["task"]
    sid = open_session(ref_server, env, "train", 2)
    try:
        prompt = http(ref_server, "GET", f"/{env}/prompt", sid=sid).json()
        assert [b["type"] for b in prompt] == ["text", "image"]
        assert prompt[1]["mimeType"] == "image/png"
        width, height, pixels = _read_png(base64.b64decode(prompt[1]["data"], validate=True))
        assert width == height == task["size"]
        assert len(pixels) == height * (1 + 3 * width)

        wrong = "red" if task["color"] != "red" else "blue"
        out = call(ref_server, env, sid, "snapshot", {"color": wrong, "size": 3})["output"]
        assert [b["type"] for b in out["blocks"]] == ["image", "text"]
        assert (out["reward"], out["finished"]) == (0.0, False)
        assert out["metadata"]["image"] == {"width": 3, "height": 3, "mime_type": "image/png"}
        assert out["metadata"]["guess"]["correct"] is False
        assert _read_png(base64.b64decode(out["blocks"][0]["data"]))[:2] == (3, 3)

        out = call(ref_server, env, sid, "snapshot", {"color": task["color"]})["output"]
        assert (out["reward"], out["finished"]) == (1.0, True)
        assert out["metadata"]["image"]["width"] == 8  # the default size
    finally:
        http(ref_server, "POST", "/delete", sid=sid)


def test_png_bytes_pixels() -> None:
    width, height, pixels = _read_png(png_bytes(2, 3, (1, 2, 3)))
    assert (width, height) == (2, 3)
    assert pixels == (b"\x00" + b"\x01\x02\x03" * 2) * 3


def test_long_text_is_deterministic_and_adversarial() -> None:
    text = long_text(20_000, 0)
    assert len(text) == 20_000
    assert text == long_text(20_000, 0)
    assert text != long_text(20_000, 1)
    assert long_text(0, 0) == ""
    assert len(long_text(5, 3)) == 5
    for needle in ("\n    ", "\t", "     ", "日本語", "\u2028", "\x85", "\ndata: ", "\r\n"):
        assert needle in text, needle


@pytest.mark.parametrize(("size", "seed"), [(20_000, 0), (50_000, 7), (100, 3)])
def test_long_output_reassembles_exactly(ref_server: ReferenceServer, size: int, seed: int) -> None:
    env = "longoutputenvironment"
    sid = open_session(ref_server, env)
    try:
        before = tool_count(ref_server, f"{env}/dump")
        events = call_events(ref_server, env, sid, "dump", {"size": size, "seed": seed})
        assert tool_count(ref_server, f"{env}/dump") == before + 1
    finally:
        http(ref_server, "POST", "/delete", sid=sid)

    datas = [data for _, data in events[1:]]
    raw = "".join(datas)
    assert [kind for kind, _ in events] == ["task_id"] + ["chunk"] * (len(datas) - 1) + ["end"]
    assert all(len(d) == SSE_CHUNK_SIZE for d in datas[:-1])
    result = json.loads(raw)
    expected = long_text(size, seed)
    assert result["output"]["blocks"][0]["text"] == expected
    assert result["output"]["metadata"] == {"size": size, "seed": seed}

    # Every slice that starts inside the text starts with a space, and a client that strips all
    # leading spaces after "data:" gets different text.
    text_end = raw.index('"text":"') + len('"text":"') + len(json.dumps(expected, ensure_ascii=False)) - 2
    inside = [d for i, d in enumerate(datas) if i > 0 and i * SSE_CHUNK_SIZE < text_end]
    assert all(d.startswith(" ") for d in inside)
    if size >= 2 * SSE_CHUNK_SIZE:
        assert any(d.startswith("  ") for d in inside)
        assert "".join(d.lstrip(" ") for d in datas) != raw


def test_schema_environment_schemas(ref_server: ReferenceServer) -> None:
    tools = {t["name"]: t for t in http(ref_server, "GET", "/schemaenvironment/tools").json()["tools"]}
    assert tools["status"]["input_schema"] is None
    order = tools["place_order"]["input_schema"]
    defs, props = order["$defs"], order["properties"]
    assert {"Point", "LineItem", "Color"} <= set(defs)
    assert props["pickup"]["$ref"] == "#/$defs/Point"
    assert {"$ref": "#/$defs/Point"} in props["dropoff"]["anyOf"]  # Point referenced twice
    assert props["wrapping"]["$ref"] == "#/$defs/Color" and defs["Color"]["enum"] == ["red", "green", "blue"]
    assert props["priority"]["enum"] == ["low", "normal", "high"]
    assert props["items"]["items"] == {"$ref": "#/$defs/LineItem"} and props["items"]["minItems"] == 1
    assert defs["LineItem"]["properties"]["sku"]["pattern"] == r"^[A-Z]{3}-\d{3}$"
    assert defs["LineItem"]["properties"]["quantity"]["maximum"] == 99
    assert props["customer"]["minLength"] == 2
    assert props["discount"]["maximum"] == 0.5
    assert props["weight_kg"]["exclusiveMinimum"] == 0
    assert props["counts"]["additionalProperties"] == {"type": "integer"}
    assert props["pair"]["prefixItems"] == [{"type": "integer"}, {"type": "string"}]
    assert props["reference"]["anyOf"] == [{"type": "integer"}, {"type": "string"}]
    assert props["customer"]["description"] == "Customer name."
    assert set(order["required"]) == {"customer", "items", "pickup", "weight_kg", "reference"}


def test_schema_environment_echoes_validated_input(ref_server: ReferenceServer) -> None:
    env = "schemaenvironment"
    sid = open_session(ref_server, env, secrets={"API_TOKEN": "s3cret"})
    try:
        order = {
            "customer": "ada",
            "items": [{"sku": "ABC-123", "quantity": 2}, {"sku": "XYZ-999", "note": "fragile"}],
            "pickup": {"x": 1, "y": 2.5},
            "wrapping": "blue",
            "weight_kg": 0.5,
            "counts": {"boxes": 3},
            "pair": [2, "two"],
            "reference": "REF-1",
        }
        before = tool_count(ref_server, f"{env}/place_order")
        out = call(ref_server, env, sid, "place_order", order)["output"]
        echoed = json.loads(out["blocks"][0]["text"])
        assert echoed == {
            "customer": "ada",
            "items": [
                {"sku": "ABC-123", "quantity": 2, "note": None},
                {"sku": "XYZ-999", "quantity": 1, "note": "fragile"},
            ],
            "pickup": {"x": 1.0, "y": 2.5},
            "dropoff": None,
            "priority": "normal",
            "wrapping": "blue",
            "discount": 0.0,
            "weight_kg": 0.5,
            "counts": {"boxes": 3},
            "pair": [2, "two"],
            "reference": "REF-1",
            "gift": False,
        }
        assert out["metadata"]["received"] == echoed and out["reward"] is None
        assert tool_count(ref_server, f"{env}/place_order") == before + 1

        bad = call(ref_server, env, sid, "place_order", {**order, "items": [{"sku": "abc"}]})
        assert bad["ok"] is False and bad["reason"] == "input_validation"
        assert tool_count(ref_server, f"{env}/place_order") == before + 1  # validation failed: not run

        mode = call(ref_server, env, sid, "set_mode", {"mode": "green", "level": 10})["output"]
        assert json.loads(mode["blocks"][0]["text"]) == {"mode": "green", "level": 10, "verbose": None}

        status = call(ref_server, env, sid, "status", {})["output"]
        assert status["metadata"]["secrets"] == {"API_TOKEN": "s3cret"}
        assert status["metadata"]["task"] == {"id": "schema-train-0", "tool": "place_order"}
    finally:
        http(ref_server, "POST", "/delete", sid=sid)


def test_sparse_environment(ref_server: ReferenceServer) -> None:
    env = "sparseenvironment"
    task = http(ref_server, "POST", f"/{env}/task", {"split": "train", "index": 5}).json()["task"]
    answer = task["a"] + task["b"]
    sid = open_session(ref_server, env, "train", 5)
    try:
        prompt = http(ref_server, "GET", f"/{env}/prompt", sid=sid).json()
        assert f"What is {task['a']} + {task['b']}?" in prompt[0]["text"]
        out = call(ref_server, env, sid, "calculator", {"expression": f"{task['a']} + {task['b']}"})["output"]
        assert out["blocks"][0]["text"] == str(answer)
        assert (out["reward"], out["finished"]) == (None, False)

        events = call_events(ref_server, env, sid, "calculator", {"expression": "__import__('os')"})
        assert [kind for kind, _ in events] == ["task_id", "error"]
        assert "unsupported expression" in events[1][1]

        out = call(ref_server, env, sid, "submit", {"answer": answer})["output"]
        assert (out["reward"], out["finished"]) == (1.0, True)
    finally:
        http(ref_server, "POST", "/delete", sid=sid)

    sid = open_session(ref_server, env, "train", 5)
    try:
        out = call(ref_server, env, sid, "submit", {"answer": answer + 1})["output"]
        assert (out["reward"], out["finished"]) == (0.0, True)
    finally:
        http(ref_server, "POST", "/delete", sid=sid)


def test_slow_environment_delays_and_parallel_sessions(make_server: Any) -> None:
    latency, setup_delay, n = 0.5, 0.3, 8
    server = make_server(
        envs="slow", env={"ORS_TEST_TOOL_LATENCY": str(latency), "ORS_TEST_SETUP_DELAY": str(setup_delay)}
    )
    env = "slowenvironment"

    async def episode(http_session: aiohttp.ClientSession, index: int) -> tuple[float, float, dict[str, Any]]:
        async with http_session.post(f"{server.url}/create_session", json={}) as resp:
            sid = parse_sse(await resp.read())[0][1]
        headers = {"X-Session-ID": sid}
        body = {"env_name": env, "split": "train", "index": index}
        async with http_session.post(f"{server.url}/create", json=body, headers=headers) as resp:
            assert resp.status == 200
        started = time.monotonic()
        async with http_session.get(f"{server.url}/{env}/prompt", headers=headers) as resp:
            assert resp.status == 200
        setup_wait = time.monotonic() - started
        started = time.monotonic()
        async with http_session.post(
            f"{server.url}/{env}/call", json={"name": "work", "input": {"step": 2}}, headers=headers
        ) as resp:
            events = parse_sse(await resp.read())
        call_time = time.monotonic() - started
        async with http_session.post(f"{server.url}/delete", headers=headers) as resp:
            assert resp.status == 200
        return setup_wait, call_time, json.loads("".join(d for _, d in events[1:]))

    async def run_all() -> list[tuple[float, float, dict[str, Any]]]:
        async with aiohttp.ClientSession() as http_session:
            return await asyncio.gather(*(episode(http_session, i) for i in range(n)))

    results = asyncio.run(run_all())
    for setup_wait, call_time, result in results:
        assert setup_wait >= setup_delay * 0.8
        assert call_time >= latency * 0.9
        assert result["output"]["reward"] == 1.0 and result["output"]["finished"] is True
    stats = server.stats()
    assert stats["peak_in_flight"][f"{env}/work"] == n, "sessions did not run their tool calls in parallel"
    assert stats["peak_in_flight"][f"{env}/setup"] == n and stats["in_flight"][f"{env}/setup"] == 0
    assert stats["tool_calls"] == {f"{env}/work": n}
    assert (stats["setups"], stats["teardowns"], stats["open_sessions"]) == (n, n, 0)

    sid = open_session(server, env, "test", 63)
    started = time.monotonic()
    out = call(server, env, sid, "sleep", {"seconds": 0.2})["output"]
    assert time.monotonic() - started >= 0.2
    assert out["blocks"][0]["text"] == "slept 0.2s" and out["reward"] is None


# --------------------------------------------------------------------------------------------------
# Idle timeout and restarts
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_idle_timeout_reaps_unpinged_session_only(make_server: Any) -> None:
    idle = 3.0
    server = make_server(envs="echo", idle_timeout=idle)
    assert server.stats()["idle_timeout"] == idle
    env = "echoenvironment"
    idle_sid = open_session(server, env, "train", 0)
    created = time.monotonic()
    kept_sid = open_session(server, env, "train", 1)
    pings_before = server.stats()["pings"]

    deadline = created + idle + 5 + 3
    sent = 0
    while idle_sid in server.stats()["sessions"]:
        assert time.monotonic() < deadline, "the idle session was not reaped"
        assert http(server, "POST", "/ping", sid=kept_sid).status == 200
        sent += 1
        time.sleep(0.5)
    reaped_after = time.monotonic() - created

    assert reaped_after >= idle - 0.2, f"reaped after {reaped_after:.1f} s, before the idle limit"
    stats = server.stats()
    assert stats["sessions"] == [kept_sid]
    assert stats["teardowns"] == 1
    assert stats["pings"] - pings_before == sent
    assert http(server, "POST", "/ping", sid=kept_sid).status == 200
    assert http(server, "POST", "/ping", sid=idle_sid).status == 404
    assert http(server, "GET", f"/{env}/prompt", sid=idle_sid).status == 404


def test_restart_and_kill_keep_the_port_and_lose_sessions(make_server: Any) -> None:
    server = make_server(envs="echo")
    env = "echoenvironment"
    sid = open_session(server, env, "train", 0)
    port, pid = server.port, server.pid
    assert server.stats()["open_sessions"] == 1

    server.restart()
    assert server.port == port and server.url.endswith(f":{port}")
    assert server.pid != pid and server.running
    assert server.stats()["open_sessions"] == 0
    assert http(server, "POST", "/ping", sid=sid).status == 404
    assert http(server, "GET", f"/{env}/prompt", sid=sid).status == 404
    assert http(server, "POST", f"/{env}/call", {"name": "echo", "input": {"text": "hello"}}, sid).status == 404
    new_sid = open_session(server, env, "train", 0)
    assert call(server, env, new_sid, "echo", {"text": "hello"})["output"]["reward"] == 1.0

    # kill() is a crash (no teardown); start() comes back on the same port; stop() is idempotent.
    url = server.url
    server.kill()
    assert not server.running
    with pytest.raises(urllib.error.URLError):
        _OPENER.open(url + "/health", timeout=2)
    server.start()
    assert server.url == url and server.stats()["open_sessions"] == 0
    assert server.stop() is not None
    assert server.stop() is not None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_server_exits_when_its_launcher_dies() -> None:
    code = (
        "import os, sys\n"
        "from ors_trl.testing import ReferenceServer\n"
        "server = ReferenceServer('ors_trl.demo._environments:EchoEnvironment').start()\n"
        "print(server.pid, server.log_path, flush=True)\n"
        "os._exit(0)  # no atexit, no cleanup: like a crashed test run\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    pid, log_path = int(out.stdout.split()[0]), out.stdout.split()[1]
    try:
        deadline = time.monotonic() + 15
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid), "orphaned server still running"
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
        os.unlink(log_path)  # a crashed launcher cannot delete it; the test does
