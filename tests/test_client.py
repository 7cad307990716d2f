"""The ORS client against the reference server: environment calls, sessions, tool calls, keepalive."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import threading

import pytest

from ors_trl import (
    AsyncClient,
    BadRequestError,
    Client,
    ConfigurationError,
    EnvironmentNotFoundError,
    ImageBlock,
    SessionExpiredError,
    TextBlock,
    ToolRefusedError,
    TransportError,
)
from ors_trl.testing.server import free_port
from tests.fixtures.environments import long_text


@pytest.fixture
def echo(ref_server):
    with Client(ref_server.url, env_name="EchoEnvironment") as client:
        yield client


def test_environment_resolution(ref_server) -> None:
    with Client(ref_server.url, env_name="ECHOENVIRONMENT") as c:
        assert c.environment() == "echoenvironment"
    with pytest.raises(EnvironmentNotFoundError) as info:
        Client(ref_server.url, env_name="nope").num_tasks()
    assert "echoenvironment" in str(info.value) and "sparseenvironment" in info.value.available


@pytest.mark.parametrize("listed", [["echoenvironment", "EchoEnvironment"], ["EchoEnvironment", "echoenvironment"]])
def test_an_exact_environment_name_wins_over_one_that_differs_in_case(ref_server, listed) -> None:
    """A server listing two names that differ only in case: the exact one is used (the last one listed won), and a
    name matching both only in case is a typed error that lists them."""
    import json

    from ors_trl.testing.faults import FaultProxy, Reply

    with FaultProxy(ref_server.url) as proxy:
        proxy.add(Reply(json.dumps(listed)), path="/list_environments", times=None)
        with Client(proxy.url, env_name="echoenvironment") as c:
            assert c.environment() == "echoenvironment"
            c.num_tasks("train")
        assert [r.path for r in proxy.requests if r.path.endswith("/num_tasks")] == ["/echoenvironment/num_tasks"]
        with pytest.raises(EnvironmentNotFoundError, match="differ only in case") as info, \
                Client(proxy.url, env_name="ECHOENVIRONMENT") as c:
            c.environment()
        assert sorted(info.value.available) == sorted(listed)


def test_single_environment_server_needs_no_name(make_server) -> None:
    server = make_server("sparse")
    with Client(server.url) as c:
        assert c.environment() == "sparseenvironment"
        assert c.num_tasks("train") > 0


def test_several_environments_without_name_use_the_default_and_warn(ref_server, caplog) -> None:
    with Client(ref_server.url) as c:
        assert c.environment() == c.list_environments()[0]
    assert "Pass env_name=" in caplog.text


def test_environment_calls(echo, ref_server) -> None:
    assert [s.name for s in echo.splits()] == ["train", "test"]
    n = echo.num_tasks("train")
    everything = echo.tasks("train")
    assert len(everything) == n
    assert echo.task("train", 3) == everything[3]
    assert echo.task_range("train", 2, 6) == everything[2:6]
    assert echo.task_range("train", -3) == everything[-3:]
    assert echo.tools().names() == ["echo"]


def test_task_range_is_one_request(echo) -> None:
    echo.environment()  # resolving the environment name is a one-time request of its own
    seen: list[tuple[str, str]] = []
    echo.async_client._transport.on_request = lambda m, p: seen.append((m, p))
    echo.task_range("train", 0, 10)
    assert seen == [("POST", "/echoenvironment/task_range")]


def test_bad_split_and_index_say_what_exists(echo) -> None:
    with pytest.raises(BadRequestError, match="available splits: train, test"):
        echo.num_tasks("nope")
    with pytest.raises(BadRequestError, match=r"out of range .* \(0\.\.15\)"):
        echo.task("train", 99)


def test_session_lifecycle_and_rewards(echo, ref_server) -> None:
    before = ref_server.stats()
    target = echo.task("train", 1)["target"]
    with echo.open_session(split="train", index=1) as s:
        assert ref_server.stats()["open_sessions"] == before["open_sessions"] + 1
        prompt = s.prompt()
        assert isinstance(prompt[0], TextBlock) and target in prompt[0].text
        miss = s.call("echo", {"text": "wrong"})
        assert (miss.reward, miss.finished, miss.text) == (0.0, False, "wrong")
        hit = s.call("echo", {"text": target})
        assert (hit.reward, hit.finished) == (1.0, True)
        assert hit.metadata == {"target_length": len(target)}
        with pytest.raises(ToolRefusedError) as info:
            s.call("echo", {"text": target})
        assert info.value.reason == "episode_finished"
    assert s.closed
    after = ref_server.stats()
    assert after["open_sessions"] == before["open_sessions"]
    assert after["tool_calls"]["echoenvironment/echo"] == before["tool_calls"].get("echoenvironment/echo", 0) + 2


def test_session_from_task_spec(echo) -> None:
    with echo.open_session(task_spec={"id": "custom", "target": "zebra"}) as s:
        assert "zebra" in s.prompt()[0].text
        assert s.call("echo", {"text": "zebra"}).reward == 1.0


def test_refusals_carry_their_reason(echo) -> None:
    with echo.open_session(split="train", index=0) as s:
        with pytest.raises(ToolRefusedError) as info:
            s.call("no_such_tool", {})
        assert info.value.reason == "not_found"
        with pytest.raises(ToolRefusedError) as info:
            s.call("echo", {"text": 123})
        assert info.value.reason == "input_validation"


def test_failed_open_leaves_nothing_behind(echo, ref_server) -> None:
    before = ref_server.stats()["open_sessions"]
    with pytest.raises(BadRequestError, match="out of range"):
        echo.open_session(split="train", index=10_000)
    with pytest.raises(BadRequestError, match="available splits"):
        echo.open_session(split="nope", index=0)
    assert ref_server.stats()["open_sessions"] == before
    assert echo.open_sessions == 0


def test_open_session_argument_errors(echo) -> None:
    with pytest.raises(ConfigurationError):
        echo.open_session()
    with pytest.raises(ConfigurationError):
        echo.open_session(split="train", index=0, task_spec={"a": 1})
    with pytest.raises(ConfigurationError):
        echo.open_session(split="train", index="3")


def test_task_specific_tools_only_show_in_sessions(ref_server) -> None:
    with Client(ref_server.url, env_name="tasktoolsenvironment") as c:
        shared = set(c.tools().names())
        per_task = []
        for i in range(3):
            with c.open_session(split="train", index=i) as s:
                per_task.append(set(s.tools().names()))
        assert all(shared < names for names in per_task)
        assert len({frozenset(n) for n in per_task}) == 3


def test_images_and_metadata(ref_server) -> None:
    with Client(ref_server.url, env_name="imageenvironment") as c, c.open_session(split="train", index=0) as s:
        prompt = s.prompt()
        images = [b for b in prompt if isinstance(b, ImageBlock)]
        assert images and images[0].mime_type == "image/png"
        assert base64.b64decode(images[0].data).startswith(b"\x89PNG")
        assert images[0].data_url().startswith("data:image/png;base64,")
        result = s.call("snapshot", {"color": c.task("train", 0)["color"]})
        assert result.reward == 1.0
        assert any(isinstance(b, ImageBlock) for b in result.blocks)
        assert isinstance(result.metadata, dict) and result.metadata
        assert "[image: image/png]" in result.text


@pytest.mark.parametrize("size,seed", [(12_000, 0), (20_000, 1), (50_000, 7)])
def test_long_outputs_are_byte_exact(ref_server, size: int, seed: int) -> None:
    with Client(ref_server.url, env_name="longoutputenvironment") as c, c.open_session(split="train", index=0) as s:
        result = s.call("dump", {"size": size, "seed": seed})
    assert result.text == long_text(size, seed)


def test_sync_facade_is_thread_safe(echo, ref_server) -> None:
    errors: list[BaseException] = []
    rewards: list[float | None] = []
    lock = threading.Lock()

    def worker(i: int) -> None:
        try:
            with echo.open_session(split="train", index=i % 16) as s:
                target = echo.task("train", i % 16)["target"]
                r = s.call("echo", {"text": target}).reward
            with lock:
                rewards.append(r)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert rewards == [1.0] * 16
    assert echo.open_sessions == 0


def test_async_client_runs_sessions_concurrently(make_server) -> None:
    server = make_server("slow", env={"ORS_TEST_TOOL_LATENCY": "0.5"})

    async def main() -> None:
        async with AsyncClient(server.url) as client:
            sessions = await asyncio.gather(*(client.open_session(split="train", index=i) for i in range(20)))
            await asyncio.gather(*(s.call("work", {"step": 0}) for s in sessions))
            assert client.open_sessions == 20

    asyncio.run(main())
    stats = server.stats()
    assert stats["peak_in_flight"]["slowenvironment/work"] == 20  # all at once, not one after another
    assert stats["open_sessions"] == 0


def test_client_close_deletes_open_sessions(ref_server) -> None:
    before = ref_server.stats()["open_sessions"]
    c = Client(ref_server.url, env_name="echoenvironment")
    for i in range(3):
        c.open_session(split="train", index=i)
    assert ref_server.stats()["open_sessions"] == before + 3
    c.close()
    assert ref_server.stats()["open_sessions"] == before


def test_connection_refused_is_a_transport_error() -> None:
    from ors_trl import RetryPolicy

    c = Client(f"http://127.0.0.1:{free_port()}", retry=RetryPolicy(max_attempts=2, backoff_initial=0.01))
    with pytest.raises(TransportError, match="cannot connect"):
        c.list_environments()
    c.close()


def test_keepalive_keeps_a_long_call_alive(make_server) -> None:
    server = make_server("slow", idle_timeout=1.5)
    with Client(server.url, keepalive_interval=0.5) as c, c.open_session(split="train", index=0) as s:
        s.call("sleep", {"seconds": 8.0})
        assert s.call("work", {"step": 0}) is not None
        assert not s.expired


def test_without_keepalive_the_same_call_loses_its_session(make_server) -> None:
    server = make_server("slow", idle_timeout=1.5)
    with Client(server.url, keepalive_interval=None) as c, c.open_session(split="train", index=0) as s:
        s.call("sleep", {"seconds": 8.0})
        with pytest.raises(SessionExpiredError):
            s.call("work", {"step": 0})
        assert s.expired


def test_a_tool_that_raises_is_a_tool_failure(ref_server) -> None:
    from ors_trl import ToolFailedError

    with Client(ref_server.url, env_name="sparseenvironment") as c, c.open_session(split="train", index=0) as s:
        assert s.call("calculator", {"expression": "2 + 3"}).text.strip().endswith("5")
        with pytest.raises(ToolFailedError, match="calculator"):
            s.call("calculator", {"expression": "import os"})
        # the session is still usable afterwards
        assert s.call("submit", {"answer": 0}).finished


def test_secrets_reach_the_environment(ref_server) -> None:
    import json

    secrets = {"OPENAI_API_KEY": "sk-oa", "custom": ("v-custom", ["x.example"])}
    with Client(ref_server.url, env_name="schemaenvironment", secrets=secrets) as c, \
            c.open_session(split="train", index=3) as s:
        body = json.loads(s.call("status").text)
    # The environment echoes what it got; the echo of a value of 6+ characters comes back masked (issue 22), which
    # shows it arrived: only a known secret value is replaced.
    assert body["secrets"] == {"OPENAI_API_KEY": "sk-oa", "custom": "***"}


def test_catalog_mode_against_a_single_host(ref_server, monkeypatch) -> None:
    # A catalog name whose platform is a loopback single host: no api./sessions. subdomains.
    monkeypatch.setenv("OPENREWARD_URL", ref_server.url)
    monkeypatch.setenv("OPENREWARD_API_KEY", "sk-test")
    before = ref_server.stats()["open_sessions"]
    with Client("acme/echo", env_name="echoenvironment") as c:
        assert c.target.kind == "catalog"
        assert c.num_tasks("train") == 16
        with c.open_session(split="train", index=0) as s:
            target = c.task("train", 0)["target"]
            assert s.call("echo", {"text": target}).reward == 1.0
    assert ref_server.stats()["open_sessions"] == before


def test_process_session_cap_queues_instead_of_failing(ref_server) -> None:
    from ors_trl import get_max_sessions, set_max_sessions
    from ors_trl.protocol.budget import process_semaphore

    async def main() -> None:
        cap, queued = process_semaphore(), asyncio.Event()  # the process-wide cap on this loop
        acquire = cap.acquire

        async def acquire_watched() -> bool:  # says when an open has to wait for a slot
            if cap.locked():
                queued.set()
            return await acquire()

        cap.acquire = acquire_watched  # type: ignore[method-assign]
        async with AsyncClient(ref_server.url, env_name="echoenvironment") as client:
            a = await client.open_session(split="train", index=0)
            b = await client.open_session(split="train", index=1)
            assert not queued.is_set()
            third = asyncio.ensure_future(client.open_session(split="train", index=2))
            await asyncio.wait_for(queued.wait(), 10)
            assert not third.done()  # waiting for a slot, not failed
            await a.close()
            c = await asyncio.wait_for(third, 10)
            assert client.open_sessions == 2
            await b.close()
            await c.close()

    set_max_sessions(2)
    try:
        assert get_max_sessions() == 2
        asyncio.run(main())
    finally:
        set_max_sessions(None)


def test_client_session_cap_times_out_with_a_clear_error(ref_server) -> None:
    from ors_trl import ORSTimeoutError

    async def main() -> None:
        async with AsyncClient(ref_server.url, env_name="echoenvironment", max_sessions=1, session_wait=0.3) as c:
            await c.open_session(split="train", index=0)
            with pytest.raises(ORSTimeoutError, match="no session slot"):
                await c.open_session(split="train", index=1)
            assert c.open_sessions == 1

    asyncio.run(main())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_fork_while_another_thread_holds_the_session_cap_lock_does_not_deadlock_the_child() -> None:
    from ors_trl.protocol import budget as _budget

    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with _budget._lock:
            held.set()
            release.wait(10)

    thread = threading.Thread(target=holder)
    thread.start()
    assert held.wait(10)
    try:
        pid = os.fork()
        if pid == 0:  # child: the lock the other (now absent) thread held must be usable
            code = 0 if _budget._lock.acquire(timeout=5) else 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
    finally:
        release.set()
        thread.join(10)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def test_a_json_api_goes_through_the_one_transport() -> None:
    """`Transport.for_url(...).post_json` (what `OpenAIPolicy` needs of an OpenAI-compatible endpoint): 429 and 5xx
    retried, other statuses final, the key masked in answers and errors (no exception chain), every failure the
    caller's error class, and a redirect to another host followed without `Authorization`."""
    import traceback

    from ors_trl import PolicyError
    from ors_trl.protocol.loop import get_loop
    from ors_trl.protocol.transport import RetryPolicy, Transport
    from ors_trl.testing.faults import EchoHeaders, FaultProxy, Redirect, Reply, Status

    key = "sk-json-api-" + "7" * 24
    retry = RetryPolicy(max_attempts=3, backoff_initial=0.01, backoff_max=0.02)
    with FaultProxy(None) as endpoint, FaultProxy(None) as elsewhere:
        api = Transport.for_url(endpoint.url + "/v1/", error=PolicyError, headers={"Authorization": f"Bearer {key}"},
                                secrets=[key], retry=retry)

        def post() -> object:
            return get_loop().run(api.post_json("/chat/completions", {"model": "m"}))

        def failure() -> PolicyError:
            with pytest.raises(PolicyError) as info:
                post()
            chain = "".join(traceback.format_exception(info.value))
            assert info.value.__context__ is None and info.value.__cause__ is None and key not in chain, chain
            return info.value

        endpoint.add(Status(429)).add(Status(500)).add(Reply(json.dumps({"echo": f"key {key}"})))
        assert post() == {"echo": "key ***"} and endpoint.count("/v1/chat/completions") == 3
        assert endpoint.requests[-1].json() == {"model": "m"}
        assert endpoint.requests[-1].headers["authorization"] == f"Bearer {key}"

        endpoint.clear()
        endpoint.add(EchoHeaders(401), times=None)
        error = failure()
        assert "HTTP 401 from" in str(error) and "Bearer ***" in str(error) and endpoint.count() == 1  # final

        endpoint.clear()
        endpoint.add(Status(503), times=None)
        assert "gave up after 3 attempts" in str(failure()) and endpoint.count() == 3

        endpoint.clear()
        endpoint.add(Reply(f"not JSON, {key}"))
        assert "invalid JSON" in str(failure())

        endpoint.clear()
        endpoint.add(Redirect(elsewhere.url + "/v1/chat/completions"))
        elsewhere.add(Reply('{"ok": true}'))
        assert post() == {"ok": True}
        assert "authorization" not in elsewhere.requests[-1].headers
        get_loop().run(api.aclose())

    gone = Transport.for_url(f"http://127.0.0.1:{free_port()}", error=PolicyError, retry=retry)
    with pytest.raises(PolicyError, match="cannot connect"):
        get_loop().run(gone.post_json("/chat/completions", {}))
    get_loop().run(gone.aclose())
    with pytest.raises(ConfigurationError, match="base_url"):
        Transport.for_url("127.0.0.1:8000/v1", error=PolicyError)


def test_client_options_are_one_object_and_keywords_still_work(ref_server) -> None:
    """The client's options are one `ClientOptions` (documented once); each may still be passed as a keyword, which
    replaces the object's, and an unknown keyword is a `ConfigurationError` that names it and the valid ones."""
    from ors_trl import ClientOptions, RetryPolicy, Timeouts

    options = ClientOptions(env_name="EchoEnvironment", timeouts=Timeouts(request=30.0))
    with Client(ref_server.url, options, retry=RetryPolicy(max_attempts=2)) as c:
        assert c.environment() == "echoenvironment" and c.num_tasks("train") > 0
        assert c.options.timeouts == Timeouts(request=30.0) and c.options.retry == RetryPolicy(max_attempts=2)
        assert c.async_client.timeouts.request == 30.0
    with pytest.raises(ConfigurationError, match=r"'max_session'; the options are .*max_sessions.*see ClientOptions"):
        AsyncClient(ref_server.url, max_session=3)
    with pytest.raises(ConfigurationError, match="max_sessions must be at least 1"):
        ClientOptions(max_sessions=0)
    assert "sk-hidden" not in repr(ClientOptions(api_key="sk-hidden-123", secrets={"k": "sk-hidden-456"}))
