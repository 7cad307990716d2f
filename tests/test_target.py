"""Target resolution: URLs vs catalog names, hosts, API-key routing, secrets encoding."""

from __future__ import annotations

import base64
import json

import pytest

from ors_trl import ConfigurationError, MissingAPIKeyError
from ors_trl.protocol.target import encode_secrets, platform_key_secret, resolve_target
from ors_trl.protocol.transport import RetryPolicy, Timeouts, Transport


def test_url_target_is_single_host_and_gets_no_key_by_default() -> None:
    t = resolve_target("http://127.0.0.1:8000/", environ={"OPENREWARD_API_KEY": "sk-secret"})
    assert t.kind == "url"
    assert t.session_url == t.api_url == "http://127.0.0.1:8000"
    assert t.api_key is None
    assert t.key_for("http://127.0.0.1:8000") is None


def test_url_target_sends_an_explicit_key_only_to_itself() -> None:
    t = resolve_target("http://127.0.0.1:8000", api_key="sk-explicit")
    assert t.key_for("http://127.0.0.1:8000") == "sk-explicit"
    assert t.key_for("http://127.0.0.1:9000") is None
    assert t.key_for("http://evil.example:8000") is None
    assert t.key_for("http://127.0.0.1:abc") is None  # a malformed port (e.g. in a redirect) gets no key, no crash
    assert t.key_for("http://127.0.0.1:99999") is None


def test_catalog_target_derives_platform_hosts() -> None:
    t = resolve_target("Eigent/SETA", environ={"OPENREWARD_API_KEY": "sk-1"})
    assert t.kind == "catalog"
    assert t.api_url == "https://api.openreward.ai"
    assert t.session_url == "https://sessions.openreward.ai"
    assert t.deployment == "Eigent/SETA"
    assert t.key_for("https://sessions.openreward.ai") == "sk-1"
    assert t.key_for("https://api.openreward.ai") == "sk-1"
    assert t.key_for("https://openreward.ai.evil.example") is None


def test_catalog_overrides_and_explicit_key_win() -> None:
    env = {
        "OPENREWARD_URL": "https://example.org",
        "OPENREWARD_SESSION_URL": "https://s.example.org",
        "OPENREWARD_API_KEY": "from-env",
    }
    t = resolve_target("a/b", api_key="explicit", environ=env)
    assert t.api_url == "https://api.example.org"
    assert t.session_url == "https://s.example.org"
    assert t.api_key == "explicit"


def test_catalog_on_a_bare_ip_is_one_host() -> None:
    t = resolve_target("a/b", environ={"OPENREWARD_URL": "http://127.0.0.1:8123", "OPENREWARD_API_KEY": "k"})
    assert t.session_url == t.api_url == "http://127.0.0.1:8123"
    t = resolve_target("a/b", environ={"OPENREWARD_URL": "http://localhost:8123", "OPENREWARD_API_KEY": "k"})
    assert t.session_url == "http://localhost:8123"


def test_missing_key_for_catalog_is_a_clear_typed_error() -> None:
    with pytest.raises(MissingAPIKeyError, match="OPENREWARD_API_KEY"):
        resolve_target("Eigent/SETA", environ={})
    assert issubclass(MissingAPIKeyError, ValueError)


@pytest.mark.parametrize(
    "bad",
    ["", "   ", "ftp://x", "http://", "http://host:notaport", "not a name", "a/b/c", "http://user:pw@127.0.0.1:1"],
)
def test_malformed_targets_raise_configuration_error(bad: str) -> None:
    with pytest.raises(ConfigurationError):
        resolve_target(bad, environ={"OPENREWARD_API_KEY": "k"})


def test_key_never_in_repr() -> None:
    t = resolve_target("a/b", environ={"OPENREWARD_API_KEY": "sk-topsecret"})
    assert "sk-topsecret" not in repr(t)
    assert "sk-topsecret" not in repr(t.api_key)


def test_transport_headers_route_key_and_deployment() -> None:
    t = resolve_target("a/b", environ={"OPENREWARD_API_KEY": "sk-1"})
    tr = Transport(t, timeouts=Timeouts(), retry=RetryPolicy())
    h = tr.headers(t.session_url, sid="abc")
    assert h == {"X-API-Key": "sk-1", "X-Deployment": "a/b", "X-Session-ID": "abc"}
    assert "X-API-Key" not in tr.headers("http://127.0.0.1:1")


def test_encode_secrets_matches_the_wire_format() -> None:
    raw = encode_secrets({"OPENAI_API_KEY": "v1", "custom": ("v2", ["x.example"])})
    payload = json.loads(base64.b64decode(raw))
    assert payload == {
        "OPENAI_API_KEY": {"value": "v1", "allowed_domains": ["api.openai.com"]},
        "custom": {"value": "v2", "allowed_domains": ["x.example"]},
    }
    with pytest.raises(ConfigurationError):
        encode_secrets({"x": 3})  # type: ignore[dict-item]


def test_platform_key_secret_only_for_catalog() -> None:
    cat = resolve_target("a/b", environ={"OPENREWARD_API_KEY": "sk-1"})
    value, domains = platform_key_secret(cat)["api_key"]
    assert value == "sk-1" and "sessions.openreward.ai" in domains
    assert platform_key_secret(resolve_target("http://127.0.0.1:1", api_key="k")) == {}
