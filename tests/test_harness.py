"""Agent harnesses that own their loop (`ors_trl.harness`, issue 35): an unmodified third-party agent library (the
OpenAI Agents SDK) plays ORS episodes through the loopback MCP endpoint and the chat-completions endpoint backed by a
scripted ors-trl generator; the training rows are the generator's ids exactly, per-episode tokens keep episodes
apart, and GRPOTrainer trains through a harness."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import re
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ors_trl import OpenRewardSpec
from ors_trl.core.episode import Rules, Task
from ors_trl.harness import Harness, HarnessConversation, build_rows
from tests.fixtures.generation import (
    cpu_grpo_trainer,
    replace_generation,
    run_batch,
    tool_call_text,
    trl_chain_rows,
    trl_generation,
    trl_tokenizer,
)

agents = pytest.importorskip("agents")  # the `harness` extra
pytest.importorskip("torch")
from agents import (  # noqa: E402
    Agent,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    set_tracing_disabled,
)
from agents.mcp import MCPServerStreamableHttp  # noqa: E402
from openai import AsyncOpenAI  # noqa: E402

from ors_trl.evaluation.policies import LocalPolicy  # noqa: E402

set_tracing_disabled(True)  # nothing leaves loopback
_TARGET = re.compile(r'exactly this text: "([^"]+)"')


class Scripted(LocalPolicy):
    """A token generator with a script for a model: echo the target, then "Done."; `produced` maps each prompt's ids
    to the ids generated for it (the ground truth the rows are checked against)."""

    def __init__(self, tokenizer) -> None:
        super().__init__(None, tokenizer, name="scripted")
        self.produced: dict[tuple[int, ...], list[int]] = {}

    def script(self, text: str) -> str:
        done = "<tool_response>" in text or "Summarise" in text
        return "Done." if done else tool_call_text("echo", {"text": _TARGET.findall(text)[0]})

    def _generate_ids(self, tokens):
        out = []
        for t in tokens:
            ids = self.tokenizer.encode(self.script(self.tokenizer.decode(t.ids)) + "<|im_end|>", add_special_tokens=False)
            self.produced[tuple(t.ids)] = ids
            out.append((ids, [-0.5] * len(ids)))
        return out


def agents_sdk(rewrite: bool = False, responses: bool = False, streamed: bool = False):
    """An OpenAI Agents SDK program, unmodified: the policy as its chat-completions model (`responses`: its Responses
    model), the episode's tools over MCP. `rewrite`: afterwards it starts over from a summary of its own (a history
    rewrite: the next call forks). `streamed`: the SDK's streamed run (server-sent chunks)."""

    async def run(ep) -> str | None:
        client = AsyncOpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        headers = {"Authorization": f"Bearer {ep.mcp_token}"}
        kind = OpenAIResponsesModel if responses else OpenAIChatCompletionsModel
        async with MCPServerStreamableHttp(params={"url": ep.mcp_url, "headers": headers}) as mcp:
            agent = Agent(name="ors", instructions=ep.system or "Use the tools.", mcp_servers=[mcp],
                          model=kind(model="policy", openai_client=client))
            if streamed:
                result = Runner.run_streamed(agent, ep.prompt, max_turns=6)
                async for _ in result.stream_events():
                    pass
            else:
                result = await Runner.run(agent, ep.prompt, max_turns=6)
            if rewrite:
                await Runner.run(agent, "Summarise what you did in one word.", max_turns=2)
        return result.final_output

    return run


#: A command-line agent on the standard library alone: the endpoints reach it as environment variables.
COMMAND_AGENT = textwrap.dedent("""
        import json, os, urllib.request
        def post(url, body, token):
            req = urllib.request.Request(url, json.dumps(body).encode(), {"Authorization": "Bearer " + token,
                                         "Content-Type": "application/json"})
            return json.load(urllib.request.urlopen(req))
        key, mcp, tok = os.environ["OPENAI_API_KEY"], os.environ["ORS_MCP_URL"], os.environ["ORS_MCP_TOKEN"]
        tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                  "parameters": t["inputSchema"]}}
                 for t in post(mcp, {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}, tok)["result"]["tools"]]
        messages = json.loads(os.environ["ORS_MESSAGES"])
        while True:
            reply = post(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
                         {"model": "policy", "messages": messages, "tools": tools}, key)["choices"][0]["message"]
            messages.append(reply)
            if not reply.get("tool_calls"):
                print(reply["content"])
                break
            for c in reply["tool_calls"]:
                out = post(mcp, {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
                    "name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}, tok)
                messages.append({"role": "tool", "tool_call_id": c["id"],
                                 "content": out["result"]["content"][0]["text"]})
""")


@pytest.fixture
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def echo_spec(ref_server):
    spec = OpenRewardSpec(ref_server.url, env_name="echoenvironment")
    _ = spec.environment_factory  # binds the tools, as rollout_func and evaluate do
    yield spec
    spec.close()


def _episodes(spec, indices):
    return [spec._runtime.episode(Task("train", i), source="test", rules=Rules(max_replies=6)) for i in indices]


async def _seated(harness, episode, generator):
    """A test that drives the endpoints by hand: the episode opened and seated, the generator started; its URL, seat
    and conversation (`_unseat` ends it)."""
    holder = HarnessConversation(episode)
    await episode.open()
    url = await harness.server.start()
    seat = harness.server.seat(episode, generator)
    generator.start(holder)
    return url, seat, holder


def _unseat(harness, seat, generator, holder) -> None:
    generator.finish(holder)
    harness.server.revoke(seat)


def test_an_agent_library_plays_episodes_token_exactly(echo_spec, ref_server, tokenizer):
    generator, harness = Scripted(tokenizer), Harness(agents_sdk(rewrite=True))
    before = ref_server.stats()["tool_calls"].get("echoenvironment/echo", 0)
    episodes = _episodes(echo_spec, [0, 1])

    async def both():
        return await asyncio.gather(*(harness.play(ep, generator) for ep in episodes))

    conversations = echo_spec.run(both())
    for ep, conversation in zip(episodes, conversations, strict=True):
        calls, rows = conversation.calls, conversation.rows
        # three model calls: the tool call and the answer merge into one row (the prefix holds); the rewritten
        # history forks a second row
        assert [(c.joined, c.row) for c in calls] == [(False, 0), (True, 0), (False, 1)]
        assert len(rows) == 2 and conversation.state is rows[1]
        mismatches = 0
        for i, row in enumerate(rows):
            mine = [c for c in calls if c.row == i]
            assert row.prompt_ids == mine[0].prompt_ids
            generated = [t for t, m in zip(row.completion_ids, row.mask, strict=True) if m]
            truth = [t for c in mine for t in generator.produced[tuple(c.prompt_ids)]]
            mismatches += sum(a != b for a, b in zip(generated, truth, strict=True))
            assert len(generated) == len(truth)
            for c in mine:  # every call's prompt and completion lie in its row exactly
                assert (row.prompt_ids + row.completion_ids)[: len(c.prompt_ids) + len(c.completion_ids)] == \
                    c.prompt_ids + c.completion_ids
            assert [lp for lp, m in zip(row.logprobs, row.mask, strict=True) if m] == [-0.5] * len(truth)
        assert mismatches == 0
        # the tool result between the two calls is context, masked out of the loss
        masked = tokenizer.decode([t for t, m in zip(rows[0].completion_ids, rows[0].mask, strict=True) if not m])
        assert "<tool_response>" in masked and ep.task.key and rows[0].mask.count(0) > 0
        assert ep.reward == 1.0 and ep.finished  # the environment's reward, through its own tool
        assert ep.info["harness"] == {"model_calls": 3, "trained_calls": 3, "rows": 2, "joined_calls": 1}
        # the record shows the model calls and the tool call in order
        assert [(t["assistant"], [c["name"] for c in t["tool_calls"]]) for t in ep.turns] == \
            [("", ["echo"]), ("Done.", []), ("Done.", [])]
        # the rows TRL's asynchronous harness worker builds from the same calls, losslessly, are these
        trl_rows = trl_chain_rows([(c.prompt_ids, c.completion_ids, c.logprobs) for c in calls])
        assert trl_rows == [(r.prompt_ids + r.completion_ids, [0] * len(r.prompt_ids) + r.mask,
                             [0.0] * len(r.prompt_ids) + r.logprobs) for r in rows]
    # a hook drops the auxiliary call: one row, the one that holds the episode
    calls = conversations[0].calls
    assert len(build_rows(calls, train=lambda c: c.index < 2)) == 1 and calls[2].row is None
    assert ref_server.stats()["tool_calls"]["echoenvironment/echo"] - before == 2
    for ep in episodes:
        ep.release()
    echo_spec.close()
    assert ref_server.stats()["open_sessions"] == 0
    assert harness.server.seats == {}  # every token revoked


@pytest.mark.parametrize("dialect", ["responses", "streamed"])
def test_the_responses_api_and_streaming_join_as_chat_completions_do(echo_spec, ref_server, tokenizer, dialect):
    generator, harness = Scripted(tokenizer), Harness(agents_sdk(**{dialect: True}))
    (episode,) = _episodes(echo_spec, [3])
    conversation = echo_spec.run(harness.play(episode, generator))
    calls = conversation.calls
    assert [(c.joined, c.row) for c in calls] == [(False, 0), (True, 0)] and len(conversation.rows) == 1
    row = conversation.rows[0]
    generated = [t for t, m in zip(row.completion_ids, row.mask, strict=True) if m]
    assert generated == [t for c in calls for t in generator.produced[tuple(c.prompt_ids)]]
    assert episode.reward == 1.0 and episode.final_message == "Done."
    episode.release()
    echo_spec.run(harness.aclose())


def test_a_wrong_token_reaches_nothing(echo_spec, ref_server, tokenizer):
    import aiohttp

    generator, harness = Scripted(tokenizer), Harness(agents_sdk())
    episode, other = _episodes(echo_spec, [0, 1])
    call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "echo", "arguments": {"text": "hello"}}}
    chat = {"model": "policy", "messages": [{"role": "user", "content": 'exactly this text: "hello"'}]}

    async def probe():
        await episode.open()
        await other.open()
        url = await harness.server.start()
        seat, theirs = harness.server.seat(episode, generator), harness.server.seat(other, generator)
        revoked = harness.server.seat(other, generator)
        harness.server.revoke(revoked)
        statuses = []
        async with aiohttp.ClientSession() as http:
            for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": f"Bearer {revoked.token}"},
                            {"Authorization": f"Basic {seat.token}"},
                            {"Authorization": f"Bearer {seat.token}", "Origin": "http://evil.example"}):
                for path, body in (("/mcp", call), ("/v1/chat/completions", chat)):
                    async with http.post(url + path, json=body, headers=headers) as r:
                        statuses.append(r.status)
            counted = ref_server.stats()["tool_calls"].get("echoenvironment/echo", 0)
            async with http.post(url + "/mcp", json=call, headers={"Authorization": f"Bearer {seat.token}"}) as r:
                ok = await r.json()
        return statuses, counted, ok, seat, theirs

    before = ref_server.stats()["tool_calls"].get("echoenvironment/echo", 0)
    statuses, counted, ok, seat, theirs = echo_spec.run(probe())
    assert statuses == [401] * 8 + [403] * 2 and harness.server.refused == 10
    assert counted == before and generator.produced == {}  # nothing ran: no tool call, no generation
    assert other.tool_calls == 0 and other.turns == []
    # the right token runs exactly one call, on its own episode only
    assert ok["result"] == {"content": [{"type": "text", "text": "hello"}], "isError": False}
    assert episode.tool_calls == 1 and other.tool_calls == 0
    assert ref_server.stats()["tool_calls"]["echoenvironment/echo"] == before + 1
    assert seat.token not in repr(seat) and seat.token != theirs.token and len(seat.token) >= 40
    for ep in (episode, other):
        ep.release()
    echo_spec.run(harness.aclose())


def test_evaluate_with_a_harness_callable_and_command(echo_spec, ref_server, tokenizer, tmp_path):
    out = tmp_path / "episodes.jsonl"
    report = echo_spec.evaluate(Scripted(tokenizer), harness=Harness(agents_sdk()), num_tasks=2, progress=False,
                                output=out)
    assert report.mean_reward == 1.0 and report.num_episodes == 2
    assert all(r["harness"]["model_calls"] == 2 and r["turns"][0]["tool_calls"][0]["status"] == "ok"
               for r in report.episodes)
    # the report page shows a harness episode as any other: each model call a turn, with the tool calls it made
    from ors_trl.cli import EXIT_OK, main

    page = tmp_path / "report.html"
    assert main(["report", str(out), "-o", str(page)]) == EXIT_OK
    html = page.read_text()
    assert '"tool_calls":[{"id":null,"name":"echo"' in html  # the episode bodies, embedded in order
    assert html.index('"name":"echo"') < html.index('"assistant":"Done."')
    # a command line: the endpoints reach it as environment variables; its output is the final answer
    script = tmp_path / "agent.py"
    script.write_text(COMMAND_AGENT)
    scored = Harness([sys.executable, str(script)], score=lambda ep, calls: 0.25 * len(calls))
    report = echo_spec.evaluate(Scripted(tokenizer), harness=scored, num_tasks=2, progress=False)
    assert report.mean_reward == 0.5  # the score hook: two model calls each
    assert all(r["env_reward"] == 1.0 and r["final"]["message"] == "Done." and r["harness"]["joined_calls"] == 1
               for r in report.episodes)
    failing = Harness([sys.executable, "-c", "raise SystemExit(3)"])
    report = echo_spec.evaluate(Scripted(tokenizer), harness=failing, num_tasks=1, progress=False)
    assert report.episodes[0]["end_reason"] == "error" and "status 3" in report.episodes[0]["error"]["message"]
    echo_spec.close()
    assert ref_server.stats()["open_sessions"] == 0


def test_grpo_trains_through_a_harness(tiny_model_dir, echo_spec, ref_server, tmp_path):
    harness = Harness(agents_sdk())
    trainer = cpu_grpo_trainer(tiny_model_dir, str(tmp_path / "h"), spec=echo_spec, mode="engine", batch=4,
                               rollout_func=harness.rollout_func(echo_spec), completion_length=128)
    tok = trl_tokenizer(trainer)
    produced: dict[tuple[int, ...], list[int]] = {}

    def generate(prompt_ids, images, mm, num_generations, has_tool_images=False):
        out = []
        for ids in prompt_ids:
            text = tok.decode(ids)
            body = "Done." if "<tool_response>" in text else tool_call_text("echo", {"text": _TARGET.findall(text)[0]})
            produced[tuple(ids)] = tok.encode(body + "<|im_end|>", add_special_tokens=False)
            out.append(list(produced[tuple(ids)]))
        return out, None

    real = trl_generation(trainer)
    replace_generation(trainer, generate)
    rows = [copy.deepcopy(echo_spec.train_dataset[i]) for i in (0, 1) for _ in range(2)]
    result = run_batch(trainer, rows)
    assert result["rewards"] == [1.0] * 4
    for prompt, completion, mask in zip(result["prompts"], result["completions"], result["tool_mask"], strict=True):
        ids = prompt + completion
        truth = [t for key, gen in produced.items() if ids[: len(key)] == list(key) for t in gen]
        assert [t for t, m in zip(completion, mask, strict=True) if m] == truth  # 0 mismatches, tools masked
        assert "<tool_response>" in tok.decode([t for t, m in zip(completion, mask, strict=True) if not m])
    # a real step with the tiny model generating: the harness's episodes count in env/<name>/ like native ones
    replace_generation(trainer, real)
    trainer.train()
    logged = {k for entry in trainer.state.log_history for k in entry}
    assert "env/echoenvironment/episodes" in logged
    echo_spec.close()
    assert ref_server.stats()["open_sessions"] == 0


def test_a_hostile_harness_gets_typed_answers_and_runs_nothing(echo_spec, ref_server, tokenizer):
    """A harness is untrusted input too: malformed requests are answered 400 / JSON-RPC errors, never a 500, and run
    nothing on the server; the episode goes on."""
    import aiohttp

    generator, harness = Scripted(tokenizer), Harness(agents_sdk())
    (episode,) = _episodes(echo_spec, [0])

    async def probe():
        await episode.open()
        url = await harness.server.start()
        seat = harness.server.seat(episode, generator)
        generator.start(HarnessConversation(episode))  # as `Harness.play` does: the generator serves it
        auth = {"Authorization": f"Bearer {seat.token}"}
        chat, mcp = url + "/v1/chat/completions", url + "/mcp"
        out = []
        async with aiohttp.ClientSession(headers=auth) as http:
            for path, data in ((chat, b"{not json"), (mcp, b"{not json"), (chat, b"[1, 2]"), (mcp, b"[1, 2]")):
                async with http.post(path, data=data, headers={"Content-Type": "application/json"}) as r:
                    out.append(r.status)
            for body in ({"messages": "hi"}, {"messages": []}, {"messages": [{"content": "no role"}]},
                         {"messages": [{"role": "assistant", "tool_calls": "echo"}]},
                         {"messages": [{"role": "user", "content": "hi"}], "stream": True},
                         {"messages": [{"role": "user", "content": "hi"}], "n": 3},
                         {"messages": [{"role": "user", "content": "hi"}], "tools": [{"function": 7}]}):
                async with http.post(chat, json=body) as r:
                    out.append(r.status)
            async with http.get(mcp) as r:
                out.append(r.status)
            rpc = []
            for message in ({"jsonrpc": "2.0", "id": 1, "method": "resources/list"},
                            {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"arguments": {}}},
                            {"jsonrpc": "2.0", "id": 3, "method": "tools/call",
                             "params": {"name": "echo", "arguments": ["hello"]}},
                            {"jsonrpc": "2.0", "id": 4, "method": "tools/call",
                             "params": {"name": "rm_rf", "arguments": {}}}):
                async with http.post(mcp, json=message) as r:
                    rpc.append((r.status, await r.json()))
            async with http.post(mcp, json={"jsonrpc": "2.0", "method": "notifications/initialized"}) as r:
                out.append(r.status)
        harness.server.revoke(seat)
        generator.finish(HarnessConversation(episode))
        return out, rpc

    before = ref_server.stats()["tool_calls"].get("echoenvironment/echo", 0)
    statuses, rpc = echo_spec.run(probe())
    assert statuses == [400] * 4 + [400] * 7 + [405, 202], statuses
    assert [r[1]["error"]["code"] for r in rpc[:2]] == [-32601, -32602]
    # calls the binding refuses reach the episode's record as refusals, with TRL's own messages; none ran remotely
    refused = [r[1]["result"] for r in rpc[2:]]
    assert all(r["isError"] for r in refused) and "Tool rm_rf not found." in refused[1]["content"][0]["text"]
    assert ref_server.stats()["tool_calls"].get("echoenvironment/echo", 0) == before
    assert episode.tool_failures == 2 and not episode.over
    episode.release()
    echo_spec.run(harness.aclose())


def test_cli_eval_runs_a_command_harness(ref_server, tiny_model_dir, tmp_path):
    from ors_trl.cli import EXIT_OK, main

    script, out = tmp_path / "agent.py", tmp_path / "episodes.jsonl"
    script.write_text(COMMAND_AGENT)
    code = main(["eval", ref_server.url, "--env-name", "echoenvironment", "--model", tiny_model_dir, "--num-tasks", "2",
                 "--max-new-tokens", "16", "--harness", f"{sys.executable} {script}", "--output", str(out),
                 "--no-progress"])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert code == EXIT_OK and len(records) == 2
    assert all(r["harness"]["model_calls"] >= 1 and r["source"] == "eval" for r in records)
    assert ref_server.stats()["open_sessions"] == 0


def test_a_message_level_policy_serves_a_harness_without_ids(echo_spec, ref_server):
    """A policy with only `respond(messages, tools)` (an endpoint's) answers the harness's calls: the episode plays
    and is scored, and there are no ids, so no rows."""
    from ors_trl import PolicyReply

    seen: list[list[dict]] = []

    class Talker:
        async def respond(self, messages, tools):
            seen.append(messages)
            if any(m["role"] == "tool" for m in messages):
                return PolicyReply("Done.")
            target = _TARGET.findall(" ".join(str(m["content"]) for m in messages))[0]
            return PolicyReply("", [{"name": "echo", "arguments": {"text": target}}])

    report = echo_spec.evaluate(Talker(), harness=Harness(agents_sdk()), num_tasks=1, progress=False)
    assert report.mean_reward == 1.0
    assert report.episodes[0]["harness"] == {"model_calls": 2, "trained_calls": 0, "rows": 0, "joined_calls": 1}
    assert [m["role"] for m in seen[1]][-2:] == ["assistant", "tool"]  # the joined conversation, as a whole


def test_a_retried_call_racing_the_first_forks_and_every_row_stays_exact(echo_spec, ref_server, tokenizer):
    """A harness that resends a call while the first is still generating (a client retry): the two never share a
    conversation, so neither row holds the other's tokens."""
    import aiohttp

    generator, harness = Scripted(tokenizer), Harness(agents_sdk())
    (episode,) = _episodes(echo_spec, [0])

    async def race():
        url, seat, holder = await _seated(harness, episode, generator)
        auth = {"Authorization": f"Bearer {seat.token}"}
        messages = episode.prompt.chat([])
        tools = episode.toolset.schemas
        async with aiohttp.ClientSession(headers=auth) as http:
            async def ask(msgs):
                async with http.post(url + "/v1/chat/completions", json={"messages": msgs, "tools": tools}) as r:
                    return (await r.json())["choices"][0]["message"]

            first = await ask(messages)
            call = first["tool_calls"][0]
            follow = [*messages, first, {"role": "tool", "tool_call_id": call["id"], "content": "hello"}]
            await asyncio.gather(ask(follow), ask(follow))
        _unseat(harness, seat, generator, holder)
        return seat.calls

    calls = echo_spec.run(race())
    assert sorted(c.joined for c in calls) == [False, False, True]
    rows = build_rows(calls)
    for i, row in enumerate(rows):
        generated = [t for t, m in zip(row.completion_ids, row.mask, strict=True) if m]
        assert generated == [t for c in calls if c.row == i for t in generator.produced[tuple(c.prompt_ids)]]
    episode.release()
    echo_spec.run(harness.aclose())


def test_the_reply_limit_holds_for_a_harness(echo_spec, ref_server, tokenizer):
    """The turn rule is the core's on every path: past `max_replies` the reply's calls are not run (the episode ends
    `max_turns`), the harness's later tool call is refused, and its next model call reads that the episode ended."""
    generator, harness = Scripted(tokenizer), Harness(agents_sdk())
    episode = echo_spec._runtime.episode(Task("train", 0), source="test", rules=Rules(max_replies=1))
    before = ref_server.stats()["tool_calls"].get("echoenvironment/echo", 0)
    conversation = echo_spec.run(harness.play(episode, generator))
    assert episode.end_reason == "max_turns" and episode.reward is None
    assert [c["status"] for c in episode.turns[0]["tool_calls"]] == ["not_run", "refused"]
    assert ref_server.stats()["tool_calls"].get("echoenvironment/echo", 0) == before
    assert len(conversation.calls) == 1  # the call after the end generated nothing and is not a model call
    episode.release()
    echo_spec.run(harness.aclose())


def test_a_generator_that_cannot_start_leaves_no_live_token(echo_spec, tokenizer):
    """A generator whose `start` raises (a worker thread that cannot start) fails `play` before any seat is given
    out: no token the harness was never told of stays live on the server."""

    class Unstartable(Scripted):
        def start(self, conversation) -> None:
            raise RuntimeError("can't start new thread")

    harness = Harness(agents_sdk())
    episode = echo_spec._runtime.episode(Task("train", 0), source="test", rules=Rules(max_replies=2))
    with pytest.raises(RuntimeError, match="new thread"):
        echo_spec.run(harness.play(episode, Unstartable(tokenizer)))
    assert harness.server.seats == {}
    episode.release()
    echo_spec.run(harness.aclose())


class Looker(Scripted):
    """The script of `AgentRunEnvironment`'s agent: `look`, then `say` what it showed, then "Done."."""

    generated = 0  # calls answered

    def script(self, text: str) -> str:
        self.generated += 1
        seen = re.findall(r"<tool_response>\s*(.*?)\s*</tool_response>", text, re.S)
        return tool_call_text("say", {"text": seen[0]}) if len(seen) == 1 else "Done." if seen else \
            tool_call_text("look", {})


def test_the_environment_runs_the_agent_through_the_capture_endpoint(make_server, tokenizer, caplog):
    """An environment that runs its agent itself (as a platform sandbox does): each session opens with env_overrides
    naming its episode's endpoint and key, one tool call runs the agent; the rows are the generator's ids exactly, the
    reward is the environment's, a spoiled key gets 401 and generates nothing, the key is in no record, log or repr,
    and every session closes."""
    import logging

    from ors_trl import ConfigurationError
    from ors_trl.harness import HarnessServer
    from ors_trl.testing import free_port

    server = make_server("agentrun")
    spec = OpenRewardSpec(server.url, env_name="agentrunenvironment")
    _ = spec.environment_factory
    port = free_port()  # the endpoint as the environment is told to reach it (a tunnel's or a routable address)
    generator = Looker(tokenizer)
    harness = Harness.in_environment("run_agent", server=HarnessServer(port=port, public_url=f"http://localhost:{port}/"))
    seats, seat = [], harness.server.seat
    harness.server.seat = lambda *a: seats.append(seat(*a)) or seats[-1]
    spoiled = {"id": "spoiled", "secret": "quartz", "key_suffix": "x"}
    episodes = [spec._runtime.episode(task, source="test", rules=Rules(max_replies=6))
                for task in (Task("train", 0), Task("train", 1), Task("train", spec=spoiled))]

    async def play():
        return await asyncio.gather(*(harness.play(ep, generator) for ep in episodes))

    with caplog.at_level(logging.DEBUG):
        conversations = spec.run(play())
    assert harness.server.url == f"http://localhost:{port}"
    for ep, conversation in zip(episodes[:2], conversations[:2], strict=True):
        calls, rows = conversation.calls, conversation.rows
        # look, say, answer: each call sends back what it had, so all three join one row
        assert [(c.joined, c.row) for c in calls] == [(False, 0), (True, 0), (True, 0)] and len(rows) == 1
        generated = [t for t, m in zip(rows[0].completion_ids, rows[0].mask, strict=True) if m]
        truth = [t for c in calls for t in generator.produced[tuple(c.prompt_ids)]]
        assert len(generated) == len(truth) and sum(a != b for a, b in zip(generated, truth, strict=True)) == 0
        assert "<tool_response>" in tokenizer.decode([t for t, m in zip(rows[0].completion_ids, rows[0].mask,
                                                                         strict=True) if not m])
        assert ep.reward == 1.0 and ep.end_reason == "finished"  # the environment's reward, from its own agent run
        trigger = ep.turns[0]["tool_calls"]
        assert [(c["name"], c["status"], c["reward"]) for c in trigger] == [("run_agent", "ok", 1.0)]
        assert [t["assistant"] for t in ep.turns[1:]] == ["", "", "Done."]
        assert ep.info["harness"] == {"model_calls": 3, "trained_calls": 3, "rows": 1, "joined_calls": 2}
    # the spoiled key: 401 at the endpoint, nothing generated for it, the environment scores its agent's failure
    bad = episodes[2]
    assert conversations[2].calls == [] and generator.generated == 6 and harness.server.refused == 1
    assert bad.reward == 0.0 and "model call: 401" in bad.turns[0]["tool_calls"][0]["output"]
    # the keys reached the environment (its agent logged them) and went no further: masked, then forgotten
    assert all("OPENAI_API_KEY=***" in ep.turns[0]["tool_calls"][0]["output"] for ep in episodes)
    shown = json.dumps([ep.record() for ep in episodes], default=str) + caplog.text + repr(harness) + repr(seats)
    assert len(seats) == 3 and not any(s.token in shown for s in seats)
    for ep in episodes:
        ep.release()
    # evaluation plays it the same way (and training: the engine plays through `Harness.play` as here)
    report = spec.evaluate(Looker(tokenizer), harness=Harness.in_environment(), num_tasks=2, progress=False)
    assert report.mean_reward == 1.0 and [r["harness"]["rows"] for r in report.episodes] == [1, 1]
    spec.close()
    assert server.stats()["open_sessions"] == 0 and server.stats()["tool_calls"]["agentrunenvironment/run_agent"] == 5
    assert harness.server.seats == {} and spec.client._transport.decoder._secrets == ()
    with pytest.raises(ConfigurationError, match="tool name"):
        Harness.in_environment("", {"a": 1})


class Operator(Scripted):
    """The script with the harness's own tool first: `bash` (the codex toolset's), then echo the target, then done."""

    def script(self, text: str) -> str:
        seen = text.count("<tool_response>")
        if seen > 1:
            return "Done."
        return tool_call_text("echo", {"text": _TARGET.findall(text)[0]}) if seen else \
            tool_call_text("bash", {"command": "ls"})


def test_white_box_and_black_box_play_one_tool_set_on_the_same_sessions(tokenizer):
    """White-box (ors-trl samples every turn: openenv's `MCPHarnessAdapter` loop of list tools, model step, call,
    verify is `core.rollout.play` over the session) and black-box (an agent's own loop, tools over MCP) on the same
    sessions: a harness's tool set bound server-side (`toolset="codex"`) is the same tools, schemas included, in both,
    and the same actions get the same records and rewards."""
    import aiohttp

    from ors_trl.testing import ReferenceServer
    from tests.fixtures.environments import EchoEnvironment, SandboxEnvironment

    listed: list[list[dict]] = []

    async def lister(ep) -> str | None:  # tools/list over the episode's MCP, then the agent library plays
        async with aiohttp.ClientSession() as http, http.post(ep.mcp_url, json={
                "jsonrpc": "2.0", "id": 1, "method": "tools/list"}, headers={
                "Authorization": f"Bearer {ep.mcp_token}", "Accept": "application/json, text/event-stream"}) as r:
            listed.append((await r.json())["result"]["tools"])
        return await agents_sdk()(ep)

    with ReferenceServer([SandboxEnvironment, EchoEnvironment]) as server:
        spec = OpenRewardSpec(server.url, env_name="sandboxenvironment", toolset="codex")
        white = spec.evaluate(Operator(tokenizer), num_tasks=2, progress=False)
        black = spec.evaluate(Operator(tokenizer), harness=Harness(lister), num_tasks=2, progress=False)
        shown = {t["function"]["name"]: t["function"]["parameters"] for t in spec.runtime.toolset.schemas}
        spec.close()
        assert server.stats()["open_sessions"] == 0
    assert set(shown) == {"echo", "bash"} and len(listed) == 2
    for tools in listed:  # over MCP, the tools the model is shown white-box: names and schemas
        assert {t["name"]: t["inputSchema"] for t in tools} == shown
    for report in (white, black):
        assert report.mean_reward == 1.0 and report.num_episodes == 2
    calls = [[[(c["name"], c["status"]) for t in r["turns"] for c in t["tool_calls"]] for r in report.episodes]
             for report in (white, black)]
    assert calls[0] == calls[1] == [[("bash", "ok"), ("echo", "ok")]] * 2
    assert [r["rewards"] for r in white.episodes] == [r["rewards"] for r in black.episodes]


def test_a_harness_travels_to_another_process_with_its_server_settings_not_its_seats(echo_spec, tokenizer):
    """TRL's async trainer takes the harness by pickle: its server's host, port and public URL go along (an
    environment-run agent must still reach it), its live seats and runner do not."""
    import pickle

    from ors_trl.harness import HarnessServer

    harness = Harness.in_environment(server=HarnessServer("0.0.0.0", 8765, "https://tunnel.example/"))
    episode = echo_spec.runtime.episode(Task("train", 0, None, None), source="eval", rules=Rules())
    harness.server.seat(episode, Scripted(tokenizer))
    copy = pickle.loads(pickle.dumps(harness))
    assert (copy.server.host, copy.server.port, copy.server.public_url) == ("0.0.0.0", 8765, "https://tunnel.example")
    assert copy.server is not harness.server and copy.server.seats == {} and harness.server.seats
    assert copy.agent == harness.agent
    episode.release()


class Gated(Scripted):
    """`Scripted` whose replies wait at a gate: `arrived` holds each request's user text as it reaches the
    generator, `gates[text]` lets it go; `outcomes` says how each ended ("returned" or "cancelled")."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.arrived: asyncio.Queue = asyncio.Queue()
        self.gates: dict[str, asyncio.Event] = {}
        self.outcomes: list[str] = []

    async def reply(self, conversation):
        text = str([m for m in conversation.messages if m["role"] == "user"][-1]["content"])
        gate = self.gates.setdefault(text, asyncio.Event())
        await self.arrived.put(text)
        try:
            await gate.wait()
        except asyncio.CancelledError:
            self.outcomes.append("cancelled")
            raise
        self.outcomes.append("returned")
        return await super().reply(conversation)


def test_a_continuation_joins_its_own_conversation_while_another_call_runs(echo_spec, tokenizer):
    """Two model calls of one episode in flight at once (a harness's sub-agent or auxiliary call beside its main
    call): the main call's continuation joins the main call's conversation, never the other's, so the model is
    shown the history the harness sent and its row extends the main call's."""
    import aiohttp

    generator, harness = Gated(tokenizer), Harness(agents_sdk())
    (episode,) = _episodes(echo_spec, [0])

    async def run():
        url, seat, holder = await _seated(harness, episode, generator)
        main = episode.prompt.chat([])
        side = [{"role": "user", "content": 'Summarise: exactly this text: "side"'}]
        tools = episode.toolset.schemas
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {seat.token}"}) as http:
            async def ask(msgs):
                async with http.post(url + "/v1/chat/completions", json={"messages": msgs, "tools": tools}) as r:
                    return (await r.json())["choices"][0]["message"]

            first = asyncio.ensure_future(ask(main))
            main_text = await asyncio.wait_for(generator.arrived.get(), 60)
            other = asyncio.ensure_future(ask(side))
            side_text = await asyncio.wait_for(generator.arrived.get(), 60)
            generator.gates[side_text].set()
            await asyncio.wait_for(other, 60)  # the side call answers first
            generator.gates[main_text].set()
            reply = await asyncio.wait_for(first, 60)
            call = reply["tool_calls"][0]
            follow = [*main, reply, {"role": "tool", "tool_call_id": call["id"], "content": "hello"}]
            await asyncio.wait_for(ask(follow), 60)
        _unseat(harness, seat, generator, holder)
        return seat.calls

    calls = echo_spec.run(run())
    side_call, main_call, follow_call = calls  # in the order they were answered
    assert "Summarise" in side_call.messages[0]["content"] and follow_call.joined
    shown = main_call.prompt_ids + main_call.completion_ids
    assert follow_call.prompt_ids[: len(shown)] == shown  # the main call's history, not the side call's
    assert "Summarise" not in tokenizer.decode(follow_call.prompt_ids)
    build_rows(calls)
    assert follow_call.row == main_call.row != side_call.row
    episode.release()
    echo_spec.run(harness.aclose())


def test_a_model_call_in_flight_when_its_episode_stops_is_cancelled(echo_spec, tokenizer):
    """A harness stopped (its deadline, a cancel) while one of its model calls is generating: the call stops with its
    episode, so nothing is generated for it afterwards and it joins no record or call list the episode already gave."""
    import aiohttp

    generator = Gated(tokenizer)

    async def agent(ep) -> str | None:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {ep.api_key}"}) as http, \
                http.post(ep.base_url + "/chat/completions", json={"messages": ep.messages}) as r:
            await r.read()
        return None

    harness = Harness(agent)
    (episode,) = _episodes(echo_spec, [0])

    async def run():
        play = asyncio.ensure_future(harness.play(episode, generator))
        text = await asyncio.wait_for(generator.arrived.get(), 60)
        play.cancel()  # as its deadline does
        await asyncio.wait([play], timeout=60)
        assert play.cancelled()
        for _ in range(100):  # the server's handler gets its turns (bounded)
            if generator.outcomes:
                break
            await asyncio.sleep(0.01)
        generator.gates[text].set()  # were it still waiting, it would generate now
        for _ in range(20):
            await asyncio.sleep(0.01)
        return list(generator.outcomes)

    outcomes = echo_spec.run(run())
    assert outcomes == ["cancelled"] and generator.produced == {}
    episode.release()
    echo_spec.run(harness.aclose())


def test_a_command_harness_stopped_mid_run_takes_its_child_processes_with_it(echo_spec, tokenizer, tmp_path):
    """A command harness whose agent started processes of its own (a shell, a tool run) that hold its output: stopping
    the episode kills them all and returns, rather than waiting for them to close the output."""
    marker = tmp_path / "child.pid"
    script = tmp_path / "agent.py"
    script.write_text(textwrap.dedent(f"""
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        with open({str(marker)!r} + ".tmp", "w") as f:
            f.write(str(child.pid))
        os.rename({str(marker)!r} + ".tmp", {str(marker)!r})
        time.sleep(3600)
    """))
    harness = Harness([sys.executable, str(script)])
    (episode,) = _episodes(echo_spec, [0])

    async def run():
        play = asyncio.ensure_future(harness.play(episode, Scripted(tokenizer)))
        for _ in range(600):  # bounded: the agent has started its child
            if marker.exists():
                break
            await asyncio.sleep(0.1)
        play.cancel()  # as its deadline does
        await asyncio.wait([play], timeout=60)
        return play.done()

    def state(pid: int) -> str:  # the process's state letter ("Z": dead, not yet reaped), "gone" once reaped
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return "gone"

    try:
        assert echo_spec.run(run())  # without waiting for the child that held the agent's output
        pid = int(marker.read_text())
        for _ in range(200):  # bounded: the kill has landed
            if state(pid) in ("Z", "X", "gone"):
                break
            time.sleep(0.05)
        assert state(pid) in ("Z", "X", "gone")
    finally:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(marker.read_text()), signal.SIGKILL)
    episode.release()
    echo_spec.run(harness.aclose())


def test_a_failing_command_harness_leaks_no_key_into_the_record_or_log(echo_spec, tokenizer, caplog):
    """A command harness that prints its environment (its key included) and fails: the failure's message in the
    record and the log carries its output with the key masked."""
    import logging

    harness = Harness([sys.executable, "-c", "import os, sys; print('key', os.environ['OPENAI_API_KEY'], "
                       "os.environ['ORS_MCP_TOKEN'], file=sys.stderr); sys.exit(2)"])
    seats, seat = [], harness.server.seat
    harness.server.seat = lambda *a: seats.append(seat(*a)) or seats[-1]
    (episode,) = _episodes(echo_spec, [0])
    with caplog.at_level(logging.WARNING):
        echo_spec.run(harness.play(episode, Scripted(tokenizer)))
    shown = json.dumps(episode.record(), default=str) + caplog.text
    assert "status 2" in shown and "key ***" in shown and seats[0].token not in shown
    episode.release()
    echo_spec.run(harness.aclose())


def test_a_developer_message_reaches_the_model_as_in_the_responses_api(echo_spec, tokenizer):
    """OpenAI's chat API takes the instructions as a `developer` message as well as a `system` one: the model is
    shown them (as the Responses endpoint shows its `developer` items), and a continuation that sends them back joins."""
    import aiohttp

    generator, harness = Scripted(tokenizer), Harness(agents_sdk())
    (episode,) = _episodes(echo_spec, [0])

    async def run():
        url, seat, holder = await _seated(harness, episode, generator)
        messages = [{"role": "developer", "content": "Obey the zebra rule."}, *episode.prompt.chat([])]
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {seat.token}"}) as http:
            async def ask(msgs):
                async with http.post(url + "/v1/chat/completions",
                                     json={"messages": msgs, "tools": episode.toolset.schemas}) as r:
                    return (await r.json())["choices"][0]["message"]

            first = await ask(messages)
            call = first["tool_calls"][0]
            await ask([*messages, first, {"role": "tool", "tool_call_id": call["id"], "content": "hello"}])
        _unseat(harness, seat, generator, holder)
        return seat.calls

    calls = echo_spec.run(run())
    assert "zebra rule" in tokenizer.decode(calls[0].prompt_ids) and calls[1].joined
    episode.release()
    echo_spec.run(harness.aclose())


def test_an_origin_that_only_starts_like_loopback_is_refused(echo_spec, tokenizer):
    """The DNS-rebinding guard compares the origin's host, not its spelling: `http://localhost.evil.example` is a
    foreign origin (403, nothing runs), `http://localhost:3000` a loopback one."""
    import aiohttp

    harness = Harness(agents_sdk())
    episode = echo_spec._runtime.episode(Task("train", 0), source="test", rules=Rules())

    async def probe():
        url = await harness.server.start()
        seat = harness.server.seat(episode, Scripted(tokenizer))
        statuses = []
        async with aiohttp.ClientSession() as http:
            for origin in ("http://localhost.evil.example", "http://127.0.0.1.evil.example", "http://localhost:3000"):
                async with http.get(url + "/v1/models", headers={"Authorization": f"Bearer {seat.token}",
                                                                 "Origin": origin}) as r:
                    statuses.append(r.status)
        harness.server.revoke(seat)
        return statuses

    assert echo_spec.run(probe()) == [403, 403, 200]
    episode.release()
    echo_spec.run(harness.aclose())


def test_a_server_whose_port_was_taken_binds_on_the_next_start(echo_spec):
    """A start that cannot bind (the port is taken) raises, and leaves the server unstarted: the next start binds and
    serves, instead of answering an empty URL."""
    import socket

    from ors_trl.harness import HarnessServer
    from ors_trl.testing import free_port

    port = free_port()
    server = HarnessServer(port=port)
    holder = socket.socket()
    holder.bind(("127.0.0.1", port))
    holder.listen()
    with holder, pytest.raises(OSError):
        echo_spec.run(server.start())
    assert echo_spec.run(server.start()) == f"http://127.0.0.1:{port}"
    echo_spec.run(server.aclose())


def test_a_model_call_its_client_gave_up_on_is_not_kept(echo_spec, tokenizer):
    """A harness whose client gives up on a model call (its own timeout) and sends it again: the call it never read
    is cancelled, so neither the episode's record nor its rows hold a reply the harness never saw; the retry is the
    episode's one call."""
    import aiohttp

    generator, harness = Gated(tokenizer), Harness(agents_sdk())
    (episode,) = _episodes(echo_spec, [0])

    async def run():
        url, seat, holder = await _seated(harness, episode, generator)
        body = {"messages": episode.prompt.chat([]), "tools": episode.toolset.schemas}
        headers = {"Authorization": f"Bearer {seat.token}"}
        async with aiohttp.ClientSession(headers=headers) as http:
            first = asyncio.ensure_future(http.post(url + "/v1/chat/completions", json=body))
            text = await asyncio.wait_for(generator.arrived.get(), 60)
            first.cancel()  # the client's timeout: it drops the connection
            await asyncio.wait([first], timeout=60)
        for _ in range(600):  # bounded: the server sees the connection go
            if generator.outcomes:
                break
            await asyncio.sleep(0.05)
        generator.gates[text].set()
        async with aiohttp.ClientSession(headers=headers) as http, \
                http.post(url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
        _unseat(harness, seat, generator, holder)
        return seat.calls

    calls = echo_spec.run(run())
    assert generator.outcomes == ["cancelled", "returned"] and len(calls) == 1 and len(episode.turns) == 1
    episode.release()
    echo_spec.run(harness.aclose())


def test_a_tool_call_its_mcp_client_left_runs_on_to_its_record(ref_server, tokenizer):
    """An MCP client that leaves during a tool call (its own timeout) does not cut the call short: the environment
    is running it, so it finishes and is recorded, as every driver records its calls; only the episode's stop
    cancels a call in flight."""
    import aiohttp

    spec = OpenRewardSpec(ref_server.url, env_name="slowenvironment")
    _ = spec.environment_factory
    harness = Harness(agents_sdk())
    episode = spec._runtime.episode(Task("train", 0), source="test", rules=Rules(max_replies=6))
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "sleep", "arguments": {"seconds": 1}}}

    async def run():
        await episode.open()
        url = await harness.server.start()
        seat = harness.server.seat(episode, Scripted(tokenizer))
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {seat.token}"}) as http:
            first = asyncio.ensure_future(http.post(url + "/mcp", json=body))
            for _ in range(600):  # bounded: until the call is on its way to the environment
                if episode.tool_calls:
                    break
                await asyncio.sleep(0.01)
            first.cancel()  # the client's timeout: it drops the connection
            await asyncio.wait([first], timeout=60)
        for _ in range(600):  # bounded: the call runs on (1 s)
            if not seat.live:
                break
            await asyncio.sleep(0.05)
        harness.server.revoke(seat)

    spec.run(run())
    assert [c.get("status") for c in episode.turns[0]["tool_calls"]] == ["ok"]
    assert episode.turns[0]["tool_calls"][0]["output"] == "slept 1s"
    episode.release()
    spec.run(harness.aclose())
    spec.close()


def test_an_image_in_a_request_is_refused_not_dropped(echo_spec, tokenizer):
    """A model call whose messages hold an image (chat's `image_url` part, the Responses API's `input_image`) is
    answered 400, saying so: the model is never asked about an image it is not shown."""
    import aiohttp

    generator, harness = Scripted(tokenizer), Harness(agents_sdk())
    (episode,) = _episodes(echo_spec, [0])
    image = "data:image/png;base64,iVBORw0KGgo="
    text = 'Call the `echo` tool with exactly this text: "hello".'

    async def run():
        url, seat, holder = await _seated(harness, episode, generator)
        out = []
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {seat.token}"}) as http:
            for path, body in (
                    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
                        {"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": image}}]}]}),
                    ("/v1/responses", {"input": [{"role": "user", "content": [
                        {"type": "input_text", "text": text}, {"type": "input_image", "image_url": image}]}]})):
                async with http.post(url + path, json=body) as r:
                    out.append((r.status, (await r.json()).get("error", {}).get("message", "")))
        _unseat(harness, seat, generator, holder)
        return out

    out = echo_spec.run(run())
    assert [status for status, _ in out] == [400, 400] and all("image" in message for _, message in out)
    assert generator.produced == {}
    episode.release()
    echo_spec.run(harness.aclose())


def test_a_harness_that_raises_its_own_timeout_fails_its_episode(echo_spec, tokenizer):
    """An agent whose own wait runs out (`asyncio.wait_for`, an HTTP client's timeout: a `TimeoutError`) fails its
    episode as any failing harness does, with its message; only the episode's deadline times an episode out."""

    async def agent(ep) -> str | None:
        await asyncio.wait_for(asyncio.Event().wait(), 0)  # the agent's own timeout
        return None

    (episode,) = _episodes(echo_spec, [0])
    echo_spec.run(Harness(agent, timeout=600).play(episode, Scripted(tokenizer)))
    assert episode.end_reason == "error" and "the harness failed: TimeoutError" in episode.error["message"]
    episode.release()


def test_a_chatty_command_harness_is_read_in_bounded_memory(echo_spec, tokenizer):
    """A command harness that logs a lot (its whole trajectory, on both streams) before its answer: its output is read
    as it comes, keeping only the tail that is used (the answer's last MiB, the error's last lines), not held whole."""
    import tracemalloc

    chatty = ("import sys\nfor _ in range(384):\n    sys.stdout.write('x' * 65535 + '\\n')\n"
              "    sys.stderr.write('y' * 65535 + '\\n')\nprint('Done.')")
    (episode,) = _episodes(echo_spec, [0])
    tracemalloc.start()
    try:
        echo_spec.run(Harness([sys.executable, "-c", chatty]).play(episode, Scripted(tokenizer)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert episode.final_message.endswith("x\nDone.") and len(episode.final_message) <= 2**20  # its output's tail
    assert peak < 8 * 2**20, peak  # 24 MiB on each stream went through
    episode.release()


def test_a_continuation_its_client_gave_up_on_leaves_no_tokens_for_the_retry(echo_spec, tokenizer):
    """A continuation whose client leaves while the model generates it (the generation finishes regardless, in the
    batch it is part of), then is sent again: the retry is rendered afresh, so its prompt holds no tokens of the reply
    nobody read, its row is what the model generated for it, and the policy goes on building later turns as GRPO does
    (joining the spent conversation again rendered an empty tool suffix, which failed, and the policy fell back to
    re-rendering every conversation for the rest of the run)."""
    import threading

    import aiohttp

    class Slow(Scripted):
        def __init__(self, tokenizer) -> None:
            super().__init__(tokenizer)
            self.generating, self.go = threading.Event(), threading.Event()

        def _generate_ids(self, tokens):
            if any("<tool_response>" in self.tokenizer.decode(t.ids) for t in tokens) and not self.go.is_set():
                self.generating.set()
                self.go.wait(60)
            return super()._generate_ids(tokens)

    generator, harness = Slow(tokenizer), Harness(agents_sdk())
    (episode,) = _episodes(echo_spec, [0])

    async def run():
        url, seat, holder = await _seated(harness, episode, generator)
        messages, tools = episode.prompt.chat([]), episode.toolset.schemas
        headers = {"Authorization": f"Bearer {seat.token}"}
        async with aiohttp.ClientSession(headers=headers) as http, \
                http.post(url + "/v1/chat/completions", json={"messages": messages, "tools": tools}) as r:
            first = (await r.json())["choices"][0]["message"]
        follow = {"messages": [*messages, first, {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"],
                                                  "content": "hello"}], "tools": tools}
        async with aiohttp.ClientSession(headers=headers) as http:
            sent = asyncio.ensure_future(http.post(url + "/v1/chat/completions", json=follow))
            for _ in range(600):  # bounded: the model is generating it
                if generator.generating.is_set():
                    break
                await asyncio.sleep(0.05)
            sent.cancel()  # the client's timeout
            await asyncio.wait([sent], timeout=60)
        for _ in range(600):  # bounded: the server saw it go
            if not seat.live:
                break
            await asyncio.sleep(0.05)
        generator.go.set()
        async with aiohttp.ClientSession(headers=headers) as http, \
                http.post(url + "/v1/chat/completions", json=follow) as r:
            assert r.status == 200
        _unseat(harness, seat, generator, holder)
        return seat.calls

    calls = echo_spec.run(run())
    retry = calls[-1]
    assert len(calls) == 2 and retry.completion_ids == generator.produced.get(tuple(retry.prompt_ids))
    assert tokenizer.decode(retry.prompt_ids).count("<tool_response>") == 1
    assert "Done." not in tokenizer.decode(retry.prompt_ids)  # the reply nobody read
    assert generator.join_turns  # the policy still builds later turns as GRPO does (no fallback to re-rendering)
    episode.release()
    echo_spec.run(harness.aclose())


def test_a_continuation_retried_after_its_generation_failed_is_rendered_afresh(echo_spec, tokenizer):
    """A continuation whose generation fails (answered 400), sent again: the retry is rendered afresh (joining the
    conversation its tool results were already added to rendered an empty tool suffix, which failed, and the policy
    fell back to re-rendering every conversation for the rest of the run)."""
    import aiohttp

    class Flaky(Scripted):
        failed = False

        def _generate_ids(self, tokens):
            if any("<tool_response>" in self.tokenizer.decode(t.ids) for t in tokens) and not self.failed:
                self.failed = True
                raise RuntimeError("CUDA out of memory")
            return super()._generate_ids(tokens)

    generator, harness = Flaky(tokenizer), Harness(agents_sdk())
    (episode,) = _episodes(echo_spec, [0])

    async def run():
        url, seat, holder = await _seated(harness, episode, generator)
        messages, tools = episode.prompt.chat([]), episode.toolset.schemas
        statuses = []
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {seat.token}"}) as http:
            async with http.post(url + "/v1/chat/completions", json={"messages": messages, "tools": tools}) as r:
                first = (await r.json())["choices"][0]["message"]
            follow = [*messages, first, {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"],
                                         "content": "hello"}]
            for _ in range(2):
                async with http.post(url + "/v1/chat/completions", json={"messages": follow, "tools": tools}) as r:
                    statuses.append(r.status)
        _unseat(harness, seat, generator, holder)
        return statuses, seat.calls

    statuses, calls = echo_spec.run(run())
    assert statuses == [400, 200] and generator.join_turns
    assert calls[-1].completion_ids == generator.produced[tuple(calls[-1].prompt_ids)]
    episode.release()
    echo_spec.run(harness.aclose())
