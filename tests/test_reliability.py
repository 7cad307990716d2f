"""Reliability under injected faults (issue 7): what the user sees, and that nothing is lost.

Faults come from ``ors_trl.testing.faults.FaultProxy`` in front of the reference server, or from the
reference server itself (restarts, idle reaping). Every test counts what reached the proxy or the
server, so "retried", "not retried" and "ran exactly once" are facts, not hopes.
"""

from __future__ import annotations

import itertools
import json
import math
import threading
import time

import pytest

from ors_trl import (
    Client,
    ConfigurationError,
    OpenRewardSpec,
    ORSError,
    ORSTimeoutError,
    ProtocolError,
    RetryPolicy,
    ServerError,
    ServiceUnavailableError,
    SessionExpiredError,
    StreamInterruptedError,
    TextBlock,
    Timeouts,
    TransportError,
    UnknownBlock,
)
from ors_trl.testing.faults import (
    Blackhole,
    DropStream,
    Flood,
    Hang,
    Pings,
    Reply,
    Reset,
    Silent,
    SSEReply,
    Stall,
    Status,
)
from tests.fixtures.environments import long_text

#: Quick retries so that fault tests take milliseconds per retry, not seconds.
FAST = RetryPolicy(max_attempts=4, backoff_initial=0.01, backoff_max=0.05, starting_timeout=10.0, resume_attempts=3)
STARTING = {"X-Backend-State": "starting", "Retry-After": "1"}
#: Generous upper bound for "the caller was not blocked forever" (never a performance assertion).
NOT_FOREVER_S = 30.0


@pytest.fixture
def proxy(ref_server):
    from ors_trl.testing.faults import FaultProxy

    with FaultProxy(ref_server.url) as p:
        yield p


def runs(server, key: str) -> int:
    """How often the server ran tool `env/tool` so far."""
    return server.stats()["tool_calls"].get(key, 0)


def call_posts(client: Client) -> list[str]:
    """Record every /call POST the client itself sends (independent of what the proxy saw)."""
    seen: list[str] = []
    client.async_client._transport.on_request = lambda m, p: seen.append(p) if p.endswith("/call") else None
    return seen


def loop_tasks() -> set:
    """The tasks running on ors-trl's background loop (where a `Client` does its I/O) right now."""
    import asyncio

    from ors_trl.protocol.loop import get_loop

    async def others() -> set:
        return asyncio.all_tasks() - {asyncio.current_task()}

    return get_loop().run(others())


def result_json(blocks: list[dict], reward: object = None, finished: bool = False,
                raw_reward: str | None = None) -> str:
    body = json.dumps({"ok": True, "output": {"blocks": blocks, "reward": reward, "finished": finished}})
    if raw_reward is not None:  # a literal the json module would not write (NaN, Infinity)
        body = body.replace('"reward": null', f'"reward": {raw_reward}')
    return body


def flushed(spec: OpenRewardSpec, envs: list) -> tuple[list, dict[str, float]]:
    """Score `envs` the way TRL does (reward_funcs with log_metric) and return (rewards, metrics)."""
    metrics: dict[str, float] = {}
    rewards = spec.reward_funcs(envs, log_metric=metrics.__setitem__)
    return rewards, metrics


# --------------------------------------------------------------------------------------------------
# 1. Gateway errors and resets, then recovery; bounded give-up
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", [Status(502), Status(503), Status(504), Status(429), Reset()],
                         ids=["502", "503", "504", "429", "reset"])
def test_transient_failures_are_retried_until_the_server_recovers(proxy, fault) -> None:
    proxy.add(fault, path="/num_tasks", times=3)
    with Client(proxy.url, env_name="echoenvironment", retry=FAST) as c:
        assert c.num_tasks("train") == 16
    assert proxy.count("/num_tasks") == 4  # three faults, then the forwarded request
    assert proxy.count("/num_tasks", fault=None) == 1


def test_session_open_rides_out_resets_and_gateway_errors(proxy, ref_server) -> None:
    before = ref_server.stats()["open_sessions"]
    proxy.add(Reset(), path="/create_session", times=1)
    proxy.add(Status(502), path="/create", times=1)
    proxy.add(Reset(), path="/create", times=1)
    proxy.add(Status(504), path="/prompt", times=2)
    with Client(proxy.url, env_name="echoenvironment", retry=FAST) as c, c.open_session(split="train", index=3) as s:
        assert "openreward" in s.prompt()[0].text
        assert ref_server.stats()["open_sessions"] == before + 1  # one session, not one per attempt
    assert (proxy.count("/create_session"), proxy.count("/create"), proxy.count("/prompt")) == (2, 3, 3)
    assert ref_server.stats()["open_sessions"] == before


def test_tool_call_gateway_errors_are_retried_and_the_tool_runs_once(proxy, ref_server) -> None:
    with Client(proxy.url, env_name="echoenvironment", retry=FAST) as c, c.open_session(split="train", index=0) as s:
        before = runs(ref_server, "echoenvironment/echo")
        proxy.add(Status(502), path="/call", times=1)
        proxy.add(Status(503), path="/call", times=1)
        proxy.add(Status(429, headers={"Retry-After": "1"}), path="/call", times=1)
        assert s.call("echo", {"text": "hello"}).reward == 1.0
    assert proxy.count("/call") == 4
    assert runs(ref_server, "echoenvironment/echo") == before + 1


@pytest.mark.parametrize("status", [502, 503, 504])
def test_gives_up_with_a_typed_error_when_the_server_does_not_recover(proxy, status) -> None:
    proxy.add(Status(status), path="/num_tasks", times=None)
    policy = RetryPolicy(max_attempts=3, backoff_initial=0.01, backoff_max=0.02)
    c = Client(proxy.url, env_name="echoenvironment", retry=policy)
    with c, pytest.raises(ServiceUnavailableError, match=r"gave up after 3 attempts") as info:
        c.num_tasks("train")
    assert info.value.status_code == status and info.value.retryable
    assert proxy.count("/num_tasks") == 3


def test_gives_up_on_connections_that_keep_resetting(proxy) -> None:
    proxy.add(Reset(), path="/num_tasks", times=None)
    policy = RetryPolicy(max_attempts=3, backoff_initial=0.01, backoff_max=0.02)
    c = Client(proxy.url, env_name="echoenvironment", retry=policy)
    with c, pytest.raises(TransportError, match="num_tasks"):
        c.num_tasks("train")
    assert proxy.count("/num_tasks") == 3


def test_tool_call_gives_up_without_running_the_tool(proxy, ref_server) -> None:
    policy = RetryPolicy(max_attempts=3, backoff_initial=0.01, backoff_max=0.02)
    with Client(proxy.url, env_name="echoenvironment", retry=policy) as c, c.open_session(split="train", index=0) as s:
        before = runs(ref_server, "echoenvironment/echo")
        proxy.add(Status(502), path="/call", times=None)
        with pytest.raises(ServiceUnavailableError, match="502"):
            s.call("echo", {"text": "hello"})
    assert proxy.count("/call") == 3
    assert runs(ref_server, "echoenvironment/echo") == before


def test_a_500_is_not_retried(proxy) -> None:
    proxy.add(Status(500, "Traceback: the environment broke"), path="/num_tasks", times=None)
    c = Client(proxy.url, env_name="echoenvironment", retry=FAST)
    with c, pytest.raises(ServerError, match="the environment broke"):
        c.num_tasks("train")
    assert proxy.count("/num_tasks") == 1


# --------------------------------------------------------------------------------------------------
# 2. A backend that is still starting
# --------------------------------------------------------------------------------------------------


def test_a_starting_backend_is_waited_out_for_prompt_and_call(proxy, ref_server) -> None:
    # max_attempts=2, yet 5 "starting" answers in a row are ridden out: they are not failed attempts.
    policy = RetryPolicy(max_attempts=2, backoff_initial=0.01, backoff_max=0.02, starting_timeout=30.0)
    starting = Status(503, "Environment still starting.", headers=STARTING)
    with Client(proxy.url, env_name="echoenvironment", retry=policy) as c, c.open_session(split="train", index=1) as s:
        before = runs(ref_server, "echoenvironment/echo")
        proxy.add(starting, path="/prompt", times=5)
        proxy.add(starting, path="/call", times=5)
        assert "world" in s.prompt()[0].text
        assert s.call("echo", {"text": "world"}).reward == 1.0
    assert proxy.count("/prompt") == 6 and proxy.count("/call") == 6
    assert runs(ref_server, "echoenvironment/echo") == before + 1


@pytest.mark.parametrize("where", ["/prompt", "/call"])
def test_a_backend_that_never_finishes_starting_is_bounded_by_starting_timeout(proxy, where) -> None:
    policy = RetryPolicy(max_attempts=2, backoff_initial=0.01, backoff_max=0.05, starting_timeout=0.5)
    with Client(proxy.url, env_name="echoenvironment", retry=policy) as c, c.open_session(split="train", index=1) as s:
        proxy.add(Status(503, "Environment still starting.", headers=STARTING), path=where, times=None)
        t0 = time.monotonic()
        with pytest.raises(ServiceUnavailableError, match=r"still starting after .*starting_timeout"):
            s.prompt() if where == "/prompt" else s.call("echo", {"text": "world"})
        assert time.monotonic() - t0 < NOT_FOREVER_S
    assert proxy.count(where) >= 3  # it did wait (several polls), then stopped


#: What a server may put in `Retry-After` to make a client poll in a loop: zero, negative, tiny, not a number, a date in
#: the past; and a huge value, which must not stall it either.
HOSTILE_RETRY_AFTER = ["0", "-1", "0.000001", "1e-9", "nan", "Wed, 21 Oct 2015 07:28:00 GMT", "\u00b2", "9" * 40]


def gaps(proxy, path: str) -> list[float]:
    """Seconds between consecutive requests to `path` as the proxy read them (a lower bound of the client's waits)."""
    at = [r.at for r in proxy.requests if r.path.endswith(path)]
    return [b - a for a, b in itertools.pairwise(at)]


@pytest.mark.parametrize("retry_after", HOSTILE_RETRY_AFTER)
def test_a_starting_backend_is_polled_no_faster_than_the_floor(proxy, retry_after) -> None:
    # A boot that never ends, answering with a Retry-After that asks for no wait: over a bounded wait of 1 s, polls
    # are at least `backoff_initial` apart, so there are few of them (a hot loop made ~600 a second).
    floor = 0.05
    policy = RetryPolicy(max_attempts=2, backoff_initial=floor, backoff_max=0.2, starting_timeout=1.0)
    headers = {"X-Backend-State": "starting", "Retry-After": retry_after.encode("utf-8").decode("latin-1")}
    proxy.add(Status(503, "Environment still starting.", headers=headers), path="/num_tasks", times=None)
    with Client(proxy.url, env_name="echoenvironment", retry=policy) as c, \
            pytest.raises(ServiceUnavailableError, match="still starting"):
        c.num_tasks("train")
    polls = proxy.count("/num_tasks")
    assert 2 <= polls <= 1.0 / floor + 2
    assert min(gaps(proxy, "/num_tasks")) >= floor


@pytest.mark.parametrize("status", [429, 503])
@pytest.mark.parametrize("retry_after", HOSTILE_RETRY_AFTER)
def test_retries_never_come_sooner_than_the_floor_whatever_retry_after_says(proxy, status, retry_after) -> None:
    floor = 0.05
    policy = RetryPolicy(max_attempts=4, backoff_initial=floor, backoff_max=0.1)
    headers = {"Retry-After": retry_after.encode("utf-8").decode("latin-1")}
    proxy.add(Status(status, headers=headers), path="/num_tasks", times=None)
    with Client(proxy.url, env_name="echoenvironment", retry=policy) as c, \
            pytest.raises(ORSError, match="gave up after 4 attempts"):
        c.num_tasks("train")
    assert proxy.count("/num_tasks") == 4
    assert min(gaps(proxy, "/num_tasks")) >= floor


@pytest.mark.parametrize("bad", [{"backoff_initial": 0.0}, {"backoff_initial": -1.0}, {"backoff_initial": math.nan},
                                 {"backoff_max": math.inf}, {"backoff_initial": 2.0, "backoff_max": 1.0},
                                 {"max_attempts": 0}, {"starting_timeout": math.nan}, {"resume_attempts": -1}])
def test_a_retry_policy_without_a_floor_is_refused(bad) -> None:
    with pytest.raises(ConfigurationError, match="RetryPolicy"):
        RetryPolicy(**bad)


def test_every_retry_delay_is_within_the_policy_bounds() -> None:
    policy = RetryPolicy(backoff_initial=0.5, backoff_max=4.0)
    for attempt in (0, 1, 2, 10, 10_000):
        for retry_after in (None, 0.0, -5.0, 1e-12, math.nan, math.inf, 1e300, 2.0):
            assert 0.5 <= policy.delay(attempt, retry_after) <= 4.0
    assert policy.delay(1, 3.0) == 3.0  # a longer Retry-After is honoured


# --------------------------------------------------------------------------------------------------
# 3. A /call stream that drops after the task id: resumed, ran once, nothing lost
# --------------------------------------------------------------------------------------------------


def test_a_stream_dropped_mid_result_is_resumed_and_the_tool_runs_once(proxy, ref_server) -> None:
    size, seed = 50_000, 4
    with Client(proxy.url, env_name="longoutputenvironment", retry=FAST) as c, \
            c.open_session(split="train", index=0) as s:
        posts = call_posts(c)
        before = runs(ref_server, "longoutputenvironment/dump")
        proxy.add(DropStream(after_bytes=20_000), path="/call", times=1)  # task id and ~4 chunks, then cut
        result = s.call("dump", {"size": size, "seed": seed})
    assert result.text == long_text(size, seed)
    assert result.metadata == {"size": size, "seed": seed}
    assert runs(ref_server, "longoutputenvironment/dump") == before + 1
    calls = [r for r in proxy.requests if r.path.endswith("/call")]
    assert len(calls) == len(posts) == 2
    assert "task_id" not in calls[0].json() and calls[1].json()["task_id"] == result.task_id
    assert calls[1].json()["input"] == calls[0].json()["input"]


def test_a_stalled_stream_is_resumed_after_stream_idle(proxy, ref_server) -> None:
    timeouts = Timeouts(stream_idle=0.5, tool_call=NOT_FOREVER_S)
    with Client(proxy.url, env_name="longoutputenvironment", retry=FAST, timeouts=timeouts) as c, \
            c.open_session(split="train", index=0) as s:
        before = runs(ref_server, "longoutputenvironment/dump")
        proxy.add(Stall(after_bytes=6_000, seconds=20), path="/call", times=1)
        result = s.call("dump", {"size": 30_000, "seed": 2})
    assert result.text == long_text(30_000, 2)
    assert runs(ref_server, "longoutputenvironment/dump") == before + 1
    assert proxy.count("/call") == 2


def test_a_stream_that_keeps_dropping_gives_up_after_resume_attempts(proxy, ref_server) -> None:
    policy = RetryPolicy(max_attempts=4, backoff_initial=0.01, backoff_max=0.02, resume_attempts=2)
    with Client(proxy.url, env_name="longoutputenvironment", retry=policy) as c, \
            c.open_session(split="train", index=0) as s:
        before = runs(ref_server, "longoutputenvironment/dump")
        proxy.add(DropStream(after_bytes=9_000), path="/call", times=None)
        with pytest.raises(StreamInterruptedError, match="kept dropping"):
            s.call("dump", {"size": 40_000, "seed": 0})
    assert proxy.count("/call") == 3  # the call and two resumes
    assert runs(ref_server, "longoutputenvironment/dump") == before + 1


def test_a_resume_the_server_no_longer_knows_is_reported_not_rerun(proxy, ref_server) -> None:
    with Client(proxy.url, env_name="echoenvironment", retry=FAST) as c, c.open_session(split="train", index=0) as s:
        before = runs(ref_server, "echoenvironment/echo")
        proxy.add(DropStream(after_bytes=60), path="/call", times=1)
        proxy.add(SSEReply([("error", "unknown task_id")]), path="/call", times=1)
        with pytest.raises(StreamInterruptedError, match="not re-run"):
            s.call("echo", {"text": "hello"})
    assert runs(ref_server, "echoenvironment/echo") == before + 1
    assert proxy.count("/call") == 2


# --------------------------------------------------------------------------------------------------
# 4. A /call stream that drops before any task id: reported, never re-run
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", [DropStream(after_bytes=0), DropStream(headers=False), Reset()],
                         ids=["after-headers", "before-headers", "reset"])
def test_a_stream_dropped_before_the_task_id_is_reported_and_not_rerun(proxy, ref_server, fault) -> None:
    with Client(proxy.url, env_name="echoenvironment", retry=FAST) as c, c.open_session(split="train", index=0) as s:
        posts = call_posts(c)
        before = runs(ref_server, "echoenvironment/echo")
        idle = loop_tasks()  # the client's own (keepalive), before the call
        proxy.add(fault, path="/call", times=1)
        with pytest.raises(StreamInterruptedError, match="not retried") as info:
            s.call("echo", {"text": "wrong"})
        assert not info.value.retryable
        assert loop_tasks() <= idle  # nothing left running that could re-post the call in the background
        ran = 0 if isinstance(fault, Reset) else 1  # Reset: the server never saw it; DropStream: it started it
        ref_server.wait_for_stats(lambda st: st["tool_calls"].get("echoenvironment/echo", 0) == before + ran)
        assert runs(ref_server, "echoenvironment/echo") - before == ran
        assert len(posts) == 1 and proxy.count("/call") == 1
        # the session itself is fine: the next call works
        assert s.call("echo", {"text": "hello"}).reward == 1.0
    assert runs(ref_server, "echoenvironment/echo") - before == ran + 1


# --------------------------------------------------------------------------------------------------
# 5. Server restart mid-episode, through the spec's adapter
# --------------------------------------------------------------------------------------------------


def test_server_restart_mid_episode_fails_the_rollout_readably(make_server) -> None:
    server = make_server("sparse")
    spec = OpenRewardSpec(server.url, num_tasks=2, retry=FAST)
    rows = spec.train_dataset
    env = spec.environment_factory()
    env.reset(**rows[0])
    assert env.calculator(expression="2 + 2").strip().endswith("4")
    server.restart()
    with pytest.raises(SessionExpiredError, match="no longer exists") as info:
        env.calculator(expression="3 + 3")
    assert "server restarted" in str(info.value)
    assert env.last_output.startswith("{'error': ") and "no longer exists" in env.last_output  # as TRL shows it
    assert env.rewards == [None, None] and env.reward is None
    rewards, metrics = flushed(spec, [env])
    assert rewards == [None]
    assert metrics[f"env/{spec.name}/failures/expired"] == 1.0
    assert metrics[f"env/{spec.name}/tool_calls"] == 2.0
    # the next rollout works on the restarted server
    prompt = env.reset(**rows[1])
    assert str(rows[1]["a"]) in prompt and env.error is None
    assert env.submit(answer=rows[1]["a"] + rows[1]["b"]) and env.reward == 1.0
    spec.close()
    assert server.stats()["open_sessions"] == 0


# --------------------------------------------------------------------------------------------------
# 6. A tool call longer than the server's idle limit, through the spec
# --------------------------------------------------------------------------------------------------


def test_keepalive_keeps_a_long_rollout_alive_and_its_absence_loses_it(make_server) -> None:
    server = make_server("slow", idle_timeout=1.0)  # reaped 1-6 s after the last activity
    kept = OpenRewardSpec(server.url, num_tasks=2, keepalive_interval=0.3)
    bare = OpenRewardSpec(server.url, num_tasks=2, keepalive_interval=None)
    envs = [kept.environment_factory(), bare.environment_factory()]
    for spec, env in zip((kept, bare), envs, strict=True):
        env.reset(**spec.train_dataset[0])
    outputs: list[str | BaseException] = [None, None]  # type: ignore[list-item]

    def long_call(i: int) -> None:
        try:
            outputs[i] = envs[i].sleep(seconds=7.5)  # longer than idle limit + reaper period
        except BaseException as exc:  # pragma: no cover - asserted below
            outputs[i] = exc

    threads = [threading.Thread(target=long_call, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert outputs == ["slept 7.5s", "slept 7.5s"]
    assert envs[0].work(step=0) == "step 0 done"  # kept alive by pings during the call
    with pytest.raises(SessionExpiredError):
        envs[1].work(step=0)
    _, kept_metrics = flushed(kept, [envs[0]])
    _, bare_metrics = flushed(bare, [envs[1]])
    assert kept_metrics[f"env/{kept.name}/failures/expired"] == 0.0
    assert bare_metrics[f"env/{bare.name}/failures/expired"] == 1.0
    assert server.stats()["pings"] > 0
    kept.close()
    bare.close()
    assert server.stats()["open_sessions"] == 0


# --------------------------------------------------------------------------------------------------
# 7. Slow or hanging servers: every deadline fires, nothing blocks forever
# --------------------------------------------------------------------------------------------------


def test_a_server_that_accepts_and_never_answers_times_out() -> None:
    with Blackhole() as hole:
        c = Client(hole.url, timeouts=Timeouts(connect=1.0, request=0.5),
                   retry=RetryPolicy(max_attempts=2, backoff_initial=0.01))
        t0 = time.monotonic()
        with pytest.raises(ORSTimeoutError, match=r"Timeouts\.request"):
            c.list_environments()
        assert time.monotonic() - t0 < NOT_FOREVER_S
        c.close()


def test_a_hanging_request_times_out_and_is_retried_when_idempotent(proxy) -> None:
    proxy.add(Hang(max_seconds=30), path="/num_tasks", times=None)
    policy = RetryPolicy(max_attempts=2, backoff_initial=0.01)
    with Client(proxy.url, env_name="echoenvironment", retry=policy, timeouts=Timeouts(request=0.5)) as c:
        t0 = time.monotonic()
        with pytest.raises(ORSTimeoutError):
            c.num_tasks("train")
        assert time.monotonic() - t0 < NOT_FOREVER_S
    assert proxy.count("/num_tasks") == 2


def test_a_call_stream_that_sends_nothing_hits_stream_idle(proxy, ref_server) -> None:
    timeouts = Timeouts(stream_idle=0.5, tool_call=NOT_FOREVER_S)
    with Client(proxy.url, env_name="echoenvironment", retry=FAST, timeouts=timeouts) as c, \
            c.open_session(split="train", index=0) as s:
        proxy.add(Silent(max_seconds=30), path="/call", times=1)
        t0 = time.monotonic()
        with pytest.raises(StreamInterruptedError, match="timed out"):
            s.call("echo", {"text": "hello"})
        assert time.monotonic() - t0 < NOT_FOREVER_S
        assert proxy.count("/call") == 1  # never acknowledged, so never re-posted
        assert s.call("echo", {"text": "hello"}).reward == 1.0


@pytest.mark.parametrize("task_id", [None, "task-1"], ids=["no-task-id", "with-task-id"])
def test_a_call_stream_of_pings_forever_hits_the_tool_call_deadline(proxy, task_id) -> None:
    timeouts = Timeouts(stream_idle=1.0, tool_call=1.5)
    with Client(proxy.url, env_name="echoenvironment", retry=FAST, timeouts=timeouts) as c, \
            c.open_session(split="train", index=0) as s:
        proxy.add(Pings(interval=0.1, task_id=task_id, max_seconds=30), path="/call", times=None)
        t0 = time.monotonic()
        with pytest.raises(ORSTimeoutError, match=r"Timeouts\.tool_call"):
            s.call("echo", {"text": "hello"})
        assert 1.4 < time.monotonic() - t0 < NOT_FOREVER_S
    assert proxy.count("/call") == 1


def test_a_hanging_tool_call_through_the_adapter_is_a_counted_timeout(proxy) -> None:
    spec = OpenRewardSpec(proxy.url, env_name="echoenvironment", num_tasks=2, retry=FAST,
                          timeouts=Timeouts(stream_idle=1.0, tool_call=1.0))
    env = spec.environment_factory()
    env.reset(**spec.train_dataset[0])
    proxy.add(Pings(interval=0.1, task_id="t", max_seconds=30), path="/call", times=1)
    done = threading.Event()
    failure: list[BaseException] = []

    def call() -> None:
        try:
            env.echo(text="hello")
        except BaseException as exc:
            failure.append(exc)
        done.set()

    threading.Thread(target=call, daemon=True).start()
    assert done.wait(NOT_FOREVER_S), "the training thread stayed blocked"
    assert isinstance(failure[0], ORSTimeoutError)
    rewards, metrics = flushed(spec, [env])
    assert rewards == [None] and metrics["env/echoenvironment/failures/timeout"] == 1.0
    env.reset(**spec.train_dataset[0])
    assert env.echo(text="hello") == "hello"
    spec.close()


# --------------------------------------------------------------------------------------------------
# 8. Malformed answers
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("body", ["{not json", '{"tasks": 3}', "[1, 2]", ""],
                         ids=["invalid", "wrong-key", "list", "empty"])
def test_malformed_json_answers_are_protocol_errors(proxy, body) -> None:
    proxy.add(Reply(body), path="/num_tasks", times=None)
    c = Client(proxy.url, env_name="echoenvironment", retry=FAST)
    with c, pytest.raises(ProtocolError, match="num_tasks"):
        c.num_tasks("train")
    assert proxy.count("/num_tasks") == 1  # the server answered: nothing to retry


def test_a_non_http_answer_is_a_transport_error(proxy) -> None:
    from ors_trl.testing.faults import Raw

    proxy.add(Raw(b"SSH-2.0-OpenSSH_9.6\r\n"), path="/num_tasks", times=None)
    with Client(proxy.url, env_name="echoenvironment", retry=FAST) as c, pytest.raises(TransportError):
        c.num_tasks("train")


def _call_with(proxy, ref_server, events, env: str = "echoenvironment", tool: str = "echo"):
    with Client(proxy.url, env_name=env, retry=FAST) as c, c.open_session(split="train", index=0) as s:
        proxy.add(SSEReply(events), path="/call", times=1)
        return s.call(tool, {"text": "x"})


@pytest.mark.parametrize("result", [
    "{not json",
    '{"output": {"blocks": []}}',  # no "ok"
    '{"ok": true}',  # no output
    '{"ok": true, "output": [1]}',
    '{"ok": true, "output": {"blocks": [{"type": "text"}]}}',  # text block without text
    '{"ok": true, "output": {"blocks": [{"type": "image", "data": "AA=="}]}}',  # no mimeType
    '{"ok": true, "output": {"blocks": "text"}}',
    '{"ok": true, "output": {"blocks": [], "reward": "lots"}}',
    '{"ok": true, "output": {"blocks": [], "reward": [1]}}',
    '{"ok": true, "output": {"blocks": [], "reward": true}}',
    '{"ok": true, "output": {"blocks": [], "reward": NaN}}',
    '{"ok": true, "output": {"blocks": [], "reward": Infinity}}',
    '{"ok": true, "output": {"blocks": [], "reward": "1e999"}}',
], ids=["invalid", "no-ok", "no-output", "output-list", "text-no-text", "image-no-mime", "blocks-str",
        "reward-str", "reward-list", "reward-bool", "reward-nan", "reward-inf", "reward-overflow"])
def test_malformed_tool_results_are_protocol_errors(proxy, ref_server, result) -> None:
    with pytest.raises(ProtocolError, match="'echo'"):
        _call_with(proxy, ref_server, [("task_id", "t-1"), ("end", result)])


def test_a_call_stream_that_ends_without_a_result_is_resumed_then_reported(proxy) -> None:
    with Client(proxy.url, env_name="echoenvironment", retry=FAST) as c, c.open_session(split="train", index=0) as s:
        proxy.add(SSEReply([("task_id", "t-1")]), path="/call", times=None)  # a clean end, but no result
        with pytest.raises(StreamInterruptedError, match="kept dropping"):
            s.call("echo", {"text": "x"})
    assert proxy.count("/call") == 1 + FAST.resume_attempts


def test_unknown_block_types_are_kept_and_shown_as_placeholders(proxy, ref_server) -> None:
    blocks = [{"type": "audio", "data": "UklGRg==", "format": "wav"}, {"type": "text", "text": "after"}]
    result = _call_with(proxy, ref_server, [("task_id", "t-1"), ("end", result_json(blocks, reward=0.5))])
    assert isinstance(result.blocks[0], UnknownBlock) and result.blocks[0].type == "audio"
    assert result.blocks[0].raw == blocks[0]  # kept as received
    assert isinstance(result.blocks[1], TextBlock)
    assert result.text == "[unsupported block: audio]\nafter"
    assert result.reward == 0.5


def test_a_valid_result_sent_as_one_huge_sse_line_is_accepted(proxy, ref_server) -> None:
    text = "y" * 1_500_000  # one `data:` line far longer than aiohttp's line buffer
    end = result_json([{"type": "text", "text": text}])
    result = _call_with(proxy, ref_server, [("task_id", "t-1"), ("end", end)])
    assert result.text == text


def test_a_nan_reward_through_the_adapter_is_a_failure_scored_none(proxy) -> None:
    spec = OpenRewardSpec(proxy.url, env_name="echoenvironment", num_tasks=2, retry=FAST)
    env = spec.environment_factory()
    env.reset(**spec.train_dataset[0])
    blocks = [{"type": "audio"}, {"type": "text", "text": "hi"}]
    proxy.add(SSEReply([("task_id", "t"), ("end", result_json(blocks, raw_reward="NaN"))]), path="/call", times=1)
    with pytest.raises(ProtocolError, match="non-finite reward"):
        env.echo(text="hello")
    assert env.reward is None and env.rewards == [None]
    # an answer past the protocol is the environment's failure: the episode is void, no later call is sent
    calls = proxy.count(path="/call")
    assert env.echo(text="hello").startswith("[not run: the environment failed (protocol)")
    assert proxy.count(path="/call") == calls and env.tool_calls == 1
    rewards, metrics = flushed(spec, [env])
    assert rewards == [None] and env.episode.unscored == "error"
    assert metrics["env/echoenvironment/failures/protocol"] == 1.0
    spec.close()


def test_max_output_chars_truncates_what_the_model_sees(ref_server) -> None:
    capped = OpenRewardSpec(ref_server.url, env_name="longoutputenvironment", num_tasks=1, max_output_chars=1000)
    full = OpenRewardSpec(ref_server.url, env_name="longoutputenvironment", num_tasks=1)
    a, b = capped.environment_factory(), full.environment_factory()
    a.reset(**capped.train_dataset[0])
    b.reset(**full.train_dataset[0])
    text = long_text(20_000, 3)
    out = a.dump(size=20_000, seed=3)
    assert out == text[:1000] + "\n[... output truncated: 1000 of 20000 characters shown ...]"
    assert a.last_output == out
    assert b.dump(size=20_000, seed=3) == text
    capped.close()
    full.close()


@pytest.mark.parametrize("fault", [Flood(), Reply("[" + "1," * 600_000 + "1]")], ids=["endless", "content-length"])
def test_the_response_size_cap_stops_oversized_answers(proxy, fault) -> None:
    proxy.add(fault, path="/num_tasks", times=None)
    with Client(proxy.url, env_name="echoenvironment", retry=FAST) as c:
        c.async_client._transport.max_response_bytes = 1_000_000
        t0 = time.monotonic()
        with pytest.raises(ProtocolError, match="1000000-byte limit"):
            c.num_tasks("train")
        assert time.monotonic() - t0 < NOT_FOREVER_S


def test_the_response_size_cap_applies_to_tool_results(proxy, ref_server) -> None:
    with Client(proxy.url, env_name="longoutputenvironment", retry=FAST) as c, \
            c.open_session(split="train", index=0) as s:
        c.async_client._transport.max_response_bytes = 100_000
        with pytest.raises(ProtocolError, match="100000 bytes"):
            s.call("dump", {"size": 300_000, "seed": 0})
        proxy.add(Flood(sse=True), path="/call", times=1)
        with pytest.raises(ProtocolError, match="100000 bytes"):
            s.call("dump", {"size": 10, "seed": 0})
        assert s.call("dump", {"size": 50_000, "seed": 0}).text == long_text(50_000, 0)  # under the cap: fine


def test_fault_proxy_request_log_is_bounded(ref_server) -> None:
    """A soak through the proxy keeps only the newest `max_log` requests, in order, and counts them."""
    import urllib.request

    from ors_trl.testing.faults import FaultProxy

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with FaultProxy(ref_server.url, max_log=3) as p:
        for i in range(5):
            request = urllib.request.Request(f"{p.url}/health", headers={"X-Request-N": str(i)})
            with opener.open(request, timeout=NOT_FOREVER_S) as resp:
                assert resp.status == 200
        seen = p.requests
        assert [{k.lower(): v for k, v in r.headers.items()}.get("x-request-n") for r in seen] == ["2", "3", "4"]
        assert p.count("/health") == 3
    with pytest.raises(ValueError, match="max_log"):
        FaultProxy(ref_server.url, max_log=0)
