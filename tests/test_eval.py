"""`evaluate` / `ors-trl eval` against the reference server, with scripted and tiny local policies.

The scripted policy is a fake OpenAI-compatible server on loopback (aiohttp, in a thread) that reads the task
from the prompt and answers with the right tool calls, so the full tool loop and scoring are deterministic.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ors_trl import ConfigurationError, EvalReport, LocalPolicy, OpenAIPolicy, OpenRewardSpec, PolicyReply
from ors_trl.cli import main
from ors_trl.core.binding import Toolset
from ors_trl.evaluation.runner import load_episodes
from ors_trl.testing.server import free_port

torch.set_num_threads(1)

ECHO = "echoenvironment"
SPARSE = "sparseenvironment"
SRC = str(Path(__file__).resolve().parents[1] / "src")


# ---------------------------------------------------------------------------------------------------------
# A scripted OpenAI-compatible endpoint


def _tool_reply(name: str, arguments: dict[str, Any], n: int) -> dict[str, Any]:
    call = {"id": f"call_fake_{n}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


#: Models whose call comes back as plain content, as from a server without a tool-call parser (the echo task's call).
AS_CONTENT = {"unparsed": '<tool_call>\n{{"name": "echo", "arguments": {{"text": "{}"}}}}\n</tool_call>',
              "custom": 'CALL echo text="{}"'}


def scripted_reply(body: dict[str, Any], n: int) -> dict[str, Any]:
    """What a competent model would answer, read off the request (model "faulty" first makes a failing call; the
    models of `AS_CONTENT` write their call as content)."""
    names = {tool["function"]["name"] for tool in body.get("tools", [])}
    messages = body["messages"]
    prompt = messages[0]["content"]
    if body["model"] in AS_CONTENT:
        return {"role": "assistant", "content": AS_CONTENT[body["model"]].format(re.search(r'"([^"]+)"', prompt)[1])}
    if body["model"] == "thinking":  # a reasoning model: its reasoning apart from the content, as vLLM's parsers give
        return {**scripted_reply({**body, "model": "scripted"}, n), "reasoning_content": f"turn {len(messages)}"}
    turns = sum(1 for m in messages if m["role"] == "assistant")
    faulty = body["model"] == "faulty"
    if "echo" in names:
        if faulty and turns == 0:
            return _tool_reply("no_such_tool", {}, n)
        if turns < (2 if faulty else 1):
            return _tool_reply("echo", {"text": re.search(r'"([^"]+)"', prompt).group(1)}, n)
    elif "work" in names:  # the slow environment: work(step=0), then 1, ...
        return _tool_reply("work", {"step": turns}, n)
    elif "submit" in names:
        a, b = map(int, re.search(r"What is (\d+) \+ (\d+)", prompt).groups())
        script = [("calculator", {"expression": f"{a} +"})] if faulty else []
        script += [("calculator", {"expression": f"{a} + {b}"}), ("submit", None)]
        if turns < len(script):
            name, args = script[turns]
            if args is None:
                args = {"answer": int(messages[-1]["content"])}
            return _tool_reply(name, args, n)
    return {"role": "assistant", "content": "Done."}


class FakeOpenAI:
    """`POST /v1/chat/completions` on 127.0.0.1, answering with `scripted_reply` (or always `message`, a choice's
    message as given); records every request."""

    def __init__(self, delay: float = 0.0, message: dict[str, Any] | None = None) -> None:
        self.delay, self.message = delay, message
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self._counter = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.port = free_port()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def _handle(self, request: Any) -> Any:
        from aiohttp import web

        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        if self.delay:
            await asyncio.sleep(self.delay)
        message = self.message if self.message is not None else scripted_reply(body, next(self._counter))
        return web.json_response({
            "id": "chatcmpl-fake", "object": "chat.completion", "model": body["model"],
            "choices": [{"index": 0, "message": message,
                         "finish_reason": "tool_calls" if message.get("tool_calls") else "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        })

    def _serve(self) -> None:
        from aiohttp import web

        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._handle)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    def start(self) -> FakeOpenAI:
        self._thread.start()
        assert self._ready.wait(10), "fake OpenAI server did not start"
        return self

    def stop(self) -> None:
        fut = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
        fut.result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture
def fake_openai():
    server = FakeOpenAI().start()
    yield server
    server.stop()


pytestmark = pytest.mark.usefixtures("no_leaked_sessions")


def bound_schemas(spec: OpenRewardSpec) -> list[dict[str, Any]]:
    from transformers.utils import get_json_schema

    _ = spec.environment_factory  # binds as training does
    return [get_json_schema(fn) for fn in spec.binding.functions.values()]


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------------------
# OpenAI-compatible endpoint: the full tool loop


def test_openai_policy_echo_exact(ref_server, fake_openai, tmp_path) -> None:
    spec = OpenRewardSpec(ref_server.url, env_name=ECHO)
    out = tmp_path / "episodes.jsonl"
    policy = OpenAIPolicy(fake_openai.url, "scripted", api_key="sk-secret-123", temperature=0.0)
    report = spec.evaluate(policy, num_tasks=5, concurrency=3, output=str(out), progress=False)
    assert isinstance(report, EvalReport)
    assert (report.num_episodes, report.num_scored, report.mean_reward) == (5, 5, 1.0)
    assert report.coverage == 1.0 and report.finished_rate == 1.0
    assert report.tool_calls_per_episode == 1.0 and report.tool_failures_per_episode == 0.0
    assert report.end_reasons == {"finished": 5} and report.num_errors == 0
    # Two requests per episode, as in training: the call that finishes it, then the model's closing reply.
    assert len(fake_openai.requests) == 10
    request = fake_openai.requests[0]
    expected = [{"type": "function", "function": {k: v for k, v in s["function"].items() if k != "return"}}
                for s in bound_schemas(spec)]
    assert request["tools"] == expected
    assert request["model"] == "scripted" and request["temperature"] == 0.0
    assert all(h.get("Authorization") == "Bearer sk-secret-123" for h in fake_openai.headers)

    lines = read_lines(out)
    assert sorted(r["task_index"] for r in lines) == [0, 1, 2, 3, 4]
    assert report.episodes == sorted(lines, key=lambda r: r["task_index"])
    words = ["hello", "world", "trl", "openreward", "spec"]
    for record in report.episodes:
        target = words[record["task_index"]]
        assert target in record["prompt"]
        assert record["environment"] == ECHO and record["reward"] == 1.0 and record["finished"] is True
        assert record["rewards"] == [1.0] and record["end_reason"] == "finished" and record["error"] is None
        turn, closing = record["turns"]
        assert closing["assistant"] == "Done." and closing["tool_calls"] == [] and record["final"] == {"message": "Done."}
        (call,) = turn["tool_calls"]
        assert call["name"] == call["remote_name"] == "echo"
        assert call["arguments"] == {"text": target} and call["output"] == target
        assert call["reward"] == 1.0 and call["finished"] is True
        assert call["metadata"] == {"target_length": len(target)}
        assert set(record["timings"]) >= {"open", "prompt", "generation", "tools", "total"}
    assert "sk-secret-123" not in out.read_text()


def test_openai_policy_sparse_multi_turn(ref_server, fake_openai) -> None:
    spec = OpenRewardSpec(ref_server.url, env_name=SPARSE)
    report = spec.evaluate(OpenAIPolicy(fake_openai.url, "scripted"), indices=[0, 3, 5], progress=False)
    assert (report.num_episodes, report.mean_reward, report.coverage) == (3, 1.0, 1.0)
    assert report.tool_calls_per_episode == 2.0 and report.tool_failures_per_episode == 0.0
    assert [e["task_index"] for e in report.episodes] == [0, 3, 5]
    for record in report.episodes:
        assert record["rewards"] == [None, 1.0]  # calculator is unscored, submit scored
        assert [c["name"] for t in record["turns"] for c in t["tool_calls"]] == ["calculator", "submit"]
    # The second request carries our assistant tool call and the tool result, keyed by the call id.
    second = [r for r in fake_openai.requests if len(r["messages"]) == 3]
    assert len(second) == 3
    user, assistant, tool = second[0]["messages"]
    assert user["role"] == "user" and "What is" in user["content"]
    (call,) = assistant["tool_calls"]
    assert call["function"]["name"] == "calculator" and isinstance(call["function"]["arguments"], str)
    assert tool == {"role": "tool", "tool_call_id": call["id"], "content": tool["content"]}
    assert tool["content"].isdigit()


def test_an_endpoints_reasoning_stays_in_the_history(ref_server, fake_openai) -> None:
    """Training keeps the model's reasoning in the conversation; evaluation through an endpoint does too: each
    reply's `reasoning_content` goes back in the next request, and the record keeps it."""
    spec = OpenRewardSpec(ref_server.url, env_name=ECHO)
    report = spec.evaluate(OpenAIPolicy(fake_openai.url, "thinking"), num_tasks=1, progress=False)
    assert report.mean_reward == 1.0
    first, second = fake_openai.requests
    assert second["messages"][1]["role"] == "assistant"
    assert second["messages"][1]["reasoning_content"] == f"turn {len(first['messages'])}"
    assert [t.get("reasoning") for t in report.episodes[0]["turns"]] == ["turn 1", "turn 3"]


def test_tool_failures_are_recorded_and_shown_to_the_model(ref_server, fake_openai) -> None:
    spec = OpenRewardSpec(ref_server.url, env_name=SPARSE)
    report = spec.evaluate(OpenAIPolicy(fake_openai.url, "faulty"), num_tasks=2, progress=False)
    assert (report.mean_reward, report.coverage) == (1.0, 1.0)
    assert report.tool_calls_per_episode == 3.0 and report.tool_failures_per_episode == 1.0
    first = report.episodes[0]["turns"][0]["tool_calls"][0]
    assert first["error"]["kind"] == "failed" and "cannot evaluate" in first["error"]["message"]
    assert first["output"].startswith("{'error': ")  # what GRPOTrainer sends the model for a failed tool
    followups = [r for r in fake_openai.requests if len(r["messages"]) == 3]
    assert any(r["messages"][2]["content"] == first["output"] for r in followups)

    spec = OpenRewardSpec(ref_server.url, env_name=ECHO)
    report = spec.evaluate(OpenAIPolicy(fake_openai.url, "faulty"), num_tasks=2, progress=False)
    assert report.mean_reward == 1.0 and report.tool_failures_per_episode == 1.0
    unknown = report.episodes[0]["turns"][0]["tool_calls"][0]
    assert unknown["error"] == {"kind": "refused", "message": "Tool no_such_tool not found.", "reason": "not_found"}
    assert unknown["output"] == "{'error': 'Tool no_such_tool not found.'}"  # TRL's own text for it


def test_max_turns_and_repeats(ref_server, fake_openai) -> None:
    spec = OpenRewardSpec(ref_server.url, env_name=SPARSE)
    report = spec.evaluate(OpenAIPolicy(fake_openai.url, "scripted"), num_tasks=2, repeats=2, max_turns=1,
                           progress=False)
    assert report.num_episodes == 4 and report.end_reasons == {"max_turns": 4}
    assert [(e["task_index"], e["repeat"]) for e in report.episodes] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert report.mean_reward is None and report.coverage == 0.0 and report.finished_rate == 0.0


def test_routing_uses_the_binding(ref_server) -> None:
    """Model-facing names and parameter names go through the bound functions to the remote ones."""

    class Scripted:
        def __init__(self) -> None:
            self.tools: list[dict[str, Any]] = []

        async def respond(self, messages, tools):
            self.tools = tools
            if len(messages) == 1:
                return PolicyReply(tool_calls=[
                    {"id": None, "name": "keywords", "arguments": {"class_": "c", "x_y": 3}},
                    {"id": None, "name": "reset", "arguments": {"value": "v"}},
                ])
            return PolicyReply(content="ok")

    policy = Scripted()
    spec = OpenRewardSpec(ref_server.url, env_name="hostileenvironment")
    report = spec.evaluate(policy, indices=[0], progress=False)
    assert policy.tools == bound_schemas(spec)
    calls = report.episodes[0]["turns"][0]["tool_calls"]
    assert calls[0]["remote_arguments"] == {"class": "c", "x-y": 3}
    assert json.loads(calls[0]["output"]) == {"tool": "keywords", "received": {
        "class": "c", "x-y": 3, "self": "", "__dunder__": ""}}
    assert calls[1]["remote_name"] == "reset" and calls[1]["reward"] == 0.25
    assert report.episodes[0]["reward"] == 0.25 and report.end_reasons == {"no_tool_calls": 1}


def test_policy_errors_and_bad_endpoint(ref_server) -> None:
    spec = OpenRewardSpec(ref_server.url, env_name=ECHO)
    policy = OpenAIPolicy(f"http://127.0.0.1:{free_port()}/v1", "nobody", max_attempts=1)
    report = spec.evaluate(policy, num_tasks=2, progress=False)
    assert report.num_errors == 2 and report.end_reasons == {"error": 2}
    assert report.episodes[0]["error"]["kind"] == "policy"


def test_an_endpoint_url_with_a_query_is_refused_unshown() -> None:
    """A query (or fragment) in base_url was silently not sent, yet the policy's name kept it: a key put there landed
    in every episode record (`policy`), the report and repr. Refused where it is given, without showing it."""
    for url in ("http://127.0.0.1:1/v1?key=sk-secret-123", "http://127.0.0.1:1/v1#sk-secret-123"):
        with pytest.raises(ConfigurationError, match="query or fragment") as info:
            OpenAIPolicy(url, "m")
        assert "sk-secret-123" not in str(info.value)


@pytest.mark.parametrize("calls", [{"id": "a", "function": {"name": "echo", "arguments": "{}"}}, ["echo"]])
def test_tool_calls_an_endpoint_sends_malformed_are_a_policy_error(ref_server, calls) -> None:
    """`tool_calls` that is not a list of objects (one call as an object, names as strings) was dropped without a word:
    the episode read as one the model ended without a call. Now the endpoint's error, said as such."""
    server = FakeOpenAI(message={"role": "assistant", "content": None, "tool_calls": calls}).start()
    try:
        report = OpenRewardSpec(ref_server.url, env_name=ECHO).evaluate(OpenAIPolicy(server.url, "m"), num_tasks=1,
                                                                       progress=False)
    finally:
        server.stop()
    assert report.end_reasons == {"error": 1} and report.episodes[0]["error"]["kind"] == "policy"
    assert "not a chat completion" in report.episodes[0]["error"]["message"]


def test_an_endpoints_content_parts_are_its_text(ref_server) -> None:
    """An endpoint answering `content` as parts (Mistral's: thinking and text chunks) gave the episode a list for the
    reply's text; its text parts are the text."""
    content = [{"type": "thinking", "thinking": [{"type": "text", "text": "hm"}]},
               {"type": "text", "text": "All "}, {"type": "text", "text": "done."}]
    server = FakeOpenAI(message={"role": "assistant", "content": content}).start()
    try:
        report = OpenRewardSpec(ref_server.url, env_name=ECHO).evaluate(OpenAIPolicy(server.url, "m"), num_tasks=1,
                                                                       progress=False)
    finally:
        server.stop()
    assert report.episodes[0]["turns"][0]["assistant"] == "All done."


def test_a_policy_failing_after_a_reward_is_an_error(ref_server, tmp_path) -> None:
    """An episode rewarded by its first call whose policy then fails is no score (a failure voids what came before),
    counted in `num_errors` (the CLI's all-failed check reads it) and run again by `resume`."""
    from ors_trl import PolicyError

    class FailsSecondTurn:
        calls = 0

        async def respond(self, messages, tools):
            self.calls += 1
            if not any(m["role"] == "tool" for m in messages):
                target = re.search(r'exactly this text: "([^"]+)"', str(messages[-1]["content"])).group(1)
                return PolicyReply(tool_calls=[{"id": "c", "name": "echo", "arguments": {"text": target}}])
            raise PolicyError("the model server went away")

    spec = OpenRewardSpec(ref_server.url, env_name=ECHO)
    out = tmp_path / "ep.jsonl"
    report = spec.evaluate(FailsSecondTurn(), num_tasks=2, output=str(out), progress=False)
    assert [e["rewards"] for e in report.episodes] == [[1.0], [1.0]] and report.end_reasons == {"error": 2}
    assert [e["reward"] for e in report.episodes] == [None, None] and report.mean_reward is None
    assert report.num_errors == 2
    again = FailsSecondTurn()
    spec.evaluate(again, num_tasks=2, output=str(out), resume=True, progress=False)
    assert again.calls == 4  # both episodes ran again


# ---------------------------------------------------------------------------------------------------------
# Output file and resume


def test_resume_runs_only_missing_episodes(ref_server, fake_openai, tmp_path) -> None:
    out = tmp_path / "ep.jsonl"
    spec = OpenRewardSpec(ref_server.url, env_name=ECHO)
    policy = OpenAIPolicy(fake_openai.url, "scripted")
    spec.evaluate(policy, num_tasks=3, output=str(out), progress=False)
    assert len(fake_openai.requests) == 3 * 2  # per episode: the echo call, then the closing reply
    with pytest.raises(ValueError, match="already exists"):
        spec.evaluate(policy, num_tasks=3, output=str(out), progress=False)
    with out.open("a") as fh:  # an interrupted write
        fh.write('{"version": 1, "split": "train", "task_ind')
    report = spec.evaluate(policy, num_tasks=6, output=str(out), resume=True, progress=False)
    assert len(fake_openai.requests) == 6 * 2  # only tasks 3, 4, 5 ran
    assert report.num_resumed == 3 and report.num_episodes == 6 and report.mean_reward == 1.0
    assert sorted(load_episodes(out)) == [("train", i, 0) for i in range(6)]
    assert [e["task_index"] for e in report.episodes] == list(range(6))
    # Nothing left to do: no request at all.
    report = spec.evaluate(policy, num_tasks=6, output=str(out), resume=True, progress=False)
    assert len(fake_openai.requests) == 6 * 2 and report.num_resumed == 6


def _cli_eval(url: str, policy_url: str, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ors_trl", "eval", url, "--env-name", ECHO, "--base-url", policy_url,
            "--model", "scripted", "--output", str(out), "--concurrency", "1", "--no-progress", *extra]


def test_cli_interrupt_then_resume(ref_server, tmp_path) -> None:
    """Ctrl-C mid-run: exit 130, finished episodes kept, sessions closed; --resume redoes only the rest."""
    slow = FakeOpenAI(delay=0.4).start()
    try:
        out = tmp_path / "ep.jsonl"
        env = {**os.environ, "PYTHONPATH": SRC, "OPENREWARD_DISABLE_UPDATE_CHECK": "1"}
        proc = subprocess.Popen(_cli_eval(ref_server.url, slow.url, out, "--num-tasks", "8"), env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while (not out.exists() or len(read_lines(out)) < 2) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 130, stderr
        assert "--resume" in stderr
        done = {r["task_index"] for r in read_lines(out)}
        assert 2 <= len(done) < 8
        ref_server.wait_for_stats(lambda s: s["open_sessions"] == 0, timeout=10)
        before = len(slow.requests)

        result = subprocess.run(_cli_eval(ref_server.url, slow.url, out, "--num-tasks", "8", "--resume", "--json"),
                                env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        summary = json.loads(result.stdout)
        assert summary["num_episodes"] == 8 and summary["num_resumed"] == len(done)
        assert summary["mean_reward"] == 1.0 and summary["coverage"] == 1.0
        assert len(slow.requests) - before == 2 * (8 - len(done))  # two replies per episode
        assert sorted(load_episodes(out)) == [("train", i, 0) for i in range(8)]
    finally:
        slow.stop()


def test_cli_eval_in_process(ref_server, fake_openai, tmp_path, capsys) -> None:
    out = tmp_path / "ep.jsonl"
    args = ["eval", ref_server.url, "--env-name", SPARSE, "--base-url", fake_openai.url, "--model", "scripted",
            "--indices", "1,2", "--output", str(out), "--no-progress", "--json"]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert {"mean_reward", "coverage", "finished_rate", "tool_calls_per_episode", "tool_failures_per_episode",
            "num_episodes", "end_reasons"} <= set(data) and "episodes" not in data
    assert data["mean_reward"] == 1.0 and data["tool_calls_per_episode"] == 2.0
    assert main(args) == 2  # the output exists: --resume or --overwrite
    assert "already exists" in capsys.readouterr().err
    assert main([*args, "--overwrite"]) == 0
    capsys.readouterr()
    # Every episode failing (the endpoint is gone) is an error exit.
    dead = f"http://127.0.0.1:{free_port()}/v1"
    bad = ["eval", ref_server.url, "--env-name", ECHO, "--base-url", dead, "--model", "x", "--num-tasks", "1",
           "--no-progress"]
    os.environ.pop("OPENAI_API_KEY", None)
    assert main(bad) == 1
    assert "every episode ended in an error" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------
# Local transformers models


def test_local_model_untrained(ref_server, tiny_model_dir, tmp_path) -> None:
    out = tmp_path / "ep.jsonl"
    spec = OpenRewardSpec(ref_server.url, env_name=ECHO)
    report = spec.evaluate(str(tiny_model_dir), num_tasks=4, concurrency=4, max_turns=2, output=str(out),
                           max_new_tokens=12, progress=False)
    assert report.num_episodes == 4 and report.policy == str(tiny_model_dir)
    assert set(report.end_reasons) <= {"no_tool_calls", "finished", "max_turns", "length"}
    assert report.num_errors == 0
    assert 0.0 <= report.coverage <= 1.0
    lines = read_lines(out)
    assert sorted(r["task_index"] for r in lines) == [0, 1, 2, 3]
    for record in lines:
        assert 1 <= len(record["turns"]) <= 2
        assert isinstance(record["turns"][0]["raw"], str)
        assert record["tool_calls"] == sum(len(t["tool_calls"]) for t in record["turns"])


class ScriptedModel:
    """Stands in for a causal LM: 'generates' the correct echo tool call for each prompt, records batch sizes."""

    def __init__(self, tokenizer) -> None:
        from transformers import PretrainedConfig

        self.tokenizer = tokenizer
        self.config = PretrainedConfig(max_position_embeddings=4096)
        self.batches: list[int] = []

    def generate(self, input_ids, attention_mask, max_new_tokens=None, **kwargs):
        self.batches.append(int(input_ids.shape[0]))
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=True):
            prompt = self.tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
            if "<tool_response>" in prompt:
                reply = "Done.<|im_end|>"
            else:
                target = re.findall(r'exactly this text: \\?"([a-z]+)', prompt)[-1]
                call = json.dumps({"name": "echo", "arguments": {"text": target}})
                reply = f"<tool_call>\n{call}\n</tool_call><|im_end|>"
            rows.append(ids + self.tokenizer.encode(reply, add_special_tokens=False))
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id
        return torch.tensor([r + [pad] * (width - len(r)) for r in rows])


def test_local_policy_batches_and_parses_tool_calls(ref_server, tiny_model_dir) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    model = ScriptedModel(tokenizer)
    # A batch window no episode outlasts on any machine (a bound, never reached): a request waits until every running
    # episode has asked, so the four first turns share one generate call however loaded the machine.
    policy = LocalPolicy(model, tokenizer, batch_wait=300.0)
    spec = OpenRewardSpec(ref_server.url, env_name=ECHO)
    report = spec.evaluate(policy, num_tasks=4, concurrency=4, progress=False)
    assert (report.mean_reward, report.coverage, report.finished_rate) == (1.0, 1.0, 1.0)
    assert report.tool_calls_per_episode == 1.0
    assert model.batches[0] == policy.batch_sizes[0] == 4  # the four episodes' first turns shared one generate call
    call = report.episodes[0]["turns"][0]["tool_calls"][0]
    assert call["arguments"] == {"text": "hello"} and call["remote_name"] == "echo"
    # the turn after the tool call ran too, its input joined as GRPO joins it (TRL's training template for Qwen3)
    assert report.end_reasons == {"finished": 4} and policy.join_turns
    assert [[t["assistant"] for t in e["turns"]] for e in report.episodes] == [["", "Done."]] * 4
    assert model.batches == policy.batch_sizes == [4, 4]


def test_local_policy_falls_back_to_whole_conversations(ref_server, tiny_model_dir, caplog) -> None:
    """A chat template TRL has no training variant of, and cannot build tool turns with (not prefix-preserving):
    rendered with the tokenizer's own template and, from the first tool turn on, whole; one log line for each, and
    every episode plays on."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import add_response_schema

    tokenizer = add_response_schema(AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True))
    tokenizer.chat_template = "{#- a template TRL does not know -#}\n" + tokenizer.chat_template  # renders the same
    model = ScriptedModel(tokenizer)
    with caplog.at_level("WARNING", logger="ors_trl.eval"):
        policy = LocalPolicy(model, tokenizer, batch_wait=300.0, name="tiny")
        report = OpenRewardSpec(ref_server.url, env_name=ECHO).evaluate(policy, num_tasks=4, concurrency=4,
                                                                        progress=False)
    assert policy.rendering.chat_template is None and not policy.join_turns
    assert report.end_reasons == {"finished": 4} and report.mean_reward == 1.0
    assert [[t["assistant"] for t in e["turns"]] for e in report.episodes] == [["", "Done."]] * 4
    logged = [r.getMessage() for r in caplog.records if r.name == "ors_trl.eval"]
    assert len(logged) == 2, logged
    assert "the tokenizer's own chat template" in logged[0] and "ValueError" in logged[0]
    assert logged[1].startswith("tiny renders every conversation whole from now on (join_turns=False)")


def test_cli_eval_of_a_model_directory_plays_tool_turns(ref_server, tiny_model_dir, tmp_path, monkeypatch) -> None:
    """`ors-trl eval --model DIR` loads the policy as `LocalPolicy.from_pretrained` does (the model's generate
    scripted: a tool call, then a final message); the turn after the tool call is built as GRPO builds it."""
    import transformers

    scripted = ScriptedModel(transformers.AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True))
    (architecture,) = transformers.AutoConfig.from_pretrained(tiny_model_dir).architectures
    monkeypatch.setattr(getattr(transformers, architecture), "generate", lambda self, **kw: scripted.generate(**kw))
    out = tmp_path / "episodes.jsonl"
    assert main(["eval", ref_server.url, "--env-name", ECHO, "--model", str(tiny_model_dir), "--num-tasks", "2",
                 "--output", str(out), "--no-progress"]) == 0
    records = read_lines(out)
    # two replies each, generated in whatever batches the episodes' timing formed (the batching rule is tested with
    # LocalPolicy itself)
    assert [r["end_reason"] for r in records] == ["finished", "finished"] and sum(scripted.batches) == 4
    assert [[t["assistant"] for t in r["turns"]] for r in records] == [["", "Done."]] * 2


def test_toolset_schemas_match_training_binding(ref_server) -> None:
    spec = OpenRewardSpec(ref_server.url, env_name="tasktoolsenvironment")
    toolset = Toolset(spec.tool_specs)
    assert toolset.schemas == bound_schemas(spec)
    assert sorted(toolset.by_name) == ["look", "open_door"]


def test_per_task_tools(ref_server) -> None:
    seen: list[list[str]] = []

    class Lister:
        async def respond(self, messages, tools):
            seen.append(sorted(t["function"]["name"] for t in tools))
            return PolicyReply(content="no")

    spec = OpenRewardSpec(ref_server.url, env_name="tasktoolsenvironment")  # training probes task 0
    spec.evaluate(Lister(), indices=[1], per_task_tools=True, progress=False)
    spec.evaluate(Lister(), indices=[1], progress=False)
    spec = OpenRewardSpec(ref_server.url, env_name="tasktoolsenvironment", indices=[1])  # probes task 1
    spec.evaluate(Lister(), progress=False)
    assert seen == [["look", "open_window"], ["look", "open_door"], ["look", "open_window"]]


def test_local_policy_context_limit(ref_server, tiny_model_dir) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    model = ScriptedModel(tokenizer)
    model.config.max_position_embeddings = 32  # smaller than any rendered prompt
    spec = OpenRewardSpec(ref_server.url, env_name=ECHO)
    report = spec.evaluate(LocalPolicy(model, tokenizer), num_tasks=2, progress=False)
    assert report.end_reasons == {"context_length": 2} and report.num_errors == 0
    assert model.batches == [] and report.mean_reward is None


def test_local_policy_joins_turns_as_grpo_does(tiny_model_dir) -> None:
    """A turn after a tool call is the previous input + the ids the model generated + TRL's tool suffix, not a
    re-render of the conversation (which tokenizes a generated call canonically and may add template text)."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import get_training_chat_template

    from ors_trl.core.rollout import Conversation

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    joined = LocalPolicy(object(), tokenizer)  # by default, the template GRPOTrainer trains tools with
    assert joined.rendering.chat_template == get_training_chat_template(tokenizer) is not None
    plain = LocalPolicy(object(), tokenizer, join_turns=False)
    user = [{"role": "user", "content": 'Call the `echo` tool with exactly this text: "hello".'}]
    conversation, whole = Conversation(None, list(user)), Conversation(None, list(user))  # type: ignore[arg-type]
    joined._extend(conversation)
    plain._extend(whole)
    first = conversation.state.ids
    assert first == whole.state.ids
    # what the model generated: a well-formed call, tokenized piece by piece (not the canonical tokenization)
    call = '<tool_call>\n{"name": "echo", "arguments": {"text": "hello"}}\n</tool_call>'
    generated = [t for piece in call for t in tokenizer.encode(piece, add_special_tokens=False)]
    generated += tokenizer.encode("<|im_end|>", add_special_tokens=False)
    reply = joined._parse(conversation, generated, None, 0.0)
    assert reply.tool_calls[0].name == "echo"
    history = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "echo", "arguments": {"text": "hello"}}}]},
        {"role": "tool", "tool_call_id": "c", "name": "echo", "content": "hello"}]
    conversation.messages += history
    whole.messages += history
    joined._extend(conversation)
    plain._extend(whole)
    suffix = joined.rendering.tool_suffix_ids([{"role": "tool", "name": "echo", "content": "hello"}])
    assert conversation.state.ids == first + generated + suffix
    assert conversation.state.mask == [1] * len(generated) + [0] * len(suffix)
    assert tokenizer.decode(suffix).startswith("\n<|im_start|>user\n<tool_response>\nhello")
    assert whole.state.ids != conversation.state.ids  # re-rendering gives the model other ids than it was trained on
    other = Conversation(None, [*user, {"role": "assistant", "content": "not generated here"},  # type: ignore[arg-type]
                                {"role": "user", "content": "and?"}])
    joined._extend(other)  # a history given whole (`respond`): rendered whole
    assert other.state.ids == plain.rendering.prompt_ids(other.messages, None)


# ---------------------------------------------------------------------------------------------------------
# Deadlines: a tool call's (--tool-timeout, Timeouts.tool_call) and an episode's (--episode-timeout)


class WorkPolicy:
    """Calls the slow environment's `work` tool, one step per turn."""

    description = "scripted-work"

    async def respond(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> PolicyReply:
        turns = sum(1 for m in messages if m["role"] == "assistant")
        return PolicyReply(content="", tool_calls=[{"id": f"w{turns}", "name": "work", "arguments": {"step": turns}}])


@pytest.fixture
def slow_server(make_server):
    """Every `work` call takes 60 s: only a deadline ends an episode in time."""
    return make_server("slow", env={"ORS_TEST_TOOL_LATENCY": "60"})


def test_episode_timeout_closes_records_and_frees_the_session(slow_server, tmp_path) -> None:
    out = tmp_path / "ep.jsonl"
    spec = OpenRewardSpec(slow_server.url, env_name="slowenvironment")
    report = spec.evaluate(WorkPolicy(), num_tasks=2, episode_timeout=0.5, output=str(out), progress=False)
    assert report.end_reasons == {"timeout": 2} and report.mean_reward is None and report.num_errors == 0
    for record in read_lines(out):
        assert (record["end_reason"], record["unscored"], record["reward"]) == ("timeout", "timeout", None)
        assert record["error"] == {"kind": "timeout", "message": "the episode exceeded episode_timeout=0.5s"}
        for call in [c for turn in record["turns"] for c in turn["tool_calls"]]:  # each a 60 s `work`: cut short
            assert (call["status"], call["error"]["kind"]) == ("failed", "cancelled")  # (none when the open was)
    slow_server.wait_for_stats(lambda s: s["open_sessions"] == 0, timeout=30)  # deleted, not left to idle out
    # the spec's own episode_timeout is evaluate's default
    spec = OpenRewardSpec(slow_server.url, env_name="slowenvironment", episode_timeout=0.5)
    assert spec.evaluate(WorkPolicy(), num_tasks=1, progress=False).end_reasons == {"timeout": 1}
    slow_server.wait_for_stats(lambda s: s["open_sessions"] == 0, timeout=30)
    with pytest.raises(ConfigurationError, match="episode_timeout must be positive"):
        spec.evaluate(WorkPolicy(), num_tasks=1, episode_timeout=0, progress=False)


def test_cli_tool_and_episode_timeouts(slow_server, fake_openai, tmp_path, capsys) -> None:
    base = ["eval", slow_server.url, "--env-name", "slowenvironment", "--base-url", fake_openai.url,
            "--model", "m", "--num-tasks", "1", "--no-progress", "--json"]
    # --tool-timeout: the call fails after 0.5 s (not 60 s), and so does the episode (as in training, the model
    # reads the error and may go on; the episode is unscored for that error)
    assert main([*base, "--tool-timeout", "0.5", "--output", str(tmp_path / "tool.jsonl")]) == 1
    info = json.loads(capsys.readouterr().out)
    assert info["num_errors"] == 1
    (record,) = read_lines(tmp_path / "tool.jsonl")
    call = record["turns"][0]["tool_calls"][0]
    assert call["error"]["kind"] == "timeout" and "within 0.5 s (Timeouts.tool_call)" in call["error"]["message"]
    slow_server.wait_for_stats(lambda s: s["open_sessions"] == 0, timeout=30)
    # --episode-timeout: closed, recorded as a timeout, scored None
    assert main([*base, "--episode-timeout", "0.5", "--output", str(tmp_path / "episode.jsonl")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["end_reasons"] == {"timeout": 1} and info["mean_reward"] is None and info["num_errors"] == 0
    (record,) = read_lines(tmp_path / "episode.jsonl")
    assert (record["end_reason"], record["reward"]) == ("timeout", None)
    slow_server.wait_for_stats(lambda s: s["open_sessions"] == 0, timeout=30)
    for bad in (["--tool-timeout", "0"], ["--episode-timeout", "nan"], ["--episode-timeout", "-1"]):
        assert main([*base, *bad]) == 2


def test_summary_escapes_the_environments_text(fake_openai, capsys) -> None:
    from ors_trl.testing import ReferenceServer
    from tests.fixtures.terminal_environments import TitleEnvironment, TrapEnvironment

    name = TitleEnvironment.name().lower()
    with ReferenceServer([TrapEnvironment, TitleEnvironment]) as server:
        assert main(["eval", server.url, "--env-name", "trapenvironment", "--base-url", fake_openai.url, "--model",
                     "m", "--num-tasks", "1", "--no-progress"]) == 0
        # a name that cannot be part of a URL path is a usage error, said escaped
        assert main(["eval", server.url, "--env-name", name, "--base-url", fake_openai.url, "--model", "m",
                     "--num-tasks", "1", "--no-progress"]) == 2
        server.wait_for_stats(lambda s: s["open_sessions"] == 0, timeout=30)
    out = capsys.readouterr()
    assert "of trapenvironment (split 'train')" in out.out and "title\\u202eenv\\x1b]0;pwned\\x07" in out.err
    assert not any(c in out.out + out.err for c in ("\x1b", "\x07", "\u202e"))
    report = EvalReport.from_episodes([], target="t", environment=name, split="te\x1b[2Jst", policy="p\r",
                                      num_resumed=0, seconds=0.0)
    assert "of title\\u202eenv\\x1b]0;pwned\\x07 (split 'te\\x1b[2Jst')" in report.summary()
    assert not any(c in report.summary() for c in ("\x1b", "\x07", "\u202e", "\r"))


# ---------------------------------------------------------------------------------------------------------
# pass@k, tool-call health, several environments


class CountingEchoPolicy:
    """Echoes the task's word right in the first `right[word]` episodes of that task (any order), wrong after."""

    description = "counting-echo"

    def __init__(self, right: dict[str, int]) -> None:
        self.right = right
        self.seen: dict[str, int] = {}

    async def respond(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> PolicyReply:
        if messages[-1]["role"] == "tool":
            return PolicyReply(content="Done.")
        word = re.search(r'exactly this text: "([^"]+)"', messages[-1]["content"]).group(1)
        k = self.seen[word] = self.seen.get(word, 0) + 1
        text = word if k <= self.right.get(word, 0) else word + "?"
        return PolicyReply(content="", tool_calls=[{"id": "c", "name": "echo", "arguments": {"text": text}}])


def test_pass_at_k_of_repeats(ref_server, tmp_path) -> None:
    """Four tasks, five episodes each, with 0, 1, 3 and 5 successes: pass@k for k = 1..5 per task and over tasks is
    the unbiased estimator, and the interval for pass@1 is over the four tasks."""
    from math import comb

    from ors_trl.core.stats import wilson

    words = ["hello", "world", "trl", "openreward"]
    right = dict(zip(words, (0, 1, 3, 5), strict=True))
    spec = OpenRewardSpec(ref_server.url, env_name=ECHO)
    report = spec.evaluate(CountingEchoPolicy(right), num_tasks=4, repeats=5, concurrency=6, progress=False)
    assert report.num_episodes == 20 and report.success_rate == 9 / 20
    expected = {k: sum(1 - comb(5 - c, k) / comb(5, k) for c in right.values()) / 4 for k in range(1, 6)}
    assert report.pass_at_k == pytest.approx(expected) and report.pass_at_k[1] == pytest.approx(9 / 20)
    assert report.pass_at_1_interval == pytest.approx(wilson(9 / 20, 4))
    assert [(t["task"], t["episodes"], t["successes"]) for t in report.tasks] == [
        (f"train #{i}", 5, c) for i, c in enumerate(right.values())]
    assert report.tasks[1]["pass_at_k"] == pytest.approx({k: k / 5 for k in range(1, 6)})  # one success of five
    text = report.summary()
    assert "pass@k over 4 task(s)" in text and f"pass@5 {expected[5]:.3f}" in text and "1/5 succeeded" in text
    data = json.loads(json.dumps(report.to_dict()))
    assert data["pass_at_k"]["5"] == pytest.approx(expected[5]) and len(data["tasks"]) == 4


def test_cli_repeats_pass_at_k_json_and_bad_input(ref_server, fake_openai, tmp_path, capsys) -> None:
    out = tmp_path / "e.jsonl"
    base = ["eval", ref_server.url, "--env-name", ECHO, "--base-url", fake_openai.url, "--model", "m",
            "--num-tasks", "2", "--no-progress"]
    assert main([*base, "--repeats", "3", "--json", "--output", str(out)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["pass_at_k"] == {"1": 1.0, "2": 1.0, "3": 1.0} and [t["episodes"] for t in info["tasks"]] == [3, 3]
    assert info["no_tool_call_rate"] == 0.0 and info["malformed_calls"] == 0
    assert main([*base, "--repeats", "2"]) == 0
    assert "pass@1 1.000  pass@2 1.000" in capsys.readouterr().out
    assert main([*base, "--repeats", "0"]) == 2
    assert "--repeats: expected an integer >= 1, got '0'" in capsys.readouterr().err
    # a threshold outside the rewards seen (0 to 1): refused after the run, the episodes kept whole
    assert main([*base, "--success-threshold", "2", "--output", str(out), "--overwrite"]) == 2
    err = capsys.readouterr()
    assert "outside the rewards seen (1 to 1)" in err.err and f"the episodes are in {out}" in err.err
    assert err.out == "" and len(read_lines(out)) == 2
    assert main(["eval", ref_server.url, ref_server.url, "--env-name", ECHO, "--env-name", SPARSE, "--env-name",
                 ECHO, "--base-url", fake_openai.url, "--model", "m", "--no-progress"]) == 2
    assert "3 --env-name values for 2 TARGETs" in capsys.readouterr().err


def test_unparsed_tool_calls_of_an_endpoint_are_counted(ref_server, fake_openai, capsys) -> None:
    """A server without a tool-call parser returns the model's call as content (`<tool_call>{...}` and no
    `tool_calls`): the turn is marked unparsed and counted, by the common markups by default, by the markup the
    user names (`tool_markup=`, `--tool-markup`) otherwise."""
    spec = OpenRewardSpec(ref_server.url, env_name=ECHO)
    report = spec.evaluate(OpenAIPolicy(fake_openai.url, "unparsed"), num_tasks=2, progress=False)
    assert report.unparsed_turn_rate == 1.0 and report.end_reasons == {"no_tool_calls": 2}
    (turn,) = report.episodes[0]["turns"]
    assert turn["unparsed"] is True and turn["assistant"].startswith("<tool_call>") and turn["tool_calls"] == []
    assert "unparsed tool calls   1.000 of turns" in report.summary()
    # a markup no chat template of the defaults writes: not seen, until named
    assert spec.evaluate(OpenAIPolicy(fake_openai.url, "custom"), num_tasks=2, progress=False).unparsed_turn_rate == 0
    named = spec.evaluate(OpenAIPolicy(fake_openai.url, "custom", tool_markup=["<<fn>>", "CALL "]), num_tasks=2,
                          progress=False)
    assert named.unparsed_turn_rate == 1.0
    none = spec.evaluate(OpenAIPolicy(fake_openai.url, "unparsed", tool_markup=()), num_tasks=1, progress=False)
    assert none.unparsed_turn_rate == 0.0 and "unparsed" not in none.episodes[0]["turns"][0]
    with pytest.raises(ConfigurationError, match="tool_markup"):
        OpenAIPolicy(fake_openai.url, "m", tool_markup=" ")

    base = ["eval", ref_server.url, "--env-name", ECHO, "--base-url", fake_openai.url, "--model", "custom",
            "--num-tasks", "2", "--no-progress", "--json"]
    assert main([*base, "--tool-markup", "CALL "]) == 0
    assert json.loads(capsys.readouterr().out)["unparsed_turn_rate"] == 1.0
    assert main([*base]) == 0
    assert json.loads(capsys.readouterr().out)["unparsed_turn_rate"] == 0.0
    assert main(["eval", ref_server.url, "--model", str(Path(SRC)), "--tool-markup", "CALL "]) == 2
    assert "--tool-markup is only used with --base-url" in capsys.readouterr().err


def test_the_common_tool_call_markups() -> None:
    """Each chat template's tool call, as a server without its parser returns it, is seen; prose and JSON answers
    that are not calls are not."""
    from ors_trl.evaluation.policies import TOOL_MARKUPS, markup_pattern
    from ors_trl.trl.backend import Rules

    rules = Rules(tool_markup=markup_pattern())
    calls = [
        '<tool_call>\n{"name": "echo", "arguments": {"text": "hi"}}\n</tool_call>',  # Qwen, Hermes
        'Sure.<|python_tag|>{"name": "echo", "parameters": {"text": "hi"}}',  # Llama 3.1 (python_tag)
        '{"name": "echo", "parameters": {"text": "hi"}}',  # Llama 3.x JSON
        'I will call it:\n  { "name" : "echo" , "arguments": {}}',  # a bare JSON call on a line of its own
        '[TOOL_CALLS][{"name": "echo", "arguments": {"text": "hi"}}]',  # Mistral
        '<\uff5ctool\u2581calls\u2581begin\uff5c><\uff5ctool\u2581call\u2581begin\uff5c>function<\uff5ctool\u2581sep'
        '\uff5c>echo\n```json\n{"text": "hi"}\n```',  # DeepSeek V3
        '<|channel|>commentary to=functions.echo <|constrain|>json<|message|>{"text": "hi"}',  # gpt-oss, tokens kept
        'commentary to=functions.echo json{"text": "hi"}',  # gpt-oss, special tokens skipped
        '<|tool_call|>[{"name": "echo", "arguments": {"text": "hi"}}]',  # Granite 3.0
        '<|tool_calls_section_begin|><|tool_call_begin|>functions.echo:0<|tool_call_argument_begin|>{}',  # Kimi K2
        '<tool_calls>\n{"name": "echo", "arguments": {}}\n</tool_calls>',  # Jamba, MiniMax-M1
        '<|action_start|><|plugin|>\n{"name": "echo", "parameters": {}}<|action_end|>',  # InternLM 2
    ]
    assert [c for c in calls if not rules.holds_call(c)] == []
    assert all(rules.holds_call(f"x {m} y") for m in TOOL_MARKUPS)
    prose = ["The answer is 42.", 'Use {"name": "x"} as the key.', 'The tool_call tag is written <tool-call>.',
             '{"name": "Paris", "population": 2100000}', "Call me at functions dot py"]
    assert [p for p in prose if rules.holds_call(p)] == []
    assert Rules(tool_markup="<tool_call>").holds_call("a <tool_call>") and not Rules().holds_call("<tool_call>")


def test_tool_call_health_with_broken_markup(ref_server, tiny_model_dir) -> None:
    """The tiny model writes, on purpose: a good call, tool-call markup whose JSON is cut (the parser makes no call of
    it), a call with an argument the tool does not have (refused: malformed), and plain text. Each is counted where
    the turn rule sees it and shown in the summary."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.fixtures.generation import tool_call_text

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    words = ["hello", "world", "trl", "openreward"]
    replies = {"hello": tool_call_text("echo", {"text": "hello"}),
               "world": '<tool_call>\n{"name": "echo", "arguments": {"text": "world"}\n</tool_call>',
               "trl": tool_call_text("echo", {"txt": "trl"}),
               "openreward": "I would rather not."}

    def generate(input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:  # the model's turn, scripted
        rows = []
        for ids in input_ids.tolist():
            text = tok.decode(ids)
            word = re.findall(r'exactly this text: "(\w+)"', text)[0]
            body = "Done." if "<tool_response>" in text else replies[word]
            rows.append(ids + tok.encode(body + "<|im_end|>", add_special_tokens=False))
        width = max(map(len, rows))
        return torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])

    model.generate = generate
    policy = LocalPolicy(model, tok, max_new_tokens=64)
    assert policy.rendering.tool_markup == "<tool_call>"  # read off the template's response schema
    report = OpenRewardSpec(ref_server.url, env_name=ECHO).evaluate(policy, num_tasks=4, progress=False)
    assert "error" not in report.end_reasons and policy.join_turns
    by_word = {words[e["task_index"]]: e for e in report.episodes}
    assert by_word["hello"]["reward"] == 1.0 and by_word["hello"]["tool_calls"] == 1
    (broken,) = by_word["world"]["turns"]
    assert broken["unparsed"] is True and broken["tool_calls"] == [] and "<tool_call>" in broken["assistant"]
    refused = by_word["trl"]["turns"][0]["tool_calls"][0]
    assert refused["status"] == "refused" and refused["error"]["reason"] == "input_validation"
    (plain,) = by_word["openreward"]["turns"]
    assert "unparsed" not in plain and plain["assistant"] == "I would rather not."
    assert report.no_tool_call_rate == 0.5 and report.malformed_calls == 1
    assert report.unparsed_turn_rate == pytest.approx(1 / 6)  # of 2 + 1 + 2 + 1 turns
    text = report.summary()
    assert "no tool call          0.500 of episodes" in text and "malformed arguments   1 call(s)" in text
    assert "unparsed tool calls   0.167 of turns" in text
    assert "warning: 50% of the episodes made no tool call; 17% of the turns wrote tool-call markup" in text


def test_mix_evaluate_and_cli_several_environments(ref_server, fake_openai, tmp_path, capsys) -> None:
    from ors_trl import OpenRewardMix

    mix = OpenRewardMix({"echo": OpenRewardSpec(ref_server.url, env_name=ECHO, num_tasks=2),
                         "sparse": OpenRewardSpec(ref_server.url, env_name=SPARSE, num_tasks=3)}, weights=[3, 1])
    out = tmp_path / "mix.jsonl"
    report = mix.evaluate(OpenAIPolicy(fake_openai.url, "faulty"), output=str(out), progress=False)
    echo, sparse = report.environments["echo"], report.environments["sparse"]
    assert (echo.num_episodes, sparse.num_episodes) == (2, 3) and report.weights == {"echo": 0.75, "sparse": 0.25}
    assert report.success_rate == pytest.approx(0.75 * echo.success_rate + 0.25 * sparse.success_rate)
    assert report.pass_at_k == {1: pytest.approx(0.75 * echo.pass_at_k[1] + 0.25 * sparse.pass_at_k[1])}
    assert {r["environment"] for r in read_lines(out)} == {"echo", "sparse"} and len(read_lines(out)) == 5
    again = mix.evaluate(OpenAIPolicy(fake_openai.url, "faulty"), output=str(out), resume=True, progress=False)
    assert again.num_resumed == 5 and again.num_episodes == 5  # each environment's episodes found again
    assert "Overall, 2 environments weighted (echo 0.750, sparse 0.250)" in report.summary()
    mix.close()

    base = ["eval", ref_server.url, "--env-name", ECHO, "--env-name", SPARSE, "--base-url", fake_openai.url,
            "--model", "m", "--num-tasks", "2", "--no-progress"]
    assert main([*base, "--json", "--weights", "1,1"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert set(info["environments"]) == {ECHO, SPARSE} and info["weights"] == {ECHO: 0.5, SPARSE: 0.5}
    assert info["overall"]["success_rate"] == 1.0 and info["overall"]["pass_at_k"] == {"1": 1.0}
    assert main([*base, "--weights", "1,2,3"]) == 2
    assert "--weights has 3 values for 2 environments" in capsys.readouterr().err

    from ors_trl.testing.faults import FaultProxy

    with FaultProxy(ref_server.url) as proxy:  # two TARGETs, an --env-name each: the second through the proxy
        out = tmp_path / "two.jsonl"
        assert main(["eval", ref_server.url, proxy.url, "--env-name", ECHO, "--env-name", SPARSE, "--base-url",
                     fake_openai.url, "--model", "m", "--num-tasks", "2", "--no-progress", "--json",
                     "--output", str(out)]) == 0
        seen = {r.path.split("/")[1] for r in proxy.requests if r.path.count("/") > 1}
        creates = [r.json()["env_name"] for r in proxy.requests if r.path.endswith("/create")]
    info = json.loads(capsys.readouterr().out)
    assert set(info["environments"]) == {ECHO, SPARSE} and info["weights"] == {ECHO: 0.5, SPARSE: 0.5}
    assert info["environments"][SPARSE]["target"] == proxy.url and info["environments"][ECHO]["target"] == ref_server.url
    assert seen == {SPARSE} and creates == [SPARSE] * 3  # its tool probe and 2 episodes there, nothing of ECHO
    assert info["overall"]["success_rate"] == 1.0 and len(read_lines(out)) == 4


def test_mix_of_one_environment_twice_plays_each(ref_server, tmp_path) -> None:
    """A mix naming the same environment twice (two servers, two toolsets...: `echoenvironment` and
    `echoenvironment_2`) plays the second's episodes too: the first's records, named after the environment, are not
    the second's to resume; a resume finds each one's own."""
    from ors_trl import OpenRewardMix

    out = tmp_path / "mix.jsonl"
    mix = OpenRewardMix([OpenRewardSpec(ref_server.url, env_name=ECHO), OpenRewardSpec(ref_server.url, env_name=ECHO)])
    policy = CountingEchoPolicy({"hello": 9, "world": 9})
    report = mix.evaluate(policy, num_tasks=2, output=str(out), progress=False)
    assert policy.seen == {"hello": 2, "world": 2} and report.num_resumed == 0
    assert sorted(r["environment"] for r in read_lines(out)) == [ECHO, ECHO, f"{ECHO}_2", f"{ECHO}_2"]
    again = mix.evaluate(policy, num_tasks=2, output=str(out), resume=True, progress=False)
    assert policy.seen == {"hello": 2, "world": 2} and [r.num_resumed for r in again.environments.values()] == [2, 2]
    mix.close()


def test_group_scored_episodes_are_flushed_as_each_group_is_scored(ref_server, tmp_path) -> None:
    """With score_groups, a task's episodes are written once its group is scored, not all at the end: an evaluation
    interrupted later keeps them, and resume does not play them again."""
    out = tmp_path / "ep.jsonl"

    class Sayer:
        seen_before_last: int | None = None

        async def respond(self, messages, tools):
            if messages[-1]["role"] == "tool":  # the group's score reads the final text: the sentence said
                return PolicyReply(content=str(messages[-1]["content"]))
            word = re.search(r'word "([^"]+)"', messages[-1]["content"]).group(1)
            if word == "cloud" and self.seen_before_last is None:  # the last task: the first two groups are scored
                for _ in range(400):  # bounded: 20 s
                    if out.exists() and len(read_lines(out)) >= 4:
                        break
                    await asyncio.sleep(0.05)
                self.seen_before_last = len(read_lines(out)) if out.exists() else 0
            return PolicyReply(tool_calls=[{"id": "c", "name": "say", "arguments": {"text": f"A {word}."}}])

    policy = Sayer()
    spec = OpenRewardSpec(ref_server.url, env_name="judgeenvironment", score_groups=True)
    report = spec.evaluate(policy, num_tasks=3, repeats=2, concurrency=1, score_groups=True, output=str(out),
                           progress=False)
    assert policy.seen_before_last == 4 and report.mean_group_reward == 1.0
    lines = read_lines(out)
    assert sorted((r["task_index"], r["repeat"]) for r in lines) == [(t, r) for t in range(3) for r in range(2)]
    assert all(r["group_reward"] == 1.0 for r in lines)


def test_a_mix_option_one_environment_cannot_run_is_said_before_any_plays(ref_server) -> None:
    """score_groups with an environment of the mix that does not score groups: the error came after the environments
    before it had played every episode (and their report was lost); now before any episode."""
    from ors_trl import OpenRewardMix

    mix = OpenRewardMix({"judge": OpenRewardSpec(ref_server.url, env_name="judgeenvironment"),
                         "echo": OpenRewardSpec(ref_server.url, env_name=ECHO)})
    asked: list[int] = []

    class Answers:
        async def respond(self, messages, tools):
            asked.append(len(messages))
            return PolicyReply(content="A river.")

    with pytest.raises(ConfigurationError, match="echo does not support group scoring"):
        mix.evaluate(Answers(), num_tasks=2, score_groups=True, progress=False)
    assert asked == []
    mix.close()


def test_an_environment_that_never_opened_is_said_as_such(ref_server, fake_openai) -> None:
    """Two environments, one whose every session is refused at `/create` (through a fault proxy): its episodes never
    opened, so they are not episodes "without a tool call" (the model never saw them) but N that failed to open; and the
    overall mean reward is the scored environment's alone, which the report says (never 1.0 as if both counted)."""
    from ors_trl import OpenRewardMix
    from ors_trl.testing.faults import FaultProxy, Status

    with FaultProxy(ref_server.url) as proxy:
        proxy.add(Status(400), path="/create", times=None)
        mix = OpenRewardMix({"echo": OpenRewardSpec(ref_server.url, env_name=ECHO),
                             "broken": OpenRewardSpec(proxy.url, env_name=ECHO, discover_task_tools=False)},
                            weights=[1, 1])
        report = mix.evaluate(OpenAIPolicy(fake_openai.url, "scripted"), num_tasks=2, progress=False)
        creates = proxy.count("/create")
    mix.close()
    echo, broken = report.environments["echo"], report.environments["broken"]
    assert creates == 2 and (broken.num_episodes, broken.num_errors, broken.mean_reward, echo.mean_reward) == (
        2, 2, None, 1.0)
    text = broken.summary()
    assert "made no tool call" not in text and broken.no_tool_call_rate == 0.0
    assert "warning: 2 episode(s) failed to open (the environment's failure" in text and broken.num_unopened == 2
    overall = report.summary().split("Overall")[1]
    assert "mean reward           1.0000  (over 0.500 of the weight: no episode of broken was scored)" in overall
    assert "warning: 2 episode(s) failed to open" in overall and "made no tool call" not in overall
    assert report.mean_reward == 1.0 and report.mean_reward_weight == 0.5 and report.unscored_environments == ["broken"]
    info = report.to_dict()["overall"]
    assert info["mean_reward_weight"] == 0.5 and info["unscored_environments"] == ["broken"]
    assert info["num_unopened"] == 2


def test_cli_indices_probe_sessions_are_the_tool_discovery(ref_server, fake_openai, capsys) -> None:
    """`eval --indices 0,3` opens one session per listed task before the episodes: the spec's tool discovery (each
    task's own tools bound, as training with that selection binds them), said in `--help`; with `--per-task-tools`
    each episode binds its own session's tools and no probe session is opened. Counted at the server (its creates)."""
    from ors_trl.testing.faults import FaultProxy

    base = ["eval", "--env-name", SPARSE, "--base-url", fake_openai.url, "--model", "m", "--indices", "0,3",
            "--no-progress", "--json"]
    with FaultProxy(ref_server.url) as proxy:
        assert main([base[0], proxy.url, *base[1:]]) == 0
        probed = proxy.count("/create")
        assert main([base[0], proxy.url, *base[1:], "--per-task-tools"]) == 0
        per_task = proxy.count("/create") - probed
    out, decoder, reports = capsys.readouterr().out.strip(), json.JSONDecoder(), []
    while out:
        report, end = decoder.raw_decode(out)
        reports.append(report)
        out = out[end:].strip()
    assert [(r["num_episodes"], r["mean_reward"]) for r in reports] == [(2, 1.0), (2, 1.0)]
    assert (probed, per_task) == (4, 2)  # 2 probes + 2 episodes, then the 2 episodes alone
    assert main(["eval", "--help"]) == 0
    assert "one session per distinct listed task" in " ".join(capsys.readouterr().out.split())
