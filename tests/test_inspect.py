"""`ors-trl inspect` against the reference server: text and JSON output, task tools, binding warnings."""

from __future__ import annotations

import inspect
import json
import threading
import unicodedata

import pytest
from transformers.utils import get_json_schema

from ors_trl.cli import main
from ors_trl.cli.inspect import describe_binding, inspect_target, render_text
from ors_trl.core.binding import DEFAULT_RESERVED, bind_tools

pytestmark = pytest.mark.usefixtures("no_leaked_sessions")


def run_json(capsys, *args: str) -> dict:
    assert main(["inspect", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_text_output(ref_server, capsys) -> None:
    assert main(["inspect", ref_server.url, "--env-name", "SparseEnvironment"]) == 0
    text = capsys.readouterr().out
    for env in ("echoenvironment", "tasktoolsenvironment", "sparseenvironment *", "hostileenvironment"):
        assert env in text
    assert "Environment: sparseenvironment" in text
    assert "train  type=train         32 tasks" in text and "test   type=test           8 tasks" in text
    assert '[0] fields: a, b, id' in text and '"id": "add-train-0"' in text
    assert "calculator: Evaluate an arithmetic expression" in text and "submit: Submit the final answer" in text
    # The exact Python signatures and the rendered schemas the model will see.
    assert "calculator(expression: str) -> str    [remote tool 'calculator']" in text
    assert "submit(answer: int) -> str    [remote tool 'submit']" in text
    assert '"name": "submit"' in text and '"type": "integer"' in text
    assert "Binding warnings: none" in text


def test_json_structure(ref_server, capsys) -> None:
    info = run_json(capsys, ref_server.url, "--env-name", "echoenvironment", "--tasks", "2")
    assert info["target"] == ref_server.url and info["kind"] == "url"
    assert info["environment"] == "echoenvironment" and "hostileenvironment" in info["environments"]
    assert info["splits"] == [{"name": "train", "type": "train", "num_tasks": 16},
                              {"name": "test", "type": "test", "num_tasks": 8}]
    assert info["split"] == "train"
    assert info["tasks"] == [{"index": 0, "task": {"id": "echo-0", "target": "hello"}},
                             {"index": 1, "task": {"id": "echo-1", "target": "world"}}]
    (echo,) = info["shared_tools"]
    assert echo["name"] == "echo" and echo["input_schema"]["required"] == ["text"]
    assert info["task_tools"] == {"probed": True, "index": 0, "tools": [], "error": None}
    binding = info["binding"]
    assert binding["schemas_rendered"] is True and binding["warnings"] == []
    (tool,) = binding["tools"]
    assert tool["signature"] == "echo(text: str) -> str"
    expected = bind_tools([echo], reserved=DEFAULT_RESERVED | {"reset"}).functions["echo"]
    assert tool["schema"] == get_json_schema(expected)
    assert tool["schema"]["function"]["parameters"]["properties"]["text"]["type"] == "string"


def test_the_newer_surface_is_shown(ref_server, capsys) -> None:
    assert main(["inspect", ref_server.url, "--env-name", "quizenvironment"]) == 0
    text = capsys.readouterr().out
    assert "Terminal tool: answer (hidden from the model; gets the model's final plain message as its argument " \
           "'answer'): Grade the model's final answer." in text
    assert "Group scoring (/score_group): not supported" in text
    assert "Conversations (/messages): yes" in text and "reasoning, tool_call, tool_result" in text
    assert "First probed task's conversation: system [text], user [text]" in text
    assert "answer(" not in text  # the model is never offered the terminal tool
    info = run_json(capsys, ref_server.url, "--env-name", "judgeenvironment")
    assert info["terminal_tool"] is None and info["supports_score_group"] is True
    assert [(m["role"], m["blocks"]) for m in info["conversation"]] == [("user", ["text"])]
    info = run_json(capsys, ref_server.url, "--env-name", "switchenvironment", "--no-probe")
    assert info["terminal_tool"] == {"name": "check", "arg": None, "description": "Grade: is the switch on?"}
    assert info["conversation"] is None


def test_inspect_shows_what_the_model_reads_and_what_a_call_returns(ref_server, capsys) -> None:
    """The prompt's text (an image as a numbered placeholder saying its size and kind), and for `--call` the output's
    text, reward, `finished` and metadata: in text and in --json."""
    call = 'snapshot={"color": "red", "size": 64}'
    assert main(["inspect", ref_server.url, "--env-name", "imageenvironment", "--call", call]) == 0
    text = capsys.readouterr().out
    assert ("The prompt the model reads (task 0; images as placeholders):\n  user:\n    What colour is this square? "
            "Call `snapshot` with the colour.\n    [image 1: 4x4 png]\n") in text
    assert ('Tool output of snapshot({"color": "red", "size": 64}): blocks [image, text]; images (1): image/png '
            '64x64, 178 bytes\n  reward 1.0; finished yes; metadata {"image": {"width": 64, "height": 64, "mime_type": '
            '"image/png"}, "guess": {"color": "red", "rgb": [220, 30, 30], "correct": true}, "tags": ["snapshot", '
            '"red"]}\n  text:\n    [image 1: 64x64 png]\n    A 64x64 red square.\n') in text
    info = run_json(capsys, ref_server.url, "--env-name", "imageenvironment", "--call", call, "--call",
                    'snapshot={"color": "blue"}')
    assert info["conversation"] == [{"role": "user", "blocks": ["text", "image"], "text": (
        "What colour is this square? Call `snapshot` with the colour.\n[image 1: 4x4 png]")}]
    red, blue = info["tool_outputs"]
    assert (red["text"], red["reward"], red["finished"]) == ("[image 1: 64x64 png]\nA 64x64 red square.", 1.0, True)
    assert red["metadata"]["guess"] == {"color": "red", "rgb": [220, 30, 30], "correct": True}
    assert blue["error"].startswith("ToolRefusedError")  # the episode finished with the first call
    info = run_json(capsys, ref_server.url, "--env-name", "echoenvironment", "--call", 'echo={"text": "nope"}')
    (echo,) = info["tool_outputs"]
    assert (echo["text"], echo["reward"], echo["finished"], echo["metadata"]) == ("nope", 0.0, False,
                                                                                 {"target_length": 5})
    # the tools as the model gets them: the rendered schema of each bound tool
    (tool,) = info["binding"]["tools"]
    assert tool["schema"]["function"]["name"] == "echo"
    assert "The tools as the model gets them, after binding (1 tools: the Python signature, then the schema" in \
        render_text(info)
    # a long output: whole in --json, its first 4,000 characters in the text, then how many more
    info = run_json(capsys, ref_server.url, "--env-name", "longoutputenvironment", "--call", 'dump={"size": 9000}')
    assert len(info["tool_outputs"][0]["text"]) == 9000 and info["tool_outputs"][0]["reward"] is None
    assert main(["inspect", ref_server.url, "--env-name", "longoutputenvironment", "--call", 'dump={"size": 9000}']) == 0
    text = capsys.readouterr().out
    assert "  reward none (not scored); finished no; metadata {\"size\": 9000, \"seed\": 0}\n  text:\n" in text
    assert "\n    ... (5000 more characters; --json has them all)\n" in text


def test_task_specific_tools(ref_server, capsys) -> None:
    info = run_json(capsys, ref_server.url, "--env-name", "tasktoolsenvironment", "--probe-index", "1")
    assert [t["name"] for t in info["shared_tools"]] == ["look"]
    assert info["task_tools"]["probed"] and info["task_tools"]["index"] == 1
    assert [t["name"] for t in info["task_tools"]["tools"]] == ["open_window"]
    assert info["task_tools"]["tools"][0]["input_schema"]["properties"]["side"]["enum"] == ["left", "right"]
    bound = {t["name"]: t for t in info["binding"]["tools"]}
    assert bound["open_window"]["signature"] == "open_window(side: Literal['left', 'right']) -> str"
    assert bound["open_window"]["schema"]["function"]["parameters"]["properties"]["side"]["enum"] == ["left", "right"]

    info = run_json(capsys, ref_server.url, "--env-name", "tasktoolsenvironment", "--no-probe")
    assert info["task_tools"]["probed"] is False and [t["name"] for t in info["binding"]["tools"]] == ["look"]


def test_hostile_binding_warnings(ref_server, capsys) -> None:
    info = run_json(capsys, ref_server.url, "--env-name", "hostileenvironment")
    warnings = info["binding"]["warnings"]
    assert any("'reset': name is reserved" in w for w in warnings)
    assert any("parameter 'class' is exposed as 'class_'" in w for w in warnings)
    bound = {t["remote_name"]: t for t in info["binding"]["tools"]}
    assert bound["reset"]["name"] == "reset" and bound["reset"]["attribute"] != "reset"
    assert bound["keywords"]["signature"].startswith("keywords(class_: str, x_y: int = <unset>")
    assert bound["run-shell"]["schema"]["function"]["name"] == "run-shell"
    text = render_text(info)
    assert f"Binding warnings ({len(warnings)}):" in text and "name is reserved" in text


def test_signatures_and_schemas_without_transformers(monkeypatch) -> None:
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name.startswith("transformers"):
            raise ImportError("no transformers here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    spec = {"name": "add", "description": "Add.", "input_schema": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer", "default": 1}},
        "required": ["a"]}}
    described = describe_binding([spec])
    assert described["schemas_rendered"] is True and described["note"] is None
    assert described["tools"][0]["signature"] == "add(a: int, b: int = <unset>) -> str"
    schema = described["tools"][0]["schema"]["function"]
    assert schema["name"] == "add" and schema["parameters"]["required"] == ["a"]
    assert set(schema["parameters"]["properties"]) == {"a", "b"}


def test_signature_is_the_bound_functions(ref_server) -> None:
    info = inspect_target(ref_server.url, env_name="schemaenvironment", tasks=0)
    specs = info["shared_tools"] + info["task_tools"]["tools"]
    binding = bind_tools(specs, reserved=DEFAULT_RESERVED | {"reset"})
    for tool in info["binding"]["tools"]:
        fn = binding.functions[tool["attribute"]]
        params = list(inspect.signature(fn).parameters.values())[1:]
        assert tool["signature"] == fn.__name__ + str(inspect.signature(fn).replace(parameters=params))
        assert tool["schema"] == get_json_schema(fn)
    assert info["tasks"] == []


def test_timeout_and_retries_flags_bound_the_wait(capsys) -> None:
    """`--timeout` bounds each request and `--retries` the tries: a hung or failing server is an error, soon."""
    from ors_trl.testing.faults import FaultProxy, Hang, Status

    with FaultProxy() as hung:
        hung.add(Hang(max_seconds=60), times=None)
        assert main(["inspect", hung.url, "--timeout", "0.5", "--retries", "1"]) == 1
        assert hung.count() == 2  # one try and one retry, each given up after 0.5 s (not the 60 s default)
    assert "no answer within 0.5 s" in capsys.readouterr().err
    with FaultProxy() as down:
        down.add(Status(503, "down"), times=None)
        assert main(["inspect", down.url, "--retries", "2", "--json"]) == 1
        assert down.count() == 3
        assert "gave up after 3 attempts" in capsys.readouterr().err
        # eval takes the same flags for its environment client (its policy endpoint is never reached here)
        assert main(["eval", down.url, "--model", "m", "--base-url", "http://127.0.0.1:1/v1", "--retries", "0"]) == 1
        assert down.count() == 4
    assert "gave up after 1 attempt)" in capsys.readouterr().err
    for bad in (["--timeout", "0"], ["--timeout", "nan"], ["--retries", "-1"]):
        assert main(["inspect", "http://127.0.0.1:1", *bad]) == 2


# -- what a hostile environment can put on a terminal ---------------------------------------------------------


@pytest.fixture(scope="module")
def trap_server():
    from ors_trl.testing import ReferenceServer
    from tests.fixtures.terminal_environments import TitleEnvironment, TrapEnvironment

    with ReferenceServer([TrapEnvironment, TitleEnvironment]) as server:
        yield server


def raw_controls(text: str) -> list[str]:
    """Control and format characters a terminal would obey (newline excepted)."""
    return sorted({c for c in text if c != "\n" and unicodedata.category(c) in ("Cc", "Cf")})


def test_control_sequences_are_printed_escaped(trap_server, capsys) -> None:
    from tests.fixtures.terminal_environments import TITLE, TitleEnvironment

    title_env = TitleEnvironment.name().lower()
    assert main(["inspect", trap_server.url, "--env-name", "trapenvironment"]) == 0
    out = capsys.readouterr()
    assert raw_controls(out.out + out.err) == []
    text = out.out
    assert "title\\u202eenv\\x1b]0;pwned\\x07" in text  # the environment listing
    assert "te\\x1b[2Jst  type=validation" in text  # a split name that would clear the screen
    assert "fields: fi\\u202eeld, id, nul" in text and "line\\roverwritten\\x9b31m" in text  # task fields
    assert "  peek\\x1b[2J: Peek." in text  # a tool name
    # a description that would retitle the terminal and rewrite its line: one line, escaped
    assert "  look: Look around.\\x1b]0;pwned\\x07 then Binding warnings: none \\u202edrawkcab\n" in text
    # a name that cannot be a URL path segment is refused before anything is sent (it would go into every request's
    # path): a usage error, said escaped
    assert main(["inspect", trap_server.url, "--env-name", title_env]) == 2
    err = capsys.readouterr().err
    assert "cannot be part of a URL path" in err and "title\\u202eenv\\x1b]0;pwned\\x07" in err
    assert raw_controls(err) == []
    # --json: the same data exactly, its control and format characters as JSON escapes
    assert main(["inspect", trap_server.url, "--env-name", "trapenvironment", "--json"]) == 0
    out = capsys.readouterr().out
    assert raw_controls(out) == []
    info = json.loads(out)
    assert info["environment"] == "trapenvironment" and TITLE in info["tasks"][0]["task"]["id"]
    assert info["shared_tools"][1]["name"] == "peek\x1b[2J" and info["splits"][1]["name"] == "te\x1b[2Jst"
    # an error message that lists the server's environments
    assert main(["inspect", trap_server.url, "--env-name", "nope"]) == 1
    err = capsys.readouterr().err
    assert "title\\u202eenv\\x1b]0;pwned\\x07" in err and raw_controls(err) == []


def test_a_server_without_messages_may_be_another_implementation(ref_server) -> None:
    info = inspect_target(ref_server.url, env_name="echoenvironment", tasks=0)
    assert "Conversations (/messages): yes" in render_text(info)
    info["messages"] = False  # what `collect` finds where /tools names no message block types
    line = next(x for x in render_text(info).splitlines() if x.startswith("Conversations"))
    assert "older server" not in line.split(":", 1)[1].split("(")[0]
    assert "an older server, or another ORS implementation" in line and "/prompt" in line


def test_default_waits_suit_a_terminal(monkeypatch, capsys) -> None:
    """Without --timeout/--retries, inspect gives a server that accepts and never answers INSPECT_TIMEOUT per try
    and INSPECT_RETRIES retries (about half a minute in all; the client's defaults waited about six minutes)."""
    import socket

    from ors_trl import cli

    assert cli.INSPECT_TIMEOUT * (cli.INSPECT_RETRIES + 1) <= 60
    assert main(["inspect", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "other than a tool call (default 10)" in help_text and "429/502/503/504 (default 2)" in help_text
    monkeypatch.setattr(cli, "INSPECT_TIMEOUT", 0.5)  # the same path, faster
    with socket.create_server(("127.0.0.1", 0)) as silent:
        silent.settimeout(30)
        port = silent.getsockname()[1]
        accepted = []
        thread = threading.Thread(target=lambda: [accepted.append(silent.accept()[0])
                                                  for _ in range(cli.INSPECT_RETRIES + 1)])
        thread.start()
        assert main(["inspect", f"http://127.0.0.1:{port}"]) == 1
        thread.join(30)
        assert len(accepted) == cli.INSPECT_RETRIES + 1  # one try and the default retries, no more
        for conn in accepted:
            conn.close()
    err = capsys.readouterr().err
    assert "no answer within 0.5 s (attempt 3)" in err
