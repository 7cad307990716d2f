"""Hostile round 2: probes in classes the first round (test_fuzz, test_security, test_reliability) left out.

Slow or trickling answers (the request deadline is a total, the stream deadline an idle one), compression (stacked,
unasked-for and corrupt encodings, raw and zlib deflate, gzip on an event stream), redirects (method and body per
status, credentials across ports, chains at the limit, relative and parser-confusing `Location`s), encodings (BOMs,
charsets, the three SSE line endings, odd fields), huge or odd identifiers (session ids, task ids, names with path
characters), concurrency against faults (resets every third connection, a flapping gateway, resumes under load, a
server that closes every keep-alive connection, pings that 404 while calls succeed) and odd HTTP (`103 Early Hints`,
endless `102 Processing`, HTTP/1.0 read to the close, 600,000 keepalive comments in bounded memory).

Each probe drives the public surface (`AsyncClient`, its sessions, `Client`) against a purpose-built loopback server
(`ors_trl.testing.FaultProxy` with scripted answers) or the reference server behind one, and asserts on typed errors,
counts of requests, what reached which server, and sessions left; every wait is bounded by the client's deadlines or
the proxy's `max_seconds`. No wall-clock thresholds.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import gzip
import json
import logging
import threading
import tracemalloc
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from ors_trl import (
    APIStatusError,
    AsyncClient,
    Client,
    ConfigurationError,
    ORSError,
    ORSTimeoutError,
    ProtocolError,
    RetryPolicy,
    ServiceUnavailableError,
    StreamInterruptedError,
    Timeouts,
    TransportError,
)
from ors_trl.protocol.loop import get_loop
from ors_trl.protocol.target import encode_secrets
from ors_trl.testing.faults import DropStream, Fault, FaultProxy, Redirect, Reply, Reset, SSEReply, Status

ENV = "hostileenv"
KEY = "sk-round2-APIKEY-4e5f6a7b8c9d"
SECRET = "hunter2-R2SECRET-1a2b3c4d"
OVERRIDE = "sk-openai-R2OVERRIDE-99887766"
SECRETS = {"db_password": SECRET}
LEAKS = (KEY, SECRET, OVERRIDE, encode_secrets(SECRETS))
#: For the probes about deadlines.
TIMEOUTS = Timeouts(connect=1.0, request=0.5, stream_idle=0.3, tool_call=1.5)
RETRY = RetryPolicy(max_attempts=2, backoff_initial=0.01, backoff_max=0.05, starting_timeout=0.3, resume_attempts=2)
#: The default: deadlines no probe comes near unless it is about them (scheduling on a busy 2-core box).
ROOMY = Timeouts(connect=5.0, request=20.0, stream_idle=20.0, tool_call=30.0)
NUM = json.dumps({"num_tasks": 4}).encode()
RESULT = json.dumps({"ok": True, "output": {"blocks": [{"type": "text", "text": "done"}], "reward": 1.0,
                                            "finished": True, "metadata": {"k": "v"}}})
#: A trickle's pause between bytes: far below every idle deadline, so only a total deadline can stop it.
DRIP_S = 0.02


# --------------------------------------------------------------------------------------------------
# A purpose-built server: FaultProxy rules, some of them scripted byte by byte
# --------------------------------------------------------------------------------------------------


class Script(Fault):
    """Answer with `fn(exchange)`: raw writes, chunks, pauses (each bounded by the proxy's stop)."""

    name = "script"

    def __init__(self, fn: Callable[[Any], Awaitable[None]]) -> None:
        self.fn = fn

    async def handle(self, ex: Any) -> None:
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self.fn(ex)


def head(status: int = 200, headers: dict[str, str] | None = None, length: int | None = None,
         content_type: str = "application/json") -> bytes:
    lines = [f"HTTP/1.1 {status} Status", f"Content-Type: {content_type}"]
    lines += [f"Content-Length: {length}"] if length is not None else []
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def drip(ex: Any, data: bytes, *, chunked: bool = False, every: float = DRIP_S) -> None:
    """Write `data` one byte at a time, `every` seconds apart (until the client goes away or the proxy stops)."""
    for i in range(len(data)):
        if ex.proxy._stopping.is_set():
            return
        await (ex.chunk if chunked else ex._write)(data[i:i + 1])
        await ex.wait(every)


def sse(*events: tuple[str, str]) -> bytes:
    return b"".join(f"event: {e}\n".encode() + b"".join(f"data: {line}\n".encode() for line in d.split("\n")) + b"\n"
                    for e, d in events)


def raw_sse(*pieces: bytes, then: str = "end") -> Script:
    """An event stream of exactly these chunks (each its own HTTP chunk, so line ends can straddle them)."""

    async def go(ex: Any) -> None:
        await ex.start_stream(200)
        for piece in pieces:
            await ex.chunk(piece)
        if then == "end":
            await ex.end()
        elif then == "hang":
            await ex.wait(10.0)
            await ex.close()
        else:
            await ex.close()

    return Script(go)


@contextlib.contextmanager
def fake(*rules: tuple[Fault, str | None] | tuple[Fault, str | None, int | None]):
    """A FaultProxy serving `rules` first (fault, path[, times]), then a valid environment listing, session ids and
    `{}` for everything else."""
    with FaultProxy(None) as proxy:
        for fault, path, *times in rules:
            proxy.add(fault, path=path, times=times[0] if times else None)
        proxy.add(Reply(json.dumps([ENV])), path="/list_environments", times=None)
        proxy.add(SSEReply([("task_id", "sid-1")]), path="/create_session", times=None)
        proxy.add(Reply("{}"), times=None)
        yield proxy


def run(url: str, body: Callable[[AsyncClient], Awaitable[Any]], **kwargs: Any) -> Any:
    options: dict[str, Any] = {"env_name": ENV, "api_key": KEY, "secrets": SECRETS, "timeouts": ROOMY,
                               "retry": RETRY, "keepalive_interval": None, **kwargs}

    async def go() -> Any:
        async with AsyncClient(url, **options) as client:
            return await body(client)

    return get_loop().run(go())


def num_tasks(client: AsyncClient) -> Awaitable[int]:
    return client.num_tasks("train")


async def one_call(client: AsyncClient, name: str = "work", arguments: dict | None = None) -> Any:
    async with await client.open_session(split="train", index=0) as session:
        return await session.call(name, arguments if arguments is not None else {"step": 0})


def posts(proxy: FaultProxy, path: str) -> list[Any]:
    return [r for r in proxy.requests if r.path.endswith(path)]


def clean(exc: BaseException, limit: int = 2000) -> str:
    """The error's message, checked: bounded, no credential (any 12 characters of one), no control character."""
    message = str(exc)
    assert isinstance(exc, ORSError), repr(exc)
    assert 0 < len(message) < limit, len(message)
    assert not any(ord(c) < 32 and c not in "\n\t" for c in message), message[:300]
    for secret in LEAKS:
        assert not any(secret[i:i + 12] in message for i in range(len(secret) - 11)), message[:300]
    assert exc.__cause__ is None and exc.__context__ is None
    return message


def anywhere(seen: list[Any]) -> str:
    """Everything a server received (headers and bodies), as one text to search for credentials."""
    return "\n".join(json.dumps(r.headers) + r.body.decode("latin-1") for r in seen)


# --------------------------------------------------------------------------------------------------
# 1. Slow and trickling answers: the request deadline is a total, the stream deadline an idle one
# --------------------------------------------------------------------------------------------------


def test_status_line_and_headers_trickled_past_the_request_deadline() -> None:
    """Headers arriving a byte every 20 ms never go idle; only the total request deadline ends them."""
    async def go(ex: Any) -> None:
        await drip(ex, head(length=len(NUM)) + NUM)

    with fake((Script(go), "/num_tasks")) as proxy:
        with pytest.raises(ORSTimeoutError) as info:
            run(proxy.url, num_tasks, timeouts=TIMEOUTS)
        assert len(posts(proxy, "/num_tasks")) == RETRY.max_attempts  # idempotent: retried, then given up
    clean(info.value)


def test_a_json_body_trickled_past_the_request_deadline() -> None:
    async def go(ex: Any) -> None:
        await ex._write(head(length=400))
        await drip(ex, b'{"num_tasks": 4' + b" " * 384 + b"}")

    with fake((Script(go), "/num_tasks")) as proxy:
        with pytest.raises(ORSTimeoutError, match=r"no answer within 0\.5 s"):
            run(proxy.url, num_tasks, timeouts=TIMEOUTS)
        assert len(posts(proxy, "/num_tasks")) == RETRY.max_attempts


def test_a_body_trickled_within_the_deadline_is_read_whole() -> None:
    body = b'{"num_tasks": 4, "pad": "' + b"p" * 40 + b'"}'

    async def go(ex: Any) -> None:
        await ex.start_stream(200, content_type="application/json")
        await drip(ex, body, chunked=True, every=0.001)
        await ex.end()

    with fake((Script(go), "/num_tasks")) as proxy:
        assert run(proxy.url, num_tasks) == 4
        assert len(posts(proxy, "/num_tasks")) == 1


def test_create_session_events_trickled_past_the_request_deadline() -> None:
    """`/create_session` is an event stream but a short request: trickled pings cannot hold it past the deadline."""
    async def go(ex: Any) -> None:
        await ex.start_stream(200)
        await drip(ex, b": ping\n\n" * 200, chunked=True)

    with fake((Script(go), "/create_session")) as proxy:
        async def body(client: AsyncClient) -> Any:
            try:
                return await client.open_session(split="train", index=0)
            finally:
                assert client.open_sessions == 0

        with pytest.raises(ORSTimeoutError):
            run(proxy.url, body, timeouts=TIMEOUTS)
        assert len(posts(proxy, "/create_session")) == RETRY.max_attempts
        assert posts(proxy, "/create") == []


def test_a_call_stream_trickling_one_unterminated_line_hits_the_tool_call_deadline() -> None:
    """Bytes every 20 ms that never end a line: never idle, never an event; `Timeouts.tool_call` ends it, and the
    call is not re-posted."""
    async def go(ex: Any) -> None:
        await ex.start_stream(200)
        await ex.chunk(sse(("task_id", "drip-1")))
        await drip(ex, b"data: " + b"x" * 500, chunked=True)

    with fake((Script(go), "/call")) as proxy:
        with pytest.raises(ORSTimeoutError, match=r"Timeouts\.tool_call") as info:
            run(proxy.url, one_call, timeouts=Timeouts(request=1.0, stream_idle=1.0, tool_call=2.0))
        assert len(posts(proxy, "/call")) == 1
    clean(info.value)


def test_pings_with_growing_gaps_are_resumed_then_given_up() -> None:
    """A slowloris stream: comments further and further apart. Once a gap passes `stream_idle` the stream is dead;
    it is resumed by its task id (each resume meets the same stream), then given up, never re-run."""
    async def go(ex: Any) -> None:
        await ex.start_stream(200)
        await ex.chunk(sse(("task_id", "grow-1")))
        for k in range(10):
            await ex.chunk(b": ping\n\n")
            await ex.wait(0.01 * 2 ** k)

    with fake((Script(go), "/call")) as proxy:
        with pytest.raises(StreamInterruptedError, match="kept dropping"):
            run(proxy.url, one_call, timeouts=Timeouts(request=1.0, stream_idle=0.2, tool_call=20.0))
        calls = posts(proxy, "/call")
        assert len(calls) == 1 + RETRY.resume_attempts
        assert "task_id" not in calls[0].json() and all(c.json()["task_id"] == "grow-1" for c in calls[1:])


def test_a_partial_event_before_a_stall_is_not_glued_to_the_replay() -> None:
    """Half an `end` event, then silence: the resumed stream's replay is read on its own."""
    first = raw_sse(sse(("task_id", "part-1")), b'event: end\ndata: {"ok": tr', then="hang")
    with fake((first, "/call", 1), (SSEReply([("task_id", "part-1"), ("end", RESULT)]), "/call")) as proxy:
        result = run(proxy.url, one_call, timeouts=TIMEOUTS)
        assert result.text == "done" and result.reward == 1.0
        calls = posts(proxy, "/call")
        assert len(calls) == 2 and calls[1].json()["task_id"] == "part-1"


def test_an_error_status_whose_body_trickles_is_read_under_the_request_deadline() -> None:
    """A 502 to a `/call` whose body trickles forever: the error's detail is read under `Timeouts.request` like any
    answer, so the 502 is retried and reported as one, instead of holding the call until `Timeouts.tool_call`."""
    async def go(ex: Any) -> None:
        await ex._write(head(502, length=100_000))
        await drip(ex, b'{"detail": "' + b"slow " * 20_000)

    with fake((Script(go), "/call")) as proxy:
        with pytest.raises(ServiceUnavailableError, match="gave up after 2 attempts") as info:
            run(proxy.url, one_call, timeouts=Timeouts(request=0.5, stream_idle=0.3, tool_call=20.0))
        assert len(posts(proxy, "/call")) == RETRY.max_attempts
    clean(info.value)


# --------------------------------------------------------------------------------------------------
# 2. Compression
# --------------------------------------------------------------------------------------------------


def raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    return packer.compress(data) + packer.flush()


@pytest.mark.parametrize("body,encoding", [
    (raw_deflate(NUM), "deflate"),
    (zlib.compress(NUM), "deflate"),
    (gzip.compress(NUM), "GZIP"),
    (gzip.compress(NUM[:7]) + gzip.compress(NUM[7:]), "gzip"),
    (NUM, "identity"),
], ids=["raw-deflate", "zlib-deflate", "upper-case-label", "two-gzip-members", "identity"])
def test_encodings_a_client_must_decode(body, encoding) -> None:
    with fake((Reply(body, headers={"Content-Encoding": encoding}), "/num_tasks")) as proxy:
        assert run(proxy.url, num_tasks) == 4


@pytest.mark.parametrize("body,encoding", [
    (zlib.compress(gzip.compress(NUM)), "gzip, deflate"),
    (b"\x0b\x02\x80" + NUM, "br"),
    (b"\x28\xb5\x2f\xfd" + NUM, "zstd"),
    (gzip.compress(NUM) + b"trailing garbage", "gzip"),
    (zlib.compress(NUM), "gzip"),
    (gzip.compress(NUM), "x-gzip"),
], ids=["stacked", "br-unasked", "zstd-unasked", "gzip-trailing-garbage", "zlib-labelled-gzip", "x-gzip"])
def test_a_body_the_client_cannot_decode_is_a_protocol_error_naming_the_encoding(body, encoding) -> None:
    """Stacked, unasked-for or corrupt encodings: the answer is malformed, not the network broken. Not retried (the
    same bytes would come back), and the message names the encoding instead of quoting compressed bytes."""
    with fake((Reply(body, headers={"Content-Encoding": encoding}), "/num_tasks")) as proxy:
        with pytest.raises(ProtocolError) as info:
            run(proxy.url, num_tasks)
        assert len(posts(proxy, "/num_tasks")) == 1
    message = clean(info.value)
    assert "encoding" in message.lower() and encoding.split(",")[0] in message, message
    assert "\\x1f\\x8b" not in message and "\\x0b" not in message


def test_an_unknown_label_on_a_plain_body_is_read_as_it_is() -> None:
    """A misconfigured server labelling plain JSON (`Content-Encoding: utf-8`): the body is still read."""
    with fake((Reply(NUM, headers={"Content-Encoding": "utf-8"}), "/num_tasks")) as proxy:
        assert run(proxy.url, num_tasks) == 4


def test_a_gzipped_event_stream_is_decoded_across_chunks() -> None:
    packed = gzip.compress(sse(("task_id", "gz-1"), ("end", RESULT)))

    async def go(ex: Any) -> None:
        await ex.start_stream(200, [("Content-Encoding", "gzip")])
        for i in range(0, len(packed), 7):
            await ex.chunk(packed[i:i + 7])
        await ex.end()

    with fake((Script(go), "/call")) as proxy:
        result = run(proxy.url, one_call)
    assert result.text == "done" and result.task_id == "gz-1"


def test_a_corrupt_gzip_event_stream_is_a_protocol_error_not_rerun() -> None:
    """A gzip stream that goes bad after the task id: malformed, not dropped; the tool is neither resumed nor re-run."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    start = packer.compress(sse(("task_id", "gz-2"))) + packer.flush(zlib.Z_SYNC_FLUSH)

    async def go(ex: Any) -> None:
        await ex.start_stream(200, [("Content-Encoding", "gzip")])
        await ex.chunk(start)
        await ex.chunk(b"\xff" * 64)
        await ex.end()

    with fake((Script(go), "/call")) as proxy:
        with pytest.raises(ProtocolError, match="gzip") as info:
            run(proxy.url, one_call)
        assert len(posts(proxy, "/call")) == 1
    clean(info.value)


def test_a_gzipped_error_detail_is_shown_decoded() -> None:
    detail = gzip.compress(json.dumps({"detail": "the environment blew up"}).encode())
    with fake((Reply(detail, status=500, headers={"Content-Encoding": "gzip"}), "/num_tasks")) as proxy, \
            pytest.raises(APIStatusError, match="the environment blew up"):
        run(proxy.url, num_tasks)


# --------------------------------------------------------------------------------------------------
# 3. Redirects
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [307, 308])
def test_307_and_308_keep_the_method_and_body(status) -> None:
    with fake((Redirect("/moved/num_tasks", status=status), f"/{ENV}/num_tasks"),
              (Reply(NUM), "/moved/num_tasks")) as proxy:
        assert run(proxy.url, num_tasks) == 4
        moved = posts(proxy, "/moved/num_tasks")
    assert [(r.method, r.json()) for r in moved] == [("POST", {"split": "train"})]
    assert moved[0].headers.get("x-api-key") == KEY  # same origin: the key follows


@pytest.mark.parametrize("status", [301, 302, 303])
def test_301_302_303_on_a_post_become_a_get_without_the_body(status) -> None:
    with fake((Redirect("/moved/num_tasks", status=status), f"/{ENV}/num_tasks"),
              (Reply(NUM), "/moved/num_tasks")) as proxy:
        assert run(proxy.url, num_tasks) == 4
        moved = posts(proxy, "/moved/num_tasks")
    assert [(r.method, r.body) for r in moved] == [("GET", b"")]
    assert "content-type" not in moved[0].headers


def test_a_302_on_create_fails_typed_and_leaves_no_session() -> None:
    """`/create` redirected by a 302 arrives as a GET the server refuses: a typed error, and the session id the
    client holds is deleted."""
    with fake((Redirect("/moved/create-here", status=302), "/create"),
              (Status(405, "Method Not Allowed"), "/moved/create-here")) as proxy:
        async def body(client: AsyncClient) -> Any:
            try:
                return await client.open_session(split="train", index=0)
            finally:
                assert client.open_sessions == 0

        with pytest.raises(APIStatusError, match="405"):
            run(proxy.url, body)
        assert [r.headers.get("x-session-id") for r in posts(proxy, "/delete")] == ["sid-1"]


@pytest.fixture
def elsewhere():
    """Another loopback server (another port: another origin) that records what reaches it."""
    with FaultProxy(None) as other:
        other.add(SSEReply([("task_id", "sid-elsewhere")]), path="/create_session", times=None)
        other.add(SSEReply([("task_id", "t-else"), ("end", RESULT)]), path="/call", times=None)
        other.add(Reply(NUM), path="/num_tasks", times=None)
        other.add(Reply("{}"), times=None)
        yield other


def test_a_cross_port_redirect_of_create_session_does_not_carry_the_overrides_in_its_body(elsewhere) -> None:
    """`/create_session` carries `env_overrides` (API keys of other services) in its body, which a redirect would
    re-send: a redirect to another origin is not followed with a credential in the body."""
    with fake((Redirect(elsewhere.url + "/create_session"), "/create_session")) as proxy, \
            pytest.raises(ORSError) as info:
        run(proxy.url, lambda c: c.open_session(split="train", index=0), env_overrides={"OPENAI_API_KEY": OVERRIDE})
    assert elsewhere.requests == []
    message = clean(info.value)
    assert "redirect" in message and "another host" in message, message


@pytest.mark.parametrize("route", ["/create", "/call"])
def test_a_cross_port_redirect_mid_session_drops_the_credential_headers(elsewhere, route) -> None:
    with fake((Redirect(elsewhere.url + route), route), (SSEReply([("task_id", "t1"), ("end", RESULT)]), "/call")
              ) as proxy:
        assert run(proxy.url, one_call).text == "done"
    seen = elsewhere.requests
    assert [r.path for r in seen] == [route]
    assert "x-api-key" not in seen[0].headers and "x-secrets" not in seen[0].headers
    text = anywhere(seen)
    assert KEY not in text and SECRET not in text


def test_a_redirect_away_and_back_does_not_leak_on_the_way(elsewhere) -> None:
    """Away to another port, then back: the other port never sees a credential (and the way back carries none)."""
    async def away(ex: Any) -> None:
        await ex.reply(307, b"", [("Location", elsewhere.url + "/away")], content_type="")

    elsewhere.clear()
    with fake((Script(away), f"/{ENV}/num_tasks"), (Reply(NUM), "/back/num_tasks")) as proxy:
        elsewhere.add(Redirect(proxy.url + "/back/num_tasks"), times=None)
        assert run(proxy.url, num_tasks) == 4
        [back] = posts(proxy, "/back/num_tasks")
    assert [r.path for r in elsewhere.requests] == ["/away"]
    assert KEY not in anywhere([*elsewhere.requests, back]) and SECRET not in anywhere(elsewhere.requests)


@pytest.mark.parametrize("hops,ok", [(10, True), (11, False)], ids=["at-the-limit", "past-the-limit"])
def test_a_redirect_chain_at_the_limit(hops, ok) -> None:
    async def go(ex: Any) -> None:
        n = int(ex.seen.path.split("/")[1][3:]) if ex.seen.path.startswith("/hop") else 0
        if n < hops:
            await ex.reply(307, b"", [("Location", f"/hop{n + 1}/num_tasks")], content_type="")
        else:
            await ex.reply(200, NUM)

    with fake((Script(go), "/num_tasks")) as proxy:
        if ok:
            assert run(proxy.url, num_tasks) == 4
        else:
            with pytest.raises(TransportError, match="more than 10 redirects") as info:
                run(proxy.url, num_tasks)
            clean(info.value)
        assert len([r for r in proxy.requests if r.path != "/list_environments"]) == 11


def test_a_relative_location_with_dot_segments_resolves_on_the_same_origin() -> None:
    with fake((Redirect("../moved/./num_tasks?from=redirect", status=307), f"/{ENV}/num_tasks"),
              (Reply(NUM), "/moved/num_tasks")) as proxy:
        assert run(proxy.url, num_tasks) == 4
        moved = posts(proxy, "/moved/num_tasks")
    assert len(moved) == 1 and moved[0].target == "/moved/num_tasks?from=redirect"
    assert moved[0].headers.get("x-api-key") == KEY and moved[0].method == "POST"


def test_a_location_two_url_parsers_read_differently_reaches_no_other_port(elsewhere) -> None:
    """`http://127.0.0.1:OTHER\\@127.0.0.1:SAME/`: `urlsplit` reads the host after the `@` (the key's own), a
    WHATWG parser the one before it. No request may reach the other port with the key."""
    async def confusing(ex: Any) -> None:
        location = f"http://127.0.0.1:{elsewhere.port}\\@127.0.0.1:{ex.proxy.port}/x"
        await ex.reply(307, b"", [("Location", location)], content_type="")

    with fake((Script(confusing), f"/{ENV}/num_tasks")) as proxy, pytest.raises(ORSError) as info:
        run(proxy.url, num_tasks)
    assert elsewhere.requests == []
    clean(info.value)


# --------------------------------------------------------------------------------------------------
# 4. Encodings: charsets, BOMs, the three SSE line endings, odd fields
# --------------------------------------------------------------------------------------------------


TASKS = {"tasks": [{"id": "café ☕"}], "env_name": ENV}


@pytest.mark.parametrize("body,content_type", [
    (json.dumps(TASKS, ensure_ascii=False).encode("latin-1", "replace"), "application/json; charset=latin-1"),
    (codecs.BOM_UTF16_LE + json.dumps(TASKS, ensure_ascii=False).encode("utf-16-le"), "application/json"),
    (json.dumps(TASKS, ensure_ascii=False).encode("utf-32-be"), "application/json"),
    (codecs.BOM_UTF8 + json.dumps(TASKS, ensure_ascii=False).encode(), "application/json; charset=utf-8"),
    (json.dumps(TASKS, ensure_ascii=False).encode(), "application/json; charset=US-ASCII"),
    (json.dumps(TASKS, ensure_ascii=False).encode(), "application/json; charset=no-such-codec"),
], ids=["declared-latin-1", "utf-16-with-bom", "utf-32-no-bom", "utf-8-bom-declared", "utf-8-declared-ascii",
        "unknown-charset"])
def test_json_in_a_declared_or_detectable_encoding_is_read_as_such(body, content_type) -> None:
    """RFC 8259 wants UTF-8, but a server that says which charset it wrote (old Java stacks: ISO-8859-1) is read in
    it, and UTF-16 or -32 are recognised as `json.loads` recognises them; ASCII is read as the UTF-8 it is part of."""
    with fake((Reply(body, content_type=content_type), "/task_range")) as proxy:
        tasks = run(proxy.url, lambda c: c.task_range("train", 0, 1))
    expected = "café ?" if "latin-1" in content_type else "café ☕"
    assert tasks[0]["id"] == expected, tasks


@pytest.mark.parametrize("pieces", [
    [b"event: task_id\rdata: le-1\r\revent: end\rdata: " + RESULT.encode() + b"\r\r"],
    [b"event: task_id\r", b"\ndata: le-1\r", b"\n\r", b"\nevent: end\r", b"\ndata: " + RESULT.encode() + b"\r",
     b"\n\r", b"\n"],
    [b"event: task_id\ndata: le-1\r\n\revent: end\r\ndata: " + RESULT.encode() + b"\n\r\n"],
    [b"\xef\xbb\xbfevent: task_id\ndata: le-1\n\n", sse(("end", RESULT))],
    [bytes([b]) for b in b"\xef\xbb\xbfevent: task_id\r\ndata: le-1\r\n\r\nevent: end\r\ndata: " + RESULT.encode()
     + b"\r\n\r\n"],
    [bytes([b]) for b in b"event: task_id\rdata: le-1\r\r: c\r\revent: end\rdata: " + RESULT.encode() + b"\r\r"],
], ids=["cr-only", "crlf-split-across-chunks", "mixed-lf-crlf-cr", "bom-at-stream-start", "crlf-byte-by-byte",
        "cr-only-byte-by-byte"])
def test_every_sse_line_ending_and_a_leading_bom(pieces) -> None:
    """The SSE spec ends lines with CRLF, LF or CR alone, and strips a BOM at the start of the stream."""
    with fake((raw_sse(*pieces), "/call")) as proxy:
        result = run(proxy.url, one_call)
    assert result.text == "done" and result.task_id == "le-1"
    assert len(posts(proxy, "/call")) == 1


@pytest.mark.parametrize("stream", [
    b"event:task_id\ndata:nospace-1\n\nevent:end\ndata:" + RESULT.encode() + b"\n\n",
    b"event: task_id\ndata: nospace-1\n\nevent: end\n" + b"".join(
        b"data: " + part.encode() + b"\n" for part in RESULT.replace(", ", ",\n").split("\n")) + b"\n",
    b"retry: 10\nid: 7\nfoo: bar\nevent: task_id\nid\ndata: nospace-1\n\n: comment\ndata\n\nevent: end\nretry: x\n"
    b"data: " + RESULT.encode() + b"\nid: \x00\n\n",
], ids=["data-without-space", "multi-line-data", "retry-id-unknown-fields"])
def test_sse_fields_the_spec_allows(stream) -> None:
    with fake((raw_sse(stream), "/call")) as proxy:
        result = run(proxy.url, one_call)
    assert result.text == "done" and result.task_id == "nospace-1"


def test_a_nul_in_the_result_json_is_a_protocol_error_shown_escaped() -> None:
    bad = RESULT.replace("done", "do\x00ne")
    with fake((SSEReply([("task_id", "nul-1"), ("end", bad)]), "/call")) as proxy:
        with pytest.raises(ProtocolError, match="invalid JSON") as info:
            run(proxy.url, one_call)
        assert len(posts(proxy, "/call")) == 1
    assert "\\x00" in clean(info.value)


@pytest.mark.parametrize("end,shown", [
    (b"event: END\n", "'END'"), (b"event: \xff\xfeend\n", "'\ufffd\ufffdend'"), (b"event: end \n", "'end '"),
    (b"event: x" + KEY.encode() + b"\n", "'x***'"),
], ids=["upper-case", "invalid-utf-8", "trailing-space", "the-api-key"])
def test_an_event_name_that_is_not_end_is_named_in_the_error(end, shown) -> None:
    """Event names are case-sensitive and exact: a stream whose result comes under another name has no result. The
    error says which events came (masked, escaped), so that the server's authors can see why."""
    stream = sse(("task_id", "odd-1")) + end + b"data: " + RESULT.encode() + b"\n\n"
    with fake((raw_sse(stream), "/call")) as proxy:
        with pytest.raises(StreamInterruptedError) as info:
            run(proxy.url, one_call)
        assert len(posts(proxy, "/call")) == 1 + RETRY.resume_attempts  # resumed, never re-run without its id
    assert f"events this client does not know: {shown}" in clean(info.value), str(info.value)


# --------------------------------------------------------------------------------------------------
# 5. Huge or odd identifiers
# --------------------------------------------------------------------------------------------------


def test_a_session_id_of_one_megabyte_is_refused_at_once() -> None:
    with fake((SSEReply([("task_id", "s" * 1_000_000)]), "/create_session")) as proxy:
        with pytest.raises(ProtocolError, match="cannot be sent back as a header") as info:
            run(proxy.url, lambda c: c.open_session(split="train", index=0))
        assert len(posts(proxy, "/create_session")) == 1 and posts(proxy, "/create") == []
    assert len(clean(info.value)) < 600


@pytest.mark.parametrize("events", [[("task_id", "")], [("task_id", "   ")], [("task_id", "\n")]],
                         ids=["empty", "spaces", "blank-lines"])
def test_an_empty_session_id_is_no_session_id(events) -> None:
    with fake((SSEReply(events), "/create_session")) as proxy:
        with pytest.raises(ProtocolError, match="no session id"):
            run(proxy.url, lambda c: c.open_session(split="train", index=0))
        assert posts(proxy, "/create") == []


def test_a_cr_in_a_session_id_ends_its_line_and_injects_no_header() -> None:
    """`data: sid-1\rX-Injected: yes`: by the SSE spec a bare CR ends the line, so the id is `sid-1` and the rest is a
    field no one knows; no request carries the injected header."""
    with fake((raw_sse(b"event: task_id\ndata: sid-1\rX-Injected: yes\n\n"), "/create_session"),
              (Reply(json.dumps([{"type": "text", "text": "hi"}])), "/prompt")) as proxy:
        async def body(client: AsyncClient) -> None:
            async with await client.open_session(split="train", index=0) as session:
                await session.prompt()

        run(proxy.url, body)
        created = posts(proxy, "/create")
    assert [r.headers.get("x-session-id") for r in created] == ["sid-1"]
    assert not any("x-injected" in r.headers for r in proxy.requests)


def test_a_task_id_with_line_breaks_and_escapes_goes_back_exactly_and_is_logged_escaped(caplog) -> None:
    odd = "a\nb\x1b[2J\u202e"
    with fake((raw_sse(sse(("task_id", odd))), "/call", 1), (SSEReply([("task_id", odd), ("end", RESULT)]), "/call")
              ) as proxy, caplog.at_level(logging.DEBUG, logger="ors_trl"):
        result = run(proxy.url, one_call)
        calls = posts(proxy, "/call")
    assert result.text == "done" and [c.json().get("task_id") for c in calls] == [None, odd]
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "resuming task" in logged and "\x1b" not in logged and "\u202e" not in logged


def test_a_task_id_of_one_megabyte_keeps_messages_bounded() -> None:
    huge = "t" * 1_000_000
    with fake((raw_sse(sse(("task_id", huge))), "/call")) as proxy:
        with pytest.raises(StreamInterruptedError, match="kept dropping") as info:
            run(proxy.url, one_call)
        calls = posts(proxy, "/call")
    assert len(calls) == 1 + RETRY.resume_attempts and calls[-1].json()["task_id"] == huge
    assert len(clean(info.value)) < 600


def test_a_resume_answered_for_another_task_is_refused() -> None:
    """The resumed stream names another task id: its result is another call's (or the tool ran again). Taking it
    would credit this call with what it did not do."""
    with fake((raw_sse(sse(("task_id", "mine")), then="close"), "/call", 1),
              (SSEReply([("task_id", "theirs"), ("end", RESULT)]), "/call")) as proxy:
        with pytest.raises(ProtocolError, match="theirs") as info:
            run(proxy.url, one_call)
        assert len(posts(proxy, "/call")) == 2
    clean(info.value)


@pytest.mark.parametrize("env_name", ["../admin", "%2e%2e", "env?x=1#y", "two words", "a/b"])
def test_an_env_name_that_is_no_path_segment_is_refused_before_anything_is_sent(env_name) -> None:
    """A user-given `env_name` goes into every request's path when the server cannot list its environments (or for
    a catalog target): `../admin` would reach another route of the server."""
    with fake((Status(404, "Not Found"), "/list_environments")) as proxy:
        with pytest.raises(ConfigurationError, match="env_name"):
            run(proxy.url, num_tasks, env_name=env_name)
        assert [r.path for r in proxy.requests if r.path != "/list_environments"] == []


def test_a_tool_name_with_path_and_query_characters_stays_in_the_body() -> None:
    name = "../../admin?x=1#frag %2e%2e/tool"
    with fake((SSEReply([("task_id", "t1"), ("end", RESULT)]), "/call")) as proxy:
        run(proxy.url, lambda c: one_call(c, name, {"p": "../"}))
        calls = posts(proxy, "/call")
    assert [(c.target, c.json()["name"]) for c in calls] == [(f"/{ENV}/call", name)]


def test_a_split_name_with_path_and_query_characters_stays_in_the_body() -> None:
    split = "../train?x=1#y %2e"
    with fake((Reply(NUM), "/num_tasks")) as proxy:
        assert run(proxy.url, lambda c: c.num_tasks(split)) == 4
        [seen] = posts(proxy, "/num_tasks")
    assert seen.target == f"/{ENV}/num_tasks" and seen.json() == {"split": split}


# --------------------------------------------------------------------------------------------------
# 6. Concurrency against faults
# --------------------------------------------------------------------------------------------------


class EveryNth(Fault):
    """Answer every `n`th request with `fault`, the rest with `otherwise` (counted, thread-safe)."""

    name = "every_nth"

    def __init__(self, n: int, fault: Fault, otherwise: Fault) -> None:
        self.n, self.fault, self.otherwise = n, fault, otherwise
        self.seen = 0
        self.hit = 0
        self._lock = threading.Lock()

    async def handle(self, ex: Any) -> None:
        with self._lock:
            self.seen += 1
            hit = self.seen % self.n == 0
            self.hit += hit
        await (self.fault if hit else self.otherwise).handle(ex)


class Forwarding(Fault):
    name = "forward"

    async def handle(self, ex: Any) -> None:
        await ex.forward()


def test_64_concurrent_requests_while_every_third_connection_resets() -> None:
    resets = EveryNth(3, Reset(), Reply(NUM))
    with fake((resets, "/num_tasks")) as proxy:
        async def body(client: AsyncClient) -> list[Any]:
            return await asyncio.gather(*(client.num_tasks("train") for _ in range(64)), return_exceptions=True)

        results = run(proxy.url, body, retry=RetryPolicy(max_attempts=6, backoff_initial=0.01, backoff_max=0.02))
        assert results == [4] * 64
        assert len(posts(proxy, "/num_tasks")) == 64 + resets.hit


@pytest.fixture
def upstream(ref_server):
    with FaultProxy(ref_server.url) as proxy:
        yield proxy


def echo_runs(server: Any) -> int:
    """How often the reference server ran the echo tool so far (other tests share it: compare, never assume 0)."""
    return server.stats()["tool_calls"].get("echoenvironment/echo", 0)


def test_64_concurrent_calls_while_every_third_call_connection_resets(upstream, ref_server) -> None:
    """A reset before the server saw the call: `StreamInterruptedError` (never re-posted blindly); every other call
    ran exactly once, and no session is left."""
    resets = EveryNth(3, Reset(), Forwarding())
    upstream.add(resets, path="/call", times=None)
    before, open_before = echo_runs(ref_server), ref_server.stats()["open_sessions"]

    async def body(client: AsyncClient) -> list[Any]:
        sessions = await asyncio.gather(*(client.open_session(split="train", index=i % 4) for i in range(16)))

        async def calls(session: Any, k: int) -> list[Any]:
            return [await _safely(session.call("echo", {"text": f"w{k}-{j}"})) for j in range(4)]

        try:
            return [r for rs in await asyncio.gather(*(calls(s, k) for k, s in enumerate(sessions))) for r in rs]
        finally:
            await asyncio.gather(*(s.close() for s in sessions))

    results = run(upstream.url, body, env_name="echoenvironment", api_key=None, secrets=None)
    failed = [r for r in results if isinstance(r, BaseException)]
    assert len(results) == 64 and len(failed) == resets.hit == 64 // 3
    assert all(isinstance(f, StreamInterruptedError) for f in failed), failed[:3]
    assert {r.text for r in results if not isinstance(r, BaseException)} <= {f"w{k}-{j}" for k in range(16)
                                                                            for j in range(4)}
    ref_server.wait_for_stats(lambda s: s["open_sessions"] == open_before)
    assert echo_runs(ref_server) - before == 64 - resets.hit


async def _safely(coro: Awaitable[Any]) -> Any:
    try:
        return await coro
    except ORSError as exc:
        return exc


def test_a_gateway_flapping_between_503_and_healthy_mid_episode(upstream, ref_server) -> None:
    flap = EveryNth(2, Status(503, "flapping"), Forwarding())
    upstream.add(flap, times=None)
    before, open_before = echo_runs(ref_server), ref_server.stats()["open_sessions"]
    with Client(upstream.url, env_name="echoenvironment", timeouts=ROOMY,
                retry=RetryPolicy(max_attempts=4, backoff_initial=0.01, backoff_max=0.02)) as client, \
            client.open_session(split="train", index=0) as session:
        assert session.prompt()
        words = [session.call("echo", {"text": f"flap{i}"}).text for i in range(3)]
    assert words == ["flap0", "flap1", "flap2"]
    assert echo_runs(ref_server) - before == 3
    assert flap.hit >= 3 and len(posts(upstream, "/call")) == 6  # each call: one 503, then the call
    ref_server.wait_for_stats(lambda s: s["open_sessions"] == open_before)


def test_16_concurrent_calls_each_dropped_after_its_task_id_resume_their_own(upstream, ref_server) -> None:
    upstream.add(DropStream(after_bytes=60), path="/call", times=16)
    before = echo_runs(ref_server)

    async def body(client: AsyncClient) -> list[Any]:
        sessions = await asyncio.gather(*(client.open_session(split="train", index=0) for _ in range(16)))
        try:
            return await asyncio.gather(*(s.call("echo", {"text": f"own{i}"}) for i, s in enumerate(sessions)))
        finally:
            await asyncio.gather(*(s.close() for s in sessions))

    results = run(upstream.url, body, env_name="echoenvironment", api_key=None, secrets=None)
    assert [r.text for r in results] == [f"own{i}" for i in range(16)]
    calls = posts(upstream, "/call")
    resumed = {c.json()["task_id"]: c.json()["input"]["text"] for c in calls if "task_id" in c.json()}
    assert len(calls) == 32 and sorted(resumed.values()) == sorted(f"own{i}" for i in range(16))
    assert {r.task_id: r.text for r in results} == resumed
    assert echo_runs(ref_server) - before == 16


class CloseAfter(Fault):
    """Forward, then close the connection without saying so (no `Connection: close`): a server whose keep-alive
    connections end after every answer."""

    name = "close_after"

    async def handle(self, ex: Any) -> None:
        await ex.forward()
        await ex.close()


def test_a_server_closing_every_keep_alive_connection_after_its_answer(upstream, ref_server) -> None:
    """A server that closes each connection after its answer without saying so (no `Connection: close`, which RFC
    9112 requires): the next request may go out on the closed connection before the client has read the close.
    Idempotent requests are retried and always succeed. A `/call` that meets the closed connection cannot be told
    from one the server received and then dropped, so it is a `StreamInterruptedError`, never re-posted: each call
    either succeeds or fails typed, and the tool ran exactly once per success."""
    upstream.add(CloseAfter(), times=None)
    before = echo_runs(ref_server)
    with Client(upstream.url, env_name="echoenvironment", timeouts=ROOMY, retry=RETRY) as client, \
            client.open_session(split="train", index=0) as session:
        outcomes = []
        for i in range(12):
            try:
                outcomes.append(session.call("echo", {"text": f"c{i}"}).text == f"c{i}")
            except StreamInterruptedError as exc:
                clean(exc)
                outcomes.append(False)
            assert client.num_tasks("train") == 16
    ran = echo_runs(ref_server) - before
    assert ran == sum(outcomes) == len(posts(upstream, "/call"))  # nothing ran twice, nothing ran unreported


def test_pings_that_404_while_calls_succeed_mark_the_session_once_and_stop() -> None:
    """The protocol says a `/ping` answered 404 means the session is gone; a gateway without the route says so of a
    live one. The keepalive marks it expired once and stops pinging it (no loop of 404s), and calls still go
    through: the server, not a ping, decides whether a call works."""
    with fake((Status(404, "Not Found"), "/ping"), (SSEReply([("task_id", "t1"), ("end", RESULT)]), "/call")) as proxy:
        async def body(client: AsyncClient) -> tuple[bool, Any]:
            async with await client.open_session(split="train", index=0) as session:
                for _ in range(60):  # bounded: the keepalive pings within a few of its 0.05 s intervals
                    if session.expired:
                        break
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.3)  # six more keepalive intervals, in which an expired session is not pinged
                return session.expired, await session.call("work", {})

        expired, result = run(proxy.url, body, keepalive_interval=0.05)
        assert len(posts(proxy, "/ping")) == 1
    assert expired and result.text == "done"


def test_32_concurrent_opens_while_every_other_create_session_resets(upstream, ref_server) -> None:
    resets = EveryNth(2, Reset(), Forwarding())
    upstream.add(resets, path="/create_session", times=None)
    open_before = ref_server.stats()["open_sessions"]

    async def body(client: AsyncClient) -> int:
        sessions = await asyncio.gather(*(client.open_session(split="train", index=i % 4) for i in range(32)))
        opened = client.open_sessions
        await asyncio.gather(*(s.close() for s in sessions))
        return opened

    assert run(upstream.url, body, env_name="echoenvironment", api_key=None, secrets=None,
               retry=RetryPolicy(max_attempts=8, backoff_initial=0.01, backoff_max=0.02)) == 32
    assert resets.hit >= 16 and len(posts(upstream, "/create")) == 32
    ref_server.wait_for_stats(lambda s: s["open_sessions"] == open_before)


def test_an_early_hints_answer_before_the_real_one() -> None:
    """`103 Early Hints`, then the answer: the informational response is skipped."""
    async def go(ex: Any) -> None:
        await ex._write(b"HTTP/1.1 103 Early Hints\r\nLink: </x>; rel=preload\r\n\r\n" + head(length=len(NUM)) + NUM)

    with fake((Script(go), "/num_tasks")) as proxy:
        assert run(proxy.url, num_tasks) == 4


def test_an_http_1_0_answer_without_a_length_is_read_to_the_close() -> None:
    async def go(ex: Any) -> None:
        await ex._write(b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n" + NUM)
        await ex.close()

    with fake((Script(go), "/num_tasks")) as proxy:
        assert run(proxy.url, lambda c: asyncio.gather(*(c.num_tasks("train") for _ in range(3)))) == [4, 4, 4]


def test_informational_answers_trickled_forever_are_bounded_by_the_request_deadline() -> None:
    """`102 Processing` after `102 Processing`: each one is skipped, none is an answer; the total deadline ends it."""
    async def go(ex: Any) -> None:
        await drip(ex, b"HTTP/1.1 102 Processing\r\n\r\n" * 100, every=0.002)

    with fake((Script(go), "/num_tasks")) as proxy:
        with pytest.raises(ORSTimeoutError):
            run(proxy.url, num_tasks, timeouts=TIMEOUTS)
        assert len(posts(proxy, "/num_tasks")) == RETRY.max_attempts


def test_a_stream_of_600000_comments_holds_no_memory_per_comment() -> None:
    """Keepalive comments are skipped as they are read: 600,000 of them (15 MB) cost what one costs."""
    comments = b": ping - 1700000000.123\r\n" * 600_000

    async def go(ex: Any) -> None:
        await ex.start_stream(200)
        await ex.chunk(sse(("task_id", "many-1")))
        for i in range(0, len(comments), 1 << 16):
            await ex.chunk(comments[i:i + (1 << 16)])
        await ex.chunk(sse(("end", RESULT)))
        await ex.end()

    with fake((Script(go), "/call")) as proxy:
        tracemalloc.start()
        try:
            result = run(proxy.url, one_call)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert result.text == "done"
    assert peak < len(comments) // 2, peak  # retaining the comments (as bytes or str) would take several times this

