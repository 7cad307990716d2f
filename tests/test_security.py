"""Security (issue 7): hostile environment metadata, bad user input, and secrets that never leak.

Hostile metadata comes from the reference server's ``HostileEnvironment``; leaky or rejecting
servers are ``FaultProxy`` rules. Every secret check looks for the raw key, the raw secret value
and the encoded ``X-Secrets`` header in logs (DEBUG, ors-trl's and aiohttp's loggers), reprs,
exception messages, what the model is shown, episode records, and the headers other hosts got.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os

import pytest

from ors_trl import (
    APIStatusError,
    AuthenticationError,
    BadRequestError,
    Client,
    ConfigurationError,
    EnvironmentNotFoundError,
    MissingAPIKeyError,
    OpenRewardSpec,
    ORSError,
    PaymentRequiredError,
    RetryPolicy,
    Timeouts,
)
from ors_trl.protocol.target import encode_secrets
from ors_trl.testing.faults import (
    DropStream,
    EchoHeaders,
    FaultProxy,
    Hang,
    Redirect,
    Reply,
    Reset,
    SSEReply,
    Status,
)
from ors_trl.testing.server import free_port
from ors_trl.trl.adapter import OpenRewardEnvironment
from tests.fixtures.environments import MANY_TOOLS, PWNED_PATH

FAST = RetryPolicy(max_attempts=2, backoff_initial=0.01, backoff_max=0.02, starting_timeout=0.3, resume_attempts=1)
KEY = "sk-live-SUPERSECRET-0123456789abcdef"
SECRET = "tok-PRIVATE-VALUE-fedcba9876543210"
SECRETS = {"PRIVATE_TOKEN": SECRET}
HEADER = encode_secrets(SECRETS)
FORBIDDEN = (KEY, SECRET, HEADER)
LOGGERS = ("ors_trl", "ors_trl.client", "ors_trl.binding", "aiohttp", "aiohttp.client", "aiohttp.internal",
           "aiohttp.server", "aiohttp.access", "asyncio")


def leaks(text: str) -> list[str]:
    return [s[:12] + "..." for s in FORBIDDEN if s in text]


@pytest.fixture
def proxy(ref_server):
    with FaultProxy(ref_server.url) as p:
        yield p


@pytest.fixture
def debug_logs(caplog):
    for name in LOGGERS:
        caplog.set_level(logging.DEBUG, logger=name)
    caplog.set_level(logging.DEBUG)
    return caplog


# --------------------------------------------------------------------------------------------------
# 9. Hostile environment metadata, end to end
# --------------------------------------------------------------------------------------------------

HOSTILE = {"reset", "get_reward", "_private", "keywords", "tree", "deep", "run-shell", "class"}


def test_hostile_metadata_binds_safely_and_every_tool_reaches_its_remote_tool(ref_server, caplog) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(PWNED_PATH)
    before = ref_server.stats()
    spec = OpenRewardSpec(ref_server.url, env_name="hostileenvironment", indices=[0, 1])
    cls = spec.environment_factory  # binds task 0's and task 1's tools (2000 of them)
    assert not os.path.exists(PWNED_PATH)
    binding = spec.binding
    assert binding is not None
    bulk = {f"bulk_{i:04d}" for i in range(MANY_TOOLS)}
    assert set(binding.remote_names.values()) == HOSTILE | bulk
    # it says what it did: every renamed tool and parameter is reported, and logged
    report = "\n".join(binding.warnings)
    for expected in ("'reset'", "'get_reward'", "'_private'", "'run-shell'", "'class'", "'x-y'", "'__dunder__'",
                     "'self'", "recursive"):
        assert expected in report, expected
    assert "bound as attribute" in caplog.text
    # the adapter's own reset is not shadowed by the remote tool called reset
    assert cls.reset is OpenRewardEnvironment.reset
    # the discovery sessions are gone
    assert ref_server.stats()["open_sessions"] == before["open_sessions"]

    # TRL's collection: public functions of the class, keyed by __name__, rendered by get_json_schema
    from transformers.utils import get_json_schema

    env = cls()
    env.reset(**spec.train_dataset[1])
    tools = {f.__name__: getattr(env, n) for n, f in inspect.getmembers(type(env), inspect.isfunction)
             if n not in ("reset", "get_reward") and not n.startswith("_")}
    assert set(tools) == HOSTILE | bulk  # every tool, under the exact name the environment gave it
    schemas = {name: get_json_schema(fn) for name, fn in tools.items()}
    assert all(s["function"]["name"] == name for name, s in schemas.items())
    assert "pwned" in schemas["run-shell"]["function"]["description"]  # shown as text, never run
    params = schemas["keywords"]["function"]["parameters"]["properties"]

    def reply(name: str, **kwargs: object) -> dict:
        return json.loads(tools[name](**kwargs))

    assert reply("reset", value="v") == {"tool": "reset", "received": {"value": "v"}}
    assert env.reward == 0.25
    assert reply("get_reward") == {"tool": "get_reward", "received": {}}
    assert env.reward == -1.0
    assert reply("_private")["tool"] == "_private"
    assert reply("class")["tool"] == "class"
    assert reply("run-shell", value="echo pwned > /tmp/ors_trl_pwned") == {
        "tool": "run-shell", "received": {"value": "echo pwned > /tmp/ors_trl_pwned"}}
    # the parameter names the model is shown, and the wire names, both arrive under the wire names
    assert sorted(params) == ["class_", "dunder_", "self_", "x_y"]
    shown = {"class_": "k", "dunder_": "d", "self_": "me", "x_y": 3}
    wire = {"__dunder__": "d", "class": "k", "self": "me", "x-y": 3}
    assert reply("keywords", **shown)["received"] == wire
    assert reply("keywords", **wire)["received"] == wire
    tree = {"label": "a", "children": [{"label": "b", "children": [{"label": "c", "children": []}]}]}
    assert reply("tree", root=tree)["received"] == {"root": tree}
    deep = {"k": [{"x": [[{"n": 1}]]}]}
    assert reply("deep", a=deep)["received"] == {"a": deep}
    for name in sorted(bulk):
        assert tools[name]() == name
    after = ref_server.stats()["tool_calls"]
    assert after["hostileenvironment/bulk"] - before["tool_calls"].get("hostileenvironment/bulk", 0) == MANY_TOOLS
    assert env.tool_failures == 0 and not os.path.exists(PWNED_PATH)
    spec.close()
    assert ref_server.stats()["open_sessions"] == before["open_sessions"]


# --------------------------------------------------------------------------------------------------
# 10. Bad user input: typed errors that name the fix, raised early
# --------------------------------------------------------------------------------------------------


def test_unknown_environment_is_reported_on_first_use(ref_server) -> None:
    for attribute in ("train_dataset", "environment_factory"):
        spec = OpenRewardSpec(ref_server.url, env_name="nope")  # construction never touches the network
        with pytest.raises(EnvironmentNotFoundError, match=r"'nope' is not on .*echoenvironment.*env_name=") as info:
            getattr(spec, attribute)
        assert "hostileenvironment" in info.value.available


def test_unknown_split_lists_the_real_ones(ref_server) -> None:
    spec = OpenRewardSpec(ref_server.url, env_name="echoenvironment", split="validation")
    with pytest.raises(BadRequestError, match=r"split 'validation' does not exist .*available splits: train, test"):
        spec.train_dataset  # noqa: B018


def test_out_of_range_and_malformed_indices(ref_server) -> None:
    with pytest.raises(ConfigurationError, match=r"indices \[16, 40\] are out of range .* 16 tasks \(0\.\.15\)"):
        OpenRewardSpec(ref_server.url, env_name="echoenvironment", indices=[0, 40, 16]).train_dataset  # noqa: B018
    for bad in ([-1], ["3"], [True], []):
        with pytest.raises(ConfigurationError, match="indices"):
            OpenRewardSpec(ref_server.url, indices=bad)
    with pytest.raises(ConfigurationError, match="num_tasks or indices, not both"):
        OpenRewardSpec(ref_server.url, num_tasks=3, indices=[0])
    for bad in (0, -2, True, "3"):
        with pytest.raises(ConfigurationError, match="num_tasks must be a positive int"):
            OpenRewardSpec(ref_server.url, num_tasks=bad)


@pytest.mark.parametrize("target", [
    "http//127.0.0.1:8000", "ftp://127.0.0.1:8000", "http://", "http://127.0.0.1:port", "127.0.0.1:8000", "",
    "http://user:pw-SECRET-123@127.0.0.1:8000", "ftp://user:pw-SECRET-123@127.0.0.1:8000",
    "http://user:pw-SECRET-123@127.0.0.1:port",
])
def test_malformed_targets_fail_at_construction(target) -> None:
    with pytest.raises(ConfigurationError) as info:
        OpenRewardSpec(target)
    message = str(info.value)
    assert "http://127.0.0.1:8000" in message or "credentials" in message or "catalog name" in message
    assert "pw-SECRET-123" not in message  # a password in a URL is not echoed back


def test_missing_api_key_for_a_catalog_name(monkeypatch) -> None:
    monkeypatch.delenv("OPENREWARD_API_KEY", raising=False)
    with pytest.raises(MissingAPIKeyError, match=r"OPENREWARD_API_KEY.*api_key="):
        OpenRewardSpec("acme/echo", num_tasks=2)


@pytest.mark.parametrize("status,error,hint", [
    (401, AuthenticationError, "Check OPENREWARD_API_KEY"),
    (403, AuthenticationError, "Check OPENREWARD_API_KEY"),
    (402, PaymentRequiredError, "no credits left"),
])
def test_platform_rejections_are_typed_and_early(monkeypatch, status, error, hint) -> None:
    with FaultProxy(None) as platform:
        platform.add(Status(status, "rejected by the platform"), times=None)
        monkeypatch.setenv("OPENREWARD_URL", platform.url)
        monkeypatch.delenv("OPENREWARD_API_KEY", raising=False)
        for attribute in ("train_dataset", "environment_factory"):
            spec = OpenRewardSpec("acme/echo", api_key=KEY, num_tasks=2, retry=FAST)
            with pytest.raises(error, match=hint) as info:
                getattr(spec, attribute)
            assert info.value.status_code == status and not info.value.retryable
            assert KEY not in str(info.value)
        assert platform.count() == 2  # one request per attempt at use: not retried
        assert all(r.headers.get("x-api-key") == KEY for r in platform.requests)  # it was the platform


# --------------------------------------------------------------------------------------------------
# 11. Secrets never leak
# --------------------------------------------------------------------------------------------------


def _forced_errors(proxy: FaultProxy, ref_server, client: Client) -> list[BaseException]:
    """Provoke every kind of error with a key and secrets set; return the exceptions."""
    errors: list[BaseException] = []

    def expect(fn, *args) -> None:
        try:
            fn(*args)
        except ORSError as exc:
            errors.append(exc)
        else:  # pragma: no cover - every call below must fail
            raise AssertionError(f"{fn} did not fail")

    expect(client.num_tasks, "nope")  # BadRequestError
    expect(lambda: Client(proxy.url, env_name="nope", api_key=KEY, secrets=SECRETS).num_tasks())
    session = client.open_session(split="train", index=0)
    leaky = [
        (EchoHeaders(400), "/num_tasks"), (EchoHeaders(401), "/num_tasks"), (EchoHeaders(402), "/num_tasks"),
        (EchoHeaders(500), "/num_tasks"), (EchoHeaders(503), "/num_tasks"), (Status(404), "/num_tasks"),
        (Reply(f"not json {KEY} {SECRET} {HEADER}"), "/num_tasks"), (Reset(), "/num_tasks"),
        (Hang(max_seconds=20), "/num_tasks"),
    ]
    for fault, path in leaky:
        proxy.add(fault, path=path, times=None)
        expect(client.num_tasks, "train")
        proxy.clear()
    proxy.add(EchoHeaders(400), path="/create", times=1)
    expect(lambda: client.open_session(split="train", index=1))
    proxy.add(Reply(f"[{{\"detail\": \"{KEY}\"}}]"), path="/create_session", times=1)  # not an SSE stream
    with contextlib.suppress(ORSError):
        client.open_session(split="train", index=1)
    for fault in (
        EchoHeaders(404),  # the session "expired"
        EchoHeaders(500),
        SSEReply([("task_id", "t"), ("error", f"tool raised: secret was {SECRET}, key {KEY}, header {HEADER}")]),
        SSEReply([("task_id", "t"), ("end", json.dumps({"ok": False, "error": f"refused {SECRET} {KEY}",
                                                         "reason": "input_validation"}))]),
        SSEReply([("task_id", "t"), ("end", f"not json {KEY} {SECRET}")]),
        SSEReply([("error", "unknown task_id")]),
        DropStream(after_bytes=0),
    ):
        proxy.add(fault, path="/call", times=1)
        expect(session.call, "status", {})
    session.close()
    return errors


def test_secrets_never_appear_in_logs_reprs_errors_or_records(proxy, ref_server, debug_logs, tmp_path) -> None:
    log_path = tmp_path / "episodes.jsonl"
    spec = OpenRewardSpec(proxy.url, env_name="schemaenvironment", api_key=KEY, secrets=SECRETS, num_tasks=4,
                          retry=FAST, timeouts=Timeouts(request=0.5, stream_idle=1.0, tool_call=5.0),
                          episode_log=str(log_path))
    env = spec.environment_factory()
    env.reset(**spec.train_dataset[3])
    create = [r for r in proxy.requests if r.path == "/create"][-1]
    assert create.headers["x-secrets"] == HEADER and create.headers["x-api-key"] == KEY  # they were sent
    # failures seen by the adapter: what the model is shown and what metrics/records keep
    proxy.add(EchoHeaders(500), path="/call", times=1)
    with pytest.raises(ORSError):
        env.status()
    shown = env.last_output
    proxy.add(EchoHeaders(400), path="/create", times=None)
    failed_open = env.reset(**spec.train_dataset[1])
    proxy.clear()
    client = Client(proxy.url, env_name="schemaenvironment", api_key=KEY, secrets=SECRETS, retry=FAST,
                    timeouts=Timeouts(request=0.5, stream_idle=1.0, tool_call=5.0))
    errors = _forced_errors(proxy, ref_server, client)
    kinds = {type(e).__name__ for e in errors}
    assert kinds >= {"BadRequestError", "EnvironmentNotFoundError", "AuthenticationError", "PaymentRequiredError",
                     "ServerError", "ServiceUnavailableError", "NotFoundError", "ProtocolError", "TransportError",
                     "ORSTimeoutError", "SessionExpiredError", "ToolFailedError", "ToolRefusedError",
                     "StreamInterruptedError"}, kinds
    session = client.open_session(split="train", index=2)
    reprs = [repr(x) for x in (client, client.async_client, client.target, session, session.async_session, spec,
                               spec.client, spec.client.target, env, spec.binding)]
    spec.reward_funcs([env])
    spec.close()
    session.close()
    client.close()
    texts = {
        "errors": "\n".join(f"{e}\n{e!r}\n{getattr(e, 'detail', '')}" for e in errors),
        "adapter": f"{shown}\n{failed_open}\n{env.error}\n{env.last_output}",
        "reprs": "\n".join(reprs),
        "logs": debug_logs.text + "\n".join(str(r.args) for r in debug_logs.records),
        "records": log_path.read_text() if log_path.exists() else "",
    }
    assert "secret was ***" in texts["errors"]  # the environment's message is kept, the secret masked
    assert texts["records"].count("\n") == 2 and "***" in texts["records"]  # both episodes, errors masked
    assert {name: leaks(text) for name, text in texts.items()} == {name: [] for name in texts}


def test_the_api_key_goes_only_to_the_platform(proxy, ref_server, monkeypatch) -> None:
    monkeypatch.setenv("OPENREWARD_API_KEY", KEY)
    # a self-hosted URL never gets the environment's key ...
    spec = OpenRewardSpec(proxy.url, env_name="echoenvironment", num_tasks=2, retry=FAST)
    env = spec.environment_factory()
    env.reset(**spec.train_dataset[0])
    env.echo(text="hello")
    spec.close()
    seen = proxy.requests
    assert len(seen) > 5
    assert not [r for r in seen if "x-api-key" in r.headers or "x-secrets" in r.headers]
    assert not [r for r in seen if KEY in json.dumps(r.headers) or KEY.encode() in r.body]
    # ... only one it was given explicitly
    proxy.clear()
    with Client(proxy.url, env_name="echoenvironment", api_key=KEY) as c:
        c.num_tasks()
    assert [r.headers.get("x-api-key") for r in proxy.requests] == [KEY, KEY]


@pytest.mark.parametrize("mode", ["url", "catalog"])
def test_a_redirect_to_another_host_does_not_carry_credentials(proxy, ref_server, monkeypatch, mode) -> None:
    with FaultProxy(ref_server.url) as elsewhere:
        proxy.add(Redirect(elsewhere.url + "/echoenvironment/num_tasks", status=307), path="/num_tasks", times=1)
        proxy.add(Redirect(elsewhere.url + "/echoenvironment/tools", status=302), path="/tools", times=1)
        if mode == "catalog":
            monkeypatch.setenv("OPENREWARD_URL", proxy.url)
            c = Client("acme/echo", env_name="echoenvironment", api_key=KEY, secrets=SECRETS, retry=FAST)
        else:
            c = Client(proxy.url, env_name="echoenvironment", api_key=KEY, secrets=SECRETS, retry=FAST)
        with c:
            assert c.num_tasks("train") == 16  # the redirect is followed ...
            assert c.tools().names() == ["echo"]
        got = elsewhere.requests
        assert [r.path for r in got] == ["/echoenvironment/num_tasks", "/echoenvironment/tools"]
        assert not [r for r in got if {"x-api-key", "x-secrets"} & set(r.headers)]  # ... without credentials
        assert not [r for r in got if KEY in json.dumps(r.headers)]
    assert proxy.count("/num_tasks") == 1


def test_a_redirect_within_the_same_host_keeps_working(proxy, ref_server) -> None:
    proxy.add(Redirect("/echoenvironment/num_tasks", status=308), path="/old/num_tasks", times=None)
    with Client(proxy.url, env_name="echoenvironment", api_key=KEY, retry=FAST) as c:
        c.environment()
        assert c.async_client._transport.target.key_for(proxy.url) == KEY
        total = c._bg.run(c.async_client._transport.request("POST", "/old/num_tasks", body={"split": "train"}))
    assert total == {"num_tasks": 16}
    assert [r.headers.get("x-api-key") for r in proxy.requests if r.path.endswith("num_tasks")] == [KEY, KEY]


def test_masking_secrets_keeps_the_servers_reason(proxy) -> None:
    proxy.add(Status(400, f"tools are disabled for this deployment (key {KEY}); contact support"), path="/tools")
    c = Client(proxy.url, env_name="echoenvironment", api_key=KEY, retry=FAST)
    with c, pytest.raises(APIStatusError) as info:
        c.tools()
    assert str(info.value) == "/echoenvironment/tools: bad request (400): tools are disabled for this deployment " \
        "(key ***); contact support"


def test_nothing_listens_is_a_clear_transport_error_without_the_key() -> None:
    c = Client(f"http://127.0.0.1:{free_port()}", api_key=KEY, retry=RetryPolicy(max_attempts=2, backoff_initial=0.01))
    with pytest.raises(ORSError, match="cannot connect") as info:
        c.list_environments()
    assert KEY not in str(info.value)
    c.close()


# --------------------------------------------------------------------------------------------------
# Issue 22: credentials an environment echoes reach no artifact (masked where answers are decoded)
# --------------------------------------------------------------------------------------------------


class _PrintenvPolicy:
    """`eval`'s policy: calls `printenv`, then answers; keeps every message it was shown."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def respond(self, messages, tools):
        from ors_trl import PolicyReply

        self.seen.append(json.dumps([messages, tools], ensure_ascii=False))
        if not any(m["role"] == "tool" for m in messages):
            return PolicyReply(tool_calls=[{"id": "c0", "name": "printenv", "arguments": {}}])
        return PolicyReply(content="done")


def test_an_environment_echoing_the_credentials_gets_them_into_no_artifact(tmp_path, monkeypatch, capsys) -> None:
    """The key (forwarded as the `api_key` secret, as in catalog mode) and a secret echoed by an environment in its
    task fields, tool descriptions, prompt, `/messages` and `printenv`'s output: what the model is shown (TRL logs
    it as the prompt and completion: an artifact too), the episode log, `ors-trl inspect` and an eval `--output`
    file all hold `***` instead."""
    from transformers.utils import get_json_schema

    from ors_trl import cli
    from ors_trl.testing import ReferenceServer
    from tests.fixtures.environments import LEAK_ENV, SecretEchoEnvironment

    secrets = {**SECRETS, "api_key": KEY}
    log, evaluated = tmp_path / "episodes.jsonl", tmp_path / "eval.jsonl"
    policy = _PrintenvPolicy()
    with ReferenceServer([SecretEchoEnvironment], env={LEAK_ENV: KEY}) as server:
        spec = OpenRewardSpec(server.url, api_key=KEY, secrets=secrets, episode_log=str(log))
        rows = spec.train_dataset
        env = spec.environment_factory()
        prompt = env.reset(**rows[0])
        schemas = [get_json_schema(getattr(env, n)) for n in ("printenv", "whoami")]
        output = env.printenv()
        spec.reward_funcs(environments=[env], completions=[[{"role": "assistant", "content": "done"}]])
        spec.close()

        spec = OpenRewardSpec(server.url, api_key=KEY, secrets=secrets)
        report = spec.evaluate(policy, output=str(evaluated), progress=False)
        spec.close()

        monkeypatch.setenv("OPENREWARD_URL", server.url)  # catalog mode against a loopback platform
        monkeypatch.setenv("OPENREWARD_API_KEY", KEY)
        capsys.readouterr()
        assert cli.main(["inspect", "acme/leak", "--env-name", "secretechoenvironment"]) == 0
        assert cli.main(["inspect", "acme/leak", "--env-name", "secretechoenvironment", "--json"]) == 0
        inspected = capsys.readouterr()
    model_sees = {"dataset": json.dumps(rows.to_list()), "prompt": prompt, "schemas": json.dumps(schemas),
                  "tool output": output}
    assert all("***" in text for text in model_sees.values()), model_sees
    assert "PRIVATE_TOKEN=***" in output and "api_key=***" in output
    assert report.mean_reward == 1.0  # the episodes ran: printenv scored them
    artifacts = {**model_sees, "episode log": log.read_text(), "eval --output": evaluated.read_text(),
                 "eval policy": "\n".join(policy.seen), "eval summary": report.summary(),
                 "inspect": inspected.out + inspected.err}
    assert "deployed with key ***" in artifacts["inspect"] and "***" in artifacts["episode log"]
    assert {name: leaks(text) for name, text in artifacts.items()} == {name: [] for name in artifacts}


def test_the_endpoint_key_of_eval_is_masked_in_errors_records_and_chains(ref_server, tmp_path, capsys) -> None:
    """Bug: `ors-trl eval --base-url ... --api-key KEY` quoted an endpoint's error body that reflects the request's
    headers as it was (`Authorization: Bearer KEY`) on stderr and in the `--output` records, and a reply that
    echoed the key went to the records too."""
    import traceback

    from ors_trl import OpenAIPolicy, PolicyError, cli
    from ors_trl.protocol.loop import get_loop

    out = tmp_path / "eval.jsonl"
    with FaultProxy(None) as endpoint:
        endpoint.add(EchoHeaders(401), path="/v1/chat/completions", times=1)
        policy = OpenAIPolicy(endpoint.url + "/v1", "m", api_key=KEY, max_attempts=1)
        with pytest.raises(PolicyError) as info:
            get_loop().run(policy.respond([{"role": "user", "content": "hi"}], []))
        get_loop().run(policy.aclose())
        chain = "".join(traceback.format_exception(info.value))
        assert "Bearer ***" in str(info.value) and info.value.__context__ is None and not leaks(chain), chain
        endpoint.add(EchoHeaders(400), path="/v1/chat/completions", times=None)
        code = cli.main(["eval", ref_server.url, "--env-name", "echoenvironment", "--model", "m", "--base-url",
                         endpoint.url + "/v1", "--api-key", KEY, "--num-tasks", "2", "--output", str(out),
                         "--no-progress"])
        printed = capsys.readouterr()
        endpoint.clear()
        reflected = {"choices": [{"message": {"content": f"your key is {KEY}"}}]}
        endpoint.add(Reply(json.dumps(reflected)), path="/v1/chat/completions", times=None)
        reply = get_loop().run(policy.respond([{"role": "user", "content": "hi"}], []))
        get_loop().run(policy.aclose())
    assert code == 1 and "Bearer ***" in printed.err, printed.err
    assert reply.content == "your key is ***"
    texts = {"stderr": printed.err, "stdout": printed.out, "--output": out.read_text()}
    assert "Bearer ***" in texts["--output"]
    assert {name: leaks(text) for name, text in texts.items()} == {name: [] for name in texts}


@pytest.mark.parametrize("key", [KEY + "\n", f" {KEY}", KEY.replace("-", "\r\n", 1), KEY + "\x00",
                                 "sk-caf\u00e9-123456"])
def test_a_key_that_cannot_be_a_header_is_a_configuration_error_at_construction(ref_server, key) -> None:
    """Bug: an API key with a trailing newline (read from a file) reached aiohttp, which raised an untyped ValueError
    at the first request; now it is refused where it is given, without being shown."""
    from ors_trl import OpenAIPolicy

    for build in (lambda: OpenRewardSpec(ref_server.url, env_name="echoenvironment", api_key=key),
                  lambda: Client("acme/echo", api_key=key),
                  lambda: OpenAIPolicy("http://127.0.0.1:1/v1", "m", api_key=key)):
        with pytest.raises(ConfigurationError, match="HTTP header cannot carry") as info:
            build()
        assert key.strip() not in str(info.value)
