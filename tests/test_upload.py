"""Uploads to the OpenReward rollout viewer, through the `openreward` SDK's rollout API, against a loopback server
that records what the SDK sends: every episode of an evaluation and of training, with the run's metadata; refused,
unreachable and overflowing uploads counted and never failing the run; the key sent only as the SDK's header."""

from __future__ import annotations

import json
import logging
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from ors_trl import MissingAPIKeyError, OpenRewardSpec, PolicyReply, __version__
from ors_trl.cli import EXIT_OK, EXIT_USAGE, main
from ors_trl.protocol.upload import RolloutUploader
from ors_trl.testing.server import free_port

pytest.importorskip("openreward")
ECHO = "echoenvironment"
KEY = "or-test-key-" + "9" * 24
pytestmark = pytest.mark.usefixtures("no_leaked_sessions")


class Platform:
    """`POST /v1/rollouts` on 127.0.0.1: records each request's headers and events, answers `status`."""

    def __init__(self, status: int = 200, delay: float = 0.0) -> None:
        self.status, self.delay = status, delay
        self.requests: list[tuple[str, dict[str, str], Any]] = []
        platform = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
                platform.requests.append((self.path, dict(self.headers), body))
                time.sleep(platform.delay)
                data = b'{"ok": true}' if platform.status == 200 else b'{"error": "no"}'
                self.send_response(platform.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def events(self) -> list[dict[str, Any]]:
        return [e for path, _, body in self.requests if path == "/v1/rollouts" for e in body["events"]]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def platform(monkeypatch):
    server = Platform()
    monkeypatch.setenv("OPENREWARD_API_URL", server.url)
    monkeypatch.setenv("OPENREWARD_API_KEY", KEY)
    yield server
    server.close()


class EchoPolicy:
    description = "scripted-echo"

    async def respond(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> PolicyReply:
        if messages[-1]["role"] == "tool":
            return PolicyReply(content="Done.")
        word = re.search(r'exactly this text: "([^"]+)"', messages[-1]["content"]).group(1)
        return PolicyReply(content="", tool_calls=[{"id": "c0", "name": "echo", "arguments": {"text": word}}])


def by_rollout(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The started event of each rollout with its messages (in order) and its updates."""
    out = {e["eventId"]: {**e, "messages": [], "updates": []} for e in events if e["eventType"] == "rollout"}
    for e in events:
        if e["eventType"] == "message":
            out[e["rolloutEventId"]]["messages"].append(e)
        elif e["eventType"] == "rollout_update":
            out[e["eventId"]]["updates"].append(e)
    for rollout in out.values():
        rollout["messages"].sort(key=lambda m: m["index"])
    return out


def test_evaluation_uploads_every_episode_with_its_run(ref_server, platform, caplog, capsys) -> None:
    spec = OpenRewardSpec(ref_server.url, env_name=ECHO)
    with caplog.at_level(logging.DEBUG, logger="ors_trl"):
        report = spec.evaluate(EchoPolicy(), num_tasks=2, upload="my-eval", progress=False)
    assert report.uploads == {"sent": 2, "failed": 0, "dropped": 0}
    assert all(headers.get("x-api-key") == KEY for _, headers, _ in platform.requests)
    rollouts = by_rollout(platform.events())
    assert len(rollouts) == 2
    words = {"hello", "world"}
    for rollout in rollouts.values():
        assert rollout["runName"] == "my-eval" and rollout["environment"] == ECHO and rollout["split"] == "train"
        assert rollout["run_info"] == {"model_name": "scripted-echo", "run_type": "eval", "framework": "ors-trl",
                                       "framework_version": __version__}
        assert rollout["metadata"]["source"] == "eval" and rollout["metadata"]["reward"] == 1.0
        types = [m["type"] for m in rollout["messages"]]
        assert types == ["user_message", "tool_call", "tool_result", "assistant_message"]
        prompt, call, result, done = rollout["messages"]
        word = json.loads(call["content"])["text"]
        assert word in prompt["content"] and call["name"] == "echo" and call["callId"] == result["callId"] == "c0"
        assert result["content"] == word and result["reward"] == 1.0 and result["isFinished"] is True
        assert done["content"] == "Done." and done["reward"] == 1.0 and done["isFinished"] is True
        (update,) = rollout["updates"]
        assert update["rollout_info"]["harness"] == "ors-trl" and update["rollout_info"]["task_index"] in (0, 1)
        words.discard(word)
    assert not words
    assert "uploaded              2 sent, 0 failed, 0 dropped" in report.summary()
    printed = capsys.readouterr()
    assert KEY not in caplog.text + printed.out + printed.err + repr(spec) + report.summary()
    spec.close()


def test_training_uploads_and_failures_never_fail_a_step(ref_server, platform, caplog, capsys) -> None:
    spec = OpenRewardSpec(ref_server.url, env_name=ECHO, num_tasks=2, upload_rollouts=True)
    words = [t["target"] for t in spec.run(spec.client.tasks("train"))[:2]]
    envs = [spec.environment_factory() for _ in range(2)]
    for i, env in enumerate(envs):
        env.reset(task_index=i)
        env.echo(text=words[i] if i == 0 else "wrong")
    assert spec.reward_funcs(envs) == [1.0, 0.0]
    spec.close()  # every episode closed, its upload sent
    assert spec.runtime.uploads.counts() == {"sent": 2, "failed": 0, "dropped": 0}
    rollouts = list(by_rollout(platform.events()).values())
    assert sorted(r["metadata"]["reward"] for r in rollouts) == [0.0, 1.0]
    assert all(r["run_info"]["run_type"] == "train" and r["run_info"]["training_stage"] == "rl"
               and r["run_info"]["framework"] == "ors-trl" and r["metadata"]["source"] == "trl" for r in rollouts)
    assert all(r["runName"].startswith("ors-trl-") for r in rollouts)

    # the platform refuses: the episodes are counted as failed, said once, and the evaluation stands
    platform.status = 403
    with caplog.at_level(logging.WARNING, logger="ors_trl"):
        report = spec.evaluate(EchoPolicy(), num_tasks=2, upload=True, progress=False)
    assert report.mean_reward == 1.0 and report.uploads == {"sent": 0, "failed": 2, "dropped": 0}
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rollout upload:")]
    assert len(warned) == 1 and "did not accept the rollout" in warned[0]
    printed = capsys.readouterr()
    assert KEY not in caplog.text + printed.out + printed.err
    spec.close()


def test_uploads_are_bounded_and_the_sdk_is_optional(platform, monkeypatch) -> None:
    slow = Platform(delay=0.5)  # every request takes a while: the queue fills, the rest is dropped, never waited for
    monkeypatch.setenv("OPENREWARD_API_URL", slow.url)
    uploader = RolloutUploader(max_pending=2, workers=1)
    record = {"environment": ECHO, "split": "train", "task_index": 0, "prompt": "p", "turns": [], "reward": 1.0}
    for _ in range(10):
        uploader.submit(record)
    uploader.close(timeout=30)
    counts = uploader.counts()
    assert counts["dropped"] >= 6 and counts["sent"] + counts["dropped"] == 10 and counts["failed"] == 0
    slow.close()

    monkeypatch.setitem(sys.modules, "openreward.api.rollouts", None)  # as if the SDK were not installed
    uploader = RolloutUploader()
    uploader.submit(record)
    uploader.close(timeout=30)
    assert uploader.counts() == {"sent": 0, "failed": 1, "dropped": 0}


def test_a_missing_key_is_a_clear_usage_error(ref_server, fake_openai_url, monkeypatch, capsys) -> None:
    monkeypatch.delenv("OPENREWARD_API_KEY", raising=False)
    with pytest.raises(MissingAPIKeyError, match="OPENREWARD_API_KEY"):
        OpenRewardSpec(ref_server.url, env_name=ECHO, upload_rollouts=True)
    assert main(["eval", ref_server.url, "--env-name", ECHO, "--base-url", fake_openai_url, "--model", "m",
                 "--num-tasks", "1", "--no-progress", "--upload"]) == EXIT_USAGE
    assert "needs an API key" in capsys.readouterr().err
    monkeypatch.setenv("OPENREWARD_API_KEY", KEY)
    platform = Platform()
    monkeypatch.setenv("OPENREWARD_API_URL", platform.url)
    assert main(["eval", ref_server.url, "--env-name", ECHO, "--base-url", fake_openai_url, "--model", "m",
                 "--num-tasks", "1", "--no-progress", "--upload"]) == EXIT_OK
    out = capsys.readouterr()
    assert "uploaded              1 sent, 0 failed, 0 dropped" in out.out and KEY not in out.out + out.err
    assert len(by_rollout(platform.events())) == 1
    platform.close()


@pytest.fixture
def fake_openai_url():
    from tests.test_eval import FakeOpenAI

    server = FakeOpenAI().start()
    yield server.url
    server.stop()


def test_a_local_model_is_uploaded_with_its_name_and_size(ref_server, platform, tiny_model_dir) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ors_trl import LocalPolicy

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    done = tok.encode("Done.<|im_end|>", add_special_tokens=False)
    model.generate = lambda input_ids, **kwargs: torch.tensor([ids + done for ids in input_ids.tolist()])
    report = OpenRewardSpec(ref_server.url, env_name=ECHO).evaluate(LocalPolicy(model, tok, name="tiny"), num_tasks=1,
                                                                    upload=True, progress=False)
    assert report.uploads == {"sent": 1, "failed": 0, "dropped": 0}
    (rollout,) = by_rollout(platform.events()).values()
    assert rollout["run_info"]["model_name"] == "tiny"
    assert rollout["run_info"]["model_params"] == sum(p.numel() for p in model.parameters()) > 0
